"""vitattn.tasks.classify: evaluation with test-time augmentation, FLOP counts, recipes, the dataset checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_train_cifar, tiny, write_folder

import train_cifar as T
from vitattn.helpers import flops_per_image
from vitattn.tasks import classify
from vitattn.tasks.classify import evaluate
from vitattn.tasks.classify.data import DataError, Normalize
from vitattn.tasks.classify.recipes import RECIPES
from vitattn.training.runtime import Dist

pytestmark = pytest.mark.usefixtures("one_thread")


def test_test_time_augmentation_views_and_weights():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    y = torch.randint(0, 4, (40,))
    norm = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    # a model that ignores its input: every kind of averaging gives the plain accuracy
    const = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4))
    with torch.no_grad():
        const[1].weight.zero_()
    r = evaluate(const, norm, x, y, batch_size=16, ranks=Dist(), tta=True)
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

    m = vitattn.create_model("vit_quick", embed_dim=192, num_heads=3)  # D 192, depth 6, mlp 2, 64 patches + cls
    d, t, depth = 192, 65, 6
    per_block = 2 * t * (3 * d * d + d * d + 2 * 2 * d * d) + 4 * t * t * d  # qkv, proj, mlp; QK^T and AV
    # counted in eval, where every block runs for every token (the class-token shortcut is training's)
    want = 2 * (3 * 4 * 4) * d * 64 + depth * per_block + 2 * d * 10  # embed, blocks, head
    assert flops_per_image(m, (32, 32)) == want


def test_missing_data_says_how_to_supply_it_and_writes_nothing(tmp_path, capsys):
    cfg = tiny(tmp_path, tmp_path / "nowhere")
    with pytest.raises(DataError, match="--dataset long-range"):
        T.main(cfg)
    assert not Path(cfg.out).exists()
    assert T.command_line(["--data-dir", str(tmp_path / "nowhere"), "--out", cfg.out, "--no-progress"]) == 2
    assert "cifar-10-batches-py" in capsys.readouterr().err and not Path(cfg.out).exists()


def test_a_corrupt_image_is_named(tmp_path):
    root = write_folder(tmp_path / "f", n_train=2, n_test=1)
    (root / "test" / "frog" / "0002.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="0002.png"):
        T.main(tiny(tmp_path, root))


def test_long_range_recipe_takes_small_batches_and_overrides_still_win():
    cnn = T.Config(dataset="long-range").recipe("cnn")
    assert (cnn.batch_size, cnn.lr) == (64, 0.1)
    vit = T.Config(dataset="long-range").recipe("vit")
    assert (vit.batch_size, vit.lr, vit.optimizer) == (64, 1e-3, "adamw")
    assert (cnn.epochs, vit.epochs) == (3, 6)
    for r in (cnn, vit):
        assert (r.translate, r.label_smoothing) == (0, 0.0)
    assert T.Config(dataset="long-range", batch_size=128).recipe("cnn").batch_size == 128
    assert T.Config().recipe("cnn").batch_size == RECIPES["cnn"].batch_size  # CIFAR-10 unchanged


def test_images_of_another_size_build_the_vit_for_them_or_are_refused_up_front(tmp_path, capsys):
    small = write_folder(tmp_path / "s16", n_train=4, n_test=2, size=16)
    s = T.main(tiny(tmp_path / "a", small, model="vit", vit_preset="vit_quick", epochs=1, batch_size=4))
    assert s["status"] == "ok" and s["modules"]["vit"].config.img_size == (16, 16)  # a 4x4 grid of 4-px patches
    odd = write_folder(tmp_path / "s30", n_train=4, n_test=2, size=30)
    out = tmp_path / "b" / "run"
    code, err = run_train_cifar(capsys, "--data-dir", odd, "--out", out, "--model", "vit", "--epochs", 1)
    assert code == 2 and "30x30" in err and "4x4 patches" in err and not out.exists()


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, folder):
    cfg = tiny(tmp_path, folder, batch_size=13)
    ds = classify.load_dataset(cfg)
    with pytest.raises(T.UsageError, match="--batch-size is the global batch and must split evenly over the 2 "
                                           "processes, got 13"):
        classify.build_model("cnn", cfg, ds, torch.device("cpu"), world=2)
    assert classify.build_model("cnn", replace(cfg, batch_size=12), ds, torch.device("cpu"), world=2) is not None


def test_fewer_images_than_one_batch_is_refused_up_front(tmp_path, folder, capsys):
    out = tmp_path / "run"
    code, err = run_train_cifar(capsys, "--data-dir", folder, "--out", out, "--model", "cnn", "--batch-size", 64)
    assert code == 2 and "a batch of 64" in err and "36" in err and not out.exists()


@pytest.mark.parametrize("family", ["vit", "cnn"])
def test_saved_weights_carry_their_data_and_timms_tools_reproduce_the_scripts_accuracy(tmp_path, family):
    """The long-range images are far from CIFAR-10's statistics (std ~0.1, not 0.25): weights
    reloaded by name and fed through timm's resolve_data_config + create_transform must get the
    normalisation they trained with, and so the script's own accuracy, image for image."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    import vitattn

    kw = dict(dataset="long-range", long_range_train=128, long_range_test=48, model=family, epochs=1,
              batch_size=32, context_images=8, progress=False, plots=False, tta=False, seed=3)
    run = T.main(T.Config(**kw, out=str(tmp_path / "run")))
    ds = classify.load_dataset(T.Config(**kw))
    preset = run["config"][f"{'vit' if family == 'vit' else 'cnn'}_preset"]
    model = vitattn.create_model(preset, checkpoint_path=str(Path(run["out"]) / classify.weights_file(family))).eval()
    cfg = resolve_data_config({}, model=model)
    assert cfg["std"] == pytest.approx(ds.norm.std) and max(cfg["std"]) < 0.2  # not CIFAR-10's 0.25
    assert model.pretrained_cfg["label_names"] == list(ds.data.classes)
    transform = create_transform(**cfg)
    x = torch.stack([transform(Image.fromarray(im.permute(1, 2, 0).numpy())) for im in ds.data.test_x])
    with torch.no_grad():
        acc = (model(x).argmax(1) == ds.data.test_y).float().mean().item()
    assert acc == pytest.approx(run["models"][family]["final_acc"], abs=1e-9)
    # the run's checkpoint says the same, and a preset of another name is refused by name
    ckpt = vitattn.create_model(preset, checkpoint_path=str(Path(run["out"]) / "checkpoints" / f"{family}.pt"))
    assert ckpt.pretrained_cfg["std"] == pytest.approx(ds.norm.std)
    other = "vit_quick" if family == "vit" else "cnn_quick"
    with pytest.raises(ValueError, match=f"holds weights of {preset}, not {other}"):
        vitattn.create_model(other, checkpoint_path=str(Path(run["out"]) / classify.weights_file(family)))
