"""One training loop for every task: a task says what a batch is, what its loss is and how the
model is evaluated; the loop does the rest the same way for all of them.

    task.batches(epoch, start_step)  -> this rank's batches of an epoch, from a step on (resume)
    task.loss(net, batch)            -> (loss, hits, images) of one batch, on the device (per seed)
    task.evaluate(model)             -> the metrics of an epoch's end   {"test_loss": .., "test_acc": ..}
    task.final(model, desc)          -> the metrics of the end of the run, with the kept weights
                                        (``desc`` names the phase: a run shows its progress)

A task may train several seeds at once (``tasks.classify.task.GroupTask`` over a ``stack.SeedStack``): its
loss is then one per seed, ``task.tasks[s]`` evaluates seed ``s``'s model, and every figure the loop
keeps, logs and returns is kept per seed; one optimiser steps them all, on one clock.

The loop steps the optimiser on the schedule (by steps or by a time budget, whichever is further
along), keeps an EMA of the weights, evaluates and checkpoints after each epoch and on Ctrl-C
(resume at any step: the batches of a step depend on ``(seed, epoch, step, rank)`` only), and
under ``torchrun`` keeps the ranks in step: they agree on the clock, a NaN and a stop every
``READ_EVERY`` steps, which are also the only steps where the host waits for a GPU.

References: timm's ``train.py`` (``train_one_epoch`` / ``validate``); airbench (the clock counts
training steps only).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..helpers import count_params
from . import optim, runfolder, runtime, seeds, stack
from .errors import Interrupted, NonFiniteLoss
from .run import Run

# Steps between reads of the running loss: each read waits for a GPU to drain its queue, and a
# torchrun's ranks agree on the clock, Ctrl-C and a NaN there, so they stop at the same step.
READ_EVERY = 50


def train_step(run: Run, batch: Any) -> int:
    """One optimiser step; its loss and hits are added to ``run.running`` on the device, so
    nothing here waits for a GPU. Returns the batch's images."""
    lr = run.lr_at(run.progress())
    # the phases are named for torch.profiler (benchmarks.precision_step --phases); free when it is off
    with record_function("forward"), runtime.autocast(run.device, run.amp_dtype):  # the backward runs as it did
        loss, hits, n = run.task.loss(run.net, batch)
    loss, hits = loss.reshape(-1), hits.reshape(-1)  # one per seed: the seeds' gradients are apart in their sum
    if run.update is not None:
        run.opt.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.sum().backward()
        with record_function("optimizer"):
            run.update(lr)
    else:
        optim.set_lr(run.opt, lr)
        optim.backward_step(loss.sum(), run.opt, run.scaler, run.model.parameters(), run.grad_clip,
                            stack.lead_dims(run.model))
        if run.ema is not None:
            with record_function("ema"):
                run.ema.update_parameters(run.model)
    # float64 sums of float32 losses are exact, so they do not depend on when they are read
    run.running += torch.stack([loss.detach().double() * n, hits.double()])
    return n


def read_running(run: Run, bar, log: bool = True) -> None:
    """Move the device's running sums into the train state (waits for a GPU); with ``log``, write
    the running figures to the board (an epoch's end leaves them to ``evaluate_epoch``, which a
    resumed run repeats when its checkpoint left the evaluation due)."""
    loss, correct = run.running.tolist()
    run.running.zero_()
    state = run.state
    state.loss_sum = [a + b for a, b in zip(state.loss_sum, loss)]
    state.correct_sum = [a + int(b) for a, b in zip(state.correct_sum, correct)]
    if run.board is not None and state.count and log:
        run.board.add(state.global_step, running_scalars(run, state.loss_sum, state.correct_sum, state.count))
    if bar is not None:  # the seeds' mean
        n = max(state.count, 1) * len(run.seeds)
        bar.set_postfix(loss=f"{sum(state.loss_sum) / n:.3f}", acc=f"{sum(state.correct_sum) / n:.3f}",
                        img_s=f"{run.images_per_s():.0f}")


