"""Train a ViT and a small CNN on CIFAR-10 under the same budget, and measure their global context.

    python train_cifar.py --data-dir path/to/cifar --time-budget 30
    python train_cifar.py --dataset long-range --time-budget 3       # generated, no download
    torchrun --nproc_per_node=2 train_cifar.py ...                   # DistributedDataParallel

Top to bottom: ``main`` (data, models, one ``vitattn.training.loop`` run per model, report) and
the command line. The options are ``vitattn.tasks.classify.Config``, the recipes each model
family trains with are ``vitattn.tasks.classify.recipes``; the run's folder, resume, Ctrl-C and torchrun
are ``vitattn.training.session``. A run writes ``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/``, plots and ``report.md`` to ``--out``. With ``--time-budget MINUTES`` each model
trains for that many minutes of steps (evaluation excluded, as in airbench) on a schedule that runs
on the budget's fraction used.

References: airbench (``airbench94.py``) for the layout and the CNN recipe; DeiT for the ViT's.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

import vitattn
from vitattn.tasks import classify
from vitattn.tasks.classify import Config, batches, report
from vitattn.tasks.classify.recipes import DEFAULT_PRESETS, recipe_defaults
from vitattn.training import checkpoint, cli, runtime, session, stack
from vitattn.training.errors import CheckpointError, DataError, UsageError

# where and how a run executes and shows, not what it trains: a resume may move them (another machine)
UNCHECKED_ON_RESUME = ("resume", "out", "progress", "plots", "device", "data_dir", "download", "compile",
                       "channels_last", "eval_batch_size", "tta", "context_images", "tf32", "cudnn_benchmark",
                       "malloc", "seed_batching", "tensorboard")


def main(config: Config) -> dict:
    """Train, measure and report; returns the summary dict with the trained modules under
    ``'modules'``. ``status`` is 'ok', 'interrupted' or 'nan' (those two raise nothing). Bad
    options, data or run folders raise UsageError / DataError / CheckpointError before anything is
    written."""
    t0 = time.perf_counter()
    with session.open_session(config, "train_cifar.py") as s:
        cfg, dev, log = s.cfg, s.device, s.log
        group = cfg.seed_list()  # several: one copy of each model per seed, trained as one (--seeds)
        # everything is checked before the run folder is written: data, models, checkpoints, options
        ds = classify.load_dataset(cfg.for_seed(group[0]), dev)
        classify.check_memory(cfg, ds, dev, s.ranks.world)  # a group that cannot fit: refused before it is built
        datasets = classify.load_datasets(cfg, dev, first=ds)  # one per seed: the long-range task is drawn from it
        models = {fam: classify.build_models(fam, cfg, datasets, dev, s.ranks.world) for fam in cfg.models()}
        teachers = classify.load_teachers(cfg, datasets, dev) if cfg.teacher else None
        resumed = {fam: s.checkpoint(fam, m, UNCHECKED_ON_RESUME) for fam, m in models.items()}
        s.begin()
        log(f"data: {ds.data.source}: {len(ds.data.train_x)} train / {len(ds.data.test_x)} test images, "
            f"{len(ds.data.classes)} classes; device {dev}, world size {s.ranks.world}"
            + (f"; seeds {cfg.seeds}" if len(group) > 1 else ""))
        results, modules = {}, {}
        for fam, model in models.items():
            teacher = None if teachers is None else [t.model for t in teachers] if len(group) > 1 else \
                teachers[0].model
            run = classify.classification_run(fam, model, cfg, datasets if len(group) > 1 else ds, dev, s.ranks,
                                     s.out / "checkpoints" / f"{fam}.pt", resumed[fam], teacher)
            loader = getattr(run.task, "tasks", [run.task])[0].loader
            pipeline = batches.pipeline_speed(loader, ds.norm) if s.ranks.main and not run.state.done else {}
            for line in [] if run.state.done else classify.describe_run(fam, model, cfg, run, pipeline,
                                                                         teachers[0] if teachers else None):
                log(line)
            results[fam] = s.fit(run, resumed[fam], info=dict(
                preset=cfg.preset(fam), flops_per_image=model.flops, recipe=asdict(cfg.recipe(fam)), pipeline=pipeline,
                **({"teacher": teachers[0].info} if teachers else {})))
            if results[fam] is None:  # stopped: Ctrl-C, SIGTERM or a NaN loss
                del results[fam]
                break
            modules[fam] = stack.members(model)
            if s.ranks.main:  # written anew when already finished: a crash may have cut the first copy short
                for k, m in zip(group, modules[fam]):
                    checkpoint.save_safetensors(m, s.out / classify.weights_file(fam, k if len(group) > 1 else None))
        summary = {"status": s.status, "signal": s.stop.signum, "dataset": cfg.dataset, "data_source": ds.data.source,
                   "classes": list(ds.data.classes), "world_size": s.ranks.world, "models": results,
                   "config": asdict(cfg), "environment": runtime.environment(dev), "out": str(s.out)}
        if s.status == "ok" and s.ranks.main:
            summary["train_seconds_total"] = sum(r["train_seconds"] for r in results.values())
            summary["wall_seconds_total"] = time.perf_counter() - t0  # data, training, evaluation
            report.write_outputs(s.out, summary, modules, classify.context_samples(cfg, datasets), ds.data.classes,
                                 cfg.plots, cfg.tensorboard)
            log(f"wrote {s.out / 'report.md'}")
            for fam, r in results.items():
                log(report.final_line(fam, r))
        return {**summary, "modules": {fam: ms[0] if len(ms) == 1 else ms for fam, ms in modules.items()}}


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line, one option per ``Config`` field, its help from the field's metadata;
    timm's names are aliases where the meaning is the same (``--output``, ``--clip-grad``)."""
    pre = argparse.ArgumentParser(add_help=False)  # the model and data the recipe defaults of --help are for
    pre.add_argument("--model", default="both", choices=("vit", "cnn", "both"))
    pre.add_argument("--dataset", default="cifar10", choices=("cifar10", "long-range"))
    chosen, _ = pre.parse_known_args(argv)
    presets = {f"{slot}_preset": ", ".join(f"{d[slot]} on {name}" for name, d in DEFAULT_PRESETS.items())
               for slot in ("vit", "cnn")}
    p = cli.build_parser(Config, __doc__.split("\n\n")[0], defaults={**recipe_defaults(chosen.model, chosen.dataset),
                                                                       **presets},
                         epilog="Options left unset take the model family's recipe "
                         "(vitattn.tasks.classify.recipes.RECIPES); --help with --model and --dataset shows that "
                         "recipe's values.")
    p.add_argument("--list-models", nargs="?", const="*", metavar="PATTERN",
                   help="print the presets (matching PATTERN, e.g. 'vit_*') with their size and purpose, and exit")
    first, _ = p.parse_known_args(argv)
    if first.list_models is not None:
        print(vitattn.registry.describe_models(first.list_models, DEFAULT_PRESETS))
        p.exit(0)
    given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv)}
    if {"--seed", "--seeds"} <= given:  # a --seed equal to the default is not seen in the config
        p.error("--seed and --seeds together: give one of them (--seed N is --seeds N)")
    return cli.parse_config(p, Config, argv, keep_on_resume=("progress",), one_option=(("seed", "seeds"),))


def command_line(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a NaN loss, 2 bad options or files, 128 + the signal (130 for Ctrl-C,
    143 for SIGTERM) when stopped, with a resumable checkpoint once training has begun."""
    return cli.exit_status(main, parse_args(argv), "train_cifar.py", (UsageError, DataError, CheckpointError))


if __name__ == "__main__":
    sys.exit(command_line())
