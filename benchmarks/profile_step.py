"""Where a training step's time goes, per library: the share of matrix products against the rest.

Builds the same ViT in vitattn and timm with the benchmark's own training step for each
(``bench_vit.make_runner``: forward, cross-entropy, backward, AdamW), profiles a few steps of
each with ``torch.profiler`` (CPU), and sorts every aten op's self time into *GEMM* (``addmm``,
``mm``, ``bmm``, convolution and the attention kernels) or *other* (LayerNorm, GELU, softmax,
adds, copies, the optimiser, ...). The GEMM share bounds what any rewrite of the rest can buy:
if GEMMs are a fraction ``g`` of the step and run at the same speed in both libraries, removing
*all* the other work speeds the step up by at most ``1 / g``.

    python -m benchmarks.profile_step --case cifar_train
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_vit import CASES, make_runner

GEMM_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::convolution",
            "aten::convolution_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::baddbmm")


def breakdown(step, steps: int) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    # self time per op: each microsecond counted once, whatever op nests in which
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        totals[ev.key] += ev.self_cpu_time_total
    total = sum(totals.values())
    gemm = sum(v for k, v in totals.items() if k in GEMM_OPS or "mkldnn" in k or "mkl_" in k)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    return dict(step_ms=total / steps / 1e3, gemm_share=gemm / total,
                top=[(k, round(v / steps / 1e3, 2)) for k, v in top])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="cifar_train", choices=sorted(CASES))
    p.add_argument("--libs", nargs="+", default=["vitattn", "timm"])
    p.add_argument("--steps", type=int, default=2, help="profiled steps per round")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args()
    case = CASES[a.case]
    if case.mode != "train":
        p.error(f"{a.case} is an inference case; this script profiles training steps")
    torch.manual_seed(0)
    x = torch.randn(case.batch, 3, case.img, case.img)
    y = torch.randint(0, case.num_classes, (case.batch,))
    cpu = torch.device("cpu")
    steps = {lib: make_runner(lib, case, x, y, cpu, compile_=False, amp=False).step for lib in a.libs}
    for _ in range(2):  # warm every model first (allocator, caches), alternating
        for step in steps.values():
            step()
    out = {}
    for _ in range(2):  # profile in turn, twice; keep each library's faster round
        for lib, step in steps.items():
            r = breakdown(step, a.steps)
            if lib not in out or r["step_ms"] < out[lib]["step_ms"]:
                out[lib] = r
    for lib, r in out.items():
        print(f"\n{lib}: {r['step_ms']:.0f} ms of op self-time per step (faster of two rounds), GEMM share "
              f"{100 * r['gemm_share']:.1f}% (removing all other work: at most {1 / r['gemm_share']:.2f}x)")
        for k, v in r["top"]:
            print(f"  {v:9.2f} ms  {k}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(case=a.case, torch=torch.__version__, results=out), indent=1))


if __name__ == "__main__":
    main()
