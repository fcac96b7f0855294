"""vitattn.tasks.classify.data: the three CIFAR layouts, the decode cache, batch augmentation, sharded batches."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import CLASSES, make_images, png_bytes, write_batches, write_folder, write_tar

from vitattn.tasks.classify import batches as B
from vitattn.tasks.classify import data as D
from vitattn.training import cli, runtime

# -- the three layouts ------------------------------------------------------------------------


def _sorted(x: torch.Tensor, y: torch.Tensor):
    key = x.flatten(1).sum(1) * 10 + y  # order-free comparison of two (images, labels) sets
    i = key.argsort()
    return x[i], y[i]


def test_three_layouts_decode_to_the_same_tensors(tmp_path):
    folder = D.load_cifar(write_folder(tmp_path / "f"), cache=False)
    tar = D.load_cifar(write_tar(tmp_path / "c.tar.gz"), cache=False)
    batches = D.load_cifar(write_batches(tmp_path / "b"), cache=False)
    x, y = make_images(12, 0)
    for d in (folder, tar, batches):
        assert d.classes == CLASSES
        assert d.train_x.shape == (36, 3, 32, 32) and d.train_x.dtype == torch.uint8
        assert d.test_x.shape == (12, 3, 32, 32)
        sx, sy = _sorted(d.train_x, d.train_y)
        ex, ey = _sorted(x, y)
        assert torch.equal(sx, ex) and torch.equal(sy, ey)  # PNG and pickles are lossless


def test_find_source_accepts_a_folder_holding_the_archive(tmp_path):
    write_tar(tmp_path / "cifar.tar.gz")
    assert D.find_source(tmp_path) == ("tar", tmp_path / "cifar.tar.gz")
    write_batches(tmp_path / "b")
    assert D.find_source(tmp_path / "b")[0] == "batches"


def test_a_class_balanced_subset_keeps_every_class_in_turn_and_the_order():
    """``--limit-train`` / ``--limit-test`` on a class-sorted folder: the first N images would hold
    one or two classes; the subset takes the classes in turn and keeps the images' order."""
    labels = torch.tensor([0] * 5 + [1] * 3 + [2] * 4)  # sorted by class, as an ImageFolder tree reads
    keep = D.class_balanced(labels, 7)
    assert keep.tolist() == sorted(keep.tolist()) and len(set(keep.tolist())) == 7
    assert torch.bincount(labels[keep]).tolist() == [3, 2, 2]  # two rounds of three, then class 0's third
    assert D.class_balanced(labels, 12).tolist() == list(range(12))
    shuffled = labels[torch.randperm(12, generator=torch.Generator().manual_seed(0))]
    assert torch.bincount(shuffled[D.class_balanced(shuffled, 6)]).tolist() == [2, 2, 2]


def test_the_cache_lives_in_the_user_cache_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "data").mkdir()
    src = write_tar(tmp_path / "data" / "c.tar.gz")
    lines: list[str] = []
    cli.show_phases(lines.append, bar=False)  # as a run shows it: the decode is a phase with its duration
    try:
        first = D.load_cifar(src)
    finally:
        cli.show_phases(None, bar=False)
    assert [line.rsplit(":", 1)[0] for line in lines] == ["decoding 36 train images", "decoding 12 test images"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["c.tar.gz"]  # nothing beside the data
    assert len(list((tmp_path / "cache").glob("c.tar.gz-*.pt"))) == 1
    monkeypatch.setattr(D, "read_tar", lambda p: pytest.fail("decoded again despite the cache"))
    again = D.load_cifar(src)
    assert torch.equal(first.train_x, again.train_x) and again.classes == first.classes


def test_cache_goes_to_home_cache_when_the_data_folder_is_read_only(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    src = write_tar(ro / "c.tar.gz")
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "cache"))
    ro.chmod(0o555)
    try:
        D.load_cifar(src)
    finally:
        ro.chmod(0o755)
    assert not list(ro.glob(".*vitattn*"))
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1


def test_cache_key_changes_with_the_source(tmp_path):
    src = write_tar(tmp_path / "c.tar.gz")
    before = D.cache_path(src)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert D.cache_path(src) != before


