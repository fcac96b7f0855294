"""benchmarks/gpu_check.py, the check for a GPU machine, runs its steps in miniature on the CPU,
so a lent GPU finds a script that works (its CUDA paths are then the only new thing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_its_steps_in_miniature_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    # --compile is left out (on a CPU it builds C++ kernels for minutes), and fp32 stands in for
    # bf16, which this CPU emulates many times slower; torchrun and the step benchmark run as on a
    # GPU, on two tiny processes and batch 8.
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--dtypes", "float32",
           "--steps", "fresh_bf16_fp16", "resume", "torchrun_two_processes", "step_bench_bf16",
           "--work", str(tmp_path / "work"), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert set(steps) == {"fresh_bf16_fp16", "resume", "torchrun_two_processes", "step_bench_bf16"}
    failed = {k: v.get("error") for k, v in steps.items() if not v["ok"]}
    assert not failed, failed
