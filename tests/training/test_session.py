"""The run lifecycle both training scripts share (vitattn.training.session), in process and fast:
nothing is written before ``begin``, a stop or a NaN becomes a status with the line that resumes,
a finished run is not trained again, and a resumed run takes the options it was started with."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vitattn.tasks.classify import Config
from vitattn.training import loop, session
from vitattn.training.errors import Interrupted, NonFiniteLoss, UsageError


def config(tmp_path, **over) -> Config:
    return Config(**{"dataset": "long-range", "out": str(tmp_path / "run"), "progress": False, "device": "cpu",
                     **over})


def fake_run(done: bool = False):
    """What ``Session.fit`` reads of a ``run.Run`` before handing it to ``loop.fit``."""
    state = SimpleNamespace(done=done, epoch=2, step_in_epoch=3, train_seconds=12.0, global_step=7, eval_at=0.0)
    return SimpleNamespace(task=SimpleNamespace(family="vit"), state=state, total_steps=10, budget_s=None,
                           seeds=(0,), board=None)


def test_nothing_is_written_before_begin(tmp_path):
    with session.open_session(config(tmp_path), "train_cifar.py") as s:
        assert not (tmp_path / "run").exists() and s.stop is None
        assert s.checkpoint("vit", None, ()) is None  # no checkpoint yet: nothing read, nothing checked
        s.begin()
        saved = json.loads((tmp_path / "run" / "config.json").read_text())
        assert saved["out"] == str(tmp_path / "run") and saved["dataset"] == "long-range"
        assert s.stop is not None and not s.stop.set
    assert s.status == "ok"


@pytest.mark.parametrize("error, status", [(Interrupted(), "interrupted"), (NonFiniteLoss("loss is nan"), "nan")])
def test_a_stop_becomes_a_status_with_the_line_that_resumes(tmp_path, monkeypatch, capsys, error, status):
    def fit(*a, **k):
        raise error

    monkeypatch.setattr(loop, "fit", fit)
    with session.open_session(config(tmp_path), "train_cifar.py") as s:
        s.begin()
        assert s.fit(fake_run(), None) is None
    out = capsys.readouterr().out
    assert s.status == status
    if status == "interrupted":
        assert f"continue with: python train_cifar.py --resume {tmp_path / 'run'}" in out
    else:
        assert "loss is nan" in out


def test_a_finished_run_returns_its_result_untrained(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "fit", lambda *a, **k: pytest.fail("a finished run was trained again"))
    with session.open_session(config(tmp_path), "train_cifar.py") as s:
        s.begin()
        assert s.fit(fake_run(done=True), {"result": {"final_acc": 0.9}}) == {"final_acc": 0.9}
    assert "[vit] already finished" in capsys.readouterr().out and s.status == "ok"


def test_a_resumed_session_takes_the_options_it_was_started_with(tmp_path, monkeypatch, capsys):
    with session.open_session(config(tmp_path, seed=5), "train_cifar.py") as s:
        s.begin()
    monkeypatch.setattr(loop, "fit", lambda *a, **k: {"final_acc": 0.5})
    resumed = config(tmp_path, out=None, resume=str(tmp_path / "run"))
    with session.open_session(resumed, "train_cifar.py") as s:
        assert s.cfg.seed == 5 and s.cfg.resume == str(tmp_path / "run")
        s.begin()  # a resumed folder is not written again
        assert s.fit(fake_run(), {"result": {}}) == {"final_acc": 0.5}
    assert "[vit] resuming at epoch 2 step 3 (12 s)" in capsys.readouterr().out


def test_a_missing_run_folder_is_refused_before_anything(tmp_path):
    with pytest.raises(UsageError, match="no such run folder"):
        with session.open_session(config(tmp_path, out=None, resume=str(tmp_path / "nowhere")), "train_cifar.py"):
            pytest.fail("the session opened")
