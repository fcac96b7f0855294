"""Build the curated result tables from the raw run files and the catalog of curated runs.

    python -m results.build            # writes results/*.csv and the tables in README.md and docs/
    python -m results.build --check    # exits 1 if any of them is out of date (the test suite runs this)

    python -m results.build --add runs/RUN NAME   # takes a finished train_cifar.py run in as NAME, then builds

Three steps, each a function: **collect** the rows of every kept run (``docs/results/runs.json``
by name, a sweep's ``docs/results/*_summaries.json`` as ``<file stem>/<key>``, the benchmarks'
JSONs in ``benchmarks/results/``, the detection experiment), **render** the tables that
``results/catalog.toml`` describes (which runs each row shows, what the machine tags mean), and
**splice** each table between ``<!-- results:NAME:begin -->`` / ``<!-- results:NAME:end -->`` in
README.md and docs/*.md. Outputs, one CSV per study:

- ``results/cifar10.csv``, ``results/long_range.csv``: every run, one row per model and seed;
- ``results/detection.csv``: the shapes detection experiment (``docs/results/detect_shapes.json``);
- ``results/step_speed.csv``: training-step speed against the peers (bench_vit), fp32 against
  bf16 (precision_step), several seeds at once against one after another (seeds_step);
- ``results/epochs.csv`` (written by ``--add``): every run's metrics lines.

A row's ``command`` is the ``train_cifar.py`` command that reproduces it (options that differ
from today's defaults; the data path written as ``path/to/cifar10``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "docs" / "results"
BENCH = ROOT / "benchmarks" / "results"
OUT = ROOT / "results"
CATALOG = OUT / "catalog.toml"
RUNS = RAW / "runs.json"
DETECTION_RUNS = RAW / "detection_runs.json"  # examples/train_detection.py runs' summaries, by name
EPOCHS = OUT / "epochs.csv"
RUN_COLUMNS = ("run", "model", "preset", "model_kwargs", "optimizer", "lr", "batch_size", "epochs", "budget_min",
               "seed", "accuracy", "best_accuracy", "accuracy_tta", "attention_px_block1", "erf_px_first",
               "erf_px_last", "accuracy_farthest", "farthest_px", "images_per_s", "train_min", "params", "hardware",
               "torch", "git_commit", "command")
DETECTION_COLUMNS = ("run", "data", "backbone", "detector", "backbone_params", "seed", "epochs", "steps", "batch_size",
                     "train_min", "images_per_s", "ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large",
                     "hardware", "torch", "command")
EPOCH_COLUMNS = ("run", "model", "seed", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
                 "train_seconds", "images_per_s", "optimizer", "peak_lr", "batch_size", "hardware", "command")
SPEED_COLUMNS = ("source", "case", "note", "library", "precision", "batch", "rate", "unit", "ratio", "peak_mb",
                 "round_ratios_vs_timm", "hardware", "torch", "command")


@dataclasses.dataclass(frozen=True)
class Catalog:
    """``results/catalog.toml`` read: the machines by tag, README's rows and each table's rows,
    every row's runs as a tuple of names (a set's name resolved)."""

    machines: dict[str, tuple[str, str]]  # tag -> (hardware, short name)
    readme: tuple[tuple[str, str, dict[str, tuple[str, ...]]], ...]  # (task, study, {family or 'control': runs})
    tables: dict[str, tuple[tuple[str, str, tuple[str, ...], str, str], ...]]  # (what, study, runs, family, model)
    detection: dict[str, tuple[tuple[str, tuple[str, ...]], ...]]  # (what, runs) of detection_runs.json

    @property
    def short(self) -> dict[str, str]:
        return dict(self.machines.values())


@functools.lru_cache(maxsize=4)
def load_catalog(path: Path = CATALOG) -> Catalog:
    """Read and check the catalog: every row has its fields, every ``@set`` is defined."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    raw = tomllib.loads(path.read_text())
    sets = {k: tuple(v) for k, v in raw.get("sets", {}).items()}

    def runs(value, where: str) -> tuple[str, ...]:
        if isinstance(value, str) and value.startswith("@"):
            if value[1:] not in sets:
                raise SystemExit(f"{path.name}: {where} names the set {value}, which [sets] does not define")
            return sets[value[1:]]
        return (value,) if isinstance(value, str) else tuple(value)

    def field(row: dict, key: str, where: str):
        if key not in row:
            raise SystemExit(f"{path.name}: {where} has no {key!r}")
        return row[key]

    readme = tuple((field(r, "task", "a [[readme]] row"), field(r, "study", "a [[readme]] row"),
                    {k: runs(v, f"README's row {r['task']!r}") for k, v in r.items() if k in ("vit", "cnn", "control")})
                   for r in raw.get("readme", []))
    tables = {name: tuple((field(r, "what", name), field(r, "study", name), runs(field(r, "runs", name), name),
                           field(r, "family", name), field(r, "model", name)) for r in rows)
              for name, rows in raw.get("tables", {}).items()}
    detection = {name: tuple((field(r, "what", name), runs(field(r, "runs", name), name)) for r in rows)
                 for name, rows in raw.get("detection", {}).items()}
    return Catalog({k: tuple(v) for k, v in raw["machines"].items()}, readme, tables, detection)


