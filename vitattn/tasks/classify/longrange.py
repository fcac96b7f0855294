"""A long-range task made on the fly: are two distant marks in one row or in one column?

Each 32x32 RGB image holds two small marks (3x3 glyphs, 5 pixels each) on a background: one grey
level (``background='plain'``, the default: finding the marks is trivial) or colour blobs, stripes
and noise (``'texture'``). With ``attribute='alignment'`` (the default, and the task the study in
docs/context.md reports) the label says whether the two marks share a row or a column, 7-15 px
apart (``_alignment_specs``). The task is closed: every part of a scene short of both places
together says nothing about its label (``view_accuracy`` measures it: one mark, the unordered
appearances, one mark's shape with the other's place, ...), so pooling local detectors cannot
solve it unless they know their place. Read out by a mean over places and a linear head, even
detectors that know their place cannot pass 3 in 4 (the scenes come in equally likely rectangles
of two row pairs and two column pairs, and a sum of one-mark terms gets at most three of the four
right): some place must see both marks, which is what a model's reach is.

Three more labels are kept for comparison: ``'colour'`` and ``'shape'`` (``same`` when the marks
match in that attribute; distances 4-28 px; a bag of local colour detectors solves the colour one,
so it measures less than it seems) and ``'pointing'`` (does an arrow point at a plus? a relation
with a shortcut). Why the label cannot be read off one place for those: each mark's shape and
colour have the same distribution in both classes, every glyph has the same pixel count, and
distances and positions are drawn independently of the label; classes are balanced.

    data = make_long_range(10_000, seed=0)
    data["images"]    # (n, 3, 32, 32) uint8
    data["labels"]    # (n,) int64, index into CLASSES['alignment']
    data["distance"]  # (n,) float32, pixels between the two mark centres

References: same/different tasks as a test of relational reasoning (Fleuret et al. 2011, SVRT;
Kim, Ricci & Serre 2018, "Not-So-CLEVR"); Tay et al. 2021, Long Range Arena (Pathfinder), for
the idea of a synthetic task whose difficulty is set by distance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .data import ImageData

LONG_RANGE_CLASSES = ("different", "same")

# 3x3 glyphs with 5 pixels each; equal area keeps pixel counts from telling shapes apart.
GLYPHS = torch.tensor([
    [[0, 1, 0], [1, 1, 1], [0, 1, 0]],  # plus
    [[1, 0, 1], [0, 1, 0], [1, 0, 1]],  # cross
    [[1, 1, 1], [0, 1, 0], [0, 1, 0]],  # tee
    [[1, 0, 0], [1, 0, 0], [1, 1, 1]],  # ell
], dtype=torch.bool)
GLYPH_NAMES = ("plus", "cross", "tee", "ell")
NUM_SHAPES = len(GLYPHS)  # the shapes the 'colour' and 'shape' tasks draw from


def _stem(glyph: torch.Tensor) -> tuple[int, int]:
    """The way a tee's stem points, ``(drow, dcol)``: from its centre of mass to the glyph centre."""
    rows, cols = glyph.nonzero(as_tuple=True)
    return (int(torch.sign(1 - rows.float().mean())), int(torch.sign(1 - cols.float().mean())))


# 'pointing': the tee in its four orientations is an arrow along its stem; the plus is the target.
_TEES = [torch.rot90(GLYPHS[2], k) for k in range(4)]
GLYPHS = torch.cat([GLYPHS, torch.stack(_TEES[1:])])
GLYPH_NAMES = (*GLYPH_NAMES, "tee-1", "tee-2", "tee-3")
ARROW_GLYPHS = torch.tensor([2, NUM_SHAPES, NUM_SHAPES + 1, NUM_SHAPES + 2])  # indices into GLYPHS
ARROW_DIRECTIONS = torch.tensor([_stem(t) for t in _TEES])  # (4, 2): where each arrow points
POINTING_CLASSES = ("away", "towards")
POINTING_DISTANCE_RANGE = (4.0, 19.0)  # both A + o and A - o must fit: |o| up to ~20 px
# 'alignment': are the two marks side by side (one row) or one above the other (one column)?
ALIGNMENT_CLASSES = ("same row", "same column")
# From 7 px apart no 5x5 field holds a pixel of both marks (the bag-of-local-features control's
# field); up to (H - 2) // 2, the largest k for which a 2k x 2k window of centres fits.
ALIGNMENT_MIN_DISTANCE = 7
CLASSES = {"colour": LONG_RANGE_CLASSES, "shape": LONG_RANGE_CLASSES, "pointing": POINTING_CLASSES,
           "alignment": ALIGNMENT_CLASSES}
