"""The main job checked on a GPU: each step passes or fails against a bound stated here.

    python -m benchmarks.gpu_check --data-dir path/to/cifar10 --out gpu_check.json   # under 8 min on one GPU
    python -m benchmarks.gpu_check --device cpu --quick --dtypes float32 --out /tmp/check.json   # tiny, for tests

Steps (``--steps``), each one line ``PASS|FAIL|SKIP name: measured vs bound``; the exit status is
1 when any step fails, else 0. The whole report, with every measurement, goes to ``--out``.

1. ``fresh``: both models trained from scratch for ``--epochs`` (3) in each of ``--dtypes`` (fp32,
   bf16, fp16 with its grad scaler). Pass: every final accuracy at or above ``FLOORS`` (CIFAR-10:
   ViT 60%, CNN 75%, 5-8 points under what the 10-epoch CPU runs in docs/results had reached at
   their third epoch, with the lr still high; long-range task: CNN 95%, ViT 60%, chance being 50%
   and the ViT's departure from it seed-dependent: CIFAR-10 is the check that counts),
   and each low precision within ``PRECISION_GAP`` (2 points; the two 10-epoch ViT seeds differ by
   0.1, and a 3-epoch run varies more, by how much no GPU run has measured yet) of fp32's
   accuracy for the same model.
2. ``resume``: the CNN for 2 epochs, once straight through and once stopped by a real SIGINT at
   step 5 (exit 130) and resumed with ``--resume``, with deterministic kernels (on for this step
   alone). Pass: metrics lines and final
   weights bit-equal.
3. ``compile``: the ViT with ``--compile`` in the first dtype. Pass: its training images/s (compile
   time excluded, reported apart) at least ``COMPILE_SPEED`` (0.95, the noise of one short run)
   of the eager run's from step 1.
4. ``torchrun``: two processes with ``--device cuda``. With two GPUs or more: exit 0 and the
   ranks' final weights equal (``ranks_agree`` in the summary). With one GPU: two ranks cannot
   each own a GPU, so the check is the refusal: the second rank's one line naming the GPU count.
5. ``seeds``: ``benchmarks.seeds_step`` on both models, one seed against ``SEEDS`` (8) at once
   (``--seed-batching vmap``), eager and compiled, in the first dtype, each as a share of the
   card's bf16 peak (an 8192^3 bf16 product timed in the same call), and each profiled: how busy
   the card was, kernel launches, the top kernels (what holds a step back). Pass: ``TARGETS``
   (images/s: CNN solo 100,000, airbench's class; ViT solo 25,000 and 80,000 over 8 seeds), the best
   of eager and compiled.
6. ``step``: the main job's own step of its CIFAR-10 ViT (``vitattn.training.loop.train_step``: Muon,
   augmentation, normalisation, label smoothing, EMA) in the first dtype, interleaved with it on
   timm's ``VisionTransformer`` of the same shape and weights. Pass: vitattn's images/s at least
   ``TIMM_SPEED`` (0.8) of timm's.

With ``--quick`` every run shrinks to seconds and the accuracy bounds are not applied (tiny data
learns nothing measurable); tests/test_benchmarks.py runs it so on the CPU. What has run on a GPU
is in docs/training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"cifar10": {"vit": 0.60, "cnn": 0.75}, "long-range": {"vit": 0.60, "cnn": 0.95}}
PRECISION_GAP = 0.02
COMPILE_SPEED = 0.95
TIMM_SPEED = 0.8
SEEDS = 8
TARGETS = {("cnn", 1): 100_000, ("vit", 1): 25_000, ("vit", SEEDS): 80_000}
# --quick's runs: the small presets, no test-time augmentation, few images measured (what a CPU
# dry run checks is the machinery, not the figures)
MINIATURE = ["--vit-preset=vit_quick", "--cnn-preset=cnn_quick", "--no-tta", "--context-images=8"]


# train_cifar.py run as a program; a Ctrl-C at a given training step (the nth cross-entropy), and
# deterministic kernels, when the environment asks for them
PRELUDE = """
import os, runpy, signal, sys
import torch
import torch.nn.functional as F
if os.environ.get("GPU_CHECK_DETERMINISTIC"):
    torch.use_deterministic_algorithms(True, warn_only=True)
at, calls, cross_entropy = int(os.environ.get("GPU_CHECK_INTERRUPT_AT", 0)), [0], F.cross_entropy
def counted(*a, **k):
    calls[0] += 1
    if calls[0] == at:
        signal.raise_signal(signal.SIGINT)
    return cross_entropy(*a, **k)
