"""Train a ViT and a small CNN on CIFAR-10 under the same budget, and measure their global context.

    python train_cifar.py --data-dir path/to/cifar --time-budget 30
    python train_cifar.py --dataset long-range --time-budget 3       # generated, no download
    torchrun --nproc_per_node=2 train_cifar.py ...                   # DistributedDataParallel

Top to bottom: ``main`` (data, models, one ``vitattn.training.loop`` run per model, report) and
the command line. The options are ``vitattn.training.classify.Config``, the recipes each model
family trains with are ``vitattn.training.recipes``. A run writes
``config.json``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/``, plots and ``report.md``
to ``--out``. With ``--time-budget MINUTES`` each model trains for that many minutes of steps
(evaluation excluded, as in airbench) on a schedule that runs on the budget's fraction used.

References: airbench (``airbench94.py``) for the layout and the CNN recipe; DeiT for the ViT's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
from torch import nn

import vitattn
from vitattn.helpers import count_params
from vitattn.training import checkpoint, classify, cli, data, loop, report, runfolder, runtime
from vitattn.training.classify import Config, Dataset
from vitattn.training.errors import CheckpointError, DataError, Interrupted, NonFiniteLoss, UsageError
from vitattn.training.recipes import DEFAULT_PRESETS


def main(config: Config) -> dict:
    """Train, measure and report; returns the summary dict with the trained modules under
    ``'modules'``. ``status`` is 'ok', 'interrupted' or 'nan' (those two raise nothing). Bad
    options, data or run folders raise UsageError / DataError / CheckpointError before anything is
    written."""
    t0 = time.perf_counter()
    cfg = runfolder.resumed_config(Config, config.resume, "train_cifar.py", progress=config.progress) \
        if config.resume else config
    dd, dev = runtime.place_process(cfg.device)
    if dev.type == "cuda":
        runtime.configure_cuda(cfg.tf32, cfg.cudnn_benchmark)
    out = runfolder.run_folder(cfg.out, cfg.resume)
    log = cli.console_log(cfg.progress) if dd.main else (lambda *a, **k: None)
    with contextlib.ExitStack() as folder:
        if cfg.resume:
            folder.enter_context(runfolder.hold(out, dd.main))
        try:
            return run_all(cfg, dd, dev, out, log, folder, t0)
        finally:
            if dd.world > 1 and dist.is_initialized():
                dist.destroy_process_group()


def run_all(cfg: Config, dd: runtime.Dist, dev, out: Path, log, folder: contextlib.ExitStack, t0: float) -> dict:
    # everything is checked before the run folder is written: data, models, checkpoints, options
    ds = classify.load_dataset(cfg, dev)
    models = {fam: classify.build_model(fam, cfg, ds, dev, dd.world) for fam in cfg.models()}
    teacher = classify.load_teacher(cfg, ds, dev) if cfg.teacher else None
    ckpts = {fam: checkpoint.resume_checkpoint(out / "checkpoints" / f"{fam}.pt", m, fam, loop.TrainState)
             for fam, m in models.items()}
    for fam, ck in ckpts.items():
        check_resumed(cfg, ck, out / "checkpoints" / f"{fam}.pt")
    if dd.main and not cfg.resume:
        runfolder.start_run_folder(out, cfg, folder)
    if dd.world > 1:
        dist.barrier()
    log(f"data: {ds.data.source}: {len(ds.data.train_x)} train / {len(ds.data.test_x)} test images, "
        f"{len(ds.data.classes)} classes; device {dev}, world size {dd.world}")
    results, modules, status = {}, {}, "ok"
    with runtime.StopFlag() as stop:
        for fam, model in models.items():
            try:
                results[fam] = train_model(fam, model, ckpts[fam], cfg, ds, out, dev, dd, stop, log, teacher)
            except Interrupted:
                log(f"interrupted: resumable checkpoint saved in {out / 'checkpoints'}; "
                    f"continue with: python train_cifar.py --resume {out}")
                status = "interrupted"
                break
            except NonFiniteLoss as e:
                log(str(e))
                status = "nan"
                break
            modules[fam] = model
    summary = {"status": status, "signal": stop.signum, "dataset": cfg.dataset, "data_source": ds.data.source,
               "classes": list(ds.data.classes), "world_size": dd.world, "models": results,
               "config": asdict(cfg), "environment": runtime.environment(dev), "out": str(out)}
    if status == "ok" and dd.main:
        summary["train_seconds_total"] = sum(r["train_seconds"] for r in results.values())
        summary["wall_seconds_total"] = time.perf_counter() - t0  # data, training, evaluation
        pick = classify.context_sample(cfg.seed, cfg.context_images, len(ds.data.test_x)).to(ds.data.test_x.device)
        report.write_outputs(out, summary, modules, ds.data.test_x[pick], ds.data.test_y[pick], ds.data.classes,
                             ds.norm, cfg.plots)
        log(f"wrote {out / 'report.md'}")
        for fam, r in results.items():
            log(f"[{fam}] final test accuracy {r['final_acc']:.4f} (best {r['best_acc']:.4f}), "
                f"{r['epochs']:.2f} epochs in {r['train_seconds'] / 60:.1f} min, {r['images_per_s']:.0f} img/s")
    return {**summary, "modules": modules}


def train_model(family: str, model: nn.Module, ck: dict | None, cfg: Config, ds: Dataset, out: Path, dev,
                dd: runtime.Dist, stop: runtime.StopFlag, log, teacher: classify.Teacher | None = None) -> dict:
    """Train one model (from its checkpoint when resuming) and save its weights; returns its result.
    Raises Interrupted / NonFiniteLoss after saving / keeping the checkpoint."""
    weights = out / "checkpoints" / f"{family}.safetensors"
    run = classify.start_run(family, model, cfg, ds, dev, dd, out / "checkpoints" / f"{family}.pt", ck,
                             teacher.model if teacher else None)
    if run.st.done:
        log(f"[{family}] already finished in {out}; skipping training")
        if dd.main:  # written anew from the checkpoint: a crash may have cut the first copy short
            checkpoint.save_safetensors(model, weights)
        return ck["result"]
    if ck is not None:
        log(f"[{family}] resuming at epoch {run.st.epoch} step {run.st.step_in_epoch} ({run.st.train_seconds:.0f} s)")
    pipeline = data.pipeline_speed(run.task.loader, ds.norm) if dd.main else {}
    r = cfg.recipe(family)
    log(f"[{family}] {cfg.preset(family)}: {count_params(model) / 1e6:.3f} M params, {model.flops / 1e6:.1f} "
        f"MFLOP/img; {r.optimizer} lr {r.lr:g} wd {r.weight_decay:g} batch {r.batch_size} "
        f"({run.task.steps_per_epoch} steps/epoch); {run.precision} on {dev}; pipeline alone "
        f"{pipeline.get('augmented_images_per_s', 0):.0f} img/s")
    if runtime.precision_warning(dev, cfg.autocast_dtype()):
        log(f"[{family}] warning: {runtime.precision_warning(dev, cfg.autocast_dtype())}")
    bar = (cli.progress_bar(family, run.total_steps, run.st.global_step, run.budget_s, run.st.train_seconds)
           if cfg.progress and dd.main else None)
    if teacher:
        log(f"[{family}] teacher: {teacher.info['preset']} of {teacher.info['run']} ({teacher.info['final_acc']:.4f} "
            f"in {teacher.info['train_seconds'] / 60:.1f} min of training)")
    result = loop.fit(run, out / "metrics.jsonl", stop, log, bar, info=dict(
        preset=cfg.preset(family), flops_per_image=model.flops, recipe=asdict(r), pipeline=pipeline,
        **({"teacher": teacher.info} if teacher else {})))
    if dd.main:
        checkpoint.save_safetensors(model, weights)
    return result


# where and how a run executes and shows, not what it trains: a resume may move them (another machine)
UNCHECKED_ON_RESUME = ("resume", "out", "progress", "plots", "device", "data_dir", "download", "compile",
                       "channels_last", "eval_batch_size", "tta", "context_images", "tf32", "cudnn_benchmark")


def check_resumed(cfg: Config, ck: dict | None, path: Path) -> None:
    """``config.json`` must still say what the checkpoint was trained with."""
    if ck is not None:
        runfolder.check_resumed_config(cfg, ck.get("config"), path, UNCHECKED_ON_RESUME)


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line, one option per ``Config`` field, its help from the field's metadata;
    timm's names are aliases where the meaning is the same (``--output``, ``--clip-grad``)."""
    p = cli.build_parser(Config, __doc__.split("\n\n")[0],
                         epilog="Options left unset take the model family's recipe (vitattn.training.recipes.RECIPES).")
    p.add_argument("--list-models", nargs="?", const="*", metavar="PATTERN",
                   help="print the presets (matching PATTERN, e.g. 'vit_*') with their size and purpose, and exit")
    first, _ = p.parse_known_args(argv)
    if first.list_models is not None:
        print(vitattn.registry.describe_models(first.list_models, DEFAULT_PRESETS))
        p.exit(0)
    return cli.parse_config(p, Config, argv, keep_on_resume=("progress",))


def command_line(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a NaN loss, 2 bad options or files, 128 + the signal (130 for Ctrl-C,
    143 for SIGTERM) when stopped, with a resumable checkpoint once training has begun."""
    expected = (UsageError, DataError, CheckpointError)
    return cli.run_cli(main, parse_args(argv), "train_cifar.py", expected)


if __name__ == "__main__":
    sys.exit(command_line())