# -- collect -------------------------------------------------------------------------------------
def machine(name: str, machines: dict[str, tuple[str, str]] | None = None) -> str:
    """The hardware a run's name says it ran on (its machine tag), or 'unknown'."""
    machines = load_catalog().machines if machines is None else machines
    tag = next((t for t in sorted(machines, key=len, reverse=True) if f"_{t}" in name), None)
    return machines[tag][0] if tag else "unknown"


# names a study driver registered for one run; their config fields are in the run's kwargs
DATA_FIELDS = ("img_size", "num_classes", "in_chans")  # set from the data by train_cifar.py


def canonical(preset: str, kwargs: str) -> tuple[str, dict]:
    """A run's model as its preset (or, if that is gone, today's preset nearest to it) plus the
    fields that differ."""
    import vitattn

    ran = vitattn.get_config(preset, **json.loads(kwargs or "{}"))
    best = None
    for name in [preset] if preset in vitattn.list_models() else vitattn.list_models():
        ours = vitattn.get_config(name)
        if type(ours) is not type(ran):
            continue
        diff = {k: v for k, v in dataclasses.asdict(ran).items()
                if k not in DATA_FIELDS and v != getattr(ours, k)}
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    return best


def command(config: dict, family: str) -> str:
    """The train_cifar.py command of a saved config: the options that differ from today's defaults."""
    from vitattn.tasks.classify import Config
    from vitattn.tasks.classify.recipes import DEFAULT_PRESETS

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    skip = {"out", "resume", "progress", "plots", "model", "vit_preset" if family != "vit" else "",
            "cnn_preset" if family == "vit" else "", "vit_kwargs" if family != "vit" else "",
            "cnn_kwargs" if family == "vit" else ""}
    parts = ["python train_cifar.py", f"--model {family}"]
    if config.get("dataset", "cifar10") == "cifar10":
        skip |= {k for k in defaults if k.startswith("long_range_")}  # options of the other data set
    gone = sorted(k for k in set(config) - set(defaults) if config[k] not in (None, 0, 0.0, False, "", "{}"))
    if gone:  # the run used an option the script no longer has: no command of today reproduces it
        raise SystemExit(f"a run used options train_cifar.py no longer has ({', '.join(gone)}); drop it from the "
                         "tables")
    for k, v in config.items():
        if k in skip or k not in defaults or v == defaults[k] or v is None:
            continue
        if k == "context_images" and v == 128:  # today's default (None) takes 128 test images too
            continue
        if k == f"{family}_preset" and v == DEFAULT_PRESETS[config.get("dataset", "cifar10")][family]:
            continue  # today's default for the data set
        if isinstance(v, float):
            v = f"{v:g}"
        flag = "--" + k.replace("_", "-")
        if k == "data_dir":
            v = "path/to/cifar10"
        if k == "teacher":
            v = "path/to/cnn_run"
        if isinstance(v, bool):
            parts.append(flag if v else f"--no-{flag[2:]}")
        else:
            parts.append(f"{flag} '{v}'" if isinstance(v, str) and ("{" in v or " " in v) else f"{flag} {v}")
    return " ".join(parts)


def run_rows(name: str, s: dict) -> list[dict]:
    """A run's rows: one per model, or per model and seed for a run of several seeds (``--seeds``),
    each with its seed's own figures and the group's command."""
    cfg, env = s["config"], s.get("environment", {})
    rows = []
    for family, group in s["models"].items():
        slot = "vit" if family == "vit" else "cnn"
        preset, kwargs = canonical(group["preset"], cfg.get(f"{slot}_kwargs", "{}"))
        kwargs = json.dumps(kwargs) if kwargs else "{}"
        cfg = {**cfg, f"{slot}_preset": preset, f"{slot}_kwargs": kwargs}
        for m in group.get("per_seed", [group]):
            recipe = m.get("recipe", {})
            rows.append({
                "run": name, "model": family, "preset": preset, "model_kwargs": kwargs,
                "optimizer": recipe.get("optimizer"), "lr": recipe.get("lr"), "batch_size": recipe.get("batch_size"),
                "epochs": round(m["epochs"], 2), "budget_min": cfg.get("time_budget"),
                "seed": m.get("seed", cfg.get("seed")),
                "accuracy": round(m["final_acc"], 4), "best_accuracy": round(m.get("best_acc", m["final_acc"]), 4),
                "accuracy_tta": round(m["final_acc_tta"], 4) if "final_acc_tta" in m else None,
                **reach(m), "images_per_s": round(m["images_per_s"], 1), "train_min": round(m["train_seconds"] / 60, 2),
                "params": m.get("params"), "hardware": machine(name), "torch": env.get("torch"),
                "git_commit": (env.get("git_commit") or "")[:10], "command": command(cfg, family)})
    return rows