def running_scalars(run: Run, loss_sum, correct_sum, count) -> list[dict[str, float]]:
    """The board's running figures, one dict per seed: the epoch's train loss and accuracy so far,
    the lr and the speed."""
    counts = count if isinstance(count, list) else [count] * len(loss_sum)
    lr, speed = run.lr_at(run.progress()), run.images_per_s()
    return [{"train/loss": loss / max(n, 1), "train/acc": hits / max(n, 1), "lr": lr, "images_per_s": speed}
            for loss, hits, n in zip(loss_sum, correct_sum, counts)]


def check_stop(run: Run, stop: runtime.StopFlag, pending_s: float) -> None:
    """Add ``pending_s`` of step time to the run's clock, then raise NonFiniteLoss or Interrupted
    when the loss read so far is not finite or Ctrl-C came. A torchrun's ranks agree first (the
    slowest clock, any NaN, any Ctrl-C), so their clocks, lr schedules and stops stay equal."""
    state = run.state
    bad = [s for s, loss in zip(run.seeds, state.loss_sum) if not math.isfinite(loss)]
    seconds, nonfinite, stopping = state.train_seconds + pending_s, bool(bad), stop.set
    if run.ranks.world > 1:
        flags = torch.tensor([seconds, nonfinite, stopping], dtype=torch.float64, device=run.device)
        seconds, nonfinite, stopping = runtime.all_reduce_(flags, run.ranks, dist.ReduceOp.MAX).tolist()
    state.train_seconds = seconds
    if nonfinite:  # a NaN on any rank poisons the averaged gradients of all
        kept = run.checkpoint_path if run.checkpoint_path.exists() else "(none yet)"
        i = run.seeds.index(bad[0]) if bad else 0
        loss = state.loss_sum[i] / max(state.count, 1)
        which = f" (seed {bad[0]}; the group stops with it)" if len(run.seeds) > 1 else ""
        raise NonFiniteLoss(f"[{run.task.family}] loss is {loss} by epoch {state.epoch} step {state.step_in_epoch}"
                            f"{which}; stopping. The last good checkpoint is kept at {kept}. Lower --lr or set "
                            "--grad-clip.")
    if stopping:  # before the forward pass, which would move BatchNorm statistics
        raise Interrupted


def train_epoch(run: Run, stop: runtime.StopFlag, bar) -> None:
    """Steps until the epoch or the budget ends; raises Interrupted at a step boundary on Ctrl-C.
    A single process checks Ctrl-C and the budget at every step (host values only); a torchrun's
    ranks every ``READ_EVERY`` steps, and their clocks move only then."""
    state, world = run.state, run.ranks.world
    if state.step_in_epoch == 0:
        state.loss_sum, state.correct_sum, state.count = [0.0] * len(run.seeds), [0] * len(run.seeds), 0
    batches = run.task.batches(state.epoch, state.step_in_epoch)
    pending = 0.0  # step seconds not yet on the clock (a torchrun's, until its ranks agree)
    while state.step_in_epoch < run.task.steps_per_epoch:
        t0 = time.perf_counter()
        due = state.global_step % READ_EVERY == 0
        if due or (world == 1 and stop.set):
            read_running(run, bar)
        if due or world == 1:
            check_stop(run, stop, pending)
            pending = 0.0
        if run.progress() >= 1.0:
            break
        batch = next(batches)
        t1 = time.perf_counter()
        n = train_step(run, batch)
        state.global_step += 1
        state.step_in_epoch += 1
        state.count += n
        if run.compiling:  # compiling is not training: reported apart, and the budget is for steps
            run.compiling = False
            state.compile_seconds += time.perf_counter() - t0
        else:
            state.data_seconds += t1 - t0
            state.images_seen += n
            step_s = time.perf_counter() - (t0 if run.task.data_on_clock else t1)
            if world == 1:
                state.train_seconds += step_s
            else:
                pending += step_s
        if bar is not None:
            bar.update((round(min(state.train_seconds, run.budget_s) / 60, 2) - bar.n) if run.budget_s else 1)
    t0 = time.perf_counter()
    read_running(run, bar, log=False)  # waits for the last steps' GPU work, which the clock must count
    check_stop(run, stop, pending + time.perf_counter() - t0)


