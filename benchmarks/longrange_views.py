"""What a part of a long-range scene alone tells about its label, per task and distance.

For each view in ``vitattn.training.longrange.VIEWS`` the label is predicted by the majority label of
400,000 generated training scenes that share the view's value, and scored on 100,000 held-out
ones (``view_accuracy``): a lower bound on what a model that sees only that much can reach.
No images are rendered, so it takes seconds.

    python -m benchmarks.longrange_views                      # the tasks at 32x32
    python -m benchmarks.longrange_views --task pointing --img-size 32 48 64
"""

from __future__ import annotations

import argparse

from vitattn.training.longrange import (
    ATTRIBUTES,
    DISTANCE_EDGES,
    VIEWS,
    accuracy_by_distance,
    make_long_range_specs,
    view_accuracy,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", nargs="+", default=["colour", "pointing", "alignment"], choices=ATTRIBUTES)
    p.add_argument("--img-size", nargs="+", type=int, default=[32])
    p.add_argument("--train", type=int, default=400_000)
    p.add_argument("--test", type=int, default=100_000)
    a = p.parse_args()
    for task in a.task:
        edges = DISTANCE_EDGES[task] if task == "alignment" else (3.5, 8, 12, 16, 20, 28.5)
        bins = " / ".join(f"{lo:g}-{hi:g}" for lo, hi in zip(edges[:-1], edges[1:]))
        print(f"\n| task | image | view | accuracy | by distance, {bins} px |\n|---|---|---|---:|---|")
        for size in a.img_size:
            train = make_long_range_specs(a.train, seed=0, attribute=task, img_size=size)
            test = make_long_range_specs(a.test, seed=1_000_000, attribute=task, img_size=size)
            for view in VIEWS:
                ok = view_accuracy(train, test, view)
                by = accuracy_by_distance(ok, test["distance"], edges)["accuracy"]
                cells = " / ".join("-" if b != b else f"{b:.2f}" for b in by)
                print(f"| {task} | {size}x{size} | {view} | {ok.float().mean():.3f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