def mean_std(values: list[float], digits: int = 1, unit: str = "") -> str:
    """``'82.0 ± 0.3%'`` over seeds (sample std), or the one value."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.{digits}f} ± {std:.{digits}f}{unit}"


def reach(m: dict) -> dict:
    """A run's global-context measures (its report's): the mean attention distance of the first
    block, the effective receptive field's radius after the first and the last stage or block, and
    (long range) the accuracy on the pairs of marks farthest apart."""
    out = {}
    if m.get("attention_distance_px"):
        first = m["attention_distance_px"][0]
        out["attention_px_block1"] = round(sum(first) / len(first), 2)
    if m.get("erf_radius_px"):
        out["erf_px_first"], out["erf_px_last"] = round(m["erf_radius_px"][0], 2), round(m["erf_radius_px"][-1], 2)
    if m.get("accuracy_by_distance"):
        d = m["accuracy_by_distance"]
        out["accuracy_farthest"] = round(d["accuracy"][-1], 4)
        out["farthest_px"] = f"{d['edges'][-2]:g}-{d['edges'][-1]:g}"
    return out


def reach_cell(rows: list[dict]) -> str:
    """The global-context cell of a table row: its runs' measures, mean ± std over the seeds."""
    def cell(key: str, scale: float = 1.0) -> str | None:
        vals = [scale * r[key] for r in rows if r.get(key) is not None]
        return mean_std(vals) if vals else None

    parts = []
    if cell("attention_px_block1") is not None:
        parts.append(f"attention {cell('attention_px_block1')} px in block 1")
    if cell("erf_px_first") is not None:
        parts.append(f"receptive field {cell('erf_px_first')} -> {cell('erf_px_last')} px")
    if cell("accuracy_farthest") is not None:
        parts.append(f"{cell('accuracy_farthest', 100)}% at {rows[0]['farthest_px']} px apart")
    return "; ".join(parts)


def summaries() -> list[tuple[str, dict]]:
    """Every kept run's summary with its name: ``runs.json``'s by theirs, a sweep's as ``<file stem>/<key>``."""
    pairs = list(json.loads(RUNS.read_text()).items())
    for path in sorted(RAW.glob("*_summaries.json")):
        stem = path.name.removesuffix("_summaries.json")
        pairs += [(f"{stem}/{k}", v) for k, v in json.loads(path.read_text()).items()]
    return pairs


def runs() -> dict[str, list[dict]]:
    """Every run's rows, by study."""
    studies: dict[str, list[dict]] = {"cifar10": [], "long_range": []}
    for name, s in summaries():
        if not isinstance(s, dict) or s.get("status") != "ok" or not s.get("models"):
            continue
        study = "cifar10" if s["dataset"] == "cifar10" else "long_range"
        studies[study] += run_rows(name, s)
    return studies


def epoch_rows(name: str, summary: dict, lines: list[dict]) -> list[dict]:
    """A run's metrics lines as rows of ``epochs.csv``, each with the run's recipe, hardware and command."""
    by_model = {(r["model"], r["seed"]): r for r in run_rows(name, summary)}
    rows = []
    for line in lines:
        seed = line.get("seed", summary["config"].get("seed"))
        run = by_model[(line["model"], seed)]
        rows.append({**{k: line.get(k) for k in EPOCH_COLUMNS}, "run": name, "seed": seed,
                     "optimizer": run["optimizer"], "peak_lr": run["lr"], "batch_size": run["batch_size"],
                     "hardware": run["hardware"], "command": run["command"]})
    return rows


class Refused(Exception):
    """An input ``--add`` will not take: one line, exit 2, nothing written."""


