"""How a ViT reads out its tokens decides whether it can start learning the long-range task.

The task (``vitattn.longrange``): two marks, label ``same`` when their colours match. Each mark's
colour is uniform in both classes, so for any per-token feature ``f`` the *sum* (or mean) of
``f`` over tokens has the same expected value in both classes: a read-out that is linear in a
token average carries no first-order signal, and a freshly initialised ViT is one (its
attention is near uniform, so the class token receives about the mean of the values). A *max*
over tokens is different: with one detector per colour, ``max`` gives which colours are present,
and the number present (1 for ``same``, 2 for ``different``) is a linear function of those
presences. A CNN with a global max-pool, like ``vitattn.SmallCNN``, has that route from the
first step.

This script trains small models on the same images with the same optimiser and prints the
training loss and test accuracy every ``--every`` steps:

    python examples/long_range_pooling.py                 # ~7 minutes on 2 CPU cores
    python examples/long_range_pooling.py --steps 300     # a quick look

Models: a ViT read out by its class token (timm's default), the same ViT read out by a max over
patch tokens (``global_pool='max'``, no class token), and ``cnn_cifar_small`` as the control.
Results measured on a 2-core CPU are in docs/training.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import vitattn
from vitattn.longrange import make_long_range


def build(name: str, dim: int, depth: int, heads: int) -> torch.nn.Module:
    vit = dict(img_size=32, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=2.0, num_classes=2)
    if name == "vit-token":
        return vitattn.ViT(**vit)
    if name == "vit-max":
        return vitattn.ViT(**vit, class_token=False, global_pool="max")
    if name == "cnn":
        return vitattn.create_model("cnn_cifar_small", num_classes=2)
    raise ValueError(f"unknown model {name!r}; expected vit-token, vit-max or cnn")


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["vit-token", "vit-max", "cnn"])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=150, help="report interval in steps")
    p.add_argument("--train", type=int, default=8000, help="training images (generated)")
    p.add_argument("--test", type=int, default=1000, help="test images (generated, another seed)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW, constant")
    p.add_argument("--dim", type=int, default=64, help="ViT width")
    p.add_argument("--depth", type=int, default=2, help="ViT blocks")
    p.add_argument("--heads", type=int, default=2, help="ViT heads")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    train, test = make_long_range(a.train, seed=a.seed), make_long_range(a.test, seed=a.seed + 1)
    pixels = train["images"].float()
    mean, std = pixels.mean((0, 2, 3), keepdim=True), pixels.std((0, 2, 3), keepdim=True)

    def norm(images: torch.Tensor) -> torch.Tensor:
        return (images.float() - mean) / std

    x_test, y_test = norm(test["images"]), test["labels"]
    history: dict[str, list[dict]] = {}
    for name in a.models:
        torch.manual_seed(a.seed)
        model = build(name, a.dim, a.depth, a.heads)
        params = sum(q.numel() for q in model.parameters())
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=a.lr, weight_decay=0.05)
        gen = torch.Generator().manual_seed(a.seed)  # the same batches for every model
        losses, rows, t0 = [], [], time.perf_counter()
        print(f"{name}: {params:,} parameters")
        for step in range(1, a.steps + 1):
            idx = torch.randint(0, a.train, (a.batch_size,), generator=gen)
            loss = F.cross_entropy(model(norm(train["images"][idx])), train["labels"][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % a.every == 0 or step == a.steps:
                model.eval()
                with torch.no_grad():
                    acc = (model(x_test).argmax(1) == y_test).float().mean().item()
                model.train()
                recent = losses[-a.every:]
                rows.append(dict(step=step, train_loss=sum(recent) / len(recent), test_acc=acc,
                                 seconds=time.perf_counter() - t0))
                print(f"  step {step:5d}  train loss {rows[-1]['train_loss']:.3f}  test acc {acc:.3f}  "
                      f"({rows[-1]['seconds']:.0f} s)", flush=True)
        history[name] = rows
    return history


if __name__ == "__main__":
    main()
