"""Side-by-side speed and memory of vitattn's ViT against timm, torchvision and vit-pytorch.

Every library builds a ViT of the same dimensions (depth, width, heads, MLP hidden width, patch,
tokens incl. one class token); all models of a case live in one process and run **interleaved**
on the same inputs: repeat r times ``for lib in rotated(libs): time `iters` steps``, then take
medians. On a shared, noisy machine only figures taken side by side like this are comparable.

Per case and library it prints images/s, the ratio to the best *peer* (the fastest of the other
libraries), achieved GFLOP/s (torch's FLOP formulas, ``vitattn.helpers.count_flops``, counted per model)
and its share of a fp32 matmul peak measured in the same run, and the peak memory of one step
(CPU allocator events from ``torch.profiler``; with ``--device cuda`` the CUDA allocator's peak).

    python -m benchmarks.bench_vit                      # all eager cases
    python -m benchmarks.bench_vit --cases cifar_train --repeats 3 --iters 1        # quick look
    python -m benchmarks.bench_vit --compile --cases cifar_train tiny_infer

Cases: (a) CIFAR training steps, (b) ImageNet-size inference, (c) long sequences,
(d) ``train_cifar.py``'s whole step, the loop's own, against the model-only step (``case_d``). ``--ablation`` adds
vitattn with one speed choice undone (the explicit attention path; the full last block instead of
the class-token shortcut), to show what each buys.

References: timm ``benchmark.py`` (interleaving, FLOP counting), airbench's timing discipline.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from benchmarks import common

LIBS = ("vitattn", "timm", "torchvision", "vit-pytorch")


class WholeLastBlock(nn.Module):
    """A ViT called through its public parts, ``forward_head(forward_features(x))``: the last
    block computed for every token, as a hook or a trace sees it (no class-token shortcut)."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit.forward_head(self.vit.forward_features(x))


# vitattn with one of its speed choices undone (or an option's cost), through a config field or a
# public method, never a patched model: not a peer, it shows what each choice buys, side by side.
VARIANTS: dict[str, dict] = {
    "vitattn[explicit]": dict(fused_attn=False),  # the readable softmax(q k^T) v path
    "vitattn[full last block]": dict(whole=True),  # WholeLastBlock
    "vitattn[rotary codes]": dict(use_rot_pos_emb=True),  # 2-D rotary codes on q and k, read at each forward
}