def test_a_folder_read_from_inside_keeps_one_cache_that_follows_its_images(tmp_path, monkeypatch):
    """``--data-dir .``: the cache is not written into the data (where it changed the folder's own
    key and grew by a copy of the data each run); the key follows images added, removed or
    renamed, one cache per source is kept, and a start stats the folders, not every image."""
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "cache"))
    root = write_folder(tmp_path / "cifar", n_train=20, n_test=4)
    monkeypatch.chdir(root)
    D.load_cifar(".")
    D.load_cifar(".")
    assert sorted(p.name for p in root.iterdir()) == ["test", "train"]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    key = D.cache_path(Path("."))
    stats = []
    real_stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, **kw: stats.append(self) or real_stat(self, **kw))
    assert D.cache_path(Path(".")) == key
    monkeypatch.undo()
    monkeypatch.setenv("VITATTN_CACHE", str(tmp_path / "cache"))
    assert stats and not [p for p in stats if p.suffix == ".png"]  # the folders, none of the 72 images
    cat = root / "train" / "cat"
    for change in (lambda: (cat / "0000.png").rename(cat / "moved.png"),
                   lambda: (cat / "extra.png").write_bytes((cat / "moved.png").read_bytes()),
                   lambda: (cat / "extra.png").unlink()):
        change()
        assert D.cache_path(root) != key
        key = D.cache_path(root)
        D.load_cifar(root)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # an older key's cache goes


def test_missing_data_lists_every_way_to_supply_it(tmp_path):
    with pytest.raises(D.DataError) as e:
        D.load_cifar(tmp_path / "nothing")
    msg = str(e.value)
    for part in ("cifar-10-batches-py", "--download", "ImageFolder", ".tar.gz", "--dataset long-range"):
        assert part in msg


@pytest.mark.parametrize("layout", ["folder", "tar"])
def test_a_corrupt_image_names_its_file(tmp_path, layout):
    root = write_folder(tmp_path / "f", n_train=2, n_test=1)
    bad = root / "train" / "dog" / "0003.png"
    bad.write_bytes(b"not a png at all")
    src = root
    if layout == "tar":
        src = tmp_path / "c.tar.gz"
        with tarfile.open(src, "w:gz") as tar:
            tar.add(root / "train", "train")
            tar.add(root / "test", "test")
    with pytest.raises(D.DataError, match="0003.png"):
        D.load_cifar(src, cache=False)


def test_images_of_different_sizes_are_refused(tmp_path):
    root = write_folder(tmp_path / "f", n_train=2, n_test=1)
    (root / "train" / "cat" / "0000.png").write_bytes(png_bytes(torch.zeros(3, 30, 32, dtype=torch.uint8)))
    with pytest.raises(D.DataError, match="one size"):
        D.load_cifar(root, cache=False)


# -- augmentation ----------------------------------------------------------------------------


def test_translate_moves_a_single_pixel_by_at_most_pad():
    x = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    x[:, :, 10, 20] = 255
    out = B.translate_flip(x, 3, False, torch.Generator().manual_seed(0))
    shifts = set()
    for img in out:
        pos = (img[0] == 255).nonzero()
        assert len(pos) == 1 and int(img.sum()) == 3 * 255  # nothing duplicated or lost
        dy, dx = int(pos[0, 0]) - 10, int(pos[0, 1]) - 20
        assert abs(dy) <= 3 and abs(dx) <= 3
        shifts.add((dy, dx))
    assert len(shifts) > 10  # offsets vary per image


def test_translate_fills_with_zeros_and_flip_mirrors():
    x = torch.randint(1, 256, (32, 3, 8, 8), dtype=torch.uint8)
    out = B.translate_flip(x, 0, True, torch.Generator().manual_seed(1))
    same = [(o == i).all() for o, i in zip(out, x)]
    mirrored = [(o == i.flip(2)).all() for o, i in zip(out, x)]
    assert all(s or m for s, m in zip(same, mirrored)) and any(same) and any(mirrored)
    shifted = B.translate_flip(x, 2, False, torch.Generator().manual_seed(2))
    assert (shifted == 0).any()  # the padding shows as zeros somewhere


