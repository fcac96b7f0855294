"""vitattn.training.seeds: several seeds trained at once equal their solo runs; their spread; bad --seeds."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import metrics, run_train_cifar, scores, tiny

import train_cifar as T
import vitattn
from vitattn.tasks import classify
from vitattn.training import optim, seeds
from vitattn.training import stack as seedstack
from vitattn.training.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_VIT = dict(model="vit", vit_kwargs='{"depth": 2}')


@pytest.mark.parametrize("text, expect", [("0,1,2,3", (0, 1, 2, 3)), ("0-7", tuple(range(8))), ("5", (5,)),
                                          ("0-2, 8", (0, 1, 2, 8)), ("3,1", (3, 1))])
def test_seeds_are_read_as_lists_and_ranges(text, expect):
    assert seeds.parse_seeds(text) == expect


@pytest.mark.parametrize("text, message", [("", "empty list"), (" , ", "empty list"), ("0,1,1", "more than once"),
                                           ("0-3,2", "more than once"), ("-1", ">= 0"), ("2--1", ">= 0"),
                                           ("7-3", "runs backwards"), ("a", "whole numbers"), ("1.5", "whole numbers"),
                                           (str(2**32), "below 2\\*\\*32"), ("0-4294967295", "at most 256"),
                                           ("0-99999", "100000 seeds"), ("0-200,300-400", "302 seeds")])
def test_bad_seeds_are_refused_in_one_line(text, message):
    with pytest.raises(UsageError, match=message):
        seeds.parse_seeds(text)


def test_a_long_list_of_seeds_is_read_in_linear_time():
    import time

    text = ",".join(map(str, range(0, 2 * seeds.MAX_GROUP, 2)))
    t = time.perf_counter()
    assert len(seeds.parse_seeds(text)) == seeds.MAX_GROUP
    twice = ",".join(map(str, range(0, 2 * seeds.MAX_GROUP - 2, 2))) + ",0"
    with pytest.raises(UsageError, match="0 more than once"):
        seeds.parse_seeds(twice)
    assert time.perf_counter() - t < 1.0  # quadratic counting took seconds at this length


def test_rank_streams_never_collide():
    from vitattn.training.runtime import stream_seed

    pairs = [(s, r) for s in (0, 1, 16, 17, 2**32 - 1) for r in (0, 1, 2, 7, 1023)]
    made = [stream_seed(s, r) for s, r in pairs]
    assert len(set(made)) == len(made) and all(0 <= m < 2**64 for m in made)
    assert stream_seed(5, 0) == 5  # a single process keeps its seed's stream


def test_seed_and_seeds_together_are_refused_and_one_seed_is_a_solo_run(tmp_path, folder, capsys):
    assert tiny(tmp_path, folder, seeds="3").seed_list() == (3,)
    assert tiny(tmp_path, folder, seeds="3").seeds is None  # --seeds 3 is --seed 3
    assert tiny(tmp_path, folder, seeds="0-3").seeds == "0-3"
    with pytest.raises(UsageError, match="together"):
        tiny(tmp_path, folder, seed=2, seeds="0,1")
    for argv, message in ((["--seed", "0", "--seeds", "1,2"], "together"), (["--seeds", "1,1"], "more than once"),
                          (["--seeds", "4-2"], "backwards")):
        with pytest.raises(SystemExit) as e:
            T.command_line(["--data-dir", str(folder), "--out", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def _models(name: str, n: int) -> list[torch.nn.Module]:
    out = []
    for k in range(n):
        torch.manual_seed(k)
        out.append(vitattn.create_model(name, num_classes=3))
    return out


@pytest.mark.parametrize("mode", seedstack.MODES)
@pytest.mark.parametrize("name", ["vit_quick", "vit_longrange", "cnn_quick"])
def test_a_stack_computes_what_each_model_computes_forward_and_backward(name, mode):
    models = _models(name, 3)
    stack = seedstack.SeedStack(models, (0, 1, 2), mode)
    x = torch.randn(3, 4, 3, 32, 32)
    out = stack(x)
    ref = [m(xi) for m, xi in zip(models, x)]
    torch.testing.assert_close(out, torch.stack(ref), atol=1e-5, rtol=1e-4)
    y = torch.tensor([0, 1, 2, 0])
    torch.stack([F.cross_entropy(o, y) for o in out]).sum().backward()
    for r in ref:
        F.cross_entropy(r, y).backward()
    for name_, p in stack.module.named_parameters():
        for s, m in enumerate(models):
            torch.testing.assert_close(p.grad[s], m.get_parameter(name_).grad, atol=1e-5, rtol=1e-4)
    for name_, b in stack.module.named_buffers():  # BatchNorm statistics moved per seed, as each model's
        for s, m in enumerate(models):
            torch.testing.assert_close(b[s], m.get_buffer(name_), atol=1e-6, rtol=1e-5)
    back = stack.unstack(2)
    assert type(back) is type(models[2]) and back.training
    for k, v in models[2].state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_a_stack_keeps_each_models_memory_layout_and_refuses_unlike_models():
    models = [m.to(memory_format=torch.channels_last) for m in _models("cnn_quick", 2)]
    stack = seedstack.SeedStack(models, (0, 1))
    w = dict(stack.module.named_parameters())["stages.0.0.0.weight"]
    assert w[1].is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="same parameters"):
        seedstack.SeedStack([models[0], _models("vit_quick", 1)[0]], (0, 1))
    with pytest.raises(ValueError, match="inputs of 2 seeds"):
        stack(torch.randn(3, 1, 3, 32, 32))


@pytest.mark.parametrize("opt", optim.OPTIMIZERS)
def test_one_optimiser_over_the_stack_steps_each_seed_as_its_own_would(opt):
    models = _models("vit_quick", 2)
    stack = seedstack.SeedStack(models, (0, 1))
    kw = dict(opt=opt, lr=1e-3, weight_decay=0.05, momentum=0.9)
    joint = optim.create_optimizer(stack.module, **kw, lead=1)
    own = [optim.create_optimizer(m, **kw) for m in models]
    x, y = torch.randn(2, 4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        joint.zero_grad()
        torch.stack([F.cross_entropy(o, y) for o in stack(x)]).sum().backward()
        optim.clip_grad_norm_(stack.parameters(), 0.5, lead=1)
        joint.step()
        for m, o, xi in zip(models, own, x):
            o.zero_grad()
            F.cross_entropy(m(xi), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
    assert [len(g["params"]) for g in joint.param_groups] == [len(g["params"]) for g in own[0].param_groups]
    for name, p in stack.module.named_parameters():
        for s, m in enumerate(models):
            # AVX-512 kernels round the stacked products differently: 1e-5 is 1% of one step at lr 1e-3, far
            # below what a seed stepped with another seed's optimiser state would move
            torch.testing.assert_close(p[s], m.get_parameter(name), atol=1e-5, rtol=1e-4)


def test_the_spread_of_each_figure_and_the_means_a_summary_shows():
    assert seeds.spread([0.8, 0.9]) == pytest.approx({"mean": 0.85, "std": 0.0707107, "min": 0.8, "max": 0.9,
                                                      "n": 2}, rel=1e-5)
    assert seeds.spread([0.5])["std"] == 0.0
    per = [{"seed": 0, "final_acc": 0.8, "erf_radius_px": [1.0, 3.0], "preset": "p", "params": 5},
           {"seed": 1, "final_acc": 0.6, "erf_radius_px": [3.0, 5.0], "preset": "p", "params": 5}]
    s = seeds.summarize(per, (0, 1))
    assert "seed" not in s and "seed" not in s["spread"]  # a label, not a figure: no seed 0.5
    assert s["final_acc"] == pytest.approx(0.7) and s["erf_radius_px"] == pytest.approx([2.0, 4.0])
    assert s["spread"]["erf_radius_px.1"]["max"] == 5.0 and s["preset"] == "p" and s["params"] == 5
    assert s["per_seed"] == per and s["seeds"] == [0, 1]
    assert seeds.seeds_label((0, 1, 2, 3, 8)) == "0-3,8" and seeds.seeds_label((2, 5)) == "2,5"


def _same_lines(solo: list[dict], group: list[dict], rel: float = 1e-5) -> None:
    """Metrics line for metrics line: the losses to ``rel`` (the stacked and the solo products
    round apart: 1e-5 in fp32; bf16's 2^-8 steps, a tenth of that compounded over steps) and
    every image counted alike, in training and in the test."""
    assert [(r["model"], r["epoch"], r["step"]) for r in solo] == [(r["model"], r["epoch"], r["step"]) for r in group]
    for a, b in zip(solo, group):
        for k in ("train_loss", "test_loss"):
            assert b[k] == pytest.approx(a[k], rel=rel), (k, a, b)
        for k in ("train_acc", "test_acc"):
            assert b[k] == a[k], (k, a, b)


# every stochastic layer a ViT has: dropout on positions, attention weights, projections and the head, drop path
STOCHASTIC_VIT = dict(model="vit", vit_kwargs=json.dumps(dict(depth=2, drop_path_rate=0.3, drop_rate=0.2,
                                                              pos_drop_rate=0.1, proj_drop_rate=0.1,
                                                              attn_drop_rate=0.1)))


@pytest.mark.parametrize("kw", [dict(model="cnn"), dict(SMALL_VIT, optimizer="muon", lr=1e-3, model_ema_decay=0.5),
                                dict(model="cnn", seed_batching="vmap"),
                                dict(SMALL_VIT, amp=True, amp_dtype="bfloat16"),
                                dict(STOCHASTIC_VIT, model_ema_decay=0.5, cutout=8),
                                dict(model="cnn", cnn_kwargs='{"drop_rate": 0.5}')],
                         ids=["cnn", "vit-muon-ema", "cnn-vmap", "vit-bf16", "vit-stochastic-ema-cutout",
                              "cnn-dropout"])
def test_each_seed_of_a_group_trains_as_its_solo_run(tmp_path, folder, kw):
    group = T.main(tiny(tmp_path / "g", folder, epochs=2, seeds="0,1", **kw))
    family = kw["model"]
    rows = metrics(group["out"])
    for k in (0, 1):
        solo = T.main(tiny(tmp_path / f"s{k}", folder, epochs=2, seed=k, **kw))
        mine = [r for r in rows if r["seed"] == k]
        # first epoch's loss: 1e-5 in fp32; bf16 rounds at 2^-8, and where a CPU multiplies bf16 natively the
        # stacked and solo products take different kernels
        first = 1e-5 if "amp" not in kw else 1e-3
        assert scores(mine)[0][3] == pytest.approx(scores(metrics(solo["out"]))[0][3], rel=first)
        _same_lines(metrics(solo["out"]), mine, rel=1e-5 if "amp" not in kw else 2e-2)
        own = group["models"][family]["per_seed"][k]
        assert own["seed"] == k and own["final_acc"] == solo["models"][family]["final_acc"]
        w = Path(group["out"]) / classify.weights_file(family, k)
        assert w.is_file()
    r = group["models"][family]
    accs = [p["final_acc"] for p in r["per_seed"]]
    assert r["final_acc"] == pytest.approx(sum(accs) / 2) and r["spread"]["final_acc"]["max"] == max(accs)
    assert r["images_per_s"] == pytest.approx(2 * r["images_per_s_per_seed"])
    assert "erf_radius_px" in r["per_seed"][1] and r["spread"]["erf_radius_px.0"]["n"] == 2
    report = (Path(group["out"]) / "report.md").read_text()
    assert "mean ± std over 2 seeds" in report and "seed 1" in report


def test_a_long_range_group_draws_each_seeds_own_data(tmp_path):
    kw = dict(dataset="long-range", long_range_train=64, long_range_test=32, model="vit", epochs=1, batch_size=16,
              context_images=8, progress=False, plots=False)
    group = T.main(T.Config(**kw, seeds="0,1", out=str(tmp_path / "g")))
    solo = T.main(T.Config(**kw, seed=1, out=str(tmp_path / "s")))
    _same_lines(metrics(solo["out"]), [r for r in metrics(group["out"]) if r["seed"] == 1])
    own = group["models"]["vit"]["per_seed"][1]
    assert own["accuracy_by_distance"] == solo["models"]["vit"]["accuracy_by_distance"]


@pytest.mark.parametrize("kw", [{}, dict(cnn_kwargs='{"drop_rate": 0.5}')], ids=["plain", "dropout"])
def test_an_interrupted_group_resumes_as_one_and_ends_as_if_never_stopped(tmp_path, folder, monkeypatch, kw):
    """Ctrl-C mid-epoch, then --resume: the same metrics and weights as a run never stopped, each
    seed's random stream (its dropout) restored from the checkpoint."""
    ref = T.main(tiny(tmp_path / "a", folder, epochs=3, seeds="0,1", **kw))
    calls = {"n": 0}
    cross_entropy = classify.task.F.cross_entropy

    def interrupt_in_epoch_3(*args, **kw):  # per epoch: 3 steps of 2 seeds, then 1 evaluation batch per seed
        calls["n"] += 1
        if calls["n"] == 19:  # the second step of epoch 3
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.task.F, "cross_entropy", interrupt_in_epoch_3)
    cfg = tiny(tmp_path / "b", folder, epochs=3, seeds="0,1", **kw)
    assert T.main(cfg)["status"] == "interrupted"
    ck = torch.load(Path(cfg.out) / "checkpoints" / "cnn.pt", weights_only=True)
    assert (ck["state"]["epoch"], ck["state"]["step_in_epoch"]) == (2, 2) and len(ck["state"]["loss_sum"]) == 2
    monkeypatch.setattr(classify.task.F, "cross_entropy", cross_entropy)
    resumed = T.main(T.Config(resume=cfg.out, progress=False))
    assert scores(metrics(cfg.out)) == scores(metrics(ref["out"]))
    for a, b in zip(ref["modules"]["cnn"], resumed["modules"]["cnn"]):
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), k


