"""Cost of a ViT detection backbone on CPU: global against windowed attention, and timm's
``forward_intermediates``, at detection sizes (512x512, 1024x1024).

Every variant is a ViT-S/16 (width 384, depth 12, 6 heads, MLP 1536, class token), random
weights, inference of one image (``torch.inference_mode``), up to the last block's map
``(1, 384, H/16, W/16)`` after the final norm:

    vitattn global      ViT.forward_intermediates, global attention in every block
    vitattn window14    the same weights, 14x14 windows (padded) except blocks 2, 5, 8, 11 (ViTDet)
    timm global         timm VisionTransformer.forward_intermediates (its fused attention)
    vitattn window14 +pyramid   the whole ViTDetBackbone: window14 trunk + simple feature pyramid (256 ch)
    vitattn global explicit     global, on the readable path: softmax(QK^T)V with the (heads, N, N)
                                weights in memory, as any attention that exposes its weights

Time: all variants of a size live in one process and run interleaved (``repeats`` rounds, each
variant once per round, in rotated order) after one warm-up each; medians. Peak memory: each
(size, variant) runs in a fresh subprocess that builds the model and input, runs a warm-up
forward, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs one forward and
reads ``VmHWM - VmRSS(before)``: every page the forward touched, allocator and all. Memory is
also measured for a training step (forward, backward of the summed outputs; gradient buffers
exist before the mark, so the figure is activations and temporaries). The
subprocess fixes glibc's mmap threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that tensors
freed by the warm-up go back to the kernel instead of staying in the heap and hiding the peak.

    python -m benchmarks.bench_detection              # ~5 min
    python -m benchmarks.bench_detection --sizes 256 --repeats 1                   # quick look

Writes ``benchmarks/results/detection.json`` and ``.md``.

References: ViTDet (Li et al. 2022) for window 14 / global every third block; timm
``forward_intermediates``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import common

VARIANTS = ("vitattn global", "vitattn window14", "timm global", "vitattn window14 +pyramid",
            "vitattn global explicit")
MODES = ("infer", "train")
DIMS = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0)


def build(variant: str, size: int):
    """The model of a variant and a function running one forward to the last map."""
    torch.manual_seed(0)
    if variant == "timm global":
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=size, num_classes=0, **DIMS).eval()
        last = DIMS["depth"] - 1
        return model, lambda x: model.forward_intermediates(x, indices=[last], norm=True, intermediates_only=True)[0]
    from vitattn import ViT
    from vitattn.vitdet import ViTDetBackbone

    windows = {"window_size": 14} if "window14" in variant else {}  # ViTDet's layout: global in blocks 2, 5, 8, 11
    vit = ViT(img_size=size, num_classes=0, fused_attn=not variant.endswith("explicit"), **DIMS, **windows).eval()
    if variant.endswith("+pyramid"):
        bb = ViTDetBackbone(vit, 256).eval()
        return bb, bb
    return vit, lambda x: vit.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def measure_memory(variant: str, size: int, threads: int, mode: str) -> dict:
    """Run in a fresh process: peak RSS growth of one forward (``infer``) or one forward and
    backward (``train``), after a warm-up of the same."""
    torch.set_num_threads(threads)
    model, fn = build(variant, size)
    x = torch.randn(1, 3, size, size)

    def step():
        if mode == "infer":
            with torch.inference_mode():
                return fn(x)
        y = fn(x)
        sum(v.sum() for v in y.values()).backward() if isinstance(y, dict) else y.sum().backward()
        return y

    model.train(mode == "train")
    step()  # warm-up: one-time buffers (kernels, caches, gradient tensors) are not the step's cost
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    before = proc_status()["VmRSS"]
    y = step()
    after = proc_status()
    shape = tuple(next(iter(y.values())).shape) if isinstance(y, dict) else tuple(y.shape)
    return {"peak_mb": (after["VmHWM"] - before) / 2**20, "out_shape": shape}


def time_size(size: int, repeats: int, threads: int) -> dict[str, dict]:
    torch.set_num_threads(threads)
    fns = {v: build(v, size)[1] for v in VARIANTS}
    x = torch.randn(1, 3, size, size)
    with torch.inference_mode():
        ref = {v: fns[v](x) for v in VARIANTS}  # warm-up
        # windows covering less than the grid must change the result (they are really on)
        ref_diff = float((ref["vitattn global"] - ref["vitattn window14"]).abs().max())

        def block(v: str) -> float:
            t0 = time.perf_counter()
            fns[v](x)
            return time.perf_counter() - t0

        times = common.interleaved({v: lambda v=v: block(v) for v in VARIANTS}, repeats)
    out = {v: {"times_s": t, "median_s": statistics.median(t)} for v, t in times.items()}
    out["vitattn global"]["max_abs_diff_to_window14"] = ref_diff
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--_memory", nargs=3, metavar=("VARIANT", "SIZE", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._memory:
        print(json.dumps(measure_memory(a._memory[0], int(a._memory[1]), a.threads, a._memory[2])))
        return

    t_start = time.perf_counter()
    results = {}
    for size in a.sizes:
        print(f"{size}x{size}: timing {len(VARIANTS)} variants x {a.repeats} rounds", file=sys.stderr, flush=True)
        res = time_size(size, a.repeats, a.threads)
        for v in VARIANTS:
            for mode in MODES:
                if v.endswith("explicit") and mode == "train" and size > 512:
                    # 12 blocks keep (6, 4096, 4096) fp32 scores and weights for backward, > 10 GB:
                    # more than this shared machine should be asked for.
                    res[v]["peak_mb_train"] = None
                    continue
                cmd = [sys.executable, __file__, "--_memory", v, str(size), mode, "--threads", str(a.threads)]
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
                run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                res[v][f"peak_mb_{mode}"] = json.loads(run.stdout.splitlines()[-1])["peak_mb"]
        base = res["vitattn global"]
        for v in VARIANTS:
            r = res[v]
            r["time_ratio"] = r["median_s"] / base["median_s"]
            for mode in MODES:
                peak = r[f"peak_mb_{mode}"]
                r[f"memory_ratio_{mode}"] = None if peak is None else peak / base[f"peak_mb_{mode}"]
            print(f"  {v:28s} {r['median_s']:7.3f} s  x{r['time_ratio']:.2f}   infer {r['peak_mb_infer']:8.1f} MB  "
                  f"train {r['peak_mb_train']} MB", file=sys.stderr, flush=True)
        results[str(size)] = res
    env = {**common.environment(torch.device("cpu")), "threads": a.threads, "wall_s": time.perf_counter() - t_start}
    report = {"dims": DIMS, "repeats": a.repeats, "env": env, "command": common.command("bench_detection"),
              "results": results}
    common.write_json(a.out / "detection.json", report)
    lines = [f"ViT-S/16 trunk to the last map, batch 1, {a.threads} threads; forward time: median of {a.repeats} "
             f"interleaved inference runs; peak memory: RSS growth of one inference forward / one training "
             f"forward+backward in a fresh process; torch {torch.__version__}, timm {env['versions']['timm']}; "
             "ratios (x) to vitattn global.", "",
             "| size | variant | forward (s) | x | peak infer (MB) | x | peak train (MB) | x |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for size, res in results.items():
        for v in VARIANTS:
            r = res[v]
            lines.append(f"| {size}x{size} | {v} | {r['median_s']:.3f} | {r['time_ratio']:.2f} | "
                         f"{r['peak_mb_infer']:.0f} | {r['memory_ratio_infer']:.2f} | "
                         + (f"{r['peak_mb_train']:.0f} | {r['memory_ratio_train']:.2f} |"
                            if r["peak_mb_train"] is not None else "not run | |"))
    (a.out / "detection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