DEFAULT_EDGES = (3.5, 8, 12, 16, 20, 24, 28.5, 42)
# Distance bins per task for ``accuracy_by_distance``: alignment has whole distances 7-15 px.
DISTANCE_EDGES = {"colour": DEFAULT_EDGES, "shape": DEFAULT_EDGES, "pointing": DEFAULT_EDGES,
                  "alignment": (6.5, 9.5, 12.5, 15.5)}

# Saturated mark colours, well outside the muted background range (below).
MARK_COLOURS = torch.tensor([
    [240, 40, 40], [40, 220, 60], [50, 90, 250], [250, 220, 30], [230, 50, 230], [30, 230, 230],
], dtype=torch.float32)

ATTRIBUTES = ("colour", "shape", "pointing", "alignment")
DEFAULT_DISTANCE_RANGE = (4.0, 28.0)
MIN_DISTANCE = 3.5  # closer centres would make the 3x3 glyphs overlap


def _ring_offsets(d: float, img_size: int) -> torch.Tensor:
    """Integer offsets ``(k, 2)`` (dy, dx) whose length rounds to ``d`` (|len - d| <= 0.5), that
    keep two 3x3 glyphs apart (Chebyshev >= 3) and fit inside the image."""
    r = img_size - 3  # the largest offset between two glyph centres along one axis
    ax = torch.arange(-r, r + 1)
    dy, dx = torch.meshgrid(ax, ax, indexing="ij")
    off = torch.stack([dy.flatten(), dx.flatten()], 1)
    length = off.float().norm(dim=1)
    keep = ((length - d).abs() <= 0.5) & (off.abs().amax(1) >= 3)
    out = off[keep]
    if len(out) == 0:
        raise ValueError(f"no mark placement {d:.1f} px apart fits in a {img_size}x{img_size} image; "
                         f"expected a distance in [{MIN_DISTANCE}, {math.sqrt(2) * r:.1f}]")
    return out


