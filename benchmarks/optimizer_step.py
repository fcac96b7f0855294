"""The default CIFAR ViT's training step under each optimiser, side by side in one process.

One step is forward, cross-entropy, backward and the optimiser's step, on random 32x32 images;
the optimisers are the recipe's AdamW, the Muon chain with ``torch.optim.Muon`` (Newton-Schulz in
bfloat16) and the chain with ``vitattn.training.optim.Muon`` (the same steps, Newton-Schulz in fp32 on a
CPU). Every round visits every optimiser, in rotating order; the table gives medians. Also times
the Newton-Schulz iteration alone on the model's matrices, in both dtypes.

    python -m benchmarks.optimizer_step --model vit_quick --batch 256
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import vitattn
from vitattn.training.optim import OptimizerChain, create_optimizer, orthogonalize
from vitattn.training.recipes import RECIPES


def make_step(model_name: str, optimizer: str, x: torch.Tensor, y: torch.Tensor):
    torch.manual_seed(0)
    model = vitattn.create_model(model_name)
    recipe = replace(RECIPES["vit"], optimizer="adamw" if optimizer == "adamw" else "muon")
    opt = create_optimizer(model, **recipe.optimizer_kwargs())
    if optimizer == "muon_torch":  # the chain's first optimiser swapped for torch's own
        ours, adamw = opt.optimizers
        opt = OptimizerChain(torch.optim.Muon(ours.param_groups[0]["params"], **ours.defaults), adamw)

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def seconds(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_quick")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="steps timed per optimiser per round")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    x = torch.randn(a.batch, 3, 32, 32)
    y = torch.randint(0, 10, (a.batch,))
    names = ["adamw", "muon_torch", "muon_vitattn"]
    steps = {n: make_step(a.model, n, x, y) for n in names}
    for fn in steps.values():  # warm-up: allocator, oneDNN primitives, optimiser state
        seconds(fn, 2)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(seconds(steps[n], a.iters))

    mats = [p for n, p in vitattn.create_model(a.model).named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    d = torch.optim.Muon(mats).defaults  # torch's coefficients, steps and eps
    ns = {str(dt).removeprefix("torch."): 1e3 * statistics.median(seconds(lambda dt=dt: [
        orthogonalize(m, d["ns_coefficients"], d["ns_steps"], d["eps"], dt) for m in mats], 2) for _ in range(a.rounds))
        for dt in (torch.bfloat16, torch.float32)}

    res = dict(model=a.model, batch=a.batch, rounds=a.rounds, iters=a.iters, threads=torch.get_num_threads(),
               cpu=platform.processor() or platform.machine(), torch=torch.__version__,
               images_per_s={n: a.batch / statistics.median(t) for n, t in times.items()},
               newton_schulz_ms_per_step={"matrices": len(mats), **ns})
    print(f"{a.model}, batch {a.batch}, {res['threads']} threads, medians of {a.rounds} rounds x {a.iters} steps")
    print("| optimiser | img/s |\n|---|---:|")
    for n, v in res["images_per_s"].items():
        print(f"| {n} | {v:.0f} |")
    print(f"Newton-Schulz on the {len(mats)} block matrices, one step: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in ns.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
