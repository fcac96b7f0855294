"""Several seeds at once against the same seeds one after another: train_cifar.py's own step.

For each model (the CIFAR-10 defaults), precision and number of seeds S, the runs are built as
the script builds them: a group of S seeds (``--seeds``, one ``SeedStack`` stepped by one
optimiser) in each ``--modes`` way, and S solo runs (``--seed k``), which stand for the same seeds
trained one after another. Each round times ``steps`` steps of the group and ``steps`` steps of
every solo run, in rotating order; the figure is the total images/s (all seeds), median over
rounds, and the group's ratio to the solo runs'. ``--compile`` adds each kind compiled (the
stepped module and the update after its backward pass, as ``--compile`` does), its first steps off
the clock. ``--profile N`` then profiles N steps of each kind's first run
(``precision_step.phase_profile``; on a GPU: how busy the card was, launches, top kernels).

    python -m benchmarks.seeds_step --data-dir path/to/cifar10 --seeds 1 2 4 --json results.json
    python -m benchmarks.seeds_step --data-dir path/to/cifar10 --models vit --dtypes float32 --compile
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import interleaved, timed, train_cifar_run, write_json
from benchmarks.precision_step import phase_profile
from vitattn.tasks import classify
from vitattn.training import runtime
from vitattn.training.runtime import native_bf16


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as train_cifar.py takes it; default: a small "
                   "long-range set (its presets)")
    p.add_argument("--models", nargs="+", default=["vit", "cnn"], choices=["vit", "cnn"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 4], help="group sizes")
    p.add_argument("--modes", nargs="+", default=["loop"], choices=["loop", "vmap"], help="how a group runs")
    p.add_argument("--compile", action="store_true", help="also time each kind compiled")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per timed block")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then profile N steps of each kind")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runtime.keep_freed_memory()  # as the scripts' --malloc keep
    dev = torch.device(args.device)
    if dev.type == "cuda":
        runtime.configure_cuda()
    result = {"environment": common.environment(dev), "native_bf16": native_bf16(dev),
              "command": common.command("seeds_step"), "rows": []}
    out = Path(tempfile.mkdtemp())
    compiled = [False, True] if args.compile else [False]
    # each solo run stands for a process of its own; in one process their optimisers' steps, one
    # compiled frame, would pass dynamo's limit of 8 compilations and run eagerly from the 9th on
    torch._dynamo.config.recompile_limit = 64
    for fam in args.models:
        for d in args.dtypes:
            amp = dict(amp=False) if d == "float32" else dict(amp=True, amp_dtype=d)
            data = dict(data_dir=args.data_dir) if args.data_dir else dict(dataset="long-range", long_range_train=2048,
                                                                            long_range_test=64)
            base = dict(**data, model=fam, device=args.device, progress=False, tensorboard=False, **amp)
            for n in args.seeds:
                kinds: dict[str, list] = {}
                for c in compiled:
                    tag = " compiled" if c else ""
                    solo = [train_cifar_run(classify.Config(**base, seed=k, compile=c, out=str(out / f"s{k}")), fam,
                                            dev, out / f"s{k}{tag}") for k in range(n)]
                    kinds[f"{n} after one another{tag}"] = solo
                    for mode in args.modes if n > 1 else ():
                        cfg = classify.Config(**base, seeds=f"0-{n - 1}", seed_batching=mode, compile=c,
                                              out=str(out / mode))
                        kinds[f"{n} at once, {mode}{tag}"] = [train_cifar_run(cfg, fam, dev, out / f"{mode}{tag}")]
                batch = classify.Config(**base).recipe(fam).batch_size
                for runs in kinds.values():  # warm-up: compiles, first allocations
                    timed(runs, 2)
                times = interleaved({k: lambda runs=runs: timed(runs, args.steps) for k, runs in kinds.items()},
                                    args.repeats)
                names = list(kinds)
                ref = statistics.median(times[names[0]])
                for k, ts in times.items():
                    row = {"model": fam, "preset": classify.Config(**base).preset(fam), "precision": d, "seeds": n,
                           "kind": k, "batch": batch, "flops_per_image": kinds[k][0][0].model.flops,
                           "img_per_s": n * batch * args.steps / statistics.median(ts),
                           "vs_sequential": ref / statistics.median(ts), "block_s": ts}
                    result["rows"].append(row)
                    print(f"{fam} {d} {k}: {row['img_per_s']:.0f} img/s ({row['vs_sequential']:.2f}x)", flush=True)
                    if args.profile:
                        row["profile"] = prof = phase_profile(*kinds[k][0], args.profile)
                        line = ", ".join(f"{p} {v:.1f}" for p, v in prof["ms_per_step"].items())
                        if "device" in prof:  # its share of the step as timed above, not as profiled
                            dev_ms = prof["device"]["device_ms_per_step"]
                            step_ms = 1e3 * n * batch / len(kinds[k]) / row["img_per_s"]  # S solo runs or a group
                            prof["device"]["busy_share_of_timed_step"] = share = dev_ms / step_ms
                            line += (f"; GPU busy {dev_ms:.1f} of {step_ms:.1f} ms/step ({share:.0%}), "
                                     f"{prof['device']['launches_per_step']:.0f} launches/step")
                        print(f"  profile, ms/step: {line}", flush=True)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
