"""vitattn.training.loop: resume equals an uninterrupted run, crashes, stop signals, NaN, compile time, torchrun."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import metrics, scores, tiny

import train_cifar as T
from vitattn.tasks import classify
from vitattn.training import checkpoint, runtime
from vitattn.training.checkpoint import save_atomic
from vitattn.training.run import TrainState

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


SMALL_VIT = dict(model="vit", vit_kwargs='{"depth": 2}')  # the recipe's ViT, two blocks: the property, faster


@pytest.mark.parametrize("family, kw, at", [("cnn", {}, 10), ("vit", dict(SMALL_VIT, optimizer="muon", lr=1e-3), 10),
                                            ("cnn", dict(model_ema_decay=0.5, bias_lr_scale=4.0), 12),
                                            ("cnn", dict(padding_mode="reflect", momentum=0.85,
                                                         warmup_lr=0.01, min_lr=0.01), 10),
                                            ("vit", dict(SMALL_VIT, amp=True, amp_dtype="float16"), 10),
                                            ("cnn", dict(amp=True, amp_dtype="bfloat16"), 10)],
                         ids=["cnn-sgd", "vit-muon", "cnn-ema", "cnn-schedule", "vit-fp16", "cnn-bf16"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, folder, monkeypatch, family, kw, at):
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3, **kw))
    calls = {"n": 0}
    cross_entropy = classify.task.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):  # 3 training steps + 1 evaluation batch per epoch (2 with an EMA)
        calls["n"] += 1
        if calls["n"] == at:  # the second step of epoch 3 (0-based epoch 2)
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.task.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3, **kw)
    assert T.main(cfg)["status"] == "interrupted"
    ck = torch.load(Path(cfg.out) / "checkpoints" / f"{family}.pt", weights_only=True)
    assert (ck["state"]["epoch"], ck["state"]["step_in_epoch"]) == (2, 2)  # stops before the next step
    assert ("scaler" in ck) == (kw.get("amp_dtype") == "float16")  # fp16's loss scale resumes too
    monkeypatch.setattr(classify.task.F, "cross_entropy", cross_entropy)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert resumed["status"] == "ok"
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    assert resumed["models"][family]["final_acc"] == ref["models"][family]["final_acc"]
    for k, v in ref["modules"][family].state_dict().items():
        assert torch.equal(v, resumed["modules"][family].state_dict()[k]), k


@pytest.mark.parametrize("after_line", [False, True], ids=["during-the-evaluation", "after-its-line"])
def test_a_crash_at_an_epoch_s_evaluation_loses_no_line_and_writes_none_twice(tmp_path, folder, monkeypatch,
                                                                              after_line):
    """Each epoch is checkpointed before it is evaluated. A crash during the evaluation, or after
    its metrics line but before the checkpoint that follows, resumes to the evaluation: every
    line once, the metrics and weights of a run that never stopped."""
    from vitattn.training import loop, runfolder

    ref = T.main(tiny(tmp_path / "ref", folder, epochs=3))
    cfg = tiny(tmp_path / "run", folder, epochs=3)
    evaluate, append = classify.ClassifyTask.evaluate, runfolder.append_jsonl
    calls = {"n": 0}

    def crash_in_epoch_2(self, model):
        calls["n"] += 1
        if calls["n"] == 2 and not after_line:
            raise RuntimeError("the machine went away")
        return evaluate(self, model)

    def crash_after_epoch_2_line(path, row):
        append(path, row)
        if row.get("epoch") == 2.0:
            raise RuntimeError("the machine went away")

    monkeypatch.setattr(classify.ClassifyTask, "evaluate", crash_in_epoch_2)
    monkeypatch.setattr(loop.runfolder, "append_jsonl", crash_after_epoch_2_line if after_line else append)
    with pytest.raises(RuntimeError, match="went away"):
        T.main(cfg)
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert ck["state"]["eval_at"] == 2.0 and ck["state"]["epoch"] == 2
    monkeypatch.setattr(classify.ClassifyTask, "evaluate", evaluate)
    monkeypatch.setattr(loop.runfolder, "append_jsonl", append)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert [r["epoch"] for r in metrics(cfg.out)] == [1.0, 2.0, 3.0]
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    for k, v in ref["modules"]["cnn"].state_dict().items():
        assert torch.equal(v, resumed["modules"]["cnn"].state_dict()[k]), k


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_on_the_command_line_saves_and_exits_cleanly(tmp_path, folder, sig, code):
    """Ctrl-C, and SIGTERM as kill, schedulers and containers send it: a checkpoint, 128 + signal."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--out", str(out),
           "--model", "cnn", "--cnn-preset", "cnn_quick", "--epochs", "100000", "--batch-size", "12",
           "--no-progress", "--no-plots"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, text
    assert signal.Signals(sig).name in text and "--resume" in text and "Traceback" not in text
    ck = torch.load(out / "checkpoints" / "cnn.pt", weights_only=True)
    assert not ck["state"]["done"] and ck["state"]["global_step"] >= 3


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, folder, capsys):
    cfg = tiny(tmp_path, folder, epochs=1)
    T.main(cfg)
    ck_path = Path(cfg.out) / "checkpoints" / "cnn.pt"
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    # Continue for another epoch at an absurd learning rate: the loss blows up.
    (Path(cfg.out) / "config.json").write_text(json.dumps({**saved, "epochs": 2, "lr": 1e30}))
    ck = torch.load(ck_path, weights_only=True)
    ck["state"]["done"] = False
    ck["config"].update(epochs=2, lr=1e30)  # the checkpoint says the same (an edit of one alone is refused)
    save_atomic(ck, ck_path)
    good = ck_path.read_bytes()
    s = T.main(T.Config(resume=cfg.out, progress=False))
    assert s["status"] == "nan"
    assert "loss is nan" in capsys.readouterr().out.lower()
    assert ck_path.read_bytes() == good


