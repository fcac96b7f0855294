"""The main job checked on one GPU, in one script: what the CPU tests can only stand in for.

    python -m benchmarks.gpu_check --data-dir path/to/cifar10 --out gpu_check.json     # ~5 min on one GPU
    python -m benchmarks.gpu_check --device cpu --quick --out /tmp/check.json       # the same steps, tiny

It runs, each step recorded in one JSON (a step that fails records its error and the rest go on):

1. fresh CIFAR-10 runs of both models for a few epochs in bf16 and in fp16 (grad scaler); the
   other steps run in the first of ``--dtypes`` (bf16);
2. an interrupted-and-resumed run against an uninterrupted one (deterministic kernels on):
   equal metrics lines and the largest weight difference;
3. a ``--compile`` run;
4. two processes on one GPU under torchrun with NCCL (NCCL may refuse two ranks on one device:
   the error is recorded);
5. ``benchmarks/bench_vit.py``'s CIFAR training step, vitattn against timm under bf16 autocast
   at batch 256 and 1024, with achieved TFLOP/s and their share of a bf16 matrix-product peak measured in
   the same run.

Without ``--data-dir`` the runs use the generated long-range task. ``--quick`` shrinks every
step to seconds so that tests/test_devices.py can run the script on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import train_cifar as T

ROOT = Path(__file__).resolve().parents[1]


def run_config(args, out: Path, **kw) -> T.Config:
    data = dict(data_dir=args.data_dir) if args.data_dir else dict(dataset="long-range")
    if args.quick:
        data |= dict(limit_train=256, limit_test=128) if args.data_dir else dict(long_range_train=256,
                                                                               long_range_test=128)
        kw = {**dict(epochs=1, batch_size=64, context_images=8), **kw}
    return T.Config(**{**data, "device": args.device, "out": str(out), "progress": False, "plots": False,
                       "epochs": args.epochs, **kw})


def summary_of(s: dict) -> dict:
    return {"status": s["status"], **{fam: {k: r.get(k) for k in ("final_acc", "final_acc_tta_shift", "epochs",
                                                                    "train_seconds", "images_per_s", "precision")}
                                      for fam, r in s["models"].items()}}


def precision(dtype: str) -> dict:
    return dict(amp=False) if dtype == "float32" else dict(amp=True, amp_dtype=dtype)


def amp_flags(args) -> list[str]:
    return [] if args.dtypes[0] == "float32" else ["--amp", f"--amp-dtype={args.dtypes[0]}"]


def fresh_runs(args, work: Path) -> dict:
    return {dtype: summary_of(T.main(run_config(args, work / f"fresh_{dtype}", **precision(dtype))))
            for dtype in args.dtypes}


def resume_equals_uninterrupted(args, work: Path) -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    kw = dict(model="cnn", epochs=2, **precision(args.dtypes[0]))
    ref = T.main(run_config(args, work / "uninterrupted", **kw))
    calls = {"n": 0}
    cross_entropy = T.F.cross_entropy

    def interrupt_mid_run(*a, **k):  # a Ctrl-C at the 5th training step
        calls["n"] += 1
        if calls["n"] == 5:
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*a, **k)

    T.F.cross_entropy = interrupt_mid_run
    try:
        cfg = run_config(args, work / "interrupted", **kw)
        first = T.main(cfg)["status"]
    finally:
        T.F.cross_entropy = cross_entropy
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    lines = [(Path(d) / "metrics.jsonl").read_text().splitlines() for d in (ref["out"], cfg.out)]
    keys = ("epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc")
    scores = [[tuple(json.loads(s)[k] for k in keys) for s in ls] for ls in lines]
    a, b = ref["modules"]["cnn"].state_dict(), resumed["modules"]["cnn"].state_dict()
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    return dict(first_status=first, resumed_status=resumed["status"], metrics_equal=scores[0] == scores[1],
                max_weight_diff=diff, uninterrupted=scores[0], resumed=scores[1])


def compiled_run(args, work: Path) -> dict:
    t = time.perf_counter()
    s = T.main(run_config(args, work / "compiled", model="vit", compile=True, **precision(args.dtypes[0])))
    return {**summary_of(s), "wall_s": time.perf_counter() - t}


def two_processes(args, work: Path) -> dict:
    out_dir = work / "torchrun"
    data = [f"--data-dir={args.data_dir}"] if args.data_dir else ["--dataset=long-range"]
    if args.quick:
        data += ["--limit-train=256", "--limit-test=128"] if args.data_dir else ["--long-range-train=256",
                                                                                 "--long-range-test=128"]
    device = "cuda:0" if args.device.startswith("cuda") else args.device  # both ranks on one GPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_cifar.py"), *data, "--model=cnn", f"--epochs={1 if args.quick else args.epochs}",
           *amp_flags(args), f"--device={device}", f"--out={out_dir}", "--no-progress", "--no-plots",
           "--context-images=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    out = dict(command=" ".join(cmd), returncode=p.returncode, tail=(p.stdout + p.stderr)[-3000:])
    if (out_dir / "summary.json").exists():
        out["summary"] = summary_of(json.loads((out_dir / "summary.json").read_text()))
    return out


def step_bench(args, work: Path) -> dict:
    from benchmarks import bench_vit

    results = {}
    for batch in (256, 1024) if not args.quick else (8,):
        argv = ["--cases", "cifar_train", "--libs", "vitattn", "timm", "--batch", str(batch), "--device",
                args.device, *amp_flags(args)[:1], "--repeats", "2" if args.quick else "5",  # --amp: bf16
                "--iters", "1" if args.quick else "10", "--no-memory", "--out", str(work / "bench"),
                "--tag", f"bf16_b{batch}"]
        r = bench_vit.main(argv)
        peak = max(r["matmul_peak_gflops"])
        results[f"batch{batch}"] = [dict(lib=row["lib"], img_per_s=row["img_per_s"],
                                         tflops_per_s=(row["gflops_per_s"] or 0) / 1e3,
                                         share_of_matmul_peak=row["peak_share"], matmul_peak_tflops=peak / 1e3)
                                    for row in r["rows"]]
    return results


STEPS = {"fresh_bf16_fp16": fresh_runs, "resume": resume_equals_uninterrupted, "compile": compiled_run,
         "torchrun_two_processes": two_processes, "step_bench_bf16": step_bench}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as train_cifar.py takes it; default: long-range")
    p.add_argument("--device", default="cuda")
    p.add_argument("--epochs", type=float, default=3, help="epochs of each training run")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16", "float32"],
                   help="precisions of the fresh runs; the first one's for the other steps")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    p.add_argument("--quick", action="store_true", help="tiny data and steps (a CPU dry run)")
    p.add_argument("--timeout", type=int, default=180, help="seconds for the torchrun step")
    p.add_argument("--work", default="runs/gpu_check", help="folder for the runs (emptied first)")
    p.add_argument("--out", default="gpu_check.json")
    args = p.parse_args(argv)
    work = Path(args.work)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    dev = torch.device(args.device)
    report = {"environment": T.runtime.environment(dev), "args": vars(args), "steps": {}}
    for name in args.steps:
        t = time.perf_counter()
        try:
            result = {"ok": True, **STEPS[name](args, work)}
        except Exception as e:  # record and go on: one broken step must not hide the others
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = time.perf_counter() - t
        report["steps"][name] = result
        print(f"# {name}: {'ok' if result['ok'] else result['error']} ({result['seconds']:.0f} s)", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the resume check
    main()