# -- cases ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    mode: str  # 'train' (forward, cross-entropy, backward, AdamW step) or 'infer' (inference_mode)
    img: int  # square image side; every peer accepts square images
    patch: int
    dim: int  # token width D
    depth: int
    heads: int
    mlp_ratio: float  # MLP hidden = dim * mlp_ratio
    batch: int
    num_classes: int = 1000
    note: str = ""
    libs: tuple[str, ...] = LIBS

    @property
    def tokens(self) -> int:
        return (self.img // self.patch) ** 2 + 1  # + class token (torchvision always has one)


CASES: dict[str, Case] = {c.name: c for c in [
    # (a) the CIFAR training step, two head layouts
    Case("cifar_train", "train", 32, 4, 192, 9, 3, 4.0, 128, 10, "32x32/4, D192, depth 9, 3 heads (d=64), mlp 4"),
    Case("cifar_lee_train", "train", 32, 4, 192, 9, 12, 2.0, 128, 10,
         "Lee et al. 2021: 12 heads of width 16, mlp 2"),
    # (b) ImageNet-size inference
    Case("tiny_infer", "infer", 224, 16, 192, 12, 3, 4.0, 32, note="vit_tiny_patch16_224"),
    Case("small_infer", "infer", 224, 16, 384, 12, 6, 4.0, 32, note="vit_small_patch16_224"),
    # (c) long sequences
    Case("long1024_infer", "infer", 512, 16, 384, 12, 6, 4.0, 2, note="512x512/16 = 1024 tokens, D384"),
    Case("long4096_infer", "infer", 1024, 16, 384, 12, 6, 4.0, 1, note="1024x1024/16 = 4096 tokens, D384"),
]}
GROUPS = {"a": ["cifar_train", "cifar_lee_train"], "b": ["tiny_infer", "small_infer"],
          "c": ["long1024_infer", "long4096_infer"], "d": ["cifar_pipeline"]}


# -- the models, same dimensions in every library ---------------------------------------------------
def build_model(lib: str, c: Case) -> nn.Module:
    hidden = int(c.dim * c.mlp_ratio)
    if lib == "vitattn" or lib in VARIANTS:
        from vitattn import ViT, ViTConfig
        fields = {k: v for k, v in VARIANTS.get(lib, {}).items() if k != "whole"}
        vit = ViT(ViTConfig(img_size=c.img, patch_size=c.patch, embed_dim=c.dim, depth=c.depth, num_heads=c.heads,
                            mlp_ratio=c.mlp_ratio, num_classes=c.num_classes, **fields))
        return WholeLastBlock(vit) if VARIANTS.get(lib, {}).get("whole") else vit
    if lib == "timm":
        from timm.models.vision_transformer import VisionTransformer
        return VisionTransformer(img_size=c.img, patch_size=c.patch, embed_dim=c.dim, depth=c.depth,
                                 num_heads=c.heads, mlp_ratio=c.mlp_ratio, num_classes=c.num_classes)
    if lib == "torchvision":
        from torchvision.models.vision_transformer import VisionTransformer
        return VisionTransformer(image_size=c.img, patch_size=c.patch, num_layers=c.depth, num_heads=c.heads,
                                 hidden_dim=c.dim, mlp_dim=hidden, num_classes=c.num_classes)
    if lib == "vit-pytorch":
        # vit-pytorch adds LayerNorms around its patch projection and has no qkv bias; the rest matches.
        from vit_pytorch import ViT as VPViT
        return VPViT(image_size=c.img, patch_size=c.patch, num_classes=c.num_classes, dim=c.dim, depth=c.depth,
                     heads=c.heads, mlp_dim=hidden, dim_head=c.dim // c.heads, pool="cls")
    raise ValueError(f"unknown library {lib!r}; expected one of {LIBS}")


# -- measuring ------------------------------------------------------------------------------------
# (M, K, N) of the reference products: a square one and the ViT's own token-by-width shapes (the
# square one alone ran slower than the ViT's own shapes on the 2-core EPYC, which put shares above 100%).
PEAK_SHAPES = ((2048, 2048, 2048), (8192, 192, 768), (8192, 768, 192), (8192, 384, 1536))


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA attention kernels; teach it the CPU flash kernel too, so a fused
# model is not credited with fewer FLOPs than an explicit one.
FLOP_MAPPING = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
}


def count_flops(step: Callable[[], object]) -> int:
    """A step's FLOPs by torch's formulas (``vitattn.helpers.count_flops``: no module hooks, so
    vitattn's ViT counts the work its timed steps do)."""
    from vitattn.helpers import count_flops as flops

    return flops(step, formulas=FLOP_MAPPING)


def peak_memory(step: Callable[[], object], device: torch.device) -> int:
    """Bytes of the largest live allocation total during one step, above what was live before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclass
class Runner:
    """One library's model for one case, with a ``step()`` that does one timed unit of work."""

    lib: str
    model: nn.Module
    step: Callable[[], object]
    params: int
    times: list[float] = field(default_factory=list)


def make_runner(lib: str, c: Case, x: torch.Tensor, y: torch.Tensor, device: torch.device, compile_: bool,
                amp: bool) -> Runner:
    torch.manual_seed(0)
    model = build_model(lib, c).to(device)
    params = sum(p.numel() for p in model.parameters())
    fwd = torch.compile(model) if compile_ else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    if c.mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            return loss
    else:
        model.eval()

        def step():
            with torch.inference_mode(), autocast:
                return fwd(x)
    return Runner(lib, model, step, params)


def time_steps(r: Runner, iters: int, device: torch.device) -> float:
    common.sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        r.step()
    common.sync(device)
    return (time.perf_counter() - t) / iters


def run_case(c: Case, args, device: torch.device, peak_gflops: float) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(c.batch, 3, c.img, c.img, device=device)
    y = torch.randint(0, c.num_classes, (c.batch,), device=device)
    libs = [lib for lib in c.libs if lib in args.libs]
    if args.ablation is not None and not args.compile and "vitattn" in libs:
        libs[1:1] = args.ablation or list(VARIANTS)
    runners = [make_runner(lib, c, x, y, device, args.compile, args.amp) for lib in libs]
    for r in runners:  # warm up (and compile) before any timing
        for _ in range(args.warmup):
            r.step()
    times = common.interleaved({r.lib: lambda r=r: time_steps(r, args.iters, device) for r in runners}, args.repeats)
    for r in runners:
        r.times = times[r.lib]
    rows = []
    for r in runners:
        flops = count_flops(r.step) if not args.compile else None
        mem = peak_memory(r.step, device) if not args.no_memory else None
        med = statistics.median(r.times)
        rows.append(dict(case=c.name, mode=c.mode, compiled=args.compile, lib=r.lib, params=r.params,
                         batch=c.batch, tokens=c.tokens, step_s=med, step_s_min=min(r.times),
                         step_s_max=max(r.times), times=r.times, img_per_s=c.batch / med, flops=flops,
                         peak_mem_bytes=mem))
    if args.compile:  # FLOPs do not depend on compilation; count them on the eager model
        for row, r in zip(rows, runners):
            eager = make_runner(r.lib, c, x, y, device, False, args.amp)
            row["flops"] = count_flops(eager.step)
    for row in rows:  # the best other library; vitattn's variants are nobody's peers
        own = row["lib"].startswith("vitattn")
        peers = [o["img_per_s"] for o in rows if o["lib"] != row["lib"] and o["lib"] not in VARIANTS
                 and not (own and o["lib"].startswith("vitattn"))]
        row["ratio_best_peer"] = row["img_per_s"] / max(peers) if peers else None
        row["gflops_per_s"] = row["flops"] / row["step_s"] / 1e9 if row["flops"] else None
        row["peak_share"] = row["gflops_per_s"] / peak_gflops if row["gflops_per_s"] else None
    return rows


# -- case (d): train_cifar.py's whole step ---------------------------------------------------------
def case_d(args, device: torch.device) -> list[dict]:
    """``train_cifar.py``'s training step, the loop's own (``loop.train_step``: batch indexing,
    augmentation on uint8, normalisation, forward, label-smoothed cross-entropy, backward,
    clipping, the recipe's optimiser), against the model-only step on a ready float batch (forward,
    cross-entropy, backward, AdamW), interleaved, vitattn only, on generated long-range images (the
    step's cost does not depend on their content)."""
    import tempfile

    import vitattn
    from vitattn.tasks import classify

    folder = Path(tempfile.mkdtemp())
    kw = dict(batch_size=args.batch) if args.batch else {}
    cfg = classify.Config(dataset="long-range", long_range_train=2048, long_range_test=64, model="vit",
                          vit_preset=args.pipeline_preset, device=str(device), progress=False, tensorboard=False,
                          compile=args.compile, out=str(folder / "run"), **kw)
    run, batches = common.train_cifar_run(cfg, "vit", device, folder)
    batch = run.task.batch_size
    torch.manual_seed(0)
    model = vitattn.create_model(args.pipeline_preset, num_classes=10).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd = torch.compile(model) if args.compile else model
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)

    def model_only() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(fwd(x), y).backward()
        opt.step()

    def block_full() -> float:
        return common.timed([(run, batches)], args.iters) / args.iters

    def block_model() -> float:
        common.sync(device)
        t = time.perf_counter()
        for _ in range(args.iters):
            model_only()
        common.sync(device)
        return (time.perf_counter() - t) / args.iters

    names = {"vitattn (train_cifar step)": block_full, "vitattn (model only)": block_model}
    times = common.interleaved(names, args.repeats, warmup=max(1, args.warmup))
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for lib, ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(case=f"cifar_pipeline ({args.pipeline_preset})", mode="train", compiled=args.compile, lib=lib,
                         params=params, batch=batch, tokens=None, step_s=med, step_s_min=min(ts), step_s_max=max(ts),
                         times=ts, img_per_s=batch / med, flops=None, peak_mem_bytes=None, ratio_best_peer=None,
                         gflops_per_s=None, peak_share=None))
    rows[0]["ratio_best_peer"] = rows[0]["img_per_s"] / rows[1]["img_per_s"]  # pipeline / model-only
    return rows


