"""A run's global-context measures, its figures and its ``report.md``.

``context_metrics`` applies :mod:`vitattn.context` to a trained model (any model with
``forward_intermediates``; a ViT also gets attention distance, rollout and per-head maps). The
plots take a run's metrics and results as ``train_cifar.py`` writes them (matplotlib, imported
lazily), and ``write_report`` joins tables and figures into one Markdown page.

References: Dosovitskiy et al. 2021, appendix D.7 (attention distance); Luo et al. 2016
(effective receptive field); Abnar & Zuidema 2020 (attention rollout).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ...context import (
    attention_entropy,
    attention_rollout,
    effective_receptive_field,
    head_attention_maps,
    mean_attention_distance,
    rollout_map,
)
from ...training import board
from ...training.runfolder import read_jsonl, write_text_atomic
from ...training.seeds import regroup

NAMES = {"vit": "ViT", "cnn": "CNN"}
Figure = tuple[str, str]  # (file name, caption)


class Sample(NamedTuple):
    """A seed's fixed test images for the measures: uint8 ``(B, 3, H, W)``, labels, and the
    normalisation its models were trained with."""

    images: torch.Tensor
    labels: torch.Tensor
    norm: nn.Module


@torch.no_grad()
def attention_maps(model: nn.Module, x: torch.Tensor, chunk: int = 32) -> list[torch.Tensor]:
    """``model.get_attention_maps`` over ``x`` in chunks, joined: per layer ``(B, heads, T, T)``."""
    if not hasattr(model, "get_attention_maps"):
        raise TypeError(f"attention maps need a model with get_attention_maps (a vitattn ViT), got "
                        f"{type(model).__name__}")
    per_chunk = [model.get_attention_maps(c) for c in x.split(chunk)]
    return [torch.cat([m[i] for m in per_chunk]) for i in range(len(per_chunk[0]))]


def context_metrics(model: nn.Module, images: torch.Tensor, erf_images: int = 32) -> dict[str, Any]:
    """How far each layer looks, in pixels, on normalised images ``(B, C, H, W)``.

    Returns ``erf`` (per layer: name, radius, 90% radius, the gradient map) for every model and,
    for a model with ``get_attention_maps``, ``attention_distance`` and ``attention_entropy``
    (nats) ``(layers, heads)``,
    ``rollout`` ``(4, gh, gw)`` and the class token's per-head maps in the first and last block.
    Prefix tokens are left out of the distances (the module note of :mod:`vitattn.context`).
    """
    model.eval()
    erf = effective_receptive_field(model, images[:erf_images])
    out: dict[str, Any] = {"erf": [{k: e[k] for k in ("name", "radius_px", "radius90_px", "grad")} for e in erf]}
    if hasattr(model, "get_attention_maps"):
        maps = attention_maps(model, images)
        p, grid = model.num_prefix_tokens, tuple(model.grid_size)
        out["attention_distance"] = mean_attention_distance(maps, grid, model.patch_embed.patch_size, p)
        out["attention_entropy"] = attention_entropy(maps, p)
        few = [m[:4] for m in maps]
        out["rollout"] = rollout_map(attention_rollout(few, p), grid, p)
        out["heads_first"] = head_attention_maps(few[0], grid, p)
        out["heads_last"] = head_attention_maps(few[-1], grid, p)
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display here or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, caption: str) -> Figure:
    """Write ``fig`` to ``path`` through a temp file, close it; returns ``(file name, caption)``."""
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    pyplot().close(fig)
    return path.name, caption


def plot_curves(out: Path, metrics: list[dict], families) -> Figure:
    """Loss and test accuracy per epoch, and test accuracy against training minutes
    (time to accuracy), both models on one figure."""
    fig, ax = pyplot().subplots(1, 3, figsize=(15, 4))
    for c, fam in enumerate(families):
        group = list(dict.fromkeys(m.get("seed") for m in metrics if m["model"] == fam))
        for i, seed in enumerate(group):  # a line per seed, labelled once
            rows = [m for m in metrics if m["model"] == fam and m.get("seed") == seed]
            ep, style = [m["epoch"] for m in rows], dict(color=f"C{c}", alpha=1.0 if len(group) == 1 else 0.6)
            name = NAMES[fam] + (f" ({len(group)} seeds)" if len(group) > 1 else "")
            first = i == 0
            ax[0].plot(ep, [m["train_loss"] for m in rows], "o-", label=f"{name} train" if first else None, **style)
            ax[0].plot(ep, [m["test_loss"] for m in rows], "s--", label=f"{name} test" if first else None, **style)
            ax[1].plot(ep, [m["test_acc"] for m in rows], "o-", label=name if first else None, **style)
            ax[2].plot([m["train_seconds"] / 60 for m in rows], [m["test_acc"] for m in rows], "o-",
                       label=name if first else None, **style)
    ax[0].set(xlabel="epoch", ylabel="loss", title="loss")
    ax[1].set(xlabel="epoch", ylabel="test accuracy", title="test accuracy per epoch")
    ax[2].set(xlabel="training minutes", ylabel="test accuracy", title="time to accuracy")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    return save_figure(fig, out / "curves.png", "Training curves; right: test accuracy against training minutes")


def plot_context(out: Path, context: dict) -> Figure:
    """ViT attention distance per block and head, beside every model's ERF radius per layer."""
    fig, ax = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for fam, c in context.items():
        radii = [e["radius_px"] for e in c["erf"]]
        rel = [(i + 1) / len(radii) for i in range(len(radii))]
        ax[1].plot(rel, radii, "o-", label=f"{NAMES[fam]} ERF radius")
        if "attention_distance" not in c:
            continue
        mad = c["attention_distance"].numpy()
        depth = list(range(mad.shape[0]))  # 0-based, as the report's blocks.i names
        for h in range(mad.shape[1]):
            ax[0].scatter(depth, mad[:, h], s=14, color="C0", alpha=0.6, label="heads" if h == 0 else None)
        ax[0].plot(depth, mad.mean(1), "C0-", label="mean over heads")
        ax[1].plot(rel, mad.mean(1), "x:", color="C0", label=f"{NAMES[fam]} attention distance")
        ax[0].set_xticks(depth)  # whole blocks only
    ax[0].set(xlabel="ViT block i (blocks.i in report.md)", ylabel="mean attention distance (px)",
              title="ViT: attention distance")
    ax[1].set(xlabel="relative depth (layer / number of layers)", ylabel="pixels",
              title="Effective receptive field radius (Luo et al. 2016)")
    for a in ax:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    return save_figure(fig, out / "context.png", "How far each layer looks: ViT mean attention distance per block "
                       "and head (left); ERF radius per ViT block and CNN stage on one pixel axis (right)")