def textured_background(n: int, img_size: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, 3, H, W)`` float in [0, 255]: muted low-frequency colour blobs + oriented stripes +
    pixel noise, so objects must be told from texture rather than from a flat field (the
    long-range task and the detection example draw on it)."""
    grey = 70 + 70 * torch.rand(n, 1, 1, 1, generator=gen)
    blobs = F.interpolate(torch.rand(n, 3, 5, 5, generator=gen) - 0.5, size=(img_size, img_size),
                          mode="bicubic", align_corners=False)
    yy, xx = torch.meshgrid(torch.arange(img_size).float(), torch.arange(img_size).float(), indexing="ij")
    theta = math.pi * torch.rand(n, 1, 1, generator=gen)
    freq = 2 * math.pi / (3 + 5 * torch.rand(n, 1, 1, generator=gen))  # periods of 3-8 px
    phase = 2 * math.pi * torch.rand(n, 1, 1, generator=gen)
    stripes = torch.sin(freq * (xx * torch.cos(theta) + yy * torch.sin(theta)) + phase)[:, None]
    noise = torch.randn(n, 3, img_size, img_size, generator=gen)
    return (grey + 60 * blobs + 14 * stripes + 12 * noise).clamp(0, 255)


def plain_background(n: int, img_size: int, gen: torch.Generator) -> torch.Tensor:
    """``(n, 3, H, W)`` float in [0, 255]: one flat grey level per image (70-140), so finding a
    mark is trivial and only where the marks are is left to work out."""
    grey = 70 + 70 * torch.rand(n, 1, 1, 1, generator=gen)
    return grey.expand(n, 3, img_size, img_size).clone()


# On 'texture' a ViT does not find the 3x3 marks in minutes (docs/context.md); 'plain' leaves
# their places as the only thing to work out.
BACKGROUNDS = {"texture": textured_background, "plain": plain_background}


def _target_distances(num: int, distances, gen: torch.Generator,
                      default_range: tuple[float, float] = DEFAULT_DISTANCE_RANGE) -> torch.Tensor:
    if distances is None:
        lo, hi = default_range
        return lo + (hi - lo) * torch.rand(num, generator=gen)
    values = torch.as_tensor([distances] if isinstance(distances, (int, float)) else list(distances),
                             dtype=torch.float32)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"distances must be a number or a sequence of numbers, got {distances!r}")
    # Each listed distance gets an equal share (up to one image), in random order.
    return values[torch.randperm(num, generator=gen) % len(values)]


def _pair_up(first: torch.Tensor, labels: torch.Tensor, k: int, gen: torch.Generator,
             matched: bool) -> torch.Tensor:
    """``(n, 2)`` attribute values of the two marks. ``matched``: the second copies the first
    where the label is ``same`` and is uniform over the other ``k - 1`` values where it is
    ``different``, so its marginal stays uniform; otherwise the second is independent of all."""
    if matched:
        other = (first + 1 + torch.randint(k - 1, first.shape, generator=gen)) % k
        second = torch.where(labels == 1, first, other)
    else:
        second = torch.randint(k, first.shape, generator=gen)
    return torch.stack([first, second], 1)


def make_long_range_specs(num: int, *, seed: int, img_size: int = 32,
                          distances: float | Sequence[float] | None = None,
                          attribute: str = "alignment") -> dict[str, torch.Tensor]:
    """Everything about each image except its pixels: ``labels``, ``shapes`` ``(n, 2)``, ``colours``
    ``(n, 2)`` (indices into ``GLYPHS`` / ``MARK_COLOURS``), ``centres`` ``(n, 2, 2)`` (row, col of
    each mark centre), ``distance``. ``attribute``: what must match for ``same``, ``'colour'`` or
    ``'shape'`` (the other one is drawn independently per mark), ``'pointing'``, a relation
    task with a shortcut (:func:`_pointing_specs`; labels index ``POINTING_CLASSES``), or
    ``'alignment'``, the closed one (:func:`_alignment_specs`; ``ALIGNMENT_CLASSES``; whole
    distances 7-15 px). Deterministic for a seed."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if img_size < 8:
        raise ValueError(f"img_size must be >= 8 to hold two marks apart, got {img_size}")
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.arange(num) % 2)[torch.randperm(num, generator=gen)]  # balanced to within one
    if attribute not in ATTRIBUTES:
        raise ValueError(f"attribute must be one of {ATTRIBUTES}, got {attribute!r}")
    if attribute == "pointing":
        target = _target_distances(num, distances, gen, POINTING_DISTANCE_RANGE)
        return _pointing_specs(labels, target, img_size, gen, seed)
    if attribute == "alignment":
        return _alignment_specs(labels, distances, img_size, gen, seed)
    shapes = _pair_up(torch.randint(NUM_SHAPES, (num,), generator=gen), labels, NUM_SHAPES, gen,
                      matched=attribute == "shape")
    colours = _pair_up(torch.randint(len(MARK_COLOURS), (num,), generator=gen), labels, len(MARK_COLOURS), gen,
                       matched=attribute == "colour")

    target = _target_distances(num, distances, gen)
    if (target < MIN_DISTANCE).any():
        raise ValueError(f"distances must be >= {MIN_DISTANCE} px (3x3 marks would overlap), "
                         f"got min {target.min().item():.2f}")
    offsets = torch.empty(num, 2, dtype=torch.long)
    keys = (target * 2).round() / 2  # rings differ only at half-pixel steps: one ring per key
    for key in keys.unique().tolist():
        sel = (keys == key).nonzero().flatten()
        ring = _ring_offsets(key, img_size)
        offsets[sel] = ring[torch.randint(len(ring), (len(sel),), generator=gen)]
    # The first centre is uniform over the places where both glyphs fit (centres in 1..H-2).
    lo = 1 + (-offsets).clamp(min=0)
    hi = img_size - 2 - offsets.clamp(min=0)
    c1 = lo + (torch.rand(num, 2, generator=gen) * (hi - lo + 1)).long()
    # Each ring holds (dy, dx) and (-dy, -dx) alike, so neither mark tends to a side or corner.
    centres = torch.stack([c1, c1 + offsets], 1)
    return dict(labels=labels, shapes=shapes, colours=colours, centres=centres,
                distance=offsets.float().norm(dim=1), seed=torch.tensor(seed))


