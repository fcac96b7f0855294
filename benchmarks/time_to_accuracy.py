"""One figure of training curves (time to accuracy) from several runs of ``train_cifar.py``.

A run's own ``curves.png`` draws the models of that run; a fair speed comparison on a shared
2-core machine runs each model alone, and a study compares runs. This joins any runs (their
folders or ``metrics.jsonl`` files) into the same three panels (loss, accuracy per epoch,
accuracy against training minutes) with ``vitattn.tasks.classify.plots.plot_curves``; each curve
is named by its model and, when several runs hold one model, by its run folder.

    python -m benchmarks.time_to_accuracy runs/A runs/B --model vit --out docs/img
    python -m benchmarks.time_to_accuracy docs/results/cifar10_cnn_*_budget30_*_metrics.jsonl \\
        docs/results/cifar10_vit_*_budget30_*_metrics.jsonl --out docs/img --name cifar10_budget30
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitattn.tasks.classify.plots import NAMES, plot_curves


def read_runs(paths: list[Path], model: str) -> tuple[list[dict], list[str], dict[str, str]]:
    """The metrics lines of ``model`` ('all': every model) in each run, each run's model under a key
    of its own: ``(lines, keys, names)``. Exits 2 with a message for a path that is not a run."""
    found = []
    for path in paths:
        file = path / "metrics.jsonl" if path.is_dir() else path
        if not file.is_file():
            sys.exit(f"error: {path}: expected a run folder of train_cifar.py or its metrics.jsonl, found "
                     f"{'a folder without metrics.jsonl' if path.is_dir() else 'nothing there'}")
        try:
            rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            sys.exit(f"error: {file}: not a metrics.jsonl (line {e.lineno}: {e.msg})")
        held = sorted({r.get("model") for r in rows} - {None})
        chosen = held if model == "all" else [model] if model in held else []
        if not chosen:
            sys.exit(f"error: {file} holds models {held}; --model {model} is not among them")
        run = file.parent.name if file.name == "metrics.jsonl" else file.stem
        found += [(run, fam, [r for r in rows if r.get("model") == fam]) for fam in chosen]
    shared = {fam for _, fam, _ in found if sum(f == fam for _, f, _ in found) > 1}  # then the run names them
    lines, keys, names = [], [], {}
    for i, (run, fam, rows) in enumerate(found):
        key = f"{i}:{fam}"
        lines += [{**r, "model": key} for r in rows]
        keys.append(key)
        names[key] = NAMES.get(fam, fam) + (f" ({run})" if fam in shared else "")
    return lines, keys, names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders of train_cifar.py, or their metrics.jsonl files")
    p.add_argument("--model", default="all", help="the model to draw from each run: vit, cnn or all (default: all)")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the figure (default: .)")
    p.add_argument("--name", default="time_to_accuracy",
                   help="the figure is <out>/<name>_curves.png (default: time_to_accuracy)")
    a = p.parse_args(argv)
    rows, keys, names = read_runs(a.runs, a.model)
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / f".{a.name}.tmp"
    tmp.mkdir(exist_ok=True)
    name, _ = plot_curves(tmp, rows, keys, names)
    target = a.out / f"{a.name}_{name}"
    (tmp / name).replace(target)
    tmp.rmdir()
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