def plot_erf(out: Path, context: dict) -> Figure:
    n = max(len(c["erf"]) for c in context.values())
    fig, ax = pyplot().subplots(len(context), n, figsize=(2.2 * n, 2.4 * len(context)), squeeze=False)
    for row, (fam, c) in enumerate(context.items()):
        for i, a in enumerate(ax[row]):
            a.axis("off")
            if i < len(c["erf"]):
                e = c["erf"][i]
                a.imshow((e["grad"] / e["grad"].max()).numpy(), cmap="magma")
                a.set_title(f"{NAMES[fam]} {e['name']}\nr={e['radius_px']:.1f}px", fontsize=8)
    return save_figure(fig, out / "erf.png", "Effective receptive fields: |d centre unit / d input| per layer")


def plot_distance(out: Path, results: dict) -> Figure:
    fig, a = pyplot().subplots(figsize=(6, 4))
    for fam, r in results.items():
        b = r["accuracy_by_distance"]
        a.plot(b["centres"], b["accuracy"], "o-", label=f"{NAMES[fam]} ({r['params'] / 1e6:.2f} M params)")
    a.axhline(0.5, color="grey", ls=":", label="chance")
    a.set(xlabel="distance between the marks (px)", ylabel="test accuracy", title="accuracy against mark distance")
    a.legend()
    a.grid(alpha=0.3)
    return save_figure(fig, out / "distance.png", "Long-range task: accuracy against mark distance")