def end_epoch(run: Run, metrics: Path, log) -> None:
    """After an epoch (or the budget): checkpoint, then ``evaluate_epoch``. The checkpoint comes
    first, so an evaluation that fails (a detector's, in pycocotools) cannot cost the epoch; it
    records the evaluation as due (``eval_at``), so a resume from it evaluates before training on."""
    state, ranks = run.state, run.ranks
    ended = state.step_in_epoch >= run.task.steps_per_epoch
    state.eval_at = round(state.epoch + (1.0 if ended else state.step_in_epoch / run.task.steps_per_epoch), 4)
    if ended:
        state.epoch, state.step_in_epoch = state.epoch + 1, 0
    runtime.average_buffers(run.model, ranks)  # each rank's BatchNorm statistics saw only its shard
    if run.ema is not None:
        runtime.average_buffers(run.ema.module, ranks)
    rng = runtime.all_rng_states(run.device, ranks, run.model)  # a collective: every rank's streams in rank 0's file
    if ranks.main:
        run.save(rng)
    evaluate_epoch(run, metrics, log)


def evaluate_epoch(run: Run, metrics: Path, log) -> None:
    """The due evaluation: a line of ``metrics`` per seed, then a checkpoint with it done (unless
    the run is done: ``finish`` saves then)."""
    state, task, ranks = run.state, run.task, run.ranks
    models = stack.members(run.model)
    averaged = stack.members(run.ema.module) if run.ema is not None else None
    sums = torch.tensor([state.loss_sum, state.correct_sum, [state.count] * len(run.seeds)], dtype=torch.float64,
                        device=run.device)
    sums = runtime.all_reduce_(sums, ranks).tolist()
    lines, evs = [], []
    with runtime.autocast(run.device, run.amp_dtype):
        for i, seed, t in run.per_seed():
            ev = t.evaluate(models[i])
            raw = {}
            if averaged is not None:  # the metrics are the kept model's, the EMA; the raw weights' are logged beside
                raw = {f"{k}_no_ema": v for k, v in ev.items()}
                ev = t.evaluate(averaged[i])
            state.best[i] = max(state.best[i], ev[task.score])
            line = dict(model=task.family, seed=seed, epoch=state.eval_at, step=state.global_step,
                        train_loss=float(sums[0][i] / max(sums[2][i], 1)),
                        train_acc=float(sums[1][i] / max(sums[2][i], 1)), **ev, lr=run.lr_at(run.progress()),
                        train_seconds=state.train_seconds, images_per_s=run.images_per_s(),
                        data_share=state.data_seconds / max(state.train_seconds, 1e-9), **raw)
            if not task.counts_hits:
                del line["train_acc"]
            lines.append(line)
            evs.append(ev)
    state.eval_at, state.done = 0.0, run.progress() >= 1.0
    if not state.done:  # an evaluation may draw random numbers (a DataLoader's seed): the states after it
        rng = runtime.all_rng_states(run.device, ranks, run.model)
    if ranks.main:
        for line in lines:
            runfolder.append_jsonl(metrics, line)
        if run.board is not None:  # the epoch's end: its running figures and its line, at one step
            running = running_scalars(run, sums[0], sums[1], sums[2]) if state.count else [{}] * len(lines)
            run.board.add(state.global_step, [{**r, **{f"epoch/{k}": v for k, v in line.items()
                                                       if k not in ("model", "seed") and isinstance(v, (int, float))}}
                                              for r, line in zip(running, lines)])
            run.board.flush()
        log(epoch_line(run, lines, evs))
        if not state.done:
            run.save(rng)


def epoch_line(run: Run, lines: list[dict], evs: list[dict]) -> str:
    """The console's line for an epoch: its figures, or over several seeds their mean and spread."""
    head, task = f"[{run.task.family}] epoch {lines[0]['epoch']:.2f}: ", run.task
    speed = f" | {lines[0]['images_per_s']:.0f} img/s, {run.state.train_seconds:.0f} s"
    if len(lines) == 1:
        line = lines[0]
        acc = f" acc {line['train_acc']:.4f}" if "train_acc" in line else ""
        return f"{head}train loss {line['train_loss']:.4f}{acc} | {task.log_line(evs[0])}{speed}"
    loss = seeds.spread([m["train_loss"] for m in lines])
    score = seeds.spread([m[task.score] for m in lines])
    each = " ".join(f"{m[task.score]:.4f}" for m in lines)
    return (f"{head}train loss {loss['mean']:.4f} | {task.score} {score['mean']:.4f} +- {score['std']:.4f} over "
            f"{len(lines)} seeds ({each}){speed}")


