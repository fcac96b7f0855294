"""How far does each layer look? ViT attention distance against CNN receptive field, measured.

Trains small versions of the CIFAR ViT and CNN presets briefly on the long-range task (two marks,
same colour or not), with the same time or step budget each, then measures on held-out images:
mean attention distance per ViT block and head, the effective receptive field radius of every ViT
block and CNN stage, and accuracy against mark distance. Writes PNG figures and a JSON of the
numbers to ``--out`` (default ``docs/img``).

    python examples/context_figure.py                 # ~4-5 min on a 2-core CPU
    python examples/context_figure.py --budget-s 20   # a quick look

References: Dosovitskiy et al. 2021 (appendix D.7, Fig. 7); Luo et al. 2016; Raghu et al. 2021,
"Do Vision Transformers See Like Convolutional Neural Networks?".
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vitattn  # noqa: E402
from vitattn.context import effective_receptive_field, mean_attention_distance  # noqa: E402
from vitattn.longrange import LONG_RANGE_CLASSES, accuracy_by_distance, make_long_range  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Hyperparameters (rates per step, budgets in seconds)
# ---------------------------------------------------------------------------------------------
# The CIFAR presets are ~2M parameters, ~50 training images/s each on 2 cores: too slow to learn
# anything in two minutes. These are the same shapes at ~0.3M parameters each (4-5x faster).
MODELS = {
    # label: (preset, overrides, optimiser, peak learning rate, weight decay)
    "vit": ("vit_cifar_patch4", dict(embed_dim=80, num_heads=4), "adamw", 2e-3, 0.05),
    "cnn": ("cnn_cifar_small", dict(), "adamw", 3e-3, 0.05),
}
WARMUP = 0.05  # fraction of the budget spent warming up the learning rate


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=110.0, help="training seconds per model (without --steps)")
    p.add_argument("--steps", type=int, default=0,
                   help="train each model for this many steps instead of a time budget (same data for both, "
                        "and the result does not depend on what else the machine is doing)")
    p.add_argument("--train-size", type=int, default=20_000)
    p.add_argument("--test-size", type=int, default=2_000)
    p.add_argument("--probe-size", type=int, default=128, help="test images for the context measures")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--attribute", default="colour", choices=("colour", "shape"), help="what must match")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# Data: the whole set as tensors, normalised once, flipped per batch
# ---------------------------------------------------------------------------------------------
def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - 0.5) / 0.25


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, gen: torch.Generator):
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            xb = x[idx]
            # Flips keep both marks and their shapes' sameness: a free augmentation.
            flip = torch.rand(len(idx), generator=gen) < 0.5
            xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
            yield xb, y[idx]


# ---------------------------------------------------------------------------------------------
# Training under a time budget (the schedule follows elapsed time) or a step budget
# ---------------------------------------------------------------------------------------------
def lr_factor(frac: float) -> float:
    if frac < WARMUP:
        return frac / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - WARMUP) / (1 - WARMUP))))


def train(model, name, x, y, args) -> dict:
    _, _, kind, lr, wd = MODELS[name]
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    start, steps, seen, losses = time.perf_counter(), 0, 0, []
    for xb, yb in batches(x, y, args.batch_size, gen):
        frac = steps / args.steps if args.steps else (time.perf_counter() - start) / args.budget_s
        if frac >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(frac)
        loss = F.cross_entropy(model(xb), yb, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps, seen = steps + 1, seen + len(xb)
        losses.append(loss.item())
        if steps % 25 == 0:
            print(f"  {name} step {steps} loss {sum(losses[-25:]) / 25:.3f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    wall = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)
    return dict(steps=steps, images=seen, epochs=seen / len(x), wall_s=wall, images_per_s=seen / wall,
                final_loss=sum(losses[-20:]) / max(1, len(losses[-20:])))


@torch.no_grad()
def predict(model, x, batch_size=500) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x[i:i + batch_size]).argmax(-1) for i in range(0, len(x), batch_size)])


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------
def measure(model, probe) -> dict:
    fields = effective_receptive_field(model, probe)
    out = dict(erf_radius_px=[f["radius_px"] for f in fields], erf_radius90_px=[f["radius90_px"] for f in fields],
               erf_names=[f["name"] for f in fields], erf_grads=[f["grad"] for f in fields])
    if isinstance(model, vitattn.ViT):
        model.eval()
        maps = model.get_attention_maps(probe)
        mad = mean_attention_distance(maps, model.grid_size, model.patch_embed.patch_size, model.num_prefix_tokens)
        out["attention_distance_px"] = mad.tolist()
    return out


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def depth_axis(n: int) -> list[float]:
    return [(i + 1) / n for i in range(n)]


def figure_context(res: dict, path: Path) -> None:
    vit, cnn = res["vit"], res["cnn"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for stage, style, alpha in (("init", "--", 0.5), ("trained", "-", 1.0)):
        mad = torch.tensor(vit[stage]["attention_distance_px"])  # (layers, heads)
        xs = depth_axis(len(mad))
        ax.plot(xs, mad.mean(1), "o" + style, color="C0", alpha=alpha, label=f"ViT attention distance ({stage})")
        if stage == "trained":
            for h in range(mad.shape[1]):
                ax.scatter(xs, mad[:, h], s=12, color="C0", alpha=0.35, lw=0)
        ax.plot(xs, vit[stage]["erf_radius_px"], "s" + style, color="C2", alpha=alpha,
                label=f"ViT ERF radius ({stage})")
        cr = cnn[stage]["erf_radius_px"]
        ax.plot(depth_axis(len(cr)), cr, "^" + style, color="C3", alpha=alpha, label=f"CNN ERF radius ({stage})")
    ax.axhline(16.55, color="grey", lw=0.8, ls=":")
    ax.text(0.02, 16.9, "uniform attention, 8x8 grid (16.55 px)", fontsize=7, color="grey",
            transform=ax.get_yaxis_transform())
    ax.set(xlabel="depth (block or stage / total)", ylabel="pixels", ylim=(0, 20),
           title="How far each layer looks (dots: single ViT heads)")
    ax.legend(fontsize=7, loc="lower right")
    for name, colour in (("vit", "C0"), ("cnn", "C3")):
        a = res[name]["accuracy_by_distance"]
        r = res[name]
        bx.plot(a["centres"], a["accuracy"], "o-", color=colour,
                label=f"{name} ({r['params'] / 1e6:.2f}M params, test acc {r['test_acc']:.3f})")
    bx.axhline(0.5, color="grey", lw=0.8, ls=":")
    bx.set(xlabel="distance between the marks (px)", ylabel="test accuracy", ylim=(0.4, 1.0),
           title="Long-range task ({}, {} each)".format(
               res["config"]["attribute"],
               f"{res['config']['steps']} steps" if res["config"]["steps"] else f"{res['config']['budget_s']:.0f} s"))
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def figure_fields(res: dict, path: Path) -> None:
    rows = [("vit", "ViT"), ("cnn", "CNN")]
    ncol = max(len(res[n]["trained"]["erf_grads"]) for n, _ in rows)
    fig, axes = plt.subplots(2, ncol, figsize=(1.45 * ncol, 3.2))
    for r, (name, label) in enumerate(rows):
        fields = res[name]["trained"]
        for c in range(ncol):
            a = axes[r, c]
            a.axis("off")
            if c < len(fields["erf_grads"]):
                g = fields["erf_grads"][c]
                # Log scale: shows the support (where the gradient is non-zero at all) as well as the mass.
                a.imshow((g / g.max()).clamp_min(1e-5).log10().numpy(), cmap="magma", vmin=-5, vmax=0)
                a.set_title(f"{label} {fields['erf_names'][c]}\nr={fields['erf_radius_px'][c]:.1f}px", fontsize=7)
    fig.suptitle("Effective receptive field of the centre unit, trained models: log10 |grad| / max, "
                 "black below 1e-5", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def figure_examples(data: dict, path: Path, n: int = 16) -> None:
    fig, axes = plt.subplots(2, n // 2, figsize=(n * 0.55, 2.6))
    for i, a in enumerate(axes.flat):
        a.imshow(data["images"][i].permute(1, 2, 0).numpy(), interpolation="nearest")
        a.set_title(f"{LONG_RANGE_CLASSES[data['labels'][i]]}\n{data['distance'][i]:.1f}px", fontsize=7)
        a.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_set = make_long_range(args.train_size, seed=args.seed, attribute=args.attribute)
    test_set = make_long_range(args.test_size, seed=args.seed + 1, attribute=args.attribute)
    figure_examples(test_set, args.out / "long_range_examples.png")
    x, y = normalise(train_set["images"]), train_set["labels"]
    xt, yt = normalise(test_set["images"]), test_set["labels"]
    probe = xt[:args.probe_size]
    res: dict = dict(config=dict(vars(args), out=str(args.out)), versions=dict(
        torch=torch.__version__, vitattn=vitattn.__version__, python=platform.python_version(),
        cpu=platform.processor() or platform.machine(), threads=args.threads))
    for name in MODELS:
        torch.manual_seed(args.seed)
        preset, overrides, *_ = MODELS[name]
        model = vitattn.create_model(preset, **overrides, num_classes=len(LONG_RANGE_CLASSES))
        r = dict(preset=preset, overrides=overrides, params=sum(p.numel() for p in model.parameters()),
                 init=measure(model, probe))
        r["train"] = train(model, name, x, y, args)
        pred = predict(model, xt)
        r["test_acc"] = (pred == yt).float().mean().item()
        r["accuracy_by_distance"] = accuracy_by_distance(pred == yt, test_set["distance"])
        r["trained"] = measure(model, probe)
        res[name] = r
        print(f"{name}: {r['params']:,} params, {r['train']['steps']} steps, {r['train']['epochs']:.1f} epochs, "
              f"{r['train']['images_per_s']:.0f} img/s, loss {r['train']['final_loss']:.3f}, "
              f"test acc {r['test_acc']:.3f}", flush=True)
    figure_context(res, args.out / "context_distance.png")
    figure_fields(res, args.out / "context_erf.png")
    res["wall_s"] = time.perf_counter() - t0
    for name in MODELS:
        for stage in ("init", "trained"):
            res[name][stage].pop("erf_grads")
    (args.out / "context_figure.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({n: dict(acc_by_distance=res[n]["accuracy_by_distance"]["accuracy"],
                              erf_radius_px=[round(v, 2) for v in res[n]["trained"]["erf_radius_px"]],
                              attention_distance_px=[round(sum(h) / len(h), 2) for h in
                                                     res[n]["trained"].get("attention_distance_px", [])])
                      for n in MODELS}, indent=1))
    print(f"wall time {res['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main(parse_args())