def test_reflect_padding_shifts_in_the_mirrored_border():
    """``padding_mode='reflect'``: every output is a crop of the image padded with its own mirror,
    so no zeros appear, and the same draws give the same shifts as zero padding."""
    x = torch.randint(1, 256, (32, 3, 8, 8), dtype=torch.uint8)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    out = B.translate_flip(x, 2, True, gen(), "reflect")
    assert not (out == 0).any()
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
    for o, p in zip(out, padded):
        views = [p[:, i:i + 8, j:j + 8] for i in range(5) for j in range(5)]
        assert any((o == v).all() or (o == v.flip(2)).all() for v in views)
    zeros = B.translate_flip(x, 2, True, gen())
    inner = zeros != 0  # where zero padding kept image pixels, both modes agree
    assert torch.equal(out[inner], zeros[inner])
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        B.translate_flip(x, 2, True, gen(), "edge")


@pytest.mark.parametrize("size", [1, 4, 7, 8])
def test_cutout_covers_one_size_by_size_square_with_the_mean_colour(size):
    """DeVries & Taylor cut the square out of normalised images, where zero is the mean: here the
    uint8 square takes the mean colour, which normalises to ~0, and is exactly size x size (less
    where it overhangs an edge)."""
    x = torch.full((64, 3, 32, 32), 7, dtype=torch.uint8)
    mean = (0.5, 0.25, 0.75)
    fill = B.mean_colour(mean)
    out = B.cutout(x, size, torch.Generator().manual_seed(0), fill)
    hole = (out != 7).any(1)  # (B, H, W)
    assert torch.equal(out.permute(0, 2, 3, 1)[hole], fill.expand(int(hole.sum()), 3))
    rows, cols = hole.any(2).sum(1), hole.any(1).sum(1)
    assert (rows <= size).all() and (cols <= size).all() and (rows == size).any() and (cols == size).any()
    assert torch.equal(hole.flatten(1).sum(1), rows * cols)  # one rectangle, the square cut by the edges
    normed = D.Normalize(mean, (0.2, 0.2, 0.2))(out)
    assert normed.permute(0, 2, 3, 1)[hole].abs().max() < 1 / (255 * 0.2)  # within one grey level of zero


def test_augment_is_deterministic_per_generator_seed():
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    aug = B.Augment(translate=4, flip=True, cutout=6, fill=(0.5, 0.5, 0.5))
    a = aug(x, runtime.step_generator(0, 1, 2))
    b = aug(x, runtime.step_generator(0, 1, 2))
    c = aug(x, runtime.step_generator(0, 1, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_normalize_matches_the_formula():
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 0.2)
    want = (x.float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    torch.testing.assert_close(D.Normalize(mean, std)(x), want)


# -- batches ---------------------------------------------------------------------------------


def test_rank_shards_are_disjoint_and_cover_the_epoch():
    x = torch.zeros(103, 3, 4, 4, dtype=torch.uint8)
    y = torch.arange(103)
    loaders = [B.BatchLoader(x, y, 10, seed=3, rank=r, world_size=2) for r in range(2)]
    seen = [torch.cat([yb for _, yb in ld.epoch(5)]) for ld in loaders]
    assert len(loaders[0]) == len(loaders[1]) == 5  # 51 per rank, full batches only
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    idx = torch.cat([ld.indices(5) for ld in loaders])
    assert len(set(idx.tolist())) == 102  # one image dropped so the shards are equal
    other_epoch = torch.cat([yb for _, yb in loaders[0].epoch(6)])
    assert not torch.equal(seen[0], other_epoch)


def test_an_epoch_resumed_mid_way_gives_the_same_batches():
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    y = torch.arange(64)
    ld = B.BatchLoader(x, y, 8, augment=B.Augment(2, True, 0), seed=1)
    full = list(ld.epoch(2))
    tail = list(ld.epoch(2, start_step=5))
    assert len(tail) == 3
    for (xa, ya), (xb, yb) in zip(full[5:], tail):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_evaluation_loader_keeps_every_image():
    x = torch.zeros(23, 3, 4, 4, dtype=torch.uint8)
    ld = B.BatchLoader(x, torch.arange(23), 5, shuffle=False, drop_last=False)
    assert torch.equal(torch.cat([yb for _, yb in ld.epoch(0)]), torch.arange(23))


def test_too_small_a_shard_for_one_batch_is_refused():
    with pytest.raises(ValueError, match="less than one batch"):
        B.BatchLoader(torch.zeros(10, 3, 4, 4, dtype=torch.uint8), torch.arange(10), 8, world_size=2)
