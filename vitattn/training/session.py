"""A training script's run, start to end, written once for every script.

A ``Session`` takes the options (those of the run being resumed, with ``--resume``), places the
process (device, torchrun rank), picks the run folder (new, or held against a second resume),
reads and checks each model's checkpoint before anything is written, starts the folder, trains
with Ctrl-C and a NaN loss turned into a status, and closes the process group at the end::

    with session.open_session(config, "train_cifar.py") as s:
        resumed = s.checkpoint("vit", model, UNCHECKED_ON_RESUME)  # None for a new run
        s.begin()                                                 # all checked: write the folder
        result = s.fit(run.build_run(..., resumed=resumed), resumed)  # None when stopped: s.status says why
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import board, checkpoint, cli, loop, runfolder, runtime
from .errors import Interrupted, NonFiniteLoss
from .run import Run, TrainState


@dataclasses.dataclass
class Session:
    cfg: Any  # the script's options, as the run was started with when resuming
    script: str  # how a user runs the script, for the line that says how to resume
    ranks: runtime.Dist
    device: torch.device
    out: Path
    log: Callable[..., None]
    folder: contextlib.ExitStack  # what the run holds until it ends (a resumed folder's lock, Ctrl-C's handler)
    status: str = "ok"  # 'ok', 'interrupted' (Ctrl-C or SIGTERM) or 'nan'
    stop: runtime.StopFlag | None = None

    def checkpoint(self, name: str, model: torch.nn.Module, unchecked: tuple[str, ...]) -> dict | None:
        """The checkpoint ``checkpoints/<name>.pt`` read and checked against ``model`` and the
        options (all but ``unchecked``), or ``None`` when there is none yet."""
        path = self.out / "checkpoints" / f"{name}.pt"
        resumed = checkpoint.resume_checkpoint(path, model, name, TrainState)
        if resumed is not None:
            runfolder.check_resumed_config(self.cfg, resumed.get("config"), path, unchecked)
        return resumed

    def begin(self) -> None:
        """Everything is checked: write a new run folder and take over Ctrl-C and SIGTERM."""
        if self.ranks.main and not self.cfg.resume:
            runfolder.create_run_folder(self.out, self.cfg, self.folder)
        if self.ranks.world > 1:
            dist.barrier()
        self.stop = self.folder.enter_context(runtime.StopFlag())

    def fit(self, run: Run, resumed: dict | None, info: dict | None = None) -> dict | None:
        """Train ``run`` (started from its checkpoint ``resumed``, if any) to its end and return its
        result; ``None`` when Ctrl-C, SIGTERM or a NaN loss stopped it (``status`` says which; the
        checkpoint is saved or kept)."""
        name = run.task.family
        if run.state.done:
            self.log(f"[{name}] already finished in {self.out}; skipping training")
            return resumed["result"]
        if resumed is not None:
            self.log(f"[{name}] resuming at epoch {run.state.epoch} step {run.state.step_in_epoch} "
                     f"({run.state.train_seconds:.0f} s)")
        bar = (cli.progress_bar(name, run.total_steps, run.state.global_step, run.budget_s, run.state.train_seconds)
               if self.cfg.progress and self.ranks.main else None)
        if self.cfg.tensorboard and self.ranks.main:
            if board.available():  # a resume drops what the stopped session wrote after its checkpoint
                st = run.state  # an epoch's figures at its checkpoint's step stay, unless evaluated again
                again = bool(st.eval_at) or st.step_in_epoch > 0
                run.board = board.Board(self.out, name, run.seeds, st.global_step + (not again) if st.global_step
                                        else 0)  # no checkpoint yet: everything an earlier session wrote goes
            else:
                self.log(f"[{name}] no TensorBoard curves: the tensorboard package is not installed "
                         "(pip install tensorboard, or --no-tensorboard)")
        try:
            return loop.fit(run, self.out / "metrics.jsonl", self.stop, self.log, bar, info=info)
        except Interrupted:
            self.log(f"interrupted: resumable checkpoint saved in {self.out / 'checkpoints'}; "
                     f"continue with: python {self.script} --resume {self.out}")
            self.status = "interrupted"
        except NonFiniteLoss as e:
            self.log(str(e))
            self.status = "nan"
        finally:
            if run.board is not None:
                run.board.close()
        return None


@contextlib.contextmanager
def open_session(config: Any, script: str, prefix: str = "") -> Iterator[Session]:
    """The session of one run of ``script`` with ``config`` (a new folder is ``runs/<prefix><time>``
    when ``--out`` is unset). Bad options, data or folders raise before anything is written."""
    cfg = runfolder.resumed_config(type(config), config.resume, script, progress=config.progress) \
        if config.resume else config
    if cfg.malloc == "keep":
        runtime.keep_freed_memory()
    ranks, device = runtime.place_process(cfg.device)
    if device.type == "cuda" and hasattr(cfg, "tf32"):  # a detector's images vary in size: no autotuner there
        runtime.configure_cuda(cfg.tf32, cfg.cudnn_benchmark)
    out = runfolder.run_folder(cfg.out, cfg.resume, prefix=prefix)
    log = cli.console_log(cfg.progress) if ranks.main else (lambda *a, **k: None)
    with contextlib.ExitStack() as folder:
        cli.show_phases(log if ranks.main else None, cfg.progress)  # the long phases' bars and lines
        folder.callback(cli.show_phases, None, False)
        if cfg.resume:
            folder.enter_context(runfolder.hold(out, ranks.main))
            runfolder.check_metrics(out)
        try:
            yield Session(cfg, script, ranks, device, out, log, folder)
        except Exception as e:  # the folder this run uses, for the line that says how to resume it
            e.run_folder = out
            raise
        finally:
            if ranks.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
