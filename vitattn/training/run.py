"""A training run: what the loop trains (the ``Task`` protocol a task implements), where a run is
(``TrainState``), its parts (``Run``), and ``build_run``, the one place a run is made, fresh or
from its checkpoint.

A task may train several seeds at once (``tasks.classify.task.GroupTask`` over a
``stack.SeedStack``): its loss is then one per seed, ``task.tasks[s]`` evaluates seed ``s``'s model,
and every figure the loop keeps, logs and returns is kept per seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..weights import describe
from . import checkpoint, cli, optim, runtime, stack

PER_SEED = ("loss_sum", "correct_sum", "best")  # TrainState's figures kept per seed


class Task(Protocol):
    """What the loop trains: classification (``classify.ClassifyTask``), detection
    (``vitattn.tasks.detect.DetectionTask``)."""

    family: str  # the checkpoint's name for the model: 'vit', 'cnn', 'detector'
    score: str  # the key of ``evaluate``'s metrics that the best-so-far tracks
    steps_per_epoch: int
    batch_size: int  # images per step on this rank
    data_on_clock: bool  # making a batch counts as training time (in-memory tensors) or not (files read)
    counts_hits: bool  # ``loss`` counts correct predictions (an accuracy to log) or returns zero

    def batches(self, epoch: int, start_step: int) -> Iterator[Any]: ...

    def loss(self, net: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]: ...

    def evaluate(self, model: nn.Module) -> dict[str, float]: ...

    def final(self, model: nn.Module, desc: str) -> dict[str, Any]: ...

    def log_line(self, metrics: dict[str, float]) -> str: ...


@dataclass
class TrainState:
    """Where a run is; everything in it loads with ``torch.load(weights_only=True)``."""

    epoch: int = 0  # current epoch (0-based)
    step_in_epoch: int = 0  # batches of this epoch already taken
    global_step: int = 0
    train_seconds: float = 0.0  # time in training steps, summed over sessions
    images_seen: int = 0  # on this rank
    data_seconds: float = 0.0  # time making batches
    compile_seconds: float = 0.0  # compiling: each session's first step, kept off the clock and the budget
    loss_sum: list[float] = field(default_factory=lambda: [0.0])  # per seed, over this epoch's steps so far
    correct_sum: list[int] = field(default_factory=lambda: [0])  # per seed
    count: int = 0  # images per seed this epoch
    best: list[float] = field(default_factory=lambda: [0.0])  # per seed, the best ``task.score`` at an epoch's end
    eval_at: float = 0.0  # the epoch mark of an evaluation due (checkpointed before it), else 0
    done: bool = False


@dataclass(kw_only=True)
class Run:
    """One model's training: what the loop reads and updates."""

    task: Task
    model: nn.Module
    net: nn.Module  # the model as stepped: wrapped in DDP and / or compiled
    opt: torch.optim.Optimizer | optim.OptimizerChain
    lr_at: Callable[[float], float]  # the learning rate at a progress in [0, 1]
    grad_clip: float
    total_steps: int | None
    budget_s: float | None  # seconds of training steps
    checkpoint_path: Path
    device: torch.device
    ranks: runtime.Dist
    scaler: torch.amp.GradScaler  # fp16's loss scaling; a pass-through otherwise
    precision: str
    ema: optim.ModelEma | None = None  # the averaged weights the run keeps, if any
    update: optim.Update | None = None  # --compile: clip, optimiser and EMA as one compiled function
    amp_dtype: torch.dtype | None = None  # the forward passes' autocast precision; None: fp32
    compiling: bool = False  # the next step compiles the model (first step of a session)
    config: dict | None = None  # the run's options, saved with each checkpoint
    extra: dict = field(default_factory=dict)  # more entries of each checkpoint (a detector's category ids)
    seeds: tuple[int, ...] = (0,)  # the seeds it trains (several: a SeedStack, one copy each)
    board: Any = None  # where its curves go (``board.Board``), if anywhere
    state: TrainState = field(default_factory=TrainState)
    running: torch.Tensor | None = None  # (loss sum, hits) per seed since the loop last read them, on the device
    started: float = field(default_factory=time.perf_counter)  # for the result's wall_seconds

    def progress(self) -> float:
        return optim.run_progress(self.state.global_step, self.total_steps, self.state.train_seconds, self.budget_s)

    def images_per_s(self) -> float:
        """Images per second of training, all seeds together."""
        return self.state.images_seen * self.ranks.world * len(self.seeds) / max(self.state.train_seconds, 1e-9)

    def per_seed(self) -> list[tuple[int, int, Task]]:
        """``(index, seed, task)`` for each seed the run trains; a group's task has one task per seed."""
        return [(i, s, t) for i, (s, t) in enumerate(zip(self.seeds, getattr(self.task, "tasks", [self.task])))]

    def save(self, rng: list[dict], result: dict | None = None) -> None:
        """Write the checkpoint (rank 0), with every rank's random states (``runtime.all_rng_states``)."""
        extra = {"ema": self.ema.state_dict()} if self.ema is not None else {}
        if not isinstance(self.model, stack.SeedStack):  # a stack's seeds are in their own files
            extra["model_info"] = describe(self.model)
        if self.scaler.is_enabled():
            extra["scaler"] = self.scaler.state_dict()
        with cli.phase(f"[{self.task.family}] checkpoint written", min_s=5.0):  # a line for large models only
            checkpoint.save_atomic({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                    "state": asdict(self.state), "rng": rng, "family": self.task.family,
                                    "config": self.config, "result": result or {}, **self.extra, **extra},
                                   self.checkpoint_path)


