"""Reach against depth on the long-range task: one table and one figure from single-model runs.

Each run is ``train_cifar.py --dataset long-range`` with one model at some depth (``--vit-kwargs
'{"depth": 2}'``, ``--cnn-kwargs '{"widths": [64, 256]}'``), all on one budget. This joins their
``summary.json`` files into a markdown table (accuracy, accuracy per distance bin, the ERF radius
of each layer, the ViT's attention distance per block) and a figure: accuracy against mark
distance per model (mean over seeds, their range as bars) and final accuracy against depth per
family. A ViT whose windows are one patch in every block is its own series, the control for
attention, and so is a ViT with rotary position codes; the dash-dot line at 3/4 is what a mean
read-out of features that never see both marks can reach on the alignment task (docs/context.md).

    python -m benchmarks.longrange_depth runs/depth_*/summary.json --out docs/img --name longrange_depth
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vitattn.training.report import pyplot, save_figure


def describe(model: dict, config: dict) -> tuple[str, int]:
    """``(series, depth)``: 'ViT', 'ViT, rotary codes', 'ViT, no token mixing' (windows of one
    patch in every block) or 'CNN', and its blocks or stages, from the run's preset and its
    ``--*-kwargs``."""
    import vitattn

    fam = model["family"]
    cfg = vitattn.get_config(model["preset"], **json.loads(config.get(f"{fam}_kwargs", "{}")))
    if fam != "vit":
        return "CNN", len(cfg.widths)
    local = cfg.window_size in (1, (1, 1)) and set(cfg.window_block_indexes) >= set(range(cfg.depth))
    if local:
        return "ViT, no token mixing", cfg.depth
    return ("ViT, rotary codes" if getattr(cfg, "use_rot_pos_emb", False) else "ViT"), cfg.depth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summaries", nargs="+", type=Path, help="summary.json files of long-range runs")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the figure")
    p.add_argument("--name", default="longrange_depth", help="the figure is <out>/<name>.png")
    a = p.parse_args()
    rows = []
    for path in a.summaries:
        if not path.is_file():
            sys.exit(f"error: {path} is not a file; expected a run's summary.json")
        s = json.loads(path.read_text())
        if s.get("dataset") != "long-range" or len(s.get("models", {})) != 1:
            sys.exit(f"error: {path} is not a one-model long-range run")
        (m,) = s["models"].values()
        rows.append((*describe(m, s["config"]), s["config"]["seed"], m))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))

    print("| model | depth | seed | params | epochs | img/s | test acc | by distance | ERF radius per layer (px) "
          "| attention distance per block (px) |\n|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for series, d, seed, m in rows:
        by = " / ".join(f"{x:.2f}" for x in m["accuracy_by_distance"]["accuracy"])
        erf = ", ".join(f"{x:.1f}" for x in m["erf_radius_px"])
        att = ", ".join(f"{sum(h) / len(h):.1f}" for h in m.get("attention_distance_px", []))
        print(f"| {series} | {d} | {seed} | {m['params'] / 1e6:.2f} M | {m['epochs']:.2f} | "
              f"{m['images_per_s']:.0f} | {100 * m['final_acc']:.1f}% | {by} | {erf} | {att} |")

    # One line per model (series, depth): the mean over seeds, the seeds' range as error bars.
    groups: dict[tuple[str, int], list[dict]] = {}
    for series, d, _, m in rows:
        groups.setdefault((series, d), []).append(m)
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    style = {"ViT": "o-", "ViT, rotary codes": "D-", "ViT, no token mixing": "^:", "CNN": "s--"}
    palette = pyplot().get_cmap("tab20").colors  # more models than tab10 has colours
    for i, ((series, d), ms) in enumerate(groups.items()):
        acc = torch.tensor([m["accuracy_by_distance"]["accuracy"] for m in ms])
        mean = acc.mean(0)
        left.errorbar(ms[0]["accuracy_by_distance"]["centres"], mean, fmt=style[series], capsize=3,
                      color=palette[(2 * i) % 20 + (2 * i) // 20 % 2],
                      yerr=torch.stack([mean - acc.amin(0), acc.amax(0) - mean]),
                      label=f"{series}, {d} {'stages' if series == 'CNN' else 'blocks'} ({len(ms)} seeds)")
    left.set(xlabel="distance between the marks (px)", ylabel="test accuracy", title="accuracy against distance")
    for colour, series in zip(("C0", "C3", "C2", "C1"), style):
        pts = sorted((d, m["final_acc"]) for s_, d, _, m in rows if s_ == series)
        if pts:
            right.plot(*zip(*pts), style[series][0], color=colour, alpha=0.5)
            ds = sorted({d for d, _ in pts})
            right.plot(ds, [sum(x for e, x in pts if e == d) / sum(e == d for e, _ in pts) for d in ds],
                       style[series], color=colour, label=f"{series} ({'stages' if series == 'CNN' else 'blocks'})")
    right.set(xlabel="depth", ylabel="test accuracy", title="accuracy against depth, equal budget (dots: seeds)")
    for ax in (left, right):
        ax.axhline(0.5, color="grey", ls=":")
        ax.axhline(0.75, color="grey", ls="-.", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a.out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, a.out / f"{a.name}.png", "Long-range task: reach against depth")
    print(f"\nwrote {a.out / f'{a.name}.png'}")


if __name__ == "__main__":
    main()
