"""Train and evaluate a torchvision detector with a vitattn backbone on a COCO-format folder.

    python examples/train_detection.py --data-dir DIR --model vit_small_patch16_224 --pretrained
    python examples/train_detection.py --data-dir DIR --detector fcos --time-budget 30 --amp
    python examples/train_detection.py --resume runs/detection-20261203-140000

``DIR`` has COCO's layout: ``annotations/instances_<split>.json`` and the images of each split in
``<split>/`` (``--train-split train2017 --val-split val2017`` for COCO itself). The detector is any
of ``vitattn.detection.DETECTORS``; the backbone any vitattn ViT preset (``--pretrained`` loads
timm's weights through ``vitattn.create_model``; ``--initial-checkpoint`` a vitattn checkpoint) in
ViTDet's simple feature pyramid, or torchvision's ResNet-18/34/50 with an FPN (random init) as the
convolutional baseline. Both give the pyramid levels of ``--strides`` plus a pooled one.

Each epoch ends with COCO box AP, AP50, AP75 and AP for small, medium and large objects from
pycocotools on the val split, a line in ``metrics.jsonl`` and a checkpoint in ``--output``
(default ``runs/detection-<timestamp>``). ``--time-budget`` minutes of training steps (loading and
evaluation excluded) end the run early; the lr schedule runs on whichever of epochs and budget is
further along, so it always finishes its decay. Ctrl-C or SIGTERM saves a checkpoint and exits
130 / 143; ``--resume`` continues at the step it stopped at. ``torchrun --nproc_per_node=N``
trains on N processes (DistributedDataParallel; ``--batch-size`` is the global batch).

The options, data and task are ``vitattn.training.detect``; the loop is the one ``train_cifar.py``
runs (``vitattn.training.loop``): the same clock, EMA (``--model-ema-decay``), resume and torchrun.

``examples/detect_shapes.py`` writes its synthetic data as such a folder and runs through here.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict

import torch.distributed as dist

from vitattn.helpers import count_params
from vitattn.training import checkpoint, cli, detect, loop, optim, runfolder, runtime
from vitattn.training.detect import Config
from vitattn.training.errors import CheckpointError, DataError, Interrupted, NonFiniteLoss, UsageError
from vitattn.training.schedule import get_lr

SCRIPT = "examples/train_detection.py"


def main(config: Config) -> dict:
    """Train and evaluate; returns the summary (``status`` 'ok', 'interrupted' or 'nan') with the
    model under ``'model'``. Bad options, data or run folders raise UsageError / CheckpointError
    before anything is written."""
    cfg = runfolder.resumed_config(Config, config.resume, SCRIPT, progress=config.progress) \
        if config.resume else config
    dd, dev = runtime.place_process(cfg.device)
    out = runfolder.run_folder(cfg.out, cfg.resume, prefix="detection-")
    log = cli.console_log(cfg.progress) if dd.main else (lambda *a, **k: None)
    with contextlib.ExitStack() as folder:
        if cfg.resume:
            folder.enter_context(runfolder.hold(out, dd.main))
        try:
            return run(cfg, dd, dev, out, log, folder)
        finally:
            if dd.world > 1 and dist.is_initialized():
                dist.destroy_process_group()


def run(cfg: Config, dd: runtime.Dist, dev, out, log, folder: contextlib.ExitStack) -> dict:
    # everything is checked before the run folder is written: the whole folder, the model, the checkpoint
    task = detect.detection_task(cfg, dev, dd)
    model = detect.build_model(cfg, len(task.category_ids)).to(dev)
    ckpt = out / "checkpoints" / "detector.pt"
    ck = checkpoint.resume_checkpoint(ckpt, model, "detector", loop.TrainState)
    if ck is not None:
        runfolder.check_resumed_config(cfg, ck.get("config"), ckpt, detect.UNCHECKED_ON_RESUME)
    elif dd.main and not cfg.resume:
        runfolder.start_run_folder(out, cfg, folder)
    if dd.world > 1:
        dist.barrier()
    opt = optim.create_optimizer(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * task.steps_per_epoch
    budget_s = cfg.time_budget * 60 if cfg.time_budget else None
    r = loop.start(task, model, opt, ck=ck, ckpt=ckpt, lr_at=lambda p: get_lr(p, cfg.lr, cfg.warmup, "cosine"),
                   grad_clip=cfg.clip_grad, total_steps=steps, budget_s=budget_s, device=dev, dd=dd,
                   seed=cfg.seed, amp_dtype=cfg.autocast_dtype(), ema_decay=cfg.model_ema_decay,
                   config=asdict(cfg), extra={"category_ids": task.category_ids})
    log(f"{cfg.detector} on {cfg.model}: {count_params(model) / 1e6:.1f}M parameters; {len(task.train.image_ids)} "
        f"train / {len(task.val.image_ids)} val images, {len(task.category_ids) - 1} categories; {r.precision} on "
        f"{dev}, world size {dd.world}")
    for name, split in ((cfg.train_split, task.train), (cfg.val_split, task.val)):
        log(f"{name}: " + ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in split.odd.items()))
    if runtime.precision_warning(dev, cfg.autocast_dtype()):
        log(f"warning: {runtime.precision_warning(dev, cfg.autocast_dtype())}")
    summary = {"status": "ok", "signal": None, "out": str(out), "config": asdict(cfg), "world_size": dd.world,
               "environment": runtime.environment(dev)}
    if r.st.done:
        log(f"already finished in {out}")
        return {**summary, "result": ck["result"], "model": model}
    bar = (cli.progress_bar("detector", r.total_steps, r.st.global_step, r.budget_s, r.st.train_seconds)
           if cfg.progress and dd.main else None)
    with runtime.StopFlag() as stop:
        try:
            summary["result"] = loop.fit(r, out / "metrics.jsonl", stop, log, bar)
        except Interrupted:
            log(f"interrupted: checkpoint saved; continue with: python {SCRIPT} --resume {out}")
            return {**summary, "status": "interrupted", "signal": stop.signum, "state": asdict(r.st), "model": model}
        except NonFiniteLoss as e:
            log(str(e))
            return {**summary, "status": "nan", "state": asdict(r.st), "model": model}
    summary |= {"state": asdict(r.st), "params": count_params(model), "images_per_s": r.images_per_s()}
    if dd.main:
        summary["final"] = runfolder.read_jsonl(out / "metrics.jsonl")[-1]  # the last evaluation
        runfolder.write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    return {**summary, "model": model}


def command_line(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a NaN loss, 2 bad options or files, 128 + the signal when stopped."""
    cfg = cli.parse_config(cli.build_parser(Config, __doc__.split("\n\n")[0]), Config, argv,
                           keep_on_resume=("progress",))
    return cli.run_cli(main, cfg, SCRIPT, (UsageError, CheckpointError, DataError))


if __name__ == "__main__":
    sys.exit(command_line())