def test_a_group_too_large_for_memory_is_refused_before_anything_is_written(tmp_path, folder, capsys, monkeypatch):
    monkeypatch.setattr(seedstack, "free_bytes", lambda device: 50 * 2**20)
    built = []
    create_model = vitattn.create_model
    monkeypatch.setattr(vitattn.registry, "create_model", lambda *a, **k: built.append(a) or create_model(*a, **k))
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", tmp_path / "run", "--model", "cnn",
                                "--cnn-preset", "cnn_quick", "--batch-size", "12", "--seeds", "0-255")
    assert code == 2 and "GiB" in err and "at most" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert len(built) <= 2  # measured on one model, not after building 256 of them


def test_a_stochastic_group_is_refused_under_vmap_and_auto_loops_it(tmp_path, folder, capsys):
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", tmp_path / "run", "--batch-size", "12",
                                "--seeds", "0,1", "--seed-batching", "vmap", "--model", "vit", "--vit-kwargs",
                                '{"drop_path_rate": 0.1}')
    assert code == 2 and "--seed-batching vmap" in err and "loop" in err and not (tmp_path / "run").exists()
    cfg = tiny(tmp_path / "auto", folder, seeds="0,1", seed_batching="auto", **STOCHASTIC_VIT)
    datasets = classify.load_datasets(cfg)
    stack = classify.build_models("vit", cfg, datasets, torch.device("cpu"))
    assert stack.mode == "loop"


def test_a_group_of_vits_learns_from_its_seeds_teachers(tmp_path, folder, capsys):
    """Each ViT seed learns from the CNN its solo run would: the same seed's from a group of CNNs,
    refused when that run has no CNN of the seed."""
    teachers = T.main(tiny(tmp_path / "t", folder, epochs=1, seeds="0,1"))["out"]
    run = T.main(tiny(tmp_path / "v", folder, epochs=1, seeds="0,1", teacher=teachers, **SMALL_VIT))
    solo = T.main(tiny(tmp_path / "s", folder, epochs=1, seed=1, teacher=teachers, **SMALL_VIT))
    _same_lines(metrics(solo["out"]), [r for r in metrics(run["out"]) if r["seed"] == 1])
    assert json.loads((Path(run["out"]) / "summary.json").read_text())["models"]["vit"]["teacher"]["run"] == teachers
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", tmp_path / "x", "--model", "vit",
                                "--teacher", teachers, "--seeds", "1,2", "--batch-size", "12")
    assert code == 2 and "seed 2" in err and not (tmp_path / "x").exists()