F.cross_entropy = counted
sys.argv = ["train_cifar.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def data_flags(args) -> list[str]:
    data = [f"--data-dir={args.data_dir}"] if args.data_dir else ["--dataset=long-range"]
    if args.quick:
        data += ["--limit-train=256", "--limit-test=128"] if args.data_dir else ["--long-range-train=256",
                                                                                 "--long-range-test=128"]
    return data


def run_script(argv: list[str], interrupt_at: int = 0, deterministic: bool = False) -> subprocess.CompletedProcess:
    """``python train_cifar.py ARGV`` through ``PRELUDE``: a Ctrl-C at training step ``interrupt_at``
    (0: none), deterministic kernels when asked."""
    env = {**os.environ, "GPU_CHECK_INTERRUPT_AT": str(interrupt_at)}
    if deterministic:  # cuBLAS needs a fixed workspace to be deterministic
        env |= {"GPU_CHECK_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.run([sys.executable, "-c", PRELUDE, *argv], capture_output=True, text=True, cwd=ROOT, env=env)


def train_cifar(args, out: Path, *flags: str, interrupt_at: int = 0, deterministic: bool = False,
                check: bool = True) -> dict:
    """``python train_cifar.py`` with the check's data and ``flags``; returns its summary.json and
    its exit status (``returncode``)."""
    quick = ["--epochs=1", "--batch-size=64", *MINIATURE] if args.quick else [f"--epochs={args.epochs}"]
    argv = [*data_flags(args), *quick, f"--device={args.device}", f"--out={out}", "--no-progress", "--no-plots",
            *flags]
    p = run_script(argv, interrupt_at, deterministic)
    if check and p.returncode != 0:
        raise RuntimeError(f"train_cifar.py {' '.join(argv)} exited {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
    path = out / "summary.json"
    return {**(json.loads(path.read_text()) if path.exists() else {}), "returncode": p.returncode}


def precision(dtype: str) -> list[str]:
    return [] if dtype == "float32" else ["--amp", f"--amp-dtype={dtype}"]


def verdict(ok: bool | None, measured: str, bound: str) -> dict:
    return {"verdict": "SKIP" if ok is None else "PASS" if ok else "FAIL", "measured": measured, "bound": bound}


def fresh(args, work: Path, report: dict) -> dict:
    runs = {}
    for dtype in args.dtypes:
        s = train_cifar(args, work / f"fresh_{dtype}", *precision(dtype))
        runs[dtype] = {fam: {k: r.get(k) for k in ("final_acc", "epochs", "images_per_s", "precision")}
                       for fam, r in s["models"].items()}
    report["fresh_runs"] = runs
    floors = FLOORS["cifar10" if args.data_dir else "long-range"]
    low = [f"{d} {fam} {r['final_acc']:.3f} < {floors[fam]}" for d, rs in runs.items() for fam, r in rs.items()
           if r["final_acc"] < floors[fam]]
    gaps = {f"{d} {fam}": abs(r["final_acc"] - runs["float32"][fam]["final_acc"])
            for d, rs in runs.items() if d != "float32" and "float32" in runs for fam, r in rs.items()}
    wide = [f"{k} {v:.3f}" for k, v in gaps.items() if v > PRECISION_GAP]
    accs = ", ".join(f"{d} {fam} {r['final_acc']:.3f}" for d, rs in runs.items() for fam, r in rs.items())
    if args.quick:
        return verdict(True, accs, "accuracy bounds not applied with --quick")
    return verdict(not low and not wide, accs + (f"; below floor: {low}" if low else "")
                   + (f"; gap to fp32: {wide}" if wide else ""),
                   f"accuracy >= {floors}; |low precision - fp32| <= {PRECISION_GAP}")


def resume(args, work: Path, report: dict) -> dict:
    from safetensors.torch import load_file

    # deterministic kernels for this step alone (the others time what users run)
    flags = ["--model=cnn", "--epochs=2", "--no-cudnn-benchmark", *precision(args.dtypes[0])]
    ref = work / "uninterrupted"
    train_cifar(args, ref, *flags, deterministic=True)
    out = work / "interrupted"
    first = train_cifar(args, out, *flags, interrupt_at=5, deterministic=True, check=False)["returncode"]
    resumed = run_script([f"--resume={out}", "--no-progress"], deterministic=True)
    keys = ("epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc")
    scores = [[tuple(json.loads(s)[k] for k in keys) for s in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (ref, out)]
    weights = [d / "checkpoints" / "cnn.safetensors" for d in (ref, out)]
    diff = float("inf")
    if all(w.exists() for w in weights):
        a, b = (load_file(str(w)) for w in weights)
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    report["resume"] = dict(first_exit=first, resumed_exit=resumed.returncode, uninterrupted=scores[0],
                            resumed=scores[1], max_weight_diff=diff)
    ok = first == 130 and resumed.returncode == 0 and scores[0] == scores[1] and diff == 0.0
    return verdict(ok, f"exit {first} then {resumed.returncode}, metrics equal {scores[0] == scores[1]}, largest "
                       f"weight difference {diff:.3g}", "Ctrl-C exits 130; bit-equal metrics and weights")


def compiled(args, work: Path, report: dict) -> dict:
    s = train_cifar(args, work / "compiled", "--model=vit", "--compile", *precision(args.dtypes[0]))
    r = s["models"]["vit"]
    eager = report.get("fresh_runs", {}).get(args.dtypes[0], {}).get("vit")
    report["compile"] = dict(images_per_s=r["images_per_s"], compile_seconds=r["compile_seconds"],
                             eager_images_per_s=eager and eager["images_per_s"])
    measured = f"{r['images_per_s']:.0f} img/s compiled ({r['compile_seconds']:.0f} s compiling)"
    if eager is None:
        return verdict(None, measured, "needs the fresh step's eager run to compare with")
    ratio = r["images_per_s"] / eager["images_per_s"]
    return verdict(ratio >= COMPILE_SPEED, f"{measured} = {ratio:.2f}x eager's {eager['images_per_s']:.0f}",
                   f">= {COMPILE_SPEED}x eager")


def torchrun(args, work: Path, report: dict) -> dict:
    out_dir = work / "torchrun"
    data = data_flags(args)
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    device = "cpu" if args.device == "cpu" else "cuda"  # each rank its own GPU
    flags = [] if args.dtypes[0] == "float32" else ["--amp", f"--amp-dtype={args.dtypes[0]}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_cifar.py"), *data, "--model=cnn", f"--epochs={1 if args.quick else args.epochs}",
           *flags, f"--device={device}", f"--out={out_dir}", "--no-progress", "--no-plots",
           *(MINIATURE if args.quick else ["--context-images=8"])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    report["torchrun"] = dict(command=" ".join(cmd), returncode=p.returncode, tail=(p.stdout + p.stderr)[-3000:])
    if device == "cuda" and gpus < 2:  # two ranks cannot each own a GPU: the refusal is what is checked
        line = next((s for s in (p.stdout + p.stderr).splitlines() if "asked for, but this machine has" in s), None)
        return verdict(p.returncode != 0 and line is not None, f"{gpus} GPU: exit {p.returncode}, {line!r}",
                       "the rank without a GPU refuses in one line (train_cifar.py's exit 2; torchrun then fails)")
    summary = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").exists() else {}
    agree = summary.get("models", {}).get("cnn", {}).get("ranks_agree")
    report["torchrun"]["ranks_agree"] = agree
    return verdict(p.returncode == 0 and agree is True, f"exit {p.returncode}, ranks agree {agree}",
                   "exit 0, equal weights on both ranks")


def step(args, work: Path, report: dict) -> dict:
    from vitattn import timm_compat
    from vitattn.tasks import classify
    from vitattn.tasks.classify.recipes import RECIPES
    from vitattn.training import runtime

    dev = runtime.pick_device(args.device)
    # the CIFAR-10 ViT and its recipe whatever the data (the long-range ViT has no timm twin)
    recipe = {k: getattr(RECIPES["vit"], k) for k in ("optimizer", "batch_size", "lr", "translate",
                                                         "label_smoothing", "grad_clip")}
    runs = {}
    for lib in ("vitattn", "timm"):
        data = dict(data_dir=args.data_dir) if args.data_dir else dict(dataset="long-range")
        if args.quick:
            data |= dict(limit_train=256, limit_test=128)
        cfg = classify.Config(**data, model="vit", vit_preset="vit_cifar10", model_ema_decay=0.999, device=args.device,
                              progress=False, **{**recipe, **({"batch_size": 64} if args.quick else {})},
                              amp=args.dtypes[0] != "float32", amp_dtype=args.dtypes[0].replace("float32", "bfloat16"))
        ds = classify.load_dataset(cfg, dev)
        model = classify.build_model("vit", cfg, ds, dev)
        if lib == "timm":
            model = timm_compat.to_timm(model).to(dev)
        runs[lib] = classify.classification_run("vit", model, cfg, ds, dev, runtime.Dist(), work / lib / "vit.pt")
    steps = 2 if args.quick else 20
    times = common.interleaved({lib: lambda r=r: common.timed([(r, r.task.batches(0, 0))], steps) / steps
                                for lib, r in runs.items()}, 2 if args.quick else 5, warmup=1)
    batch = runs["vitattn"].task.batch_size
    speed = {lib: batch / statistics.median(ts) for lib, ts in times.items()}
    report["step"] = dict(batch=batch, images_per_s=speed, step_seconds=times, precision=args.dtypes[0])
    ratio = speed["vitattn"] / speed["timm"]
    return verdict(ratio >= TIMM_SPEED, f"{speed['vitattn']:.0f} vs timm {speed['timm']:.0f} img/s = {ratio:.2f}x",
                   f">= {TIMM_SPEED}x timm")


def peak_tflops(device: torch.device, n: int = 8192) -> float:
    """The card's bf16 product rate: the best of a few ``n``-cube products."""
    return common.matmul_rate(device, torch.bfloat16, ((n, n, n),), reps=4) / 1e3


def seeds(args, work: Path, report: dict) -> dict:
    from benchmarks import seeds_step

    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       "cpu" if args.device == "auto" else args.device)
    n = 2 if args.quick else SEEDS
    argv = ["--device", str(dev), "--dtypes", args.dtypes[0], "--seeds", "1", str(n), "--modes", "vmap",
            "--repeats", "1" if args.quick else "3", "--steps", "1" if args.quick else "10",
            "--profile", "1" if args.quick else "5"]
    argv += [] if args.quick else ["--compile"]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    rows = seeds_step.main(argv)["rows"]
    peak = peak_tflops(dev, 512 if args.quick else 8192)
    for r in rows:
        r["share_of_bf16_peak"] = 3 * r["flops_per_image"] * r["img_per_s"] / 1e12 / peak
    report["seeds"] = dict(rows=rows, bf16_peak_tflops=peak)
    best = {}
    for r in rows:
        key = (r["model"], r["seeds"])
        best[key] = max(best.get(key, 0.0), r["img_per_s"])
    measured = ", ".join(f"{m} x{k}: {v:.0f} img/s" for (m, k), v in best.items())
    busy = [f"{r['model']} x{r['seeds']} {r['kind'].split(' ', 1)[1]} {d['busy_share_of_timed_step']:.0%}"
            for r in rows if (d := r["profile"].get("device"))]
    measured += f"; GPU busy: {', '.join(busy)}" if busy else ""
    if args.quick:
        return verdict(True, measured, "targets not applied with --quick")
    missed = [f"{m} x{k} {best.get((m, k), 0):.0f} < {t}" for (m, k), t in TARGETS.items() if best.get((m, k), 0) < t]
    return verdict(not missed, measured + (f"; missed: {missed}" if missed else ""), f"img/s >= {TARGETS}")


STEPS = {"fresh": fresh, "resume": resume, "compile": compiled, "torchrun": torchrun, "seeds": seeds, "step": step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="CIFAR-10 as train_cifar.py takes it; default: long-range")
    p.add_argument("--device", default="auto")
    p.add_argument("--epochs", type=float, default=3, help="epochs of each training run")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "float16"],
                   choices=["bfloat16", "float16", "float32"], help="precisions of the fresh runs; the first one's "
                   "for the other steps")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    p.add_argument("--quick", action="store_true", help="tiny data and steps (a CPU dry run); no accuracy bounds")
    p.add_argument("--timeout", type=int, default=180, help="seconds for the torchrun step")
    p.add_argument("--work", default="runs/gpu_check", help="folder for the runs (emptied first)")
    p.add_argument("--out", default="gpu_check.json")
    args = p.parse_args(argv)

    print(f"gpu_check on {args.device}: {', '.join(args.steps)}; each step PASS or FAIL against the bound in "
          "benchmarks/gpu_check.py's docstring", flush=True)
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       "cpu" if args.device == "auto" else args.device)
    report = {"environment": common.environment(dev), "args": vars(args), "command": common.command("gpu_check"),
              "verdicts": {}}
    for name in args.steps:
        t = time.perf_counter()
        try:
            v = STEPS[name](args, work, report)
        except Exception as e:  # a broken step fails and the others still run
            v = verdict(False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "runs")
            report[f"{name}_traceback"] = traceback.format_exc()[-3000:]
        v["seconds"] = time.perf_counter() - t
        report["verdicts"][name] = v
        print(f"{v['verdict']} {name}: {v['measured']} (bound: {v['bound']}; {v['seconds']:.0f} s)", flush=True)
        common.write_json(args.out, report)
    failed = [k for k, v in report["verdicts"].items() if v["verdict"] == "FAIL"]
    print(f"gpu_check: {'FAIL ' + ', '.join(failed) if failed else 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