def _pointing_specs(labels: torch.Tensor, target: torch.Tensor, img_size: int, gen: torch.Generator,
                    seed: int) -> dict[str, torch.Tensor]:
    """The relation task: mark 0 is an arrow (a tee, pointing along its stem in one of four
    directions), mark 1 a plus; ``towards`` (1) when the plus lies in the arrow's 90-degree cone,
    ``away`` (0) when it lies in the opposite cone.

    The offset ``o`` from arrow to plus is drawn from the ring at the target distance, in the
    label's cone, among offsets for which *both* ``A + o`` and ``A - o`` fit, and the arrow's
    centre ``A`` uniformly where both do. The two labels' offsets are then mirror images (``o``
    and ``-o``) over the same places, so the arrow alone (where it is, where it points, its
    colour), the plus alone (where it is, averaged over the four directions), and the pair of
    appearances have one distribution in both classes.

    Not closed: the arrow's direction *with the plus's place* tells the label (``view_accuracy``:
    a far plus sits near the border the arrow points at, or the opposite one). No bounded image
    avoids this: ``E[(B - A) . d]`` changes sign with the label, so the places of A or B given
    the direction ``d`` must differ between the classes.
    """
    num = len(labels)
    direction = torch.randint(4, (num,), generator=gen)
    colours = torch.randint(len(MARK_COLOURS), (num, 2), generator=gen)
    side = ARROW_DIRECTIONS[direction] * (2 * labels - 1)[:, None]  # the cone's axis, (n, 2)
    reach = (img_size - 3) // 2  # |o| per axis for which A - o and A + o both fit
    offsets = torch.empty(num, 2, dtype=torch.long)
    keys = (target * 2).round() / 2
    for key in keys.unique().tolist():
        ring = _ring_offsets(key, img_size)
        ring = ring[ring.abs().amax(1) <= reach]
        for axis in {tuple(a) for a in side[keys == key].tolist()}:
            sel = ((keys == key) & (side == torch.tensor(axis)).all(1)).nonzero().flatten()
            along = (ring * torch.tensor(axis)).sum(1)
            cone = ring[along >= (ring - along[:, None] * torch.tensor(axis)).abs().amax(1)]
            if len(cone) == 0:
                raise ValueError(f"no arrow-and-target placement {key:.1f} px apart fits in a {img_size}x"
                                 f"{img_size} image; the pointing task takes distances in "
                                 f"[{MIN_DISTANCE}, {POINTING_DISTANCE_RANGE[1]:g}]")
            offsets[sel] = cone[torch.randint(len(cone), (len(sel),), generator=gen)]
    lo = 1 + offsets.abs()  # the same box for o and -o
    hi = img_size - 2 - offsets.abs()
    arrow = lo + (torch.rand(num, 2, generator=gen) * (hi - lo + 1)).long()
    shapes = torch.stack([ARROW_GLYPHS[direction], torch.zeros_like(direction)], 1)  # arrow, plus
    return dict(labels=labels, shapes=shapes, colours=colours, centres=torch.stack([arrow, arrow + offsets], 1),
                distance=offsets.float().norm(dim=1), direction=direction, seed=torch.tensor(seed))


