"""A run's global-context measures and its ``report.md``.

``context_metrics`` applies :mod:`vitattn.context` to a trained model (any model with
``forward_intermediates``; a ViT also gets attention distance, rollout, per-head maps and token
norms); ``write_outputs`` writes them with the plots (:mod:`.plots`) and ``write_report`` joins
tables and figures into one Markdown page.

References: Dosovitskiy et al. 2021, appendix D.7 (attention distance); Luo et al. 2016
(effective receptive field); Abnar & Zuidema 2020 (attention rollout).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ...context import (
    attention_entropy,
    attention_rollout,
    effective_receptive_field,
    head_attention_maps,
    mean_attention_distance,
    patch_centres,
    rollout_map,
    token_norms,
)
from ...training import board
from ...training.cli import phase, track
from ...training.runfolder import read_jsonl, write_text_atomic
from ...training.seeds import regroup
from .plots import NAMES, Figure, write_plots


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
    ``rollout`` ``(4, gh, gw)``, the class token's per-head maps in the first and last block and
    ``token_norms`` (per block: the largest patch-token norm over the median, the share over 3x).
    Prefix tokens are left out of the distances (the module note of :mod:`vitattn.context`).
    """
    model.eval()
    erf = effective_receptive_field(model, images[:erf_images])
    out: dict[str, Any] = {"erf": [{k: e[k] for k in ("name", "radius_px", "radius90_px", "grad")} for e in erf]}
    if hasattr(model, "get_attention_maps"):
        maps = attention_maps(model, images)
        p, grid = model.num_prefix_tokens, tuple(model.grid_size)
        out["attention_distance"] = mean_attention_distance(maps, grid, model.patch_embed.patch_size, p)
        centres = patch_centres(grid, model.patch_embed.patch_size)  # a head that looks everywhere alike:
        out["uniform_distance"] = float(torch.cdist(centres, centres).mean())  # the plots' reference line
        out["attention_entropy"] = attention_entropy(maps, p)
        few, cls = [m[:4] for m in maps], model.has_class_token
        out["rollout"] = rollout_map(attention_rollout(few, p), grid, p, class_token=cls)
        out["heads_first"] = head_attention_maps(few[0], grid, p, class_token=cls)
        out["heads_last"] = head_attention_maps(few[-1], grid, p, class_token=cls)
    if hasattr(model, "get_intermediate_layers"):  # high-norm artefact patches (Darcet et al. 2024)
        with torch.no_grad():
            out["token_norms"] = token_norms(model.get_intermediate_layers(images, n=len(model.blocks)))
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


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
             "uniform attention over N patches, 0 for one patch). Token norms (Darcet et al. 2024): the patch "
             "tokens' norms after the block, the largest over the image's median, and the share over 3x the "
             "median (high-norm artefact tokens).", "",
             "| model | layer | ERF radius (px) | ERF 90% radius (px) | attention distance (px), mean [min, max] "
             "over heads | attention entropy (nats), mean [min, max] over heads | token norm max / median "
             "| tokens over 3x median |", "|---|---|---:|---:|---|---|---:|---:|"]
    for fam, c in context.items():
        for i, e in enumerate(c["erf"]):
            cells = []
            for key in ("attention_distance", "attention_entropy"):
                row = c[key][i] if key in c else None
                cells.append("" if row is None else f"{row.mean():.2f} [{row.min():.2f}, {row.max():.2f}]")
            norms = c.get("token_norms")
            cells += ["", ""] if norms is None else [f"{norms['max_ratio'][i]:.2f}", f"{norms['outlier_share'][i]:.2%}"]
            lines.append(f"| {NAMES[fam]} | {e['name']} | {e['radius_px']:.2f} | {e['radius90_px']:.1f} "
                         f"| {' | '.join(cells)} |")
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
    if "token_norms" in first:
        out["token_norms"] = {k: torch.stack([c["token_norms"][k] for c in contexts]).mean(0)
                              for k in first["token_norms"]}
    return out


def context_figures(context: dict) -> dict[str, Any]:
    """A model's global-context figures as a result holds them (lists of numbers, in pixels and nats)."""
    out: dict[str, Any] = {"erf_radius_px": [e["radius_px"] for e in context["erf"]]}
    if "attention_distance" in context:
        out["attention_distance_px"] = context["attention_distance"].tolist()
        out["attention_entropy_nats"] = context["attention_entropy"].tolist()
    if "token_norms" in context:
        out["token_norm_max_ratio"] = context["token_norms"]["max_ratio"].tolist()
        out["token_norm_outlier_share"] = context["token_norms"]["outlier_share"].tolist()
    return out


def write_outputs(out: Path, summary: dict, modules: dict[str, list[nn.Module]], samples: list[Sample], classes,
                  plots: bool = True, tensorboard: bool = False) -> None:
    """A run's outputs: the global-context measures of each seed's model (``modules[family][s]``)
    on that seed's fixed test images (``samples[s]``), added to ``summary`` (a group's per seed, then
    its means and spread anew), then summary.json, the plots and report.md (a group's measures as
    their means over the seeds), and with ``tensorboard`` the final figures as scalars (``board``)."""
    summary["config"]["context_images"] = len(samples[0].images)  # what the report's measures saw
    context = {}
    jobs = [(fam, m, s) for fam, ms in modules.items() for m, s in zip(ms, samples)]
    measured = iter([context_metrics(m, s.norm(s.images)) for _, m, s in track(
        jobs, f"context measures ({len(samples[0].images)} images, {len(jobs)} models)", unit="model")])
    for fam, ms in modules.items():
        per_seed = [next(measured) for _ in ms]
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
        with phase("plots"):
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