def read_run(folder: Path) -> tuple[dict, list[dict]]:
    """A finished train_cifar.py run's summary and metrics lines, each read whole, or ``Refused``."""
    from vitattn.training.errors import CheckpointError
    from vitattn.training.runfolder import METRICS_KEYS, read_jsonl

    if not folder.is_dir():
        raise Refused(f"{folder}: no such run folder")
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except FileNotFoundError:
        raise Refused(f"{folder}: no summary.json; the run has not finished (resume it first)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise Refused(f"{folder}/summary.json is not whole JSON ({e}); a crash cut it: resume the run to rewrite "
                      "it") from None
    detection = isinstance(summary, dict) and "result" in summary and "models" not in summary
    if not isinstance(summary, dict) or not ({"status", "config", "result"} if detection else
                                             {"status", "config", "models", "dataset"}) <= set(summary):
        raise Refused(f"{folder}/summary.json is neither a train_cifar.py summary (status, config, models, dataset) "
                      "nor a train_detection.py one (status, config, result)")
    if summary["status"] != "ok":
        raise Refused(f"{folder}: the run did not finish (status {summary['status']!r}); resume it first")
    if detection and summary.get("control"):  # the constant box trains nothing: no metrics lines
        return summary, []
    try:
        lines = read_jsonl(folder / "metrics.jsonl", METRICS_KEYS)
    except FileNotFoundError:
        raise Refused(f"{folder}: no metrics.jsonl") from None
    except CheckpointError as e:
        raise Refused(str(e)) from None
    return summary, lines


