"""One figure of training curves (time to accuracy) from runs made one model at a time.

``train_cifar.py --model both`` draws both models into its ``curves.png``; a fair speed
comparison on a shared 2-core machine runs each model alone, which leaves two metrics files.
This joins them into the same three panels (loss, accuracy per epoch, accuracy against
training minutes) with ``vitattn.tasks.classify.report.plot_curves``.

    python -m benchmarks.time_to_accuracy docs/results/cifar10_cnn_*_budget30_*_metrics.jsonl \\
        docs/results/cifar10_vit_*_budget30_*_metrics.jsonl --out docs/img --name cifar10_budget30
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitattn.tasks.classify.report import plot_curves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files, one model each")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the figure")
    p.add_argument("--name", default="time_to_accuracy", help="the figure is <out>/<name>_curves.png")
    a = p.parse_args()
    rows, families = [], []
    for path in a.metrics:
        if not path.is_file():
            sys.exit(f"error: {path} is not a file; expected a run's metrics.jsonl")
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        fams = sorted({r.get("model") for r in runs} - {None})
        if not fams or set(fams) & set(families):
            sys.exit(f"error: {path} holds models {fams}; expected one model per file, each once")
        rows += runs
        families += fams
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / f".{a.name}.tmp"
    tmp.mkdir(exist_ok=True)
    name, _ = plot_curves(tmp, rows, families)
    target = a.out / f"{a.name}_{name}"
    (tmp / name).replace(target)
    tmp.rmdir()
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
