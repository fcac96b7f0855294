"""benchmarks/gpu_check.py, the check for a GPU machine, runs its steps in miniature on the CPU,
so a lent GPU finds a script that works (its CUDA paths are then the only new thing), and its
verdict can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_its_steps_in_miniature_on_the_cpu_and_passes(tmp_path):
    out = tmp_path / "check.json"
    # --compile is left out (on a CPU it builds C++ kernels for minutes), and fp32 stands in for
    # bf16; torchrun runs two tiny gloo processes, the step comparison batch 64 for two steps.
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--dtypes", "float32",
           "--steps", "fresh", "resume", "torchrun", "seeds", "step", "--work", str(tmp_path / "work"),
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("gpu_check on cpu: fresh, resume, torchrun, seeds, step;") and \
        lines[-1] == "gpu_check: PASS"
    report = json.loads(out.read_text())
    assert {k: v["verdict"] for k, v in report["verdicts"].items()} == dict.fromkeys(
        ("fresh", "resume", "torchrun", "seeds", "step"), "PASS")
    assert {r["seeds"] for r in report["seeds"]["rows"]} == {1, 2} and report["seeds"]["bf16_peak_tflops"] > 0
    assert report["resume"]["max_weight_diff"] == 0.0 and report["torchrun"]["ranks_agree"] is True


def test_gpu_check_fails_a_step_that_misses_its_bound(tmp_path, monkeypatch, capsys):
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "TIMM_SPEED", 1e9)  # no step is a billion times faster than timm's
    status = gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32", "--steps", "step", "--work",
                             str(tmp_path / "work"), "--out", str(tmp_path / "check.json")])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL step:" in out and out.strip().endswith("gpu_check: FAIL step")


def test_every_benchmark_imports_as_run_by_python_m():
    """``python -m benchmarks.<name>`` imports the module inside the package: a sibling import
    (``from bench_vit import ...``) works only when the script's folder is on the path."""
    import importlib

    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert "seeds_step" in names and len(names) >= 6
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        assert module.__doc__, f"benchmarks/{name}.py says what it measures in its docstring"
    r = subprocess.run([sys.executable, "-m", "benchmarks.seeds_step", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]


def test_a_gpu_profile_counts_the_cards_work_and_launches_per_step():
    """``precision_step.device_profile`` reads kineto's events as torch gives them: a stand-in with
    the real events' methods (checked on a CPU profile), and the activity types kineto gives a
    GPU's work and its launches (torch/profiler/_chrome_trace_export.py)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.precision_step import device_profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4) @ torch.ones(4)
    real = next(iter(prof.profiler.kineto_results.events()))
    assert isinstance(real.activity_type(), str) and isinstance(real.name(), str) and real.duration_ns() >= 0

    class Event:
        def __init__(self, kind: str, name: str, ms: float):
            self.kind, self.label, self.ns = kind, name, int(ms * 1e6)

        def activity_type(self):
            return self.kind

        def name(self):
            return self.label

        def duration_ns(self):
            return self.ns

    events = [Event("cpu_op", "aten::mm", 5.0), Event("cuda_runtime", "cudaLaunchKernel", 0.01),
              Event("cuda_driver", "cuLaunchKernel", 0.01), Event("cuda_runtime", "cudaStreamSynchronize", 9.0),
              Event("kernel", "gemm", 3.0), Event("kernel", "gemm", 1.0), Event("kernel", "softmax", 1.0),
              Event("gpu_memcpy", "Memcpy HtoD", 1.0), Event("gpu_user_annotation", "forward", 6.0)]
    d = device_profile(events, steps=2, wall_ms=10.0)
    assert d["device_ms_per_step"] == 3.0 and d["device_busy_share"] == 0.3  # (3 + 1 + 1 + 1) ms over 2 steps
    assert d["kernels_per_step"] == 1.5 and d["launches_per_step"] == 1.0
    assert list(d["top_ms_per_step"].items()) == [("gemm", 2.0), ("softmax", 0.5), ("Memcpy HtoD", 0.5)]


def test_no_benchmark_patches_a_model_or_copies_the_shared_helpers():
    """A variant is a config field or a public call (no replaced method, no edited config, no
    private set from outside), and timing, interleaving, the environment and the training step
    come from benchmarks/common.py."""
    import re
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    patched = re.compile(r"\.(forward|fused)\s*=(?!=)|(?<!_dynamo)\.config\.\w+\s*=(?!=)|setattr\(model")
    copied = re.compile(r"^def (sync|environment|matmul_peak|gemm_gflops|timed|train_cifar_run)\(", re.M)
    for path in folder.glob("*.py"):
        code = path.read_text()
        assert not patched.search(code), path
        if path.name != "common.py":
            assert not copied.search(code), path
            assert "json.dumps(report" not in code and "json.dumps(result" not in code, path
