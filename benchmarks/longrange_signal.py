"""Is there a gradient to follow? The coherence of a model's first gradients on a long-range task.

A model starts learning where the expected gradient of the loss is large against the noise of
one batch. For ``--batches`` B batches of 64 scenes, with g_b the flattened gradient of the mean
cross-entropy over all parameters at the initial weights (no step is taken),

    coherence = ||mean_b g_b|| * sqrt(B) / sqrt(mean_b ||g_b||^2)

is about 1 when the gradients are noise around a zero mean and up to sqrt(B) when every batch
points the same way. The same scenes with shuffled labels calibrate it (their mean gradient
only moves the output towards the class frequencies), and the coherence of the per-batch
difference g_b(true labels) - g_b(shuffled) isolates the part that depends on the labels: about
1 when the labels give the model nothing first-order to follow. A task whose label no single
place carries gives a model whose features are still local (or uniformly mixed) exactly that.

    python -m benchmarks.longrange_signal --preset vit_quick cnn_longrange --task alignment colour
    python -m benchmarks.longrange_signal --preset vit_longrange --task alignment --background plain

For a ViT the table also gives where its first block starts: the entropy of the attention rows
(ln 64 = 4.159 is uniform over 8x8 patches), the mean of each row's largest weight (1/64 =
0.016 if uniform), and the gradient of the q, k and v projections relative to their weights
(``||grad|| / ||W||`` over the batches' mean gradient):

    python -m benchmarks.longrange_signal --preset vit_longrange --task alignment \
        --background plain --seed S [--over '{"qk_norm": true}']
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import vitattn
from vitattn.training.data import Normalize, channel_stats
from vitattn.training.longrange import ATTRIBUTES, BACKGROUNDS, make_long_range


def gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> torch.Tensor:
    """``(B, params)``: one flattened gradient per batch, at the current weights."""
    grads = []
    for xb, yb in zip(x.split(batch), y.split(batch)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    return torch.stack(grads)


def coherence(g: torch.Tensor) -> float:
    return float(g.mean(0).norm() * len(g) ** 0.5 / g.pow(2).sum(1).mean().sqrt())


def attention_start(vit: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> str:
    """Table cells for the first block at the current weights: attention entropy, the mean
    largest weight per row, and ``||grad|| / ||W||`` of its q + k and of its v projection."""
    with torch.no_grad():
        a = vit.get_attention_maps(x)[0]  # (B, heads, N, N)
    entropy = -(a * a.clamp_min(1e-12).log()).sum(-1).mean()
    vit.zero_grad(set_to_none=True)
    F.cross_entropy(vit(x), y).backward()
    w = vit.blocks[0].attn.qkv.weight  # rows: q, k, v
    d = w.shape[1]
    rel = [float(w.grad[s].norm() / w.detach()[s].norm()) for s in (slice(0, 2 * d), slice(2 * d, 3 * d))]
    return f"{entropy:.3f} | {a.amax(-1).mean():.3f} | {rel[0]:.1e} | {rel[1]:.1e}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", nargs="+", default=["vit_quick", "cnn_longrange"])
    p.add_argument("--over", default="{}", help="JSON of config overrides for every preset")
    p.add_argument("--task", nargs="+", default=["alignment", "colour"], choices=ATTRIBUTES)
    p.add_argument("--background", default="texture", choices=tuple(BACKGROUNDS))
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    batch = 64
    print(f"background: {a.background}\n")
    print("| model | task | coherence, true labels | shuffled labels | label part (true - shuffled) "
          "| block-0 attention entropy | largest weight | q, k relative gradient | v relative gradient |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for task in a.task:
        data = make_long_range(a.batches * batch, seed=a.seed, attribute=task, background=a.background)
        norm = Normalize(*channel_stats(data["images"]))
        x, y = norm(data["images"]), data["labels"]
        shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(a.seed))]
        for preset in a.preset:
            torch.manual_seed(a.seed)
            model = vitattn.create_model(preset, num_classes=2, **json.loads(a.over)).train()
            if hasattr(model, "init_stem"):
                model.init_stem(x[:1000])
            true, noise = gradients(model, x, y, batch), gradients(model, x, shuffled, batch)
            start = attention_start(model, x, y) if hasattr(model, "get_attention_maps") else " | | | "
            print(f"| {preset} | {task} | {coherence(true):.2f} | {coherence(noise):.2f} | "
                  f"{coherence(true - noise):.2f} | {start} |", flush=True)


if __name__ == "__main__":
    main()
