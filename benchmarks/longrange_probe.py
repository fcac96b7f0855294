"""Where a model fails on a long-range task: perception, read-out or relation.

Trains one preset for a few minutes on a variant of ``make_long_range`` and prints held-out
accuracy every 30 s of training steps (AdamW or Nesterov SGD, warmup + cosine, clipping at 1,
batch 64, horizontal flips where they keep the label):

- ``--task``: ``pointing`` (does the arrow point at the plus?), ``alignment`` (one row or one
  column?) or ``colour`` (do the two marks share a colour? pooled colour detectors solve it);
- ``--background``: ``texture`` (colour blobs, stripes, noise) or ``plain`` (one grey level):
  is finding the marks part of what fails?
- ``--target direction`` (pointing only): which way the arrow points (4 classes): can it see the arrow?
- ``--cue colour`` (pointing only): the arrow's colour names its direction (colours 0-3), the plus
  takes colour 4 or 5, so a linear patch embedding can see the direction; no flips.

    python -m benchmarks.longrange_probe --preset vit_quick --target direction \
        --over '{"class_token": false, "global_pool": "max"}' --minutes 1
    python -m benchmarks.longrange_probe --preset cnn_quick --sgd --lr 0.1 --wd 5e-4 --cue colour
    python -m benchmarks.longrange_probe --task colour --background plain --minutes 1.5 \
        --over '{"depth": 4, "class_token": false, "global_pool": "max"}'
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import vitattn
from vitattn.training.classify import evaluate
from vitattn.training.data import Normalize, channel_stats
from vitattn.training.longrange import BACKGROUNDS, make_long_range_specs, render_long_range
from vitattn.training.optim import get_lr, param_groups


def scenes(n: int, seed: int, task: str, background: str, target: str, cue: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = make_long_range_specs(n, seed=seed, attribute=task)
    if cue == "colour":
        s["colours"][:, 0] = s["direction"]
        s["colours"][:, 1] = 4 + s["colours"][:, 1] % 2
    images = render_long_range(s, background=background)
    return images, (s["labels"] if target == "label" else s["direction"]).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="vit_quick")
    p.add_argument("--over", default="{}", help="JSON of config overrides")
    p.add_argument("--task", default="pointing", choices=("pointing", "alignment", "colour"))
    p.add_argument("--background", default="texture", choices=tuple(BACKGROUNDS))
    p.add_argument("--target", default="label", choices=("label", "direction"))
    p.add_argument("--cue", default="shape", choices=("shape", "colour"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--sgd", action="store_true")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--train", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.task != "pointing" and (a.target != "label" or a.cue != "shape"):
        p.error("--target direction and --cue colour belong to --task pointing")
    x, y = scenes(a.train, a.seed, a.task, a.background, a.target, a.cue)
    xt, yt = scenes(2000, a.seed + 1_000_000, a.task, a.background, a.target, a.cue)
    norm = Normalize(*channel_stats(x))
    torch.manual_seed(a.seed)
    model = vitattn.create_model(a.preset, num_classes=2 if a.target == "label" else 4, **json.loads(a.over))
    if hasattr(model, "init_stem"):
        model.init_stem(norm(x[:5000]))
    groups = param_groups(model, a.wd)
    opt = (torch.optim.SGD(groups, lr=a.lr, momentum=0.9, nesterov=True) if a.sgd
           else torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.99)))
    flip = a.target == "label" and a.cue == "shape"  # a mirrored scene keeps its label
    gen = torch.Generator().manual_seed(a.seed)

    budget, spent, step, report = a.minutes * 60, 0.0, 0, 30.0
    while spent < budget:
        for idx in torch.randperm(len(y), generator=gen).split(64):
            t0 = time.perf_counter()
            xb = x[idx].flip(-1) if flip and torch.rand(1, generator=gen) < 0.5 else x[idx]
            for g in opt.param_groups:
                g["lr"] = get_lr(spent / budget, a.lr, 0.05, "cosine")
            loss = F.cross_entropy(model(norm(xb)), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            spent += time.perf_counter() - t0
            step += 1
            if spent >= report or spent >= budget:
                acc = evaluate(model, norm, xt, yt)["acc"]
                print(f"{spent:5.0f} s  step {step:5d}  loss {loss.item():.4f}  test {acc:.4f}  "
                      f"{step * 64 / spent:.0f} img/s", flush=True)
                report += 30
            if spent >= budget:
                break
    acc = evaluate(model, norm, xt, yt)["acc"]
    print(f"final test accuracy {acc:.4f} ({a.preset} {a.over}, task {a.task}, background {a.background}, "
          f"target {a.target}, cue {a.cue})")


if __name__ == "__main__":
    main()