def _alignment_specs(labels: torch.Tensor, distances, img_size: int, gen: torch.Generator,
                     seed: int) -> dict[str, torch.Tensor]:
    """The relation task closed to every view short of both places: two marks ``k`` px apart
    (shapes and colours drawn independently per mark), in one row (``same row``, 0) or in one
    column (``same column``, 1).

    A square window of ``2k x 2k`` mark centres is placed uniformly in the image, the first
    centre uniformly in the window, and the second is its partner ``k`` cells further along the
    label's axis, counted around the window (``(u + k) mod 2k``). The partner map is a bijection
    of the window onto itself, so *each* centre is uniform over the same window in both classes,
    and the window depends only on ``k``: one mark alone (place, shape, colour), the other's place
    with any appearance, and the pair of appearances hold both labels equally (``view_accuracy``).
    Only the two places together, their offset ``(0, +-k)`` or ``(+-k, 0)``, tell the label.
    The row and column partner maps commute, so the corners ``u``, ``u + k e_row``,
    ``u + k e_col``, ``u + k (e_row + e_col)`` (mod ``2k``) make four equally likely scenes, two
    of each label, on which any sum ``f(mark 0) + f(mark 1)`` errs at least once.
    """
    num = len(labels)
    top = (img_size - 2) // 2  # centres live in 1..H-2: a 2k window fits while 2k <= H - 2
    lo = ALIGNMENT_MIN_DISTANCE
    if top < lo:
        raise ValueError(f"the alignment task needs img_size >= {2 * lo + 2}, got {img_size}")
    if distances is None:
        k = torch.randint(lo, top + 1, (num,), generator=gen)
    else:
        values = _target_distances(num, distances, gen)
        k = values.round().long()
        if ((values - k).abs() > 1e-6).any() or (k < lo).any() or (k > top).any():
            raise ValueError(f"the alignment task takes whole distances in [{lo}, {top}] px for "
                             f"{img_size}x{img_size} images, got {sorted(set(values.tolist()))}")
    side = 2 * k[:, None]  # (n, 1)
    window = 1 + (torch.rand(num, 2, generator=gen) * (img_size - 1 - side)).long()  # origin, in 1..H-1-2k
    u = (torch.rand(num, 2, generator=gen) * side).long()  # the first centre within the window
    axis = torch.stack([labels, 1 - labels], 1)  # (n, 2): step along rows (column task) or columns (row task)
    v = (u + axis * k[:, None]) % side
    shapes = torch.randint(NUM_SHAPES, (num, 2), generator=gen)
    colours = torch.randint(len(MARK_COLOURS), (num, 2), generator=gen)
    return dict(labels=labels, shapes=shapes, colours=colours, centres=torch.stack([window + u, window + v], 1),
                distance=k.float(), seed=torch.tensor(seed))


def render_long_range(specs: dict[str, torch.Tensor], *, img_size: int = 32,
                      marks: tuple[bool, bool] = (True, True), background: str = "texture") -> torch.Tensor:
    """``(n, 3, H, W)`` uint8 images for ``make_long_range_specs``' output; ``marks`` chooses
    which of the two marks to draw (for tests of what one mark alone reveals), ``background``
    what they are drawn on (``BACKGROUNDS``: ``'texture'`` or ``'plain'``)."""
    if background not in BACKGROUNDS:
        raise ValueError(f"background must be one of {tuple(BACKGROUNDS)}, got {background!r}")
    n = len(specs["labels"])
    gen = torch.Generator().manual_seed(int(specs["seed"]) + 1_000_003)  # background stream
    img = BACKGROUNDS[background](n, img_size, gen)
    gy, gx = torch.meshgrid(torch.arange(-1, 2), torch.arange(-1, 2), indexing="ij")
    for m in (0, 1):
        if not marks[m]:
            continue
        on = GLYPHS[specs["shapes"][:, m]].flatten(1)  # (n, 9)
        rows = (specs["centres"][:, m, 0, None] + gy.flatten()).expand(n, 9)
        cols = (specs["centres"][:, m, 1, None] + gx.flatten()).expand(n, 9)
        b = torch.arange(n)[:, None].expand(n, 9)
        colour = MARK_COLOURS[specs["colours"][:, m]]  # (n, 3)
        colour = colour[:, None].expand(n, 9, 3)
        # Advanced indexing puts the indexed dims first: img[b, :, r, c] is (k, 3).
        img[b[on], :, rows[on], cols[on]] = colour[on]
    return img.round().to(torch.uint8)


def make_long_range(num: int, *, seed: int, img_size: int = 32,
                    distances: float | Sequence[float] | None = None,
                    attribute: str = "alignment", background: str = "plain") -> dict[str, torch.Tensor]:
    """``num`` images of the long-range task: ``images`` (n, 3, H, W) uint8, ``labels`` (n,) int64
    (index into ``CLASSES[attribute]``), ``distance`` (n,) float32 in pixels between the mark
    centres. ``attribute``: ``'alignment'`` (the default, train_cifar's: one row or one column,
    7-15 px), ``'colour'`` / ``'shape'`` (same colour / glyph or not), ``'pointing'``.
    ``distances``: ``None`` for the task's range, a number, or a list of numbers that share the
    images equally. ``background``: ``'plain'`` (the default: a grey level and noise) or
    ``'texture'`` (colour blobs, stripes and noise). The same seed gives the same data."""
    specs = make_long_range_specs(num, seed=seed, img_size=img_size, distances=distances, attribute=attribute)
    return dict(images=render_long_range(specs, img_size=img_size, background=background),
                labels=specs["labels"].long(),
                distance=specs["distance"].float())


