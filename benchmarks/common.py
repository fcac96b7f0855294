"""What every benchmark here shares, one copy each: interleaved timing, a device's product rate,
the environment a figure was measured in, the command that reproduces it, the JSON it is kept
as, and ``train_cifar.py``'s own run and step (``vitattn.training.loop.train_step``), so a
benchmark of the training step measures the loop's step, not a copy of it.

    rounds = interleaved({"a": time_a, "b": time_b}, repeats=5)   # each callable times one block
    run, batches = train_cifar_run(cfg, "vit", device, folder)    # as the script builds it
    seconds = timed([(run, batches)], steps=4)                   # the loop's own steps
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEERS = ("torch", "timm", "torchvision", "vit-pytorch", "einops", "vitattn")  # versions every result records


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(blocks: dict[str, Callable[[], float]], repeats: int, warmup: int = 0) -> dict[str, list[float]]:
    """Each block's seconds over ``repeats`` rounds, the order rotating by one each round, so that
    a machine's drift falls on every block alike; the first ``warmup`` rounds are run, not kept.
    Only figures taken side by side like this compare on a shared, noisy machine."""
    names = list(blocks)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + repeats):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            seconds = blocks[name]()
            if rep >= warmup:
                times[name].append(seconds)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.float32,
                shapes: tuple[tuple[int, int, int], ...] = ((2048, 2048, 2048),), reps: int = 5) -> float:
    """The device's best product rate in GFLOP/s, now: the best of ``reps`` of each ``(M, K, N)``
    product, then the best shape (a model's own shapes can run faster than a square one)."""
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            a @ b
            sync(device)
            best = min(best, time.perf_counter() - t)
        rates.append(2 * m * k * n / best / 1e9)
    return max(rates)


def environment(device: torch.device) -> dict[str, Any]:
    """The machine and versions of a figure: the training runs' record (``runtime.environment``)
    and the peers' versions."""
    from vitattn.training import runtime

    env = runtime.environment(device)
    versions = {}
    for pkg in PEERS:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {**env, "versions": versions}


def command(module: str, argv: list[str] | None = None) -> str:
    """The command that reproduces a result, runnable from the repository root."""
    return " ".join([f"python -m benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def write_json(path: str | Path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def train_cifar_run(cfg, family: str, device: torch.device, folder: Path):
    """A run of ``train_cifar.py`` as the script builds it (its data, model or seed group, recipe,
    optimiser and update), and its first epoch's batches."""
    from vitattn.tasks import classify
    from vitattn.training.runtime import Dist

    datasets = classify.load_datasets(cfg, device)
    model = classify.build_models(family, cfg, datasets, device)
    ds = datasets if len(cfg.seed_list()) > 1 else datasets[0]
    run = classify.classification_run(family, model, cfg, ds, device, Dist(), Path(folder) / f"{family}.pt")
    return run, run.task.batches(0, 0)


def timed(runs: list, steps: int) -> float:
    """Seconds for ``steps`` of the loop's own training step of each ``(run, batches)`` in turn,
    waiting for a GPU at the end (as the loop does at its reads)."""
    from vitattn.training import loop

    t = time.perf_counter()
    for run, batches in runs:
        for _ in range(steps):
            loop.train_step(run, next(batches))
        run.running.tolist()
    return time.perf_counter() - t
