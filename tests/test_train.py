"""train_cifar.py: main(config) end to end on tiny generated data, resume, interrupts, NaN, DDP."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_data import write_batches, write_folder, write_tar

import train_cifar as T
from vitattn.data import DataError, Normalize
from vitattn.train import RECIPES, Dist, evaluate, flops_per_image, get_lr, param_groups, save_atomic

ROOT = Path(__file__).resolve().parents[1]

SCORE_KEYS = ("model", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr")


def tiny(tmp_path: Path, data_dir, **kw) -> T.Config:
    base = dict(data_dir=str(data_dir), out=str(tmp_path / "run"), model="cnn", cnn_preset="cnn_cifar_small",
                epochs=3, batch_size=12, lr=0.05, progress=False, plots=False, context_images=8)
    return T.Config(**{**base, **kw})


def metrics(out) -> list[dict]:
    return [json.loads(s) for s in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def scores(rows: list[dict]) -> list[tuple]:
    """The parts of a metrics line that depend on the computation, not on the clock."""
    return [tuple(r[k] for k in SCORE_KEYS) for r in rows]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny batches run fastest on one thread, and two threads on a busy 2-core machine spin-wait
    (3x slower here); restore the setting for the other test modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("data") / "cifar")


# -- pure pieces -----------------------------------------------------------------------------
def test_lr_schedule_warms_up_then_decays_to_zero():
    for decay in ("cosine", "linear"):
        lrs = [get_lr(p / 100, 1.0, 0.1, decay) for p in range(101)]
        assert lrs[0] == 0 and lrs[10] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.0, abs=1e-12)
        assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))
        assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert get_lr(0.55, 2.0, 0.1, "cosine") == pytest.approx(1.0)  # half way through the cosine


def test_weight_decay_skips_biases_norms_and_position_tables():
    import vitattn

    m = vitattn.create_model("vit_cifar_small_patch4")
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "head.bias"} <= skipped
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0


def test_test_time_augmentation_views_and_weights():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    y = torch.randint(0, 4, (40,))
    norm = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    # a model that ignores its input: every kind of averaging gives the plain accuracy
    const = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4))
    with torch.no_grad():
        const[1].weight.zero_()
    r = evaluate(const, norm, x, y, batch_size=16, dd=Dist(), tta=True)
    assert r["acc"] == r["acc_tta"] == r["acc_tta_shift"]
    # a model that reads every pixel: the counts match the views written out by hand
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4)).eval()
    r = evaluate(model, norm, x, y, batch_size=16, tta=True)
    with torch.no_grad():
        xb = norm(x)
        prob = lambda v: model(v).softmax(1)  # noqa: E731
        pad = torch.nn.functional.pad(xb, (1, 1, 1, 1), mode="reflect")
        up_left, down_right = pad[..., :8, :8], pad[..., 2:, 2:]
        pair = (prob(xb) + prob(xb.flip(3))) / 2
        four = (prob(up_left) + prob(up_left.flip(3)) + prob(down_right) + prob(down_right.flip(3))) / 4
    assert r["acc"] == pytest.approx(float((model(xb).argmax(1) == y).float().mean()))
    assert r["acc_tta"] == pytest.approx(float((pair.argmax(1) == y).float().mean()))
    assert r["acc_tta_shift"] == pytest.approx(float(((pair + four).argmax(1) == y).float().mean()))
    assert len({r["acc"], r["acc_tta"], r["acc_tta_shift"]}) > 1  # the views do differ here


def test_flops_per_image_counts_every_matrix_product():
    import vitattn

    m = vitattn.create_model("vit_cifar_patch4")  # D 192, depth 6, mlp 2, 64 patches of 4x4 + class token
    d, t, depth = 192, 65, 6
    per_block = 2 * t * (3 * d * d + d * d + 2 * 2 * d * d) + 4 * t * t * d  # qkv, proj, mlp; QK^T and AV
    # the last block runs for the class token only: k, v of every token; q, attention, proj, mlp of one
    last_block = 2 * t * (2 * d * d) + 2 * (d * d + d * d + 2 * 2 * d * d) + 4 * t * d
    want = 2 * (3 * 4 * 4) * d * 64 + (depth - 1) * per_block + last_block + 2 * d * 10  # embed, blocks, head
    assert flops_per_image(m, (32, 32)) == want


def test_cli_help_and_preset_routing(capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--help"])
    assert e.value.code == 0 and "--time-budget" in capsys.readouterr().out
    cfg = T.parse_args(["--vit-preset", "vit_cifar_lee_patch4", "--cnn-preset", "cnn_cifar_small", "--bf16"])
    assert (cfg.vit_preset, cfg.cnn_preset, cfg.bf16) == ("vit_cifar_lee_patch4", "cnn_cifar_small", True)
    with pytest.raises(SystemExit):
        T.parse_args(["--vit-preset", "cnn_cifar"])  # a CNN preset where a ViT one belongs


# -- end to end ------------------------------------------------------------------------------
def test_both_models_train_and_every_output_appears(tmp_path, folder):
    cfg = tiny(tmp_path, folder, model="both", epochs=3, plots=True, lr=None,
               vit_preset="vit_cifar_small_patch4", batch_size=12)
    s = T.main(cfg)
    out = Path(cfg.out)
    assert s["status"] == "ok"
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.md", "curves.png", "context.png",
                 "erf.png", "attention.png", "checkpoints/vit.pt", "checkpoints/cnn.pt",
                 "checkpoints/vit.safetensors", "checkpoints/cnn.safetensors"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("*.tmp*"))
    rows = metrics(out)
    for fam in ("vit", "cnn"):
        mine = [r for r in rows if r["model"] == fam]
        assert [r["epoch"] for r in mine] == [1, 2, 3]
        assert mine[-1]["train_loss"] < mine[0]["train_loss"]  # it learns
        r = s["models"][fam]
        assert r["final_acc"] > 0.6 and r["params"] > 0 and r["flops_per_image"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["torch"] == torch.__version__ and "git_commit" in summary["environment"]
    mad = torch.tensor(summary["models"]["vit"]["attention_distance_px"])
    assert mad.shape == (6, 4) and (mad > 0).all() and (mad < 32 * math.sqrt(2)).all()
    assert len(summary["models"]["cnn"]["erf_radius_px"]) == 3
    ck = torch.load(out / "checkpoints" / "vit.pt", weights_only=True)  # no pickled code
    assert ck["state"]["done"] and ck["result"]["final_acc"] == s["models"]["vit"]["final_acc"]
    from safetensors.torch import load_file

    sd = load_file(str(out / "checkpoints" / "cnn.safetensors"))
    torch.testing.assert_close(sd["head.weight"], s["modules"]["cnn"].head.weight)
    report = (out / "report.md").read_text()
    assert "| ViT |" in report and "| CNN |" in report and "![" in report


@pytest.mark.parametrize("layout", ["tar", "batches"])
def test_the_other_layouts_train(tmp_path, layout):
    src = write_tar(tmp_path / "c.tar.gz") if layout == "tar" else write_batches(tmp_path / "b")
    s = T.main(tiny(tmp_path, src))
    rows = metrics(s["out"])
    assert s["status"] == "ok" and len(rows) == 3 and rows[-1]["train_loss"] < rows[0]["train_loss"]


def test_a_whitening_stem_is_set_from_the_training_images(tmp_path, folder):
    import vitattn

    cfg = tiny(tmp_path, folder, cnn_preset="cnn_cifar_whiten", epochs=2)
    s = T.main(cfg)
    rows = metrics(s["out"])
    assert s["status"] == "ok" and rows[-1]["train_loss"] < rows[0]["train_loss"]
    ds = T.load_dataset(cfg)
    want = vitattn.whitening_filters(ds.norm(ds.data.train_x[:5000]))
    ck = torch.load(Path(s["out"]) / "checkpoints" / "cnn.pt", weights_only=True)
    torch.testing.assert_close(ck["model"]["stem.0.weight"], want)  # set from data, then frozen
    assert ck["model"]["stem.0.bias"].abs().sum() > 0  # the bias learns


def test_long_range_reports_accuracy_against_distance(tmp_path):
    s = T.main(tiny(tmp_path, "unused", dataset="long-range", long_range_train=96, long_range_test=64, epochs=1,
                    model="both", vit_preset="vit_cifar_small_patch4"))
    for fam in ("vit", "cnn"):
        b = s["models"][fam]["accuracy_by_distance"]
        assert sum(b["count"]) == 64 and len(b["accuracy"]) == len(b["edges"]) - 1
    assert "Accuracy against mark distance" in (Path(s["out"]) / "report.md").read_text()


# -- nothing lost ----------------------------------------------------------------------------
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, folder, monkeypatch):
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3))
    calls = {"n": 0}
    cross_entropy = T.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):  # 3 training steps + 1 evaluation batch per epoch
        calls["n"] += 1
        if calls["n"] == 10:  # the second step of epoch 3 (0-based epoch 2)
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(T.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3)
    assert T.main(cfg)["status"] == "interrupted"
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert (ck["state"]["epoch"], ck["state"]["step_in_epoch"]) == (2, 2)  # stops before the next step
    monkeypatch.setattr(T.F, "cross_entropy", cross_entropy)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert resumed["status"] == "ok"
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    assert resumed["models"]["cnn"]["final_acc"] == ref["models"]["cnn"]["final_acc"]
    for k, v in ref["modules"]["cnn"].state_dict().items():
        assert torch.equal(v, resumed["modules"]["cnn"].state_dict()[k]), k


def test_ctrl_c_on_the_command_line_saves_and_exits_cleanly(tmp_path, folder):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_cifar.py"), "--data-dir", str(folder), "--out", str(out),
           "--model", "cnn", "--cnn-preset", "cnn_cifar_small", "--epochs", "100000", "--batch-size", "12",
           "--no-progress", "--no-plots"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, text
    assert "--resume" in text and "Traceback" not in text
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
    save_atomic(ck, ck_path)
    good = ck_path.read_bytes()
    s = T.main(T.Config(resume=cfg.out, progress=False))
    assert s["status"] == "nan"
    assert "loss is nan" in capsys.readouterr().out.lower()
    assert ck_path.read_bytes() == good


def test_missing_data_says_how_to_supply_it_and_writes_nothing(tmp_path, capsys):
    cfg = tiny(tmp_path, tmp_path / "nowhere")
    with pytest.raises(DataError, match="--dataset long-range"):
        T.main(cfg)
    assert not Path(cfg.out).exists()
    assert T.cli(["--data-dir", str(tmp_path / "nowhere"), "--out", cfg.out, "--no-progress"]) == 2
    assert "cifar-10-batches-py" in capsys.readouterr().err and not Path(cfg.out).exists()


def test_a_corrupt_image_is_named(tmp_path):
    root = write_folder(tmp_path / "f", n_train=2, n_test=1)
    (root / "test" / "frog" / "0002.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="0002.png"):
        T.main(tiny(tmp_path, root))


# -- DistributedDataParallel -----------------------------------------------------------------
def _ddp_worker(rank: int, world: int, port: int, cfg: T.Config, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    s = T.main(cfg)
    torch.save({"state": s["modules"]["cnn"].state_dict(), "status": s["status"]}, f"{out}/rank{rank}.pt")


def test_two_process_gloo_run_ends_with_equal_weights(tmp_path, folder):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tiny(tmp_path, folder, epochs=2, batch_size=12)
    mp.spawn(_ddp_worker, args=(2, port, cfg, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert a["status"] == b["status"] == "ok"
    for k, v in a["state"].items():  # DDP also broadcasts rank 0's BN statistics each step
        assert torch.equal(v, b["state"][k]), k
    rows = metrics(cfg.out)
    assert [r["epoch"] for r in rows] == [1, 2]  # rank 0 alone writes
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["models"]["cnn"]["batch_per_rank"] == 6


def test_configs_round_trip_through_json(tmp_path, folder):
    cfg = tiny(tmp_path, folder, time_budget=0.5, bf16=True)
    assert T.Config(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert replace(cfg, model="vit").models() == ["vit"]


def test_long_range_recipe_takes_small_batches_and_overrides_still_win():
    cnn = T.Config(dataset="long-range").recipe("cnn")
    assert (cnn.batch_size, cnn.lr) == (64, 0.1)
    assert T.Config(dataset="long-range", batch_size=128).recipe("cnn").batch_size == 128
    assert T.Config().recipe("cnn").batch_size == RECIPES["cnn"].batch_size  # CIFAR-10 unchanged