def _ddp_worker(rank: int, world: int, port: int, cfg: T.Config, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    s = T.main(cfg)
    cnn = s["modules"]["cnn"]
    states = [m.state_dict() for m in (cnn if isinstance(cnn, list) else [cnn])]
    torch.save({"states": states, "status": s["status"]}, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("seeds", [None, "0,1"], ids=["one-seed", "two-seeds"])
def test_two_process_gloo_run_ends_with_equal_weights(tmp_path, folder, seeds):
    """torchrun splits each seed's batch over the ranks (a group: every rank steps every seed)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tiny(tmp_path, folder, epochs=2, batch_size=12, seeds=seeds)
    mp.spawn(_ddp_worker, args=(2, port, cfg, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert a["status"] == b["status"] == "ok" and len(a["states"]) == (2 if seeds else 1)
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert len(ck["rng"]) == 2 and not torch.equal(ck["rng"][0]["cpu"], ck["rng"][1]["cpu"])  # each rank's own
    for sa, sb in zip(a["states"], b["states"]):
        for k, v in sa.items():  # DDP also broadcasts rank 0's BN statistics each step
            assert torch.equal(v, sb[k]), k
    rows = metrics(cfg.out)
    assert [r["epoch"] for r in rows] == ([1, 1, 2, 2] if seeds else [1, 2])  # rank 0 alone writes
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["models"]["cnn"]["batch_per_rank"] == 6
    assert summary["models"]["cnn"]["ranks_agree"] is True


@pytest.mark.parametrize("kw, at", [(dict(model_ema_decay=0.5, bias_lr_scale=4.0), 12),
                                   (dict(SMALL_VIT, optimizer="muon", lr=1e-3, seeds="0,1"), 19)],  # a loss per seed
                         ids=["cnn-sgd-ema", "vit-muon-group"])
def test_a_compiled_run_trains_as_the_eager_run_and_resumes(tmp_path, folder, monkeypatch, kw, at):
    """--compile (the model, and the update after its backward pass at a tensor lr) takes the eager
    run's steps, through a Ctrl-C and a resume. Dynamo's graphs run eagerly here (backend 'eager':
    seconds, where inductor takes minutes on 2 cores); inductor's update is held to the eager one
    in test_optim.py, its model in tests/model/test_export.py."""
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3, **kw))
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **_: compile_(fn, backend="eager"))
    calls, cross_entropy = {"n": 0}, classify.task.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at:
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.task.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3, compile=True, **kw)
    assert T.main(cfg)["status"] == "interrupted"
    monkeypatch.setattr(classify.task.F, "cross_entropy", cross_entropy)
    ck = torch.load(Path(cfg.out) / "checkpoints" / f"{kw.get('model', 'cnn')}.pt", weights_only=True)
    assert ck["state"]["step_in_epoch"] == 2 and ck["config"]["compile"]
    groups = ck["optimizer"].get("chain", [ck["optimizer"]])[0]["param_groups"]
    assert torch.is_tensor(groups[0]["lr"])  # stepped by the compiled update
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert resumed["status"] == "ok"
    want, got = metrics(ref["out"]), metrics(cfg.out)
    assert [(r["seed"] if "seed" in r else 0, r["step"]) for r in got] == \
        [(r["seed"] if "seed" in r else 0, r["step"]) for r in want]
    for a, b in zip(want, got):
        for k in ("train_loss", "test_loss", "lr"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a, b)


def test_compile_time_is_reported_apart_and_kept_off_the_budget(tmp_path, folder, monkeypatch):
    """--compile's first step compiles (minutes on a GPU for a large model): it is not training."""
    class SlowFirstCall(torch.nn.Module):
        def __init__(self, module, **_):
            super().__init__()
            self.module, self.calls = module, 0

        def forward(self, *args):  # the model's forward, and the update after the backward pass
            self.calls += 1
            if self.calls == 1:
                time.sleep(1.5)  # what compiling costs, in miniature
            return self.module(*args)

    monkeypatch.setattr(runtime.torch, "compile", SlowFirstCall)
    s = T.main(tiny(tmp_path, folder, epochs=1, compile=True))
    r = s["models"]["cnn"]
    assert r["compile_seconds"] >= 1.5 and r["train_seconds"] < 1.5


def test_a_run_killed_mid_epoch_resumes_from_its_last_complete_checkpoint(tmp_path, folder):
    """SIGKILL (no handler runs) while training: --resume continues from the last checkpoint and
    ends where an uninterrupted run ends, each epoch logged once."""
    epochs = 50  # enough left after the third epoch to kill it mid-run, however slow its start
    ref = T.main(tiny(tmp_path / "ref", folder, epochs=epochs))
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--out", str(out),
           "--model", "cnn", "--cnn-preset", "cnn_quick", "--epochs", str(epochs), "--batch-size", "12",
           "--lr", "0.05", "--no-progress", "--no-plots", "--context-images", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    ck = out / "checkpoints" / "cnn.pt"
    deadline = time.time() + 120
    while not (ck.exists() and (out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
        assert time.time() < deadline and proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    state = torch.load(ck, weights_only=True)["state"]
    assert not state["done"] and state["epoch"] < epochs
    resumed = subprocess.run([sys.executable, str(ROOT / "train_cifar.py"), "--resume", str(out), "--no-progress"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at epoch" in resumed.stdout
    assert scores(metrics(out)) == scores(metrics(ref["out"]))
    assert json.loads((out / "summary.json").read_text())["models"]["cnn"]["final_acc"] == \
        ref["models"]["cnn"]["final_acc"]


class Killed(BaseException):
    """The process dying at this point: no handler of ours catches it (a BaseException, not Ctrl-C)."""


def kill_on_call(monkeypatch, owner, name: str, nth: int, partial_write: bool = False):
    """Make ``owner.name``'s ``nth`` call die (after writing a cut file, for a writer); returns the
    function that puts it back."""
    real, calls = getattr(owner, name), {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            if partial_write:  # torch.save(obj, path): half a file where the write was going
                Path(args[1]).write_bytes(b"PK\x03\x04 cut short")
            raise Killed(f"{owner.__name__}.{name} call {nth}")
        return real(*args, **kwargs)

    setattr(owner, name, dying)
    return lambda: setattr(owner, name, real)


def _phases():
    from vitattn.tasks.classify import report
    from vitattn.training import checkpoint

    return {"before the first checkpoint": (classify.task.F, "cross_entropy", 3, False),
            "inside a checkpoint write": (checkpoint.torch, "save", 2, True),
            "in an evaluation": (classify.task, "evaluate", 2, False),
            "after the last checkpoint, in the final evaluation": (classify.task, "evaluate", 4, False),
            "in the report and plots": (report, "write_plots", 1, False)}


@pytest.mark.parametrize("phase", list(_phases()))
def test_a_kill_at_any_phase_then_resume_ends_as_an_uninterrupted_run(tmp_path, folder, monkeypatch, phase):
    """The process dies (no handler runs) at each phase of a run; --resume then gives the metrics,
    the final weights and the TensorBoard curves of a run never stopped, no line and no step twice."""
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    from safetensors.torch import load_file

    def curves(out: Path) -> dict:
        """Each tag's (step, value) as the event files hold them, files in the order written, with
        only the purges they ask for (a session's start): out-of-order steps are not forgiven, as
        TensorBoard's Rust reader does not forgive them."""
        tags: dict[str, list] = {}
        def written(f: Path) -> tuple[int, int]:  # events.out.tfevents.<seconds>.<host>.<pid>.<writer number>
            return int(f.name.split(".")[3]), int(f.name.rsplit(".", 1)[1])  # (not by name: 10 sorts before 9)

        for f in sorted((out / "tensorboard" / "cnn").glob("events.out.tfevents.*"), key=written):
            for event in loader.EventFileLoader(str(f)).Load():
                if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                    tags = {t: [p for p in pts if p[0] < event.step] for t, pts in tags.items()}
                for v in event.summary.value:
                    value = v.simple_value if v.HasField("simple_value") else float(v.tensor.float_val[0])
                    tags.setdefault(v.tag, []).append((event.step, round(value, 5)))
        return tags

    from vitattn.training import loop

    monkeypatch.setattr(loop, "READ_EVERY", 2)  # running figures on the board between checkpoints, too
    kw = dict(epochs=3, tensorboard=True, model_ema_decay=0.5, cnn_kwargs='{"drop_rate": 0.3}')
    ref = T.main(tiny(tmp_path / "ref", folder, **kw))
    owner, name, nth, partial = _phases()[phase]
    restore = kill_on_call(monkeypatch, owner, name, nth, partial)
    cfg = tiny(tmp_path / "run", folder, **kw, plots=phase == "in the report and plots")
    try:
        with pytest.raises(Killed):
            T.main(cfg)
    finally:
        restore()
    T.main(T.Config(resume=cfg.out, progress=False))
    out, want = Path(cfg.out), Path(ref["out"])
    assert scores(metrics(out)) == scores(metrics(want))
    a, b = (load_file(str(f / "checkpoints" / "cnn.safetensors")) for f in (out, want))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got, expected = curves(out), curves(want)
    assert sorted(got) == sorted(expected)
    for tag in expected:
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag  # each step once, none missing
        if not tag.endswith(("seconds", "images_per_s", "data_share")):  # the clock's figures
            assert got[tag] == expected[tag], tag


def test_a_finished_run_with_an_ema_resumed_through_loop_fit_keeps_its_weights(tmp_path, folder):
    """loop.fit on a finished run's checkpoint (no script's early return in between) evaluates the
    kept weights again and leaves them as they were: the EMA's, not its first copy."""
    from vitattn.training import loop

    cfg = tiny(tmp_path, folder, epochs=2, model_ema_decay=0.5)
    done = T.main(cfg)
    path = Path(cfg.out) / "checkpoints" / "cnn.pt"
    cpu = torch.device("cpu")
    ds = classify.load_dataset(cfg)
    model = classify.build_model("cnn", cfg, ds, cpu)
    resumed = checkpoint.resume_checkpoint(path, model, "cnn", TrainState)
    run = classify.classification_run("cnn", model, cfg, ds, cpu, runtime.Dist(), path, resumed)
    with runtime.StopFlag() as stop:
        result = loop.fit(run, Path(cfg.out) / "metrics.jsonl", stop, lambda *a: None)
    for k, v in done["modules"]["cnn"].state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert result["final_acc"] == done["models"]["cnn"]["final_acc"]
    assert len(metrics(cfg.out)) == 2  # nothing trained or logged again