# -- report ---------------------------------------------------------------------------------------
def markdown(rows: list[dict], peak: float) -> str:
    lines = ["| case | mode | library | params | img/s | vs best peer | GFLOP/s | % of peak | peak mem (MB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mode = r["mode"] + (" compiled" if r.get("compiled") else "")
        ratio = f"{r['ratio_best_peer']:.2f}x" if r.get("ratio_best_peer") else "-"
        if r["case"].startswith("cifar_pipeline") and r.get("ratio_best_peer"):
            ratio += " of model-only"
        gf = f"{r['gflops_per_s']:.0f}" if r.get("gflops_per_s") else "-"
        share = f"{100 * r['peak_share']:.0f}%" if r.get("peak_share") else "-"
        mem = f"{r['peak_mem_bytes'] / 2**20:.0f}" if r.get("peak_mem_bytes") is not None else "-"
        name = f"**{r['lib']}**" if r["lib"] == "vitattn" else r["lib"]
        lines.append(f"| {r['case']} | {mode} | {name} | {r['params'] / 1e6:.2f}M | {r['img_per_s']:.1f} | "
                     f"{ratio} | {gf} | {share} | {mem} |")
    shapes = ", ".join("x".join(map(str, s)) for s in PEAK_SHAPES)
    lines.append(f"\nfp32 matmul peak measured in this run: {peak:.0f} GFLOP/s (best of 5 each of `torch.mm` "
                 f"M x K x N = {shapes}; before and after the cases).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["a", "b", "c"],
                   help=f"case names or groups: {sorted(CASES) + ['cifar_pipeline']} / {sorted(GROUPS)}")
    p.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--iters", type=int, default=2, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the rounds")
    p.add_argument("--batch", type=int, default=None, help="override every case's batch size")
    p.add_argument("--ablation", nargs="*", default=None, choices=list(VARIANTS), metavar="VARIANT",
                   help=f"also run vitattn with a speed choice undone (all when no name is given): "
                        f"{', '.join(VARIANTS)}")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (compiled vs compiled)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (meant for CUDA)")
    p.add_argument("--pipeline-preset", default="vit_quick", help="vitattn preset for case (d)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory step")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and markdown files")
    p.add_argument("--tag", default=None, help="file name stem; default: the cases, mode, rounds and CPU")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [n for sel in args.cases for n in GROUPS.get(sel, [sel])]
    unknown = [n for n in names if n not in CASES and n != "cifar_pipeline"]
    if unknown:
        p.error(f"unknown case(s) {unknown}; expected names from {sorted(CASES)} or groups {sorted(GROUPS)}")

    env = common.environment(device)
    t0 = time.perf_counter()
    peak_dtype = torch.bfloat16 if args.amp else torch.float32  # the share is of the precision the steps run in
    peaks = [common.matmul_rate(device, peak_dtype, PEAK_SHAPES)]
    rows: list[dict] = []
    for name in names:
        if name == "cifar_pipeline":
            rows += case_d(args, device)
        else:
            c = CASES[name]
            if args.batch:
                c = replace(c, batch=args.batch)
            rows += run_case(c, args, device, peaks[0])
        print(f"# {name} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    peaks.append(common.matmul_rate(device, peak_dtype, PEAK_SHAPES))
    peak = max(peaks)
    for r in rows:  # share of the best peak seen in the run
        if r.get("gflops_per_s"):
            r["peak_share"] = r["gflops_per_s"] / peak
    table = markdown(rows, peak)
    print(table)
    command = common.command("bench_vit")
    result = dict(env=env, args=vars(args), command=command, matmul_peak_gflops=peaks,
                  wall_s=time.perf_counter() - t0, cases={n: asdict(CASES[n]) for n in names if n in CASES},
                  rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = "".join(c for c in platform.processor() or platform.machine() if c.isalnum())[:12] or "cpu"
    tag = args.tag or "_".join([*args.cases, "compiled" if args.compile else "eager", f"{args.repeats}rounds",
                                f"{cpu}{os.cpu_count()}"])
    common.write_json(out / f"{tag}.json", result)
    (out / f"{tag}.md").write_text(
        f"{env['cpu']}, {env['threads']} threads, torch {env['versions']['torch']}, timm {env['versions']['timm']}, "
        f"torchvision {env['versions']['torchvision']}, vit-pytorch {env['versions']['vit-pytorch']}; "
        f"`{result['command']}`; {args.repeats} interleaved repeats x {args.iters} steps, medians; "
        f"wall {result['wall_s']:.0f} s\n\n{table}\n")
    print(f"wrote {out / tag}.json and .md", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