def long_range_data(num_train: int, num_test: int, *, seed: int, attribute: str = "alignment",
                    background: str = "plain") -> tuple[ImageData, torch.Tensor]:
    """The task as a data set (``train_cifar.py --dataset long-range``): ``num_train`` training and
    ``num_test`` test scenes from disjoint streams of ``seed``, and the test scenes' distances."""
    tr = make_long_range(num_train, seed=seed, attribute=attribute, background=background)
    te = make_long_range(num_test, seed=seed + 1_000_000, attribute=attribute, background=background)
    data = ImageData(tr["images"], tr["labels"], te["images"], te["labels"], CLASSES[attribute],
                     f"generated long-range task ({attribute}, {background} background)")
    return data, te["distance"]


def _place(specs: dict[str, torch.Tensor], m: int) -> torch.Tensor:
    return specs["centres"][:, m]  # (n, 2) row, col


# What a model that sees only part of an image could know: named views of the specs, each a
# (n, k) integer key. ``view_accuracy`` says how well the label can be told from each.
VIEWS = {
    "mark 0 alone": lambda s: torch.cat([s["shapes"][:, :1], s["colours"][:, :1], _place(s, 0)], 1),
    "mark 1 alone": lambda s: torch.cat([s["shapes"][:, 1:], s["colours"][:, 1:], _place(s, 1)], 1),
    "appearances, unordered": lambda s: (s["shapes"] * len(MARK_COLOURS) + s["colours"]).sort(1).values,
    "mark 0 shape + mark 1 place": lambda s: torch.cat([s["shapes"][:, :1], _place(s, 1)], 1),
    "offset between the marks": lambda s: _place(s, 1) - _place(s, 0),
    "mark 0 shape + offset": lambda s: torch.cat([s["shapes"][:, :1], _place(s, 1) - _place(s, 0)], 1),
}


def view_accuracy(train: dict[str, torch.Tensor], test: dict[str, torch.Tensor], view: str) -> torch.Tensor:
    """``(n_test,)`` bool: is the label right when predicted from one of ``VIEWS`` alone, by the
    majority label of the training images that share the view's value (ties and unseen values
    predict class 0). A held-out lower bound on what that information can reach, given
    ``make_long_range_specs`` output for both sets."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {tuple(VIEWS)}, got {view!r}")
    keys = torch.cat([VIEWS[view](train), VIEWS[view](test)]).long()
    cell = torch.unique(keys, dim=0, return_inverse=True)[1]
    n_train = len(train["labels"])
    count = torch.bincount(cell[:n_train], minlength=int(cell.max()) + 1).float()
    ones = torch.bincount(cell[:n_train], weights=train["labels"].float(), minlength=len(count))
    predict = (2 * ones > count).long()
    return predict[cell[n_train:]] == test["labels"]


def accuracy_by_distance(correct: torch.Tensor, distance: torch.Tensor,
                         edges: Sequence[float] = DEFAULT_EDGES) -> dict[str, list]:
    """Accuracy per distance bin: ``{'edges', 'centres', 'accuracy', 'count'}`` (empty bins give
    ``nan``). ``correct``: (n,) bool, prediction == label; ``distance``: (n,) pixels."""
    if correct.shape != distance.shape:
        raise ValueError(f"correct {tuple(correct.shape)} and distance {tuple(distance.shape)} differ in shape")
    e = torch.as_tensor(edges, dtype=torch.float32)
    which = torch.bucketize(distance.float(), e, right=True) - 1
    acc, count = [], []
    for i in range(len(e) - 1):
        sel = which == i
        count.append(int(sel.sum()))
        acc.append(correct[sel].float().mean().item() if sel.any() else float("nan"))
    centres = ((e[1:] + e[:-1]) / 2).tolist()
    return dict(edges=e.tolist(), centres=centres, accuracy=acc, count=count)