def add_run(folder: Path, name: str, replace: bool = False) -> None:
    """Take the finished run in ``folder`` in as ``name``: its summary into ``runs.json``, its
    metrics lines into ``epochs.csv``. Everything is read and its rows made before either file
    is written (each atomically); a name already kept is refused unless ``replace``."""
    from vitattn.training.runfolder import write_text_atomic

    if machine(name) == "unknown":
        raise Refused(f"{name}: the name must end in a machine tag, one of {', '.join(load_catalog().machines)}")
    summary, lines = read_run(Path(folder))
    if "models" not in summary:  # a detection run: its summary alone, into detection_runs.json
        kept = json.loads(DETECTION_RUNS.read_text()) if DETECTION_RUNS.exists() else {}
        if name in kept and not replace:
            raise Refused(f"{name} is already a kept detection run; choose another name, or --replace it")
        kept[name] = {k: v for k, v in summary.items() if k not in ("out",)}
        write_text_atomic(DETECTION_RUNS, json.dumps(dict(sorted(kept.items())), indent=1) + "\n")
        return
    kept = json.loads(RUNS.read_text()) if RUNS.exists() else {}
    if name in kept and not replace:
        raise Refused(f"{name} is already a kept run (docs/results/runs.json); choose another name, or --replace it")
    try:
        rows = epoch_rows(name, summary, lines)  # also each model's row and command: what the tables will need
    except SystemExit as e:
        raise Refused(f"{folder}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise Refused(f"{folder}: its summary or metrics lack what a table row needs ({type(e).__name__}: {e})") \
            from None
    kept[name] = {k: v for k, v in summary.items() if k != "out"}
    old = list(csv.DictReader(open(EPOCHS))) if EPOCHS.exists() else []
    write_text_atomic(EPOCHS, to_csv([r for r in old if r["run"] != name] + rows, EPOCH_COLUMNS))
    write_text_atomic(RUNS, json.dumps(dict(sorted(kept.items())), indent=1) + "\n")


def seeds_cell(seeds: list[int]) -> str:
    """``'4 (0-3)'``: how many seeds a row averages, and which."""
    from vitattn.training.seeds import seeds_label

    return f"{len(seeds)} ({seeds_label(seeds)})" if len(seeds) > 1 else str(seeds[0])


def runnable(cmd: str) -> str:
    """A benchmark's recorded command as it runs today: ``python -m benchmarks.NAME ARGS``."""
    cmd = re.sub(r"^(python )?benchmarks/(\w+)\.py", r"python -m benchmarks.\2", cmd)
    cmd = re.sub(r" --(out|json) \S+", "", cmd)  # where its author kept the files
    return re.sub(r"(\w+\[[^\]]*\])", r"'\1'", cmd)  # a bracketed name with spaces, as the shell needs it


def significant(x: float) -> float:
    return round(x, 1 if x >= 10 else 3)


def rate(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def speed_rows() -> list[dict]:
    rows = []
    for path in sorted(BENCH.glob("*.json")):
        d = json.loads(path.read_text())
        hw = machine(path.stem)
        if d.get("rows") and "kind" in d["rows"][0]:  # seeds_step.py: a group of seeds against its solo runs
            env = d["environment"]
            for r in d["rows"]:
                rows.append({"source": path.name, "case": f"{r['model']} training step, {r['seeds']} seed(s)",
                             "note": r["kind"], "library": "vitattn", "precision": r["precision"],
                             "batch": r["batch"], "rate": significant(r["img_per_s"]), "unit": "img/s",
                             "ratio": round(r["vs_sequential"], 3), "hardware": hw, "torch": env["torch"],
                             "command": runnable(d["command"])})
        elif "rows" in d:  # bench_vit.py: each library per case, interleaved rounds
            env = d["env"]
            timm = {(r["case"], r.get("compiled")): r["times"] for r in d["rows"] if r["lib"] == "timm"}
            for r in d["rows"]:
                ref = timm.get((r["case"], r.get("compiled")))
                rows.append({"source": path.name, "case": r["case"] + (" compiled" if r.get("compiled") else ""),
                             "note": d["cases"][r["case"]]["note"], "library": r["lib"], "precision": "fp32",
                             "batch": r["batch"], "rate": significant(r["img_per_s"]), "unit": "img/s",
                             "ratio": round(r["ratio_best_peer"], 3) if r.get("ratio_best_peer") else None,
                             "peak_mb": round(r["peak_mem_bytes"] / 2**20) if r.get("peak_mem_bytes") else None,
                             "round_ratios_vs_timm": " ".join(f"{t / s_:.2f}" for t, s_ in zip(ref, r["times"]))
                             if ref and r["lib"] != "timm" else None,
                             "hardware": hw, "torch": env["versions"]["torch"], "command": runnable(d["command"])})
        elif "gemm_gflops" in d:  # precision_step.py: fp32 against bf16 / fp16
            env, fp32 = d["environment"], d["gemm_gflops"]["float32"]
            for precision, g in d["gemm_gflops"].items():
                rows.append({"source": path.name, "case": "8192x512 @ 512x512 product", "library": "torch",
                             "precision": precision, "rate": significant(g), "unit": "GFLOP/s",
                             "ratio": round(g / fp32, 3),
                             "hardware": hw, "torch": env["torch"], "command": runnable(d["command"])})
            for family, m in d["models"].items():
                for precision, q in m["precisions"].items():
                    rows.append({"source": path.name, "case": f"{family} training step", "note": m["preset"],
                                 "library": "vitattn", "precision": precision, "batch": m["batch"],
                                 "rate": significant(q["img_per_s"]), "unit": "img/s", "ratio": round(q["vs_fp32"], 3),
                                 "hardware": hw, "torch": env["torch"], "command": runnable(d["command"])})
    return rows


def speed_table(source: str, rows: list[dict]) -> str:
    """A results table of one benchmark file (``<!-- results:speed/FILE:begin -->``)."""
    rows = [r for r in rows if r["source"] == source]
    if not rows:
        raise SystemExit(f"no step-speed rows from benchmarks/results/{source}")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    if rows[0]["case"].endswith("seed(s)"):  # seeds_step: kinds side by side
        kinds = list(dict.fromkeys(r["note"].split(" ", 1)[1] for r in rows))
        # the last column: a group against its seeds one after another, or (--compile alone) compiled against eager
        grouped = any("at once" in k for k in kinds)
        last = "best at once / one after another" if grouped else "compiled / eager"
        lines = ["| model, precision | seeds | " + " | ".join(kinds) + f" | {last} |",
                 "|---|---:|" + "---:|" * (len(kinds) + 1)]
        for key in dict.fromkeys((r["case"], r["precision"]) for r in rows):
            by = {r["note"].split(" ", 1)[1]: r for r in rows if (r["case"], r["precision"]) == key}
            n = key[0].rsplit(", ", 1)[1].split(" ")[0]
            best = max((r["ratio"] for k, r in by.items() if ("at once" in k) == grouped and k != kinds[0]),
                       default=None)
            lines.append(f"| {key[0].split(' ')[0]}, {key[1]} | {n} | "
                         + " | ".join(f"{by[k]['rate']:.0f}" if k in by else "" for k in kinds)
                         + (f" | **{best:.2f}x** |" if best is not None else " | |"))
    elif any(r["unit"] == "GFLOP/s" for r in rows):  # precision
        precisions = list(dict.fromkeys(r["precision"] for r in rows))
        lines = ["| what | " + " | ".join(precisions) + f" | {precisions[-1]} / {precisions[0]} |",
                 "|---|" + "---:|" * (len(precisions) + 1)]
        for case in cases:
            by = {r["precision"]: r for r in rows if r["case"] == case}
            what = case + (f" (`{by[precisions[0]]['note']}`, batch {by[precisions[0]]['batch']})"
                           if by[precisions[0]].get("note") else "")
            lines.append(f"| {what} | " + " | ".join(f"{rate(by[p]['rate'])} {by[p]['unit']}" for p in precisions)
                         + f" | **{by[precisions[-1]]['ratio']:.3f}x** |")
    else:  # libraries side by side
        libs = list(dict.fromkeys(r["library"] for r in rows))
        peers, peak = "timm" in libs, any(r.get("peak_mb") for r in rows)
        head = " | ".join(libs) + " |" + (" vitattn vs best peer | per-round ratio to timm |" if peers else "")
        lines = ["| case | " + head + (f" peak MB ({' / '.join(libs)}) |" if peak else ""),
                 "|---|" + "---:|" * len(libs) + ("---:|---|" if peers else "") + ("---|" if peak else "")]
        for case in cases:
            by = {r["library"]: r for r in rows if r["case"] == case}
            v = by["vitattn"]
            lines.append(f"| {case} ({v['note']}, batch {v['batch']}) | "
                         + " | ".join(rate(by[lib]["rate"]) if lib in by else "" for lib in libs) + " |"
                         + (f" **{v['ratio']:.2f}x** | {v['round_ratios_vs_timm']} |" if peers else "")
                         + (" " + " / ".join(str(by[lib].get("peak_mb") or "") for lib in libs) + " |" if peak else ""))
    r0 = rows[0]
    lines.append("")
    lines.append(f"*{r0['unit'] if len({r['unit'] for r in rows}) == 1 else 'rates'}, {r0['hardware']}, torch "
                 f"{r0['torch']}: `{r0['command']}`*")
    return "\n".join(lines) + "\n"


def detection_rows() -> list[dict]:
    """The shapes experiment (examples/detect_shapes.py), one row per backbone, and every kept
    examples/train_detection.py run (``detection_runs.json``), one row each."""
    d = json.loads((RAW / "detect_shapes.json").read_text())
    c = d["config"]
    rows = []
    for name, r in d["results"].items():
        f = r["final"]
        rows.append({"run": "detect_shapes", "data": "shapes", "backbone": name, "detector": "fcos",
                     "backbone_params": r["backbone_params"], "seed": c.get("seed", 0),
                     "steps": r["state"]["global_step"], "batch_size": c["batch_size"],
                     "train_min": round(r["state"]["train_seconds"] / 60, 2), "ap": round(f["map"], 3),
                     "ap50": round(f["map_50"], 3), "ap75": round(f["map_75"], 3), "ap_small": round(f["map_small"], 3),
                     "ap_medium": round(f["map_medium"], 3), "ap_large": round(f["map_large"], 3),
                     "hardware": f"{d['env'].get('cpu', 'unknown CPU')}, {d['env'].get('cpu_count')} cores",
                     "torch": d["env"]["torch"], "command": "python examples/detect_shapes.py"})
    kept = json.loads(DETECTION_RUNS.read_text()) if DETECTION_RUNS.exists() else {}
    for name, s in kept.items():
        cfg, r, env = s["config"], s["result"], s.get("environment", {})
        control = bool(s.get("control"))
        rows.append({"run": name, "data": Path(cfg["data_dir"]).name, "backbone": "constant box" if control else
                     cfg["model"], "detector": None if control else cfg["detector"],
                     "backbone_params": s.get("params"), "seed": cfg["seed"],
                     "epochs": None if control else round(r["epochs"], 1), "steps": None if control else r["steps"],
                     "batch_size": None if control else cfg["batch_size"],
                     "train_min": None if control else round(r["train_seconds"] / 60, 2),
                     "images_per_s": None if control else round(r["images_per_s"], 2),
                     **{k: round(r[f"final_{m}"], 3) for k, m in (("ap", "map"), ("ap50", "map_50"), ("ap75", "map_75"),
                                                                  ("ap_small", "map_small"),
                                                                  ("ap_medium", "map_medium"),
                                                                  ("ap_large", "map_large"))},
                     "hardware": machine(name), "torch": env.get("torch"), "command": detection_command(cfg)})
    return rows


def detection_command(config: dict) -> str:
    """The examples/train_detection.py command of a kept run's options (those that differ from
    today's defaults; the data folder as named)."""
    from vitattn.tasks.detect import Config

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    parts = ["python examples/train_detection.py"]
    for k, v in config.items():
        if k in ("out", "resume", "progress", "tensorboard", "workers") or k not in defaults or (
                tuple(v) if isinstance(v, list) else v) == defaults[k]:  # JSON gives lists for tuples
            continue
        flag = "--" + k.replace("_", "-")
        if k == "data_dir":
            v = f"path/to/{Path(v).name}"
        if k == "initial_checkpoint":
            v = "path/to/cifar_run/checkpoints/vit.safetensors"
        if isinstance(v, bool):
            parts.append(flag if v else f"--no-{flag[2:]}")
        elif isinstance(v, (list, tuple)):
            parts.append(f"{flag} {' '.join(map(str, v))}")
        else:
            parts.append(f"{flag} '{v}'" if isinstance(v, str) and ("{" in v or " " in v) else f"{flag} {v}")
    return " ".join(parts)


def detection_row(what: str, mine: list[dict], catalog: Catalog) -> str:
    """One row of a detection study: its runs' AP, AP50 and AP75 (mean ± std over the seeds), their
    epochs, speed and training minutes (means), and the hardware."""
    def cell(key: str) -> str:
        return mean_std([r[key] for r in mine], digits=3)

    def mean(key: str, fmt: str) -> str:
        return "" if mine[0][key] is None else f"{sum(r[key] for r in mine) / len(mine):{fmt}}"

    seeds = seeds_cell([r["seed"] for r in mine]) if mine[0]["epochs"] is not None else "-"
    hardware = " / ".join(sorted({catalog.short.get(r["hardware"], r["hardware"]) for r in mine}))
    return (f"| {what} | {mine[0]['backbone']} | **{cell('ap')}** | **{cell('ap50')}** | {cell('ap75')} | {seeds} | "
            f"{mean('epochs', '.0f')} | {mean('images_per_s', '.1f')} | {mean('train_min', '.1f')} | {hardware} |")


def detection_study_table(catalog: Catalog, name: str, rows: list[dict]) -> str:
    """A detection study of the catalog (``[[detection.NAME]]``): a row per entry, its runs' seeds
    pooled, mean ± std of AP and AP50."""
    lines = ["| what | backbone | AP | AP50 | AP75 | seeds | epochs | img/s | train min | hardware |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for what, runs_ in catalog.detection[name]:
        mine = [r for r in rows if r["run"] in runs_]
        if {r["run"] for r in mine} != set(runs_):
            raise SystemExit(f"detection table {name!r} names runs docs/results/detection_runs.json does not hold: "
                             f"{sorted(set(runs_) - {r['run'] for r in mine})}")
        lines.append(detection_row(what, mine, catalog))
    return "\n".join(lines) + "\n"


def detection_table(rows: list[dict]) -> str:
    rows = [r for r in rows if r["run"] == "detect_shapes"]
    lines = ["| backbone | backbone params | steps (batch 16) | AP | AP50 | AP75 | AP small | AP medium | hardware |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['backbone']} | {r['backbone_params'] / 1e6:.2f}M | {r['steps']} | **{r['ap']:.3f}** | "
                     f"{r['ap50']:.3f} | {r['ap75']:.3f} | {r['ap_small']:.3f} | {r['ap_medium']:.3f} | "
                     f"{r['hardware']} |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def row_cells(rows: list[dict]) -> dict[str, str]:
    """The cells of a table row from its runs' rows: accuracy and context as mean ± std over the
    seeds, epochs, seeds, the machine's img/s (a run of several seeds: its seeds' rates summed) and
    the hardware's short name."""
    per_run: dict[str, float] = {}
    for r in rows:
        per_run[r["run"]] = per_run.get(r["run"], 0.0) + r["images_per_s"]
    epochs = sorted({r["epochs"] for r in rows})
    return {"accuracy": mean_std([100 * r["accuracy"] for r in rows], unit="%"), "context": reach_cell(rows),
            "epochs": f"{epochs[0]:g}{'' if len(epochs) == 1 else f'-{epochs[-1]:g}'}",
            "seeds": seeds_cell([r["seed"] for r in rows]), "n": str(len(rows)),
            "speed": f"{sum(per_run.values()) / len(per_run):.0f}",
            "hardware": " / ".join(sorted({load_catalog().short[r["hardware"]] for r in rows}))}


def rows_of(name: str, study: str, runs_, family: str, studies: dict[str, list[dict]]) -> list[dict]:
    runs_ = (runs_,) if isinstance(runs_, str) else runs_
    rows = [r for run in runs_ for r in studies[study] if r["run"] == run and r["model"] == family]
    if {r["run"] for r in rows} != set(runs_):
        raise SystemExit(f"table {name!r} names runs that results/{study}.csv does not hold: {runs_}")
    return rows


def readme_table(catalog: Catalog, studies: dict[str, list[dict]]) -> str:
    """README's table: the comparison the project exists for, a row per task, ViT against CNN (and
    the long-range control), mean ± std over the seeds."""
    lines = ["| task | ViT | CNN | control | global context, ViT | global context, CNN | seeds | hardware |",
             "|---|---:|---:|---:|---|---|---|---|"]
    for task, study, runs_ in catalog.readme:
        cells = {fam: row_cells(rows_of("readme", study, r, "vit" if fam == "vit" else "cnn", studies))
                 for fam, r in runs_.items()}
        acc = [cells[f]["accuracy"] if f in cells else "" for f in ("vit", "cnn", "control")]
        seeds = " / ".join(cells[f]["n"] for f in cells)
        hardware = " / ".join(sorted({cells[f]["hardware"] for f in cells}))
        lines.append(f"| {task} | {' | '.join(acc)} | {cells['vit']['context']} | {cells['cnn']['context']} | "
                     f"{seeds} | {hardware} |")
    return "\n".join(lines) + "\n"


def table(catalog: Catalog, name: str, studies: dict[str, list[dict]]) -> str:
    """A table of the catalog as markdown: a row per entry, its runs' seeds pooled (mean ± std);
    each run's command is in the study's CSV."""
    lines = ["| what | model | epochs | test accuracy | seeds | img/s | hardware |",
             "|---|---|---:|---:|---|---:|---|"]
    for task, study, runs_, family, what in catalog.tables[name]:
        rows = rows_of(name, study, runs_, family, studies)
        c = row_cells(rows)
        kwargs = "" if rows[0]["model_kwargs"] in ("{}", "", None) else f" `{rows[0]['model_kwargs']}`"
        lines.append(f"| {task} | {what} (`{rows[0]['preset']}`{kwargs}) | {c['epochs']} | {c['accuracy']} | "
                     f"{c['seeds']} | {c['speed']} | {c['hardware']} |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class Collected:
    studies: dict[str, list[dict]]  # study -> every run's rows
    speed: list[dict]
    detection: list[dict]


def collect() -> Collected:
    """Step 1: every kept run's rows, the benchmarks' and the detection experiment's."""
    return Collected(runs(), speed_rows(), detection_rows())


def render(catalog: Catalog, c: Collected, names: list[str]) -> dict[str, str]:
    """Step 2: the tables ``names`` (the pages' markers), markdown."""
    def one(name: str) -> str:
        if name == "readme":
            return readme_table(catalog, c.studies)
        if name == "detection":
            return detection_table(c.detection)
        if name.startswith("speed/"):
            return speed_table(name.removeprefix("speed/"), c.speed)
        if name in catalog.tables:
            return table(catalog, name, c.studies)
        if name.startswith("detection/") and name.removeprefix("detection/") in catalog.detection:
            return detection_study_table(catalog, name.removeprefix("detection/"), c.detection)
        raise SystemExit(f"a page has the marker results:{name}, which neither results/catalog.toml nor a "
                         "benchmark file in benchmarks/results/ makes")

    return {name: one(name) for name in names}


def splice(text: str, tables: dict[str, str]) -> str:
    """Step 3: a page with each table put between its markers (pages without them are unchanged)."""
    for name, body in tables.items():
        begin, end = f"<!-- results:{name}:begin -->\n", f"<!-- results:{name}:end -->"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + begin + body + end + rest.split(end, 1)[1]
    return text


def outputs() -> dict[Path, str]:
    """Every file the build writes, with its text: the study CSVs and the pages."""
    c = collect()
    pages = {page: page.read_text() for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))}
    names = list(dict.fromkeys(m for text in pages.values() for m in re.findall(r"<!-- results:(\S+):begin -->", text)))
    catalog = load_catalog()
    unshown = sorted(set(catalog.tables) - set(names)) + sorted(f"detection/{n}" for n in catalog.detection
                                                               if f"detection/{n}" not in names)
    if unshown:
        raise SystemExit(f"results/catalog.toml describes tables no page shows: {unshown}; add their markers or "
                         "drop them")
    tables = render(catalog, c, names)
    files = {OUT / f"{study}.csv": to_csv(rows, RUN_COLUMNS) for study, rows in c.studies.items()}
    files[OUT / "step_speed.csv"] = to_csv(c.speed, SPEED_COLUMNS)
    files[OUT / "detection.csv"] = to_csv(c.detection, DETECTION_COLUMNS)
    files.update({page: splice(text, tables) for page, text in pages.items()})
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether the outputs are up to date")
    p.add_argument("--add", nargs=2, metavar=("RUN", "NAME"), help="take a finished run folder in as NAME "
                   "(<study>_<model>_<what differs>_<epochs or budget>_<machine>), then build")
    p.add_argument("--replace", action="store_true", help="with --add: replace a kept run of that name")
    a = p.parse_args(argv)
    if a.add:
        try:
            add_run(Path(a.add[0]), a.add[1], a.replace)
        except Refused as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    stale = []
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(text)
    if a.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}; run python -m results.build", file=sys.stderr)
        return 1
    print("updated: " + ", ".join(map(str, stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