def build_run(task: Task, model: nn.Module, opt: torch.optim.Optimizer | optim.OptimizerChain, *, resumed: dict | None,
          checkpoint_path: Path, lr_at: Callable[[float], float], grad_clip: float, total_steps: int | None,
          budget_s: float | None, device: torch.device, ranks: runtime.Dist, seed: int,
          amp_dtype: torch.dtype | None = None, ema_decay: float = 0.0, compile: bool = False,
          config: dict | None = None, extra: dict | None = None, group: tuple[int, ...] | None = None) -> Run:
    """A run of ``task`` on ``model`` with ``opt``, from its checkpoint ``resumed`` (read and checked by
    ``checkpoint.resume_checkpoint``) when resuming. With ``amp_dtype`` the loop runs the task's
    forward passes (its loss, its evaluations) under autocast in it, and fp16 gets a gradient scaler:
    precision is the loop's alone (a detector's fp32 heads are a module of its own,
    ``vitattn.vitdet.Float32``). ``group``: the seeds of a ``stack.SeedStack`` ``model`` (default:
    ``(seed,)``); a group's random streams start from its first."""
    group = group or (seed,)
    ema = optim.ModelEma(model, ema_decay) if ema_decay > 0 else None
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    state = TrainState(loss_sum=[0.0] * len(group), correct_sum=[0] * len(group), best=[0.0] * len(group))
    restored = False
    if resumed is not None:
        restored = checkpoint.restore(resumed, model, opt, scaler, device, ranks.rank)
        state = TrainState(**{k: [v] if k in PER_SEED and not isinstance(v, list) else v  # a solo run of 0.2
                              for k, v in resumed["state"].items()})
        if ema is not None:  # a finished run's too: finish() would otherwise put the EMA's first copy in the model
            ema.load_state_dict(resumed["ema"])
    if not restored:  # each rank's own dropout / drop-path stream; in a group, each seed's own too
        if isinstance(model, stack.SeedStack):
            model.start_streams([runtime.stream_seed(k, ranks.rank) for k in group], device)
        torch.manual_seed(runtime.stream_seed(group[0], ranks.rank))
    # fp16's scaler decides on the host whether to step: its update stays eager
    update = optim.Update(opt, model, ema, grad_clip, stack.lead_dims(model)) \
        if compile and not scaler.is_enabled() else None
    return Run(task=task, model=model, net=runtime.wrap_model(model, ranks, device, compile), opt=opt, lr_at=lr_at,
               grad_clip=grad_clip, total_steps=total_steps, budget_s=budget_s, checkpoint_path=checkpoint_path,
               device=device, ranks=ranks,
               scaler=scaler, precision=runtime.precision_name(amp_dtype, scaler.is_enabled()), ema=ema,
               update=update, amp_dtype=amp_dtype,
               compiling=compile, config=config, extra=extra or {}, state=state, seeds=tuple(group),
               running=torch.zeros(2, len(group), dtype=torch.float64, device=device))
