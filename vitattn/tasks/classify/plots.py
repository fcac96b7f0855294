"""A run's figures: curves, how far each layer looks, accuracy by distance, attention maps and
example images, from the metrics and results ``train_cifar.py`` writes (matplotlib, imported
lazily, on the file-only Agg backend)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

NAMES = {"vit": "ViT", "cnn": "CNN"}
Figure = tuple[str, str]  # (file name, caption)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display here or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, caption: str, tight: bool = True) -> Figure:
    """Write ``fig`` to ``path`` through a temp file, close it; returns ``(file name, caption)``.
    ``tight``: lay it out with ``tight_layout`` (a figure made with ``layout="constrained"`` is not)."""
    if tight:
        fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    pyplot().close(fig)
    return path.name, caption


def plot_curves(out: Path, metrics: list[dict], families, names: dict[str, str] | None = None) -> Figure:
    """Loss and test accuracy per epoch, and test accuracy against training minutes
    (time to accuracy), every model (``metrics`` lines' ``model``) on one figure, named by ``names``."""
    names = {**NAMES, **(names or {})}
    fig, ax = pyplot().subplots(1, 3, figsize=(15, 4))
    for c, fam in enumerate(families):
        group = list(dict.fromkeys(m.get("seed") for m in metrics if m["model"] == fam))
        for i, seed in enumerate(group):  # a line per seed, labelled once
            rows = [m for m in metrics if m["model"] == fam and m.get("seed") == seed]
            ep, style = [m["epoch"] for m in rows], dict(color=f"C{c}", alpha=1.0 if len(group) == 1 else 0.6)
            name = names.get(fam, fam) + (f" ({len(group)} seeds)" if len(group) > 1 else "")
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
    """ViT attention distance per block and head, beside every model's ERF radius per layer; both
    axes from zero, with the distance of attention spread evenly over the image for reference."""
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
        if "uniform_distance" in c:
            ax[0].axhline(c["uniform_distance"], color="grey", ls=":", label="attention spread evenly")
    ax[0].set(xlabel="ViT block i (blocks.i in report.md)", ylabel="mean attention distance (px)",
              title="ViT: attention distance")
    ax[1].set(xlabel="relative depth (layer / number of layers)", ylabel="pixels",
              title="Effective receptive field radius (Luo et al. 2016)")
    for a in ax:
        a.set_ylim(0, a.get_ylim()[1] * 1.05)  # from zero: a spread of 0.1 px must look like one
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="best")
    return save_figure(fig, out / "context.png", "How far each layer looks: ViT mean attention distance per block "
                       "and head (left); ERF radius per ViT block and CNN stage on one pixel axis (right)")


def plot_erf(out: Path, context: dict) -> Figure:
    """Each model's effective receptive fields, a row per model and a panel per layer, each panel
    scaled to its own peak (one colour bar for all)."""
    n = max(len(c["erf"]) for c in context.values())
    fig, ax = pyplot().subplots(len(context), n, figsize=(2.2 * n + 1, 2.6 * len(context)), squeeze=False,
                                layout="constrained")
    for row, (fam, c) in enumerate(context.items()):
        ax[row, 0].set_ylabel(NAMES[fam], fontsize=11)
        for i, a in enumerate(ax[row]):
            a.set_xticks([]), a.set_yticks([])
            if i >= len(c["erf"]):
                a.set_frame_on(False)
                continue
            e = c["erf"][i]
            im = a.imshow((e["grad"] / e["grad"].max()).numpy(), cmap="magma", vmin=0, vmax=1)
            a.set_title(f"{e['name']}\nr={e['radius_px']:.1f}px", fontsize=8)
    fig.colorbar(im, ax=ax, shrink=0.8, label="|gradient| / panel peak")
    return save_figure(fig, out / "erf.png", "Effective receptive fields: |d centre unit / d input| per layer",
                       tight=False)


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


def plot_attention(out: Path, c: dict, images: torch.Tensor, names: list[str]) -> Figure:
    """Rollout and the class token's per-head attention in the first and last block, on four
    images ``(4, 3, H, W)`` in [0, 1] named ``names`` (their rows' labels); each block's heads share
    one colour scale, with its bar."""
    heads = c["heads_last"].shape[1]
    cols = 2 + 2 * heads
    fig, ax = pyplot().subplots(len(images), cols, figsize=(1.7 * cols + 1.5, 1.8 * len(images)), squeeze=False,
                                layout="constrained")
    last = c["attention_distance"].shape[0] - 1 if "attention_distance" in c else "last"
    scales = {key: float(c[key][: len(images)].max()) for key in ("heads_first", "heads_last")}
    for i, im in enumerate(images):
        img = im.permute(1, 2, 0).clamp(0, 1).numpy()
        ax[i, 0].imshow(img)
        ax[i, 0].set_ylabel(names[i], fontsize=9)
        ax[i, 1].imshow(img)
        up = F.interpolate(c["rollout"][i][None, None].float(), size=img.shape[:2], mode="nearest")[0, 0]
        shown = ax[i, 1].imshow(up.numpy(), cmap="jet", alpha=0.5, vmin=0, vmax=float(c["rollout"].max()))
        for h in range(heads):
            first = ax[i, 2 + h].imshow(c["heads_first"][i, h].numpy(), cmap="viridis", vmin=0,
                                        vmax=scales["heads_first"])
            lastm = ax[i, 2 + heads + h].imshow(c["heads_last"][i, h].numpy(), cmap="viridis", vmin=0,
                                                vmax=scales["heads_last"])
    for j, title in enumerate(["image", "rollout"] + [f"blocks.0 h{h}" for h in range(heads)]
                              + [f"blocks.{last} h{h}" for h in range(heads)]):
        ax[0, j].set_title(title, fontsize=8)
    for a in ax.flat:
        a.set_xticks([]), a.set_yticks([])
    fig.colorbar(shown, ax=ax[:, 1], location="bottom", shrink=0.9, label="rollout share")
    fig.colorbar(first, ax=ax[:, 2:2 + heads], location="bottom", shrink=0.6, label="blocks.0 attention weight")
    fig.colorbar(lastm, ax=ax[:, 2 + heads:], location="bottom", shrink=0.6, label=f"blocks.{last} attention weight")
    return save_figure(fig, out / "attention.png", "Attention rollout (Abnar & Zuidema 2020) and where each head "
                       "of the class token (the centre patch without one) looks, in the first and last block",
                       tight=False)


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
        figs.append(plot_attention(out, vit, images[:4], [str(classes[int(k)]) for k in labels[:4]]))
    return figs
