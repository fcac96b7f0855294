"""Batches of uint8 images, augmented a whole batch at a time on the images' device.

    ImageData (N, 3, H, W) uint8
      -> BatchLoader        per-epoch permutation, this rank's shard, batches     (B, 3, H, W) uint8
      -> Augment            random translate (zero or mirror pad), flip, cutout   (B, 3, H, W) uint8

No per-image work: every epoch is tensor indexing. Randomness comes from a generator on the
images' device seeded by ``(seed, epoch, step, rank)`` (``runtime.step_generator``), so a run
resumed at any step draws the same batches as one that never stopped.

References: Keller Jordan's airbench (``airbench94.py``: the dataset as tensors, per-batch flip and
translate); DeVries & Taylor 2017 (cutout).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...training.runtime import step_generator

PADDING_MODES = ("constant", "reflect")


def translate_flip(x: torch.Tensor, pad: int, flip: bool, gen: torch.Generator,
                   padding_mode: str = "constant") -> torch.Tensor:
    """``(B, C, H, W) -> (B, C, H, W)``: each image shifted by up to ``pad`` pixels each way
    (a random crop of the image padded with zeros, or with its own border mirrored for
    ``padding_mode='reflect'``, as airbench and torchvision's ``RandomCrop`` do) and, with ``flip``,
    a random half mirrored left-right. The mirror is folded into the column index, so the whole
    thing is two gathers over the batch."""
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
    b, c, h, w = x.shape
    # drawn where the images are (gen lives on x's device): no host-device copy per batch
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen, device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen, device=x.device)
    mirrored = (torch.rand(b, generator=gen, device=x.device) < 0.5) if flip else torch.zeros(b, dtype=torch.bool,
                                                                                              device=x.device)
    cols = torch.arange(w, device=x.device)
    cols = torch.where(mirrored[:, None], cols.flip(0), cols) + dx[:, None]  # (B, W)
    rows = torch.arange(h, device=x.device) + dy[:, None]  # (B, H)
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode=padding_mode) if pad > 0 else x
    xp = xp.gather(2, rows[:, None, :, None].expand(b, c, h, w + 2 * pad))
    return xp.gather(3, cols[:, None, None, :].expand(b, c, h, w))


def mean_colour(mean) -> torch.Tensor:
    """Per-channel means in [0, 1] as the uint8 colour ``(C,)`` nearest to them."""
    return (torch.tensor(mean, dtype=torch.float64) * 255).round().to(torch.uint8)


def cutout(x: torch.Tensor, size: int, gen: torch.Generator, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Cover one ``size x size`` square per image, its centre anywhere (it may overhang the edge),
    with ``fill``, a uint8 colour ``(C,)`` (default black). DeVries & Taylor zero the square of the
    normalised image, i.e. paint it the mean: pass ``mean_colour`` of the normalisation's mean."""
    if size <= 0:
        return x
    b, c, h, w = x.shape
    top = torch.randint(0, h, (b,), generator=gen, device=x.device)[:, None, None] - size // 2
    left = torch.randint(0, w, (b,), generator=gen, device=x.device)[:, None, None] - size // 2
    ys, xs = torch.arange(h, device=x.device)[None, :, None], torch.arange(w, device=x.device)[None, None, :]
    hole = (ys >= top) & (ys < top + size) & (xs >= left) & (xs < left + size)  # (B, H, W)
    colour = torch.zeros(c, dtype=x.dtype, device=x.device) if fill is None else fill.to(x.device, x.dtype)
    return torch.where(hole[:, None], colour.view(1, c, 1, 1), x)


@dataclass
class Augment:
    translate: int = 2  # max shift in pixels
    flip: bool = True  # random horizontal mirror
    cutout: int = 0  # side of a square painted with the images' mean colour, in pixels; 0 = off
    padding_mode: str = "constant"  # what a shift brings in at the border: zeros or the mirrored image
    fill: tuple[float, ...] = (0.0, 0.0, 0.0)  # the cutout's colour: the normalisation's mean, in [0, 1]

    def __call__(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if self.translate > 0 or self.flip:
            x = translate_flip(x, self.translate, self.flip, gen, self.padding_mode)
        if self.cutout <= 0:
            return x
        colours = self.__dict__.setdefault("_colours", {})  # made once per device: no copy to a GPU per batch
        if x.device not in colours:
            colours[x.device] = mean_colour(self.fill).to(x.device)
        return cutout(x, self.cutout, gen, colours[x.device])


class BatchLoader:
    """Batches of ``(images uint8, labels)`` for one epoch of one rank, on the device ``x`` is on.

    Every rank draws the same permutation for an epoch and takes ``perm[rank::world]``, so
    ranks see disjoint shards of equal size (the remainder is dropped when training). With
    ``drop_last`` a short final batch is dropped, as in training. Held on a GPU, the images are
    indexed, augmented and (by the caller) normalised there, with the random numbers drawn there
    too (airbench's way): the host only queues work.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool = True,
                 drop_last: bool = True, augment: Augment | None = None, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.drop_last, self.augment = shuffle, drop_last, augment
        self.seed, self.rank, self.world_size = seed, rank, world_size
        per_rank = len(x) // world_size if shuffle else -(-(len(x) - rank) // world_size)
        self.shard_size = per_rank
        if drop_last and per_rank < batch_size:
            raise ValueError(f"{per_rank} images per rank is less than one batch of {batch_size}; "
                             "lower the batch size")

    def __len__(self) -> int:
        n = self.shard_size
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's image indices for ``epoch``, on the images' device (drawn there)."""
        n, dev = len(self.x), self.x.device
        idx = (torch.randperm(n, generator=step_generator(self.seed, epoch, device=dev), device=dev) if self.shuffle
               else torch.arange(n, device=dev))
        if self.shuffle:
            idx = idx[: n - n % self.world_size]  # equal shards, so ranks step in lockstep
        return idx[self.rank::self.world_size]

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of one epoch from ``start_step`` on (for resuming mid-epoch)."""
        idx = self.indices(epoch)
        for step in range(start_step, len(self)):
            j = idx[step * self.batch_size:(step + 1) * self.batch_size]
            x = self.x[j]
            if self.augment is not None:
                x = self.augment(x, step_generator(self.seed, epoch, step, self.rank, device=self.x.device))
            yield x, self.y[j]


def pipeline_speed(loader: BatchLoader, norm: nn.Module, batches: int = 20) -> dict[str, float]:
    """Images/s of the batch pipeline alone (index, augment, normalise), with and without the
    augmentation: what it costs next to a training step. Draws from its own seed, so a training
    run that measures it first sees the same batches as one that does not."""
    import time

    out = {}
    for name, aug in (("augmented", loader.augment), ("plain", None)):
        probe = BatchLoader(loader.x, loader.y, loader.batch_size, augment=aug, seed=loader.seed + 1)
        n, t, total = 0, time.perf_counter(), torch.zeros((), device=loader.x.device)
        for i, (xb, _) in enumerate(probe.epoch(0)):
            total += norm(xb)[0, 0, 0, 0]
            n += len(xb)
            if i + 1 >= batches:
                break
        total.item()  # waits for a GPU to finish the batches
        out[f"{name}_images_per_s"] = n / (time.perf_counter() - t)
    return out