def plot_attention(out: Path, c: dict, images: torch.Tensor) -> Figure:
    """Rollout and the class token's per-head attention in the first and last block, on four
    images ``(4, 3, H, W)`` in [0, 1]."""
    heads = c["heads_last"].shape[1]
    cols = 2 + 2 * heads
    fig, ax = pyplot().subplots(len(images), cols, figsize=(1.7 * cols, 1.8 * len(images)), squeeze=False)
    for i, im in enumerate(images):
        img = im.permute(1, 2, 0).clamp(0, 1).numpy()
        ax[i, 0].imshow(img)
        ax[i, 1].imshow(img)
        up = F.interpolate(c["rollout"][i][None, None].float(), size=img.shape[:2], mode="nearest")[0, 0]
        ax[i, 1].imshow(up.numpy(), cmap="jet", alpha=0.5)
        for h in range(heads):
            ax[i, 2 + h].imshow(c["heads_first"][i, h].numpy(), cmap="viridis")
            ax[i, 2 + heads + h].imshow(c["heads_last"][i, h].numpy(), cmap="viridis")
    last = c["attention_distance"].shape[0] - 1 if "attention_distance" in c else "last"
    for j, title in enumerate(["image", "rollout"] + [f"blocks.0 h{h}" for h in range(heads)]
                              + [f"blocks.{last} h{h}" for h in range(heads)]):
        ax[0, j].set_title(title, fontsize=8)
    for a in ax.flat:
        a.axis("off")
    return save_figure(fig, out / "attention.png", "Attention rollout (Abnar & Zuidema 2020) and where each head "
                       "of the class token (the centre patch without one) looks, in the first and last block")


