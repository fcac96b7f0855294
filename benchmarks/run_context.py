"""The global-context measures of a finished ``train_cifar.py`` run, recomputed from its weights.

A run measures its models once, at the end; a measure added later (the attention entropy) is
taken here for a run that predates it. The test images are the run's own pick (its seed and
``--context-images``), so the columns the run measured come out as in its report.

    python -m benchmarks.run_context runs/RUN            # the report's section, as markdown
    python -m benchmarks.run_context runs/RUN   --json   # the numbers, for summaries
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vitattn.training import classify, report
from vitattn.training.errors import DataError, UsageError


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run folder written by train_cifar.py")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    a = p.parse_args()
    if not (a.run / "config.json").is_file():
        sys.exit(f"error: {a.run} has no config.json; expected a run folder written by train_cifar.py")
    try:
        cfg = classify.Config(**{**json.loads((a.run / "config.json").read_text()), "resume": None})
        weights = {fam: a.run / "checkpoints" / f"{fam}.safetensors" for fam in cfg.models()}
        missing = [str(w) for w in weights.values() if not w.is_file()]
        if missing:
            raise UsageError(f"{a.run}: expected the final weights {', '.join(missing)}; "
                               "is the run finished?")
        ds = classify.load_dataset(cfg)
    except (OSError, ValueError, TypeError, UsageError, DataError) as e:
        sys.exit(f"error: {e}")
    from safetensors.torch import load_file

    dev = torch.device("cpu")
    pick = classify.context_sample(cfg.seed, cfg.context_images, len(ds.data.test_x))
    images = ds.norm(ds.data.test_x[pick])
    rows, contexts = {}, {}
    for fam, path in weights.items():
        model = classify.build_model(fam, cfg, ds, dev)
        model.load_state_dict(load_file(str(path)))
        c = contexts[fam] = report.context_metrics(model, images)
        rows[fam] = {"layers": [e["name"] for e in c["erf"]],
                     "erf_radius_px": [e["radius_px"] for e in c["erf"]],
                     "erf_radius90_px": [e["radius90_px"] for e in c["erf"]]}
        for key in ("attention_distance", "attention_entropy"):
            if key in c:
                rows[fam][key] = c[key].tolist()
    print(json.dumps(rows, indent=1) if a.json else "\n".join(report.context_table(contexts, len(images))))


if __name__ == "__main__":
    main()
