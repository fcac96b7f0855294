"""train_cifar.py's own training step in fp32 against bf16 (and fp16) autocast, side by side.

For each model (the CIFAR-10 defaults) one run per precision is built the way the script builds
it (same weights, same batches), and their steps are timed interleaved in one process:
``repeats`` rounds, each timing ``steps`` steps of every precision in rotating order; medians.
It also prints whether the CPU multiplies bf16 natively (``avx512_bf16`` / ``amx_bf16`` flags)
and the rate of one bf16 and one fp32 matrix product, which say most of what autocast can buy.
``--phases`` then profiles ``steps`` more steps of each precision with ``torch.profiler``: the
milliseconds per step of each phase the loop names (data, forward, backward, optimizer, ema) and
the share of the process's CPU time spent in the kernel (page faults: ``--malloc``).

    python -m benchmarks.precision_step --data-dir path/to/cifar10 --json results.json
    python -m benchmarks.precision_step --data-dir path/to/cifar10 --dtypes float32 --phases --malloc system
    python -m benchmarks.precision_step --device cuda --dtypes float32 bfloat16 float16
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import common
from vitattn.tasks import classify
from vitattn.training import loop, runtime
from vitattn.training.run import Run
from vitattn.training.runtime import native_bf16

PHASES = ("data", "forward", "backward", "optimizer", "ema")


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of what a GPU runs


def device_profile(events, steps: int, wall_ms: float, top: int = 8) -> dict:
    """What a GPU did over ``steps`` profiled steps (``events``: kineto's, as
    ``prof.profiler.kineto_results.events()`` gives them): its busy time per step and its share of
    the wall time (low: the host, launching, holds it back), kernels and launches per step (a CUDA
    graph is one launch of many kernels), and the ``top`` kernels by time."""
    busy: dict[str, float] = {}
    kernels = launches = 0
    for e in events:
        kind = e.activity_type()
        if kind in DEVICE_WORK:
            busy[e.name()] = busy.get(e.name(), 0.0) + e.duration_ns() / 1e6 / steps
            kernels += kind == "kernel"
        elif kind in ("cuda_runtime", "cuda_driver") and "Launch" in e.name():
            launches += 1
    ms = sum(busy.values())
    return {"device_ms_per_step": ms, "device_busy_share": ms / wall_ms, "kernels_per_step": kernels / steps,
            "launches_per_step": launches / steps,
            "top_ms_per_step": dict(sorted(busy.items(), key=lambda kv: -kv[1])[:top])}


def phase_profile(run: Run, batches, steps: int) -> dict:
    """Milliseconds per step of each phase of ``steps`` profiled steps (the rest: what no phase
    names), and the kernel's share of the process's CPU time over them; on a GPU also
    ``device_profile``'s figures."""
    cuda = run.device.type == "cuda"
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(steps):
            with record_function("data"):
                batch = next(batches)
            loop.train_step(run, batch)
        run.running.tolist()
    wall_ms, r1 = (time.perf_counter() - t) * 1e3 / steps, resource.getrusage(resource.RUSAGE_SELF)
    ms = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.key in PHASES}
    ms["rest"] = wall_ms - sum(ms.values())
    sys_s = r1.ru_stime - r0.ru_stime
    out = {"ms_per_step": ms, "wall_ms_per_step": wall_ms, "sys_share": sys_s / (sys_s + r1.ru_utime - r0.ru_utime)}
    if cuda:
        out["device"] = device_profile(prof.profiler.kineto_results.events(), steps, wall_ms)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as train_cifar.py takes it; default: long-range")
    p.add_argument("--models", nargs="+", default=["vit", "cnn"], choices=["vit", "cnn"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--phases", action="store_true", help="then profile each precision's phases")
    p.add_argument("--malloc", default="system", choices=["keep", "system"],
                   help="glibc's malloc as train_cifar.py's --malloc sets it (here the default is glibc's own)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kept = args.malloc == "keep" and runtime.keep_freed_memory()
    dev = torch.device(args.device)
    data = dict(data_dir=args.data_dir) if args.data_dir else dict(dataset="long-range", long_range_train=2048,
                                                                    long_range_test=64)
    result = {"environment": common.environment(dev), "native_bf16": native_bf16(dev),
              "command": common.command("precision_step"), "malloc": args.malloc, "malloc_kept": kept,
              "gemm_gflops": {d: common.matmul_rate(dev, getattr(torch, d), ((8192, 512, 512),)) for d in args.dtypes},
              "models": {}}
    print(f"native bf16: {result['native_bf16']}; 8192x512 @ 512x512 GFLOP/s: "
          + ", ".join(f"{d} {g:.1f}" for d, g in result["gemm_gflops"].items()), flush=True)
    out = Path(tempfile.mkdtemp())
    for fam in args.models:
        runs = {}
        for d in args.dtypes:
            amp = dict(amp=False) if d == "float32" else dict(amp=True, amp_dtype=d)
            cfg = classify.Config(**data, model=fam, device=args.device, out=str(out / d), progress=False, **amp)
            runs[d] = common.train_cifar_run(cfg, fam, dev, out / d)
        times = common.interleaved({d: lambda r=r: common.timed([r], args.steps) / args.steps for d, r in runs.items()},
                                   args.repeats, warmup=1)
        batch = runs[args.dtypes[0]][0].task.batch_size
        rows = {d: {"img_per_s": batch / statistics.median(ts), "step_s": ts} for d, ts in times.items()}
        for d in rows:
            rows[d]["vs_fp32"] = rows[d]["img_per_s"] / rows["float32"]["img_per_s"] if "float32" in rows else None
            print(f"{fam} {d}: {rows[d]['img_per_s']:.0f} img/s" + (f" ({rows[d]['vs_fp32']:.2f}x fp32)"
                                                                    if rows[d]["vs_fp32"] else ""), flush=True)
            if args.phases:
                rows[d]["phases"] = ph = phase_profile(*runs[d], args.steps)
                print(f"  phases, ms/step under the profiler (wall {ph['wall_ms_per_step']:.0f}): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in ph["ms_per_step"].items())
                      + f"; kernel share of CPU time {ph['sys_share']:.1%}", flush=True)
        result["models"][fam] = {"preset": cfg.preset(fam), "batch": batch, "precisions": rows}
    if args.json:
        common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