def plot_examples(out: Path, images: torch.Tensor, labels: torch.Tensor, classes, n: int = 16) -> Figure:
    """A grid of test images ``(B, 3, H, W)`` in [0, 1] with their class names: what the task is."""
    n = min(n, len(images))
    cols = min(8, n)
    rows = -(-n // cols)
    fig, ax = pyplot().subplots(rows, cols, figsize=(1.4 * cols, 1.55 * rows), squeeze=False)
    for i, a in enumerate(ax.flat):
        a.axis("off")
        if i < n:
            a.imshow(images[i].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            a.set_title(str(classes[int(labels[i])]), fontsize=8)
    return save_figure(fig, out / "examples.png", "Test images and their labels")


def write_plots(out: Path, metrics: list[dict], results: dict, context: dict, images: torch.Tensor,
                labels: torch.Tensor, classes) -> list[Figure]:
    """Every figure of a run; ``images``: test images ``(B, 3, H, W)`` in [0, 1] (four or more)
    with their ``labels`` and the ``classes``' names."""
    figs = [plot_examples(out, images, labels, classes), plot_curves(out, metrics, list(results)),
            plot_context(out, context), plot_erf(out, context)]
    by_distance = {f: r for f, r in results.items() if "accuracy_by_distance" in r}
    if by_distance:
        figs.append(plot_distance(out, by_distance))
    vit = next((c for c in context.values() if "rollout" in c), None)
    if vit is not None:
        figs.append(plot_attention(out, vit, images[:4]))
    return figs


# ---------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------


def _row(name: str, r: dict, fmt) -> str:
    tta = (f" (flip-TTA {fmt(r, 'final_acc_tta')}, 6-view TTA {fmt(r, 'final_acc_tta_shift')})"
           if "final_acc_tta" in r else "")
    if "final_acc_no_ema" in r:  # the run kept an EMA of its weights; the raw weights' figure beside it
        tta += f" (EMA; raw weights {fmt(r, 'final_acc_no_ema')})"
    return (f"| {name} | {r['preset']} | {r['params'] / 1e6:.3f} M | {r['flops_per_image'] / 1e6:.1f} "
            f"| {r['epochs']:.2f} | {r['steps']} | {r['train_seconds'] / 60:.1f} | {r['images_per_s']:.0f} "
            f"| {100 * r['data_share']:.1f}% | {fmt(r, 'final_acc')}{tta} | {fmt(r, 'best_acc')} |")


def _results_table(res: dict) -> list[str]:
    """A row per model; a group of seeds gets a row per seed and one of their mean +- std."""
    lines = ["| model | preset | params | MFLOP/img (fwd) | epochs | steps | train min | img/s | data share "
             "| final test acc | best test acc |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain = lambda r, k: f"{r[k]:.4f}"  # noqa: E731
    spread = lambda r, k: f"{r['spread'][k]['mean']:.4f} ± {r['spread'][k]['std']:.4f}"  # noqa: E731
    for fam, r in res.items():
        if "per_seed" not in r:
            lines.append(_row(NAMES[fam], r, plain))
            continue
        for one in r["per_seed"]:
            lines.append(_row(f"{NAMES[fam]}, seed {one['seed']}", one, plain))
        lines.append(_row(f"**{NAMES[fam]}, mean ± std over {len(r['seeds'])} seeds** (img/s: all together)", r,
                          spread))
    return lines


def context_table(context: dict, images: int) -> list[str]:
    """The report's global-context section (markdown lines) for ``context_metrics`` of each family."""
    lines = ["## Global context", "",
             "Mean attention distance (ViT paper, D.7): per patch query, sum_j A_ij ||pos_i - pos_j|| in pixels "
             f"over patch keys, averaged over queries and {images} test images (the class token left out, each "
             "patch query's weights renormalised over patch keys). Effective receptive field (Luo et al. 2016): "
             f"|d centre unit / d input| over {min(32, images)} test images, reduced to a radius with the same "
             "formula. Attention entropy: -sum_j A_ij log A_ij over the same patch keys, in nats (log N for "
             "uniform attention over N patches, 0 for one patch).", "",
             "| model | layer | ERF radius (px) | ERF 90% radius (px) | attention distance (px), mean [min, max] "
             "over heads | attention entropy (nats), mean [min, max] over heads |", "|---|---|---:|---:|---|---|"]
    for fam, c in context.items():
        for i, e in enumerate(c["erf"]):
            cells = []
            for key in ("attention_distance", "attention_entropy"):
                row = c[key][i] if key in c else None
                cells.append("" if row is None else f"{row.mean():.2f} [{row.min():.2f}, {row.max():.2f}]")
            lines.append(f"| {NAMES[fam]} | {e['name']} | {e['radius_px']:.2f} | {e['radius90_px']:.1f} "
                         f"| {cells[0]} | {cells[1]} |")
    return lines + [""]


def _distance_table(res: dict) -> list[str]:
    rows = {f: r["accuracy_by_distance"] for f, r in res.items() if "accuracy_by_distance" in r}
    if not rows:
        return []
    edges = next(iter(rows.values()))["edges"]
    lines = ["## Accuracy against mark distance", "",
             "| model | " + " | ".join(f"{lo:g}-{hi:g} px" for lo, hi in zip(edges, edges[1:])) + " |",
             "|---|" + "---:|" * (len(edges) - 1)]
    for fam, b in rows.items():
        lines.append(f"| {NAMES[fam]} | " + " | ".join("" if math.isnan(a) else f"{a:.3f}" for a in b["accuracy"])
                     + " |")
    return lines + [""]


def mean_context(contexts: list[dict]) -> dict:
    """Several seeds' ``context_metrics`` of one model as one: radii, distances, entropies and
    gradient maps averaged over the seeds; the example maps (rollout, heads) the first seed's."""
    first = contexts[0]
    if len(contexts) == 1:
        return first
    out = dict(first)
    out["erf"] = [{"name": e["name"], **{k: sum(c["erf"][i][k] for c in contexts) / len(contexts)
                                        for k in ("radius_px", "radius90_px", "grad")}}
                  for i, e in enumerate(first["erf"])]
    for key in ("attention_distance", "attention_entropy"):
        if key in first:
            out[key] = torch.stack([c[key] for c in contexts]).mean(0)
    return out


def context_figures(context: dict) -> dict[str, Any]:
    """A model's global-context figures as a result holds them (lists of numbers, in pixels and nats)."""
    out: dict[str, Any] = {"erf_radius_px": [e["radius_px"] for e in context["erf"]]}
    if "attention_distance" in context:
        out["attention_distance_px"] = context["attention_distance"].tolist()
        out["attention_entropy_nats"] = context["attention_entropy"].tolist()
    return out


def write_outputs(out: Path, summary: dict, modules: dict[str, list[nn.Module]], samples: list[Sample], classes,
                  plots: bool = True, tensorboard: bool = False) -> None:
    """A run's outputs: the global-context measures of each seed's model (``modules[family][s]``)
    on that seed's fixed test images (``samples[s]``), added to ``summary`` (a group's per seed, then
    its means and spread anew), then summary.json, the plots and report.md (a group's measures as
    their means over the seeds), and with ``tensorboard`` the final figures as scalars (``board``)."""
    summary["config"]["context_images"] = len(samples[0].images)  # what the report's measures saw
    context = {}
    for fam, ms in modules.items():
        per_seed = [context_metrics(m, s.norm(s.images)) for m, s in zip(ms, samples)]
        result = summary["models"][fam]
        if "per_seed" in result:
            for r, c in zip(result["per_seed"], per_seed):
                r.update(context_figures(c))
            summary["models"][fam] = regroup(result)
        else:
            result.update(context_figures(per_seed[0]))
        context[fam] = mean_context(per_seed)
    if tensorboard and board.available():
        for fam, r in summary["models"].items():  # the end's figures one step after the last, purged there first:
            end = r["steps"] + 1  # a report written again (a resume after a crash here) replaces them
            b = board.Board(out, fam, r.get("seeds", [summary["config"]["seed"]]), purge_step=end)
            b.add(end, board.final_scalars(r))
            b.close()
    figs = []
    if plots:
        first = samples[0]
        figs = write_plots(out, read_jsonl(out / "metrics.jsonl"), summary["models"], context,
                           first.images[:16].float().cpu() / 255, first.labels[:16].cpu(), classes)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    write_report(out, summary, context, figs)


def final_line(family: str, r: dict) -> str:
    """The console's last line for a model: its final accuracy, or over seeds their mean and spread."""
    if "spread" in r:
        acc = r["spread"]["final_acc"]
        return (f"[{family}] final test accuracy {acc['mean']:.4f} +- {acc['std']:.4f} over {acc['n']} seeds (min "
                f"{acc['min']:.4f}, max {acc['max']:.4f}), {r['epochs']:.2f} epochs in {r['train_seconds'] / 60:.1f} "
                f"min, {r['images_per_s']:.0f} img/s for all seeds together")
    return (f"[{family}] final test accuracy {r['final_acc']:.4f} (best {r['best_acc']:.4f}), "
            f"{r['epochs']:.2f} epochs in {r['train_seconds'] / 60:.1f} min, {r['images_per_s']:.0f} img/s")


def write_report(out: Path, summary: dict, context: dict, figs: list[Figure]) -> None:
    """``out/report.md``: provenance, the results table, the context and distance tables, figures."""
    env, cfg = summary["environment"], summary["config"]
    budget = (f"Budget: {cfg['time_budget']:g} min of training steps per model" if cfg.get("time_budget")
              else f"Epochs: {summary['models'][next(iter(summary['models']))]['epochs']:g}")
    lines = [f"# ViT against CNN on {summary['dataset']}", "",
             f"Run folder `{out}`; {env['device']} ({env.get('cpu', '')}, {env['threads']} threads), "
             f"torch {env['torch']}, commit {env.get('git_commit')}"
             f"{' (with uncommitted changes)' if env.get('git_dirty') else ''}, "
             f"{'seeds ' + cfg['seeds'] if cfg.get('seeds') else 'seed ' + str(cfg['seed'])}, "
             f"world size {summary['world_size']}.", "", *_results_table(summary["models"]), "",
             f"{budget} (evaluation excluded). 'data share' = time making batches (index, augment, "
             "normalise) / training time.", ""]
    if cfg.get("seeds"):
        lines += [f"Seeds {cfg['seeds']} trained at once on one clock: the budget or the epochs are the group's, and "
                  "the measures below are the seeds' means (each seed's are in summary.json, `per_seed`).", ""]
    if context:
        lines += context_table(context, cfg["context_images"])
    lines += _distance_table(summary["models"])
    for name, caption in figs:
        lines += [f"![{caption}]({name})", "", f"*{caption}*", ""]
    write_text_atomic(out / "report.md", "\n".join(lines))
