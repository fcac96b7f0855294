"""Reach against depth on the long-range task: one table and one figure from single-model runs.

Each run is ``train_cifar.py --dataset long-range`` with one model at some depth (``--vit-kwargs
'{"depth": 2}'``, ``--cnn-kwargs '{"widths": [64, 256]}'``), all on one budget. This joins their
``summary.json`` files into a markdown table (accuracy, accuracy per distance bin, the ERF radius
of each layer, the ViT's attention distance per block) and a figure: accuracy against mark
distance per run, and final accuracy against depth per family.

    python benchmarks/longrange_depth.py runs/depth_*/summary.json --out docs/img --name longrange_depth
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitattn.report import pyplot, save_figure


def depth(model: dict, config: dict) -> int:
    """Blocks of a ViT, stages of a CNN, from the run's preset and its ``--*-kwargs``."""
    import vitattn

    fam = model["family"]
    cfg = vitattn.get_config(model["preset"], **json.loads(config.get(f"{fam}_kwargs", "{}")))
    return cfg.depth if fam == "vit" else len(cfg.widths)


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
        rows.append((m["family"], depth(m, s["config"]), s["config"]["seed"], m))
    rows.sort(key=lambda r: (r[0] != "vit", r[1], r[2]))

    print("| model | depth | seed | params | epochs | img/s | test acc | by distance | ERF radius per layer (px) "
          "| attention distance per block (px) |\n|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for fam, d, seed, m in rows:
        by = " / ".join(f"{x:.2f}" for x in m["accuracy_by_distance"]["accuracy"])
        erf = ", ".join(f"{x:.1f}" for x in m["erf_radius_px"])
        att = ", ".join(f"{sum(h) / len(h):.1f}" for h in m.get("attention_distance_px", []))
        print(f"| {fam} {m['preset']} | {d} | {seed} | {m['params'] / 1e6:.2f} M | {m['epochs']:.2f} | "
              f"{m['images_per_s']:.0f} | {100 * m['final_acc']:.1f}% | {by} | {erf} | {att} |")

    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    for fam, d, seed, m in rows:
        b = m["accuracy_by_distance"]
        unit = "blocks" if fam == "vit" else "stages"
        left.plot(b["centres"], b["accuracy"], "o-" if fam == "vit" else "s--",
                  label=f"{'ViT' if fam == 'vit' else 'CNN'}, {d} {unit}, seed {seed}")
    left.set(xlabel="distance between the marks (px)", ylabel="test accuracy", title="accuracy against distance")
    for fam, marker in (("vit", "o-"), ("cnn", "s--")):
        pts = sorted((d, m["final_acc"]) for f, d, _, m in rows if f == fam)
        if pts:
            right.plot(*zip(*pts), marker, label="ViT (blocks)" if fam == "vit" else "CNN (stages)")
    right.set(xlabel="depth", ylabel="test accuracy", title="accuracy against depth, equal budget")
    for ax in (left, right):
        ax.axhline(0.5, color="grey", ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a.out.mkdir(parents=True, exist_ok=True)
    save_figure(fig, a.out / f"{a.name}.png", "Long-range task: reach against depth")
    print(f"\nwrote {a.out / f'{a.name}.png'}")


if __name__ == "__main__":
    main()
