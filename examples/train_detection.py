"""Train and evaluate a torchvision detector with a vitattn backbone on a COCO or Pascal VOC folder.

    python examples/train_detection.py --data-dir DIR --model vit_small_patch16_224 --pretrained
    python examples/train_detection.py --data-dir DIR --detector fcos --time-budget 30 --amp
    python examples/train_detection.py --resume runs/detection-20261203-140000

``DIR`` has COCO's layout (``annotations/instances_<split>.json`` and ``<split>/`` images) or Pascal
VOC's (``Annotations/``, ``JPEGImages/``, ``ImageSets/Main/<split>.txt``; or labelImg's). Each
epoch ends with COCO box AP from pycocotools on the val split, a line in ``metrics.jsonl`` and a
checkpoint. The options, data and task are ``vitattn.tasks.detect``; the run (folder, resume,
Ctrl-C, torchrun) is ``vitattn.training.session`` and its loop ``train_cifar.py``'s; docs/detection.md
says more. ``examples/detect_shapes.py`` writes its synthetic data as such a folder and runs here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from vitattn.helpers import count_params
from vitattn.tasks import detect
from vitattn.tasks.detect import Config
from vitattn.tasks.detect.report import constant_box_control, draw_predictions
from vitattn.training import cli, runfolder, runtime, session
from vitattn.training.errors import CheckpointError, DataError, UsageError

SCRIPT = "examples/train_detection.py"


def main(config: Config) -> dict:
    """Train and evaluate; returns the summary (``status`` 'ok', 'interrupted' or 'nan') with the
    model under ``'model'``. Bad options, data or run folders raise UsageError / CheckpointError
    before anything is written."""
    with session.open_session(config, SCRIPT, prefix="detection-") as s:
        cfg, dev = s.cfg, s.device
        # everything is checked before the run folder is written: the whole folder, the model, the checkpoint
        task = detect.detection_task(cfg, dev, s.ranks)
        if cfg.control:  # no model: the constant box, scored as a model's detections are
            s.begin()
            result = constant_box_control(task.train, task.val, cfg.detections_per_img)
            result["per_class"], result["per_class_50"] = ({task.class_names[task.category_ids.index(c)]: v
                                                            for c, v in result[k].items()}
                                                           for k in ("per_class", "per_class_50"))
            summary = {"status": "ok", "out": str(s.out), "config": asdict(cfg), "control": True,
                       "classes": task.class_names, "result": {f"final_{k}": v for k, v in result.items()},
                       "environment": runtime.environment(dev)}
            s.log(f"constant box {[round(v, 3) for v in result['box']]}: AP {result['map']:.4f} AP50 "
                  f"{result['map_50']:.4f}")
            runfolder.write_text_atomic(s.out / "summary.json", json.dumps(summary, indent=1))
            return summary
        model = detect.build_model(cfg, len(task.category_ids)).to(dev)
        resumed = s.checkpoint("detector", model, detect.UNCHECKED_ON_RESUME)
        s.begin()
        run = detect.detection_run(cfg, task, model, dev, s.ranks, s.out / "checkpoints" / "detector.pt", resumed)
        for line in detect.describe_run(cfg, model, task, run):
            s.log(line)
        finished = run.state.done
        result = s.fit(run, resumed)
        summary = {"status": s.status, "signal": s.stop.signum, "out": str(s.out), "config": asdict(cfg),
                   "world_size": s.ranks.world, "environment": runtime.environment(dev)}
        if finished or s.status != "ok":
            return {**summary, **({"result": result} if finished else {"state": asdict(run.state)}), "model": model}
        summary |= {"result": result, "state": asdict(run.state), "params": count_params(model),
                    "images_per_s": run.images_per_s(), "classes": task.class_names}
        if s.ranks.main:
            summary["final"] = runfolder.read_jsonl(s.out / "metrics.jsonl")[-1]  # the last evaluation
            if cfg.picture:
                path = draw_predictions(model, task.val, task.class_names,
                                        s.out / "predictions.png", dev, n=min(cfg.picture, len(task.val.dataset)))
                s.log(f"wrote {path}")
            runfolder.write_text_atomic(s.out / "summary.json", json.dumps(summary, indent=1))
        return {**summary, "model": model}


def command_line(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 a NaN loss, 2 bad options or files, 128 + the signal when stopped."""
    cfg = cli.parse_config(cli.build_parser(Config, __doc__.split("\n\n")[0]), Config, argv,
                           keep_on_resume=("progress",))
    return cli.exit_status(main, cfg, SCRIPT, (UsageError, CheckpointError, DataError))


if __name__ == "__main__":
    sys.exit(command_line())