def finish(run: Run, metrics: Path, info: dict | None = None) -> dict:
    """The final evaluation (``task.final``) of the weights the run keeps (the EMA's when it has
    one), saved in the checkpoint with the run's figures and ``info``; returns them: for several
    seeds, each seed's (``per_seed``), their means and their spread (``seeds.summarize``)."""
    wall_s = time.perf_counter() - run.started
    state, model, ranks, task = run.state, run.model, run.ranks, run.task
    rows = [m for m in runfolder.read_jsonl(metrics) if m["model"] == task.family] if ranks.main else []
    if run.ema is not None:  # the run keeps the averaged weights: they are tested, saved and measured
        model.load_state_dict(run.ema.module.state_dict())
    models, name, results = stack.members(model), task.score.removeprefix("test_"), []  # test_acc: final_acc
    for i, seed, t in run.per_seed():
        desc = f"[{task.family}] final evaluation" + (f", seed {seed} ({i + 1}/{len(run.seeds)})"
                                                      if len(run.seeds) > 1 else "")
        own = [m for m in rows if m.get("seed", seed) == seed]
        # the last epoch's line already tested the raw weights
        raw = {f"final_{k.removeprefix('test_')}": v for k, v in own[-1].items() if k.endswith("_no_ema")} \
            if own and run.ema is not None else {}
        with runtime.autocast(run.device, run.amp_dtype):
            final = t.final(models[i], desc)
        results.append(dict(
            family=task.family, seed=seed, params=count_params(models[i]),
            epochs=own[-1]["epoch"] if own else state.epoch, steps=state.global_step, **final,
            **{f"best_{name}": max(state.best[i], final[f"final_{name}"])}, train_seconds=state.train_seconds,
            images_per_s=run.images_per_s() / len(run.seeds),
            data_share=state.data_seconds / max(state.train_seconds, 1e-9), batch_per_rank=task.batch_size,
            world_size=ranks.world, precision=run.precision, wall_seconds=wall_s,
            compile_seconds=state.compile_seconds, **raw, **(info or {})))
    result = results[0]
    if len(results) > 1:  # the group's figures: the seeds' means, the machine's rate for all of them
        result = {**seeds.summarize(results, run.seeds), "images_per_s": run.images_per_s(),
                  "images_per_s_per_seed": run.images_per_s() / len(run.seeds)}
    if ranks.world > 1:  # DDP keeps the ranks' weights equal: checked, not assumed
        result["ranks_agree"] = runtime.ranks_agree(model, ranks)
    rng = runtime.all_rng_states(run.device, ranks, run.model)
    if ranks.main:
        run.save(rng, result)
    return result


def fit(run: Run, metrics: Path, stop: runtime.StopFlag, log, bar=None, info: dict | None = None) -> dict:
    """Train ``run`` to its end (from where its state is), evaluating after each epoch; returns
    ``finish``'s result. Raises Interrupted (after saving a checkpoint) or NonFiniteLoss (keeping
    the last one). Lines of ``metrics`` written after the checkpoint it resumes from are dropped,
    and an evaluation that checkpoint left due is done first."""
    state = run.state
    if run.ranks.main:  # the due evaluation's line, if it was written, is written again below
        step, family, due = state.global_step, run.task.family, bool(state.eval_at)
        runfolder.filter_jsonl(metrics, lambda m: m["model"] != family or m["step"] < step + (not due))
    run.model.train()
    try:
        if state.eval_at:
            evaluate_epoch(run, metrics, log)
        while run.progress() < 1.0:
            train_epoch(run, stop, bar)
            end_epoch(run, metrics, log)
    except Interrupted:  # every rank stops at the same step (check_stop), so all gather
        rng = runtime.all_rng_states(run.device, run.ranks, run.model)
        if run.ranks.main:
            run.save(rng)
        raise
    finally:
        if bar is not None:
            bar.close()
    return finish(run, metrics, info)
