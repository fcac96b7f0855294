"""Global-context measures (vitattn.context) and the long-range task (vitattn.tasks.classify.longrange)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vitattn import CNNConfig, SmallCNN, ViT, ViTConfig
from vitattn.context import (
    attention_entropy,
    attention_rollout,
    effective_receptive_field,
    head_attention_maps,
    mean_attention_distance,
    patch_centres,
    rollout_map,
    token_norms,
    weighted_radius,
)
from vitattn.tasks.classify.longrange import (
    GLYPHS,
    LONG_RANGE_CLASSES,
    MARK_COLOURS,
    accuracy_by_distance,
    make_long_range,
    make_long_range_specs,
    render_long_range,
)


def uniform_maps(layers=2, b=2, heads=3, n=64, p=0):
    return [torch.full((b, heads, p + n, p + n), 1.0 / (p + n)) for _ in range(layers)]


def test_patch_centres_are_pixel_centres():
    pos = patch_centres((2, 3), 4)
    assert pos.tolist() == [[2, 2], [2, 6], [2, 10], [6, 2], [6, 6], [6, 10]]


# -- mean attention distance ------------------------------------------------------------------
def test_uniform_attention_on_8x8_grid_of_4px_patches_is_16_55px():
    mad = mean_attention_distance(uniform_maps(), (8, 8), 4, 0)
    assert mad.shape == (2, 3)
    torch.testing.assert_close(mad, torch.full((2, 3), 16.5459), atol=1e-3, rtol=0)


def test_self_attention_only_is_zero_and_prefix_tokens_are_dropped():
    eye = torch.eye(1 + 64).expand(2, 4, 65, 65)
    assert mean_attention_distance([eye], 8, 4, 1).abs().max() == 0
    # Half the mass on the class token, half uniform over patches: renormalised, that is uniform.
    a = torch.full((1, 1, 65, 65), 0.5 / 64)
    a[..., 0] = 0.5
    torch.testing.assert_close(mean_attention_distance([a], 8, 4, 1), torch.tensor([[16.5459]]), atol=1e-3, rtol=0)
    # Without renormalising, class-token mass counts as distance 0: half the uniform value.
    raw = mean_attention_distance([a], 8, 4, 1, renormalize=False)
    torch.testing.assert_close(raw, torch.tensor([[16.5459 / 2]]), atol=1e-3, rtol=0)


def test_attention_entropy_is_log_n_for_uniform_zero_for_one_key_and_drops_prefix_tokens():
    torch.testing.assert_close(attention_entropy(uniform_maps(), 0), torch.full((2, 3), math.log(64)))
    eye = torch.eye(1 + 64).expand(2, 4, 65, 65)
    assert attention_entropy([eye], 1).abs().max() == 0  # all weight on one key; 0 log 0 counts 0
    # Half on the class token, half uniform over patches: renormalised over patches it is uniform.
    a = torch.full((1, 1, 65, 65), 0.5 / 64)
    a[..., 0] = 0.5
    torch.testing.assert_close(attention_entropy([a], 1), torch.tensor([[math.log(64)]]))


def test_attention_entropy_tells_sharp_far_attention_from_uniform_where_distance_cannot():
    # Each query puts all its weight on the patch mirrored through the grid's centre: as far on
    # average as uniform attention, yet with zero entropy.
    n = torch.arange(64)
    mirror = torch.zeros(1, 1, 64, 64)
    mirror[0, 0, n, 63 - n] = 1.0
    assert mean_attention_distance([mirror], 8, 4, 0).item() > 16.55
    assert attention_entropy([mirror], 0).item() == 0


def test_attention_entropy_matches_a_direct_sum_per_layer_and_head():
    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(3, 2, 17, 17, generator=g).softmax(-1) for _ in range(2)]
    got = attention_entropy(maps, 1)
    patches = [m[..., 1:, 1:] / m[..., 1:, 1:].sum(-1, keepdim=True) for m in maps]  # class token out
    want = torch.stack([-(a * a.log()).sum(-1).mean(dim=(0, 2)) for a in patches])
    assert got.shape == (2, 2)
    torch.testing.assert_close(got, want)
    assert (got > 0).all() and (got < math.log(16)).all()


def test_attention_distance_per_head_and_layer_and_rectangular_patches():
    # Head 0 attends to the right neighbour (4 px away), head 1 to the one below (8 px with 8x4 patches).
    gh = gw = 4
    n = gh * gw
    a = torch.zeros(1, 2, n, n)
    for i in range(n):
        r, c = divmod(i, gw)
        a[0, 0, i, r * gw + (c + 1) % gw] = 1
        a[0, 1, i, ((r + 1) % gh) * gw + c] = 1
    mad = mean_attention_distance(torch.stack([a, a]), (gh, gw), (8, 4), 0)
    # 12 of 16 queries look one cell on, the 4 that wrap around look 3 cells back.
    torch.testing.assert_close(mad[0], torch.tensor([(12 * 4 + 4 * 12) / 16, (12 * 8 + 4 * 24) / 16]))
    torch.testing.assert_close(mad[1], mad[0])


def test_attention_distance_rejects_mismatched_grid():
    with pytest.raises(ValueError, match="grid"):
        mean_attention_distance(uniform_maps(n=64), (4, 4), 4, 0)


def test_attention_distance_of_a_real_vit_matches_uniform_at_init_scale():
    torch.manual_seed(0)
    vit = ViT(ViTConfig(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=2))
    maps = vit.get_attention_maps(torch.randn(4, 3, 32, 32))
    mad = mean_attention_distance(maps, vit.grid_size, 4, vit.num_prefix_tokens)
    assert mad.shape == (2, 2)
    # Near-zero init gives near-uniform attention: close to 16.55 px, and never beyond the max.
    assert ((mad - 16.55).abs() < 1.0).all(), mad


# -- attention rollout --------------------------------------------------------------------------
def test_rollout_rows_sum_to_one_and_identity_attention_gives_identity():
    torch.manual_seed(0)
    maps = [torch.softmax(torch.randn(2, 3, 17, 17), -1) for _ in range(4)]
    r = attention_rollout(maps, 1)
    assert r.shape == (2, 17, 17)
    torch.testing.assert_close(r.sum(-1), torch.ones(2, 17))
    assert (r >= 0).all()
    eye = [torch.eye(17).expand(2, 3, 17, 17) for _ in range(3)]
    torch.testing.assert_close(attention_rollout(eye, 1), torch.eye(17).expand(2, 17, 17))


def test_rollout_of_one_layer_is_half_attention_half_identity():
    a = torch.softmax(torch.randn(1, 2, 5, 5), -1)
    r = attention_rollout([a], 0)
    torch.testing.assert_close(r[0], 0.5 * a[0].mean(0) + 0.5 * torch.eye(5))
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout([a], 0, head_fusion="median")


def test_rollout_map_and_head_maps():
    torch.manual_seed(0)
    maps = [torch.softmax(torch.randn(2, 3, 1 + 16, 1 + 16), -1) for _ in range(2)]
    m = rollout_map(attention_rollout(maps, 1), (4, 4), 1)
    assert m.shape == (2, 4, 4)
    torch.testing.assert_close(m.sum((1, 2)), torch.ones(2))
    h = head_attention_maps(maps[0], (4, 4), 1)
    assert h.shape == (2, 3, 4, 4)
    expect = maps[0][0, 1, 0, 1:] / maps[0][0, 1, 0, 1:].sum()
    torch.testing.assert_close(h[0, 1].flatten(), expect)
    # A patch query by (row, col) and by index agree.
    torch.testing.assert_close(head_attention_maps(maps[0], 4, 1, (2, 3)), head_attention_maps(maps[0], 4, 1, 11))


# -- effective receptive field ------------------------------------------------------------------
class OneConv(nn.Module):
    """A single 3x3 convolution with the intermediates interface."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.Conv2d(3, 4, 3, padding=1)])

    def forward_intermediates(self, x, indices=None, intermediates_only=True):
        return [self.stages[0](x)]


def test_token_norms_find_a_planted_high_norm_patch_and_nothing_in_equal_norms():
    x = torch.nn.functional.normalize(torch.randn(2, 16, 8), dim=-1)  # every patch token of norm 1
    x[0, 5] *= 10.0                                                  # one artefact patch in image 0
    r = token_norms([x, torch.nn.functional.normalize(x, dim=-1)])
    assert torch.allclose(r["max_ratio"], torch.tensor([(10.0 + 1.0) / 2, 1.0]))  # the mean over images
    assert torch.allclose(r["outlier_share"], torch.tensor([1 / 32, 0.0]))
    assert torch.equal(token_norms(torch.stack([x, x]))["outlier_share"], r["outlier_share"][:1].repeat(2))
    with pytest.raises(ValueError, match="factor must be over 1"):
        token_norms(x, factor=1.0)
    with pytest.raises(ValueError, match=r"expected block outputs \(B, N, D\)"):
        token_norms([torch.randn(2, 3)])


def test_erf_of_a_single_3x3_conv_is_exactly_3x3():
    torch.manual_seed(0)
    model = OneConv()
    (field,) = effective_receptive_field(model, torch.randn(3, 3, 15, 15))
    assert field["name"] == "stages.0" and field["stride"] == (1.0, 1.0) and field["centre"] == (7.0, 7.0)
    nz = field["grad"] > 0
    assert nz.sum() == 9 and nz[6:9, 6:9].all(), nz.nonzero().tolist()
    # The radius is the gradient-weighted mean distance from the centre pixel, so it lies in (0, sqrt 2].
    assert 0 < field["radius_px"] <= 2**0.5
    assert field["radius_px"] == pytest.approx(weighted_radius(field["grad"], (7, 7)))
    assert all(p.grad is None for p in model.parameters())


def test_vit_first_block_sees_the_whole_image_and_cnn_first_stage_is_local():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    vit = ViT(ViTConfig(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=2))
    cnn = SmallCNN(CNNConfig(stem_width=8, widths=(8, 16, 16), num_classes=2))
    vit.train()
    cnn.train()
    v = effective_receptive_field(vit, x, indices=[0])[0]
    c = effective_receptive_field(cnn, x)
    assert v["name"] == "blocks.0" and v["stride"] == (4.0, 4.0) and len(c) == 3
    assert (v["grad"] > 0).all(), "every pixel reaches the centre patch after one global attention"
    # stem conv3x3 -> conv3x3 -> pool/2 -> conv3x3: a 10x10 window around the centre unit.
    nz = (c[0]["grad"] > 0).nonzero()
    assert nz.min(0).values.tolist() == [12, 12] and nz.max(0).values.tolist() == [21, 21]
    outside = torch.ones(32, 32, dtype=torch.bool)
    outside[12:22, 12:22] = False
    assert v["grad"][outside].sum() > 0 and c[0]["grad"][outside].sum() == 0
    # Deeper CNN stages see farther.
    radii = [f["radius_px"] for f in c]
    assert radii == sorted(radii)
    # The models keep their mode and get no parameter gradients.
    assert vit.training and cnn.training
    assert all(p.grad is None for p in [*vit.parameters(), *cnn.parameters()])


def test_erf_rejects_integer_images():
    with pytest.raises(ValueError, match="float images"):
        effective_receptive_field(OneConv(), torch.zeros(1, 3, 8, 8, dtype=torch.uint8))


# -- the long-range task ------------------------------------------------------------------------
def test_long_range_is_deterministic_balanced_and_typed():
    a = make_long_range(400, seed=3)
    b = make_long_range(400, seed=3)
    c = make_long_range(400, seed=4)
    assert a["images"].shape == (400, 3, 32, 32) and a["images"].dtype == torch.uint8
    assert a["labels"].dtype == torch.int64 and a["distance"].dtype == torch.float32
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["images"], c["images"])
    assert a["labels"].sum() == 200 and len(LONG_RANGE_CLASSES) == 2


def test_long_range_distances_cover_near_to_far_and_can_be_set():
    d = make_long_range_specs(2000, seed=0, attribute="colour")["distance"]
    assert d.min() < 5 and d.max() > 27
    assert (d >= 3.5).all()
    fixed = make_long_range_specs(300, seed=0, distances=[4, 26], attribute="colour")["distance"]
    assert ((fixed - 4).abs() <= 0.5).sum() == 150 and ((fixed - 26).abs() <= 0.5).sum() == 150
    with pytest.raises(ValueError, match="overlap"):
        make_long_range_specs(10, seed=0, distances=2, attribute="colour")
    with pytest.raises(ValueError, match="fits"):
        make_long_range_specs(10, seed=0, distances=60, attribute="colour")


@pytest.mark.parametrize("attribute", ["colour", "shape"])
def test_long_range_one_mark_says_nothing_about_the_label(attribute):
    s = make_long_range_specs(8000, seed=1, attribute=attribute)
    y = s["labels"].float()
    key = "colours" if attribute == "colour" else "shapes"
    # The label is what it says, and glyphs share one area.
    assert torch.equal(s["labels"], (s[key][:, 0] == s[key][:, 1]).long())
    assert len({int(g.sum()) for g in GLYPHS}) == 1
    # For either mark alone, every shape, colour and position band holds both labels equally.
    for m in (0, 1):
        for what, values in (("shape", s["shapes"][:, m]), ("colour", s["colours"][:, m]),
                             ("row band", s["centres"][:, m, 0] // 8), ("col band", s["centres"][:, m, 1] // 8)):
            for v in values.unique():
                sel = values == v
                assert abs(y[sel].mean() - 0.5) < 0.06, (m, what, int(v), float(y[sel].mean()), int(sel.sum()))
    # The nuisance attribute matches by chance only (1 in 4 glyphs, 1 in 6 colours) in both classes.
    other = "shapes" if attribute == "colour" else "colours"
    same_other = (s[other][:, 0] == s[other][:, 1]).float()
    assert abs(same_other[y == 1].mean() - same_other[y == 0].mean()) < 0.04
    # Distance is independent of the label.
    assert abs(s["distance"][y == 1].mean() - s["distance"][y == 0].mean()) < 0.5
    with pytest.raises(ValueError, match="attribute"):
        make_long_range_specs(4, seed=0, attribute="size")


def test_long_range_marks_are_drawn_where_the_specs_say():
    s = make_long_range_specs(50, seed=2, attribute="colour")
    both = render_long_range(s)
    first = render_long_range(s, marks=(True, False))
    none = render_long_range(s, marks=(False, False))
    for i in range(50):
        for m, img in ((0, first), (1, both)):
            r, c = s["centres"][i, m].tolist()
            on = GLYPHS[s["shapes"][i, m]]
            patch = img[i, :, r - 1:r + 2, c - 1:c + 2]
            colour = MARK_COLOURS[s["colours"][i, m]].to(torch.uint8)
            assert (patch.permute(1, 2, 0)[on] == colour).all()
    # Outside the marks, the images are the same background.
    assert ((both != none).any(1).sum((1, 2)) == 10).all()


def test_plain_background_is_one_grey_level_and_the_marks_are_the_same():
    s = make_long_range_specs(40, seed=3, attribute="alignment")
    plain = render_long_range(s, background="plain")
    empty = render_long_range(s, marks=(False, False), background="plain")
    flat = empty.flatten(1)
    assert (flat == flat[:, :1]).all() and flat[:, 0].float().std() > 5  # flat per image, varied between images
    for i in range(40):
        for m in (0, 1):
            r, c = s["centres"][i, m].tolist()
            patch = plain[i, :, r - 1:r + 2, c - 1:c + 2].permute(1, 2, 0)[GLYPHS[s["shapes"][i, m]]]
            assert (patch == MARK_COLOURS[s["colours"][i, m]].to(torch.uint8)).all()
    assert ((plain != empty).any(1).sum((1, 2)) == 10).all()  # nothing but two 5-pixel glyphs
    with pytest.raises(ValueError, match="background must be one of"):
        render_long_range(s, background="stars")


def test_accuracy_by_distance_bins():
    correct = torch.tensor([True, False, True, True])
    dist = torch.tensor([4.0, 5.0, 20.0, 30.0])
    out = accuracy_by_distance(correct, dist, edges=(0, 10, 25, 40))
    assert out["count"] == [2, 1, 1] and out["accuracy"] == [0.5, 1.0, 1.0]



def test_pointing_task_labels_the_relation_and_one_mark_alone_says_nothing():
    """The 'pointing' label is where the plus lies relative to where the arrow points; the arrow
    alone, the plus alone and the pair of appearances hold both labels equally."""
    from vitattn.tasks.classify.longrange import ARROW_DIRECTIONS, ARROW_GLYPHS, POINTING_CLASSES

    s = make_long_range_specs(12000, seed=5, attribute="pointing")
    y = s["labels"].float()
    assert y.sum() == 6000 and POINTING_CLASSES[1] == "towards"
    arrow, plus = s["centres"][:, 0], s["centres"][:, 1]
    along = ((plus - arrow) * ARROW_DIRECTIONS[s["direction"]]).sum(1).float()
    across = ((plus - arrow) - along[:, None].long() * ARROW_DIRECTIONS[s["direction"]]).abs().amax(1)
    assert torch.equal((along > 0).long(), s["labels"]) and (along.abs() >= across).all()  # in a cone
    assert torch.equal(s["shapes"][:, 0], ARROW_GLYPHS[s["direction"]]) and (s["shapes"][:, 1] == 0).all()
    assert s["distance"].min() >= 3.5 and s["distance"].max() <= 19.6
    assert abs(s["distance"][y == 1].mean() - s["distance"][y == 0].mean()) < 0.3
    cells = {
        "arrow: direction x row band x col band": s["direction"] * 16 + (arrow[:, 0] // 8) * 4 + arrow[:, 1] // 8,
        "arrow: direction x colour": s["direction"] * 6 + s["colours"][:, 0],
        "plus: row band x col band": (plus[:, 0] // 8) * 4 + plus[:, 1] // 8,
        "plus: colour": s["colours"][:, 1],
        "pair of appearances: direction x both colours": s["direction"] * 36 + s["colours"][:, 0] * 6
        + s["colours"][:, 1],
    }
    for what, cell in cells.items():
        for v in cell.unique():
            sel = cell == v
            n = int(sel.sum())
            if n >= 40:  # 4 standard errors of a fair coin, or 0.08, whichever is larger
                tol = max(0.08, 4 * 0.5 / n**0.5)
                assert abs(y[sel].mean() - 0.5) < tol, (what, int(v), float(y[sel].mean()), n)
    img = render_long_range(s)[:20]
    for i in range(20):
        r, c = arrow[i].tolist()
        on = GLYPHS[s["shapes"][i, 0]]
        assert (img[i, :, r - 1:r + 2, c - 1:c + 2].permute(1, 2, 0)[on]
                == MARK_COLOURS[s["colours"][i, 0]].to(torch.uint8)).all()
    with pytest.raises(ValueError, match="pointing task takes distances"):
        make_long_range_specs(10, seed=0, attribute="pointing", distances=24)


def test_alignment_task_labels_the_relation_and_each_mark_is_uniform_in_both_classes():
    """'alignment': one row (0) or one column (1), k px apart; each centre, with or without its
    appearance, has one distribution in both classes (per cell of 12,000 images), and the two
    marks are exchangeable."""
    from vitattn.tasks.classify.longrange import ALIGNMENT_CLASSES, ALIGNMENT_MIN_DISTANCE

    s = make_long_range_specs(12000, seed=5, attribute="alignment")
    y = s["labels"].float()
    assert y.sum() == 6000 and ALIGNMENT_CLASSES == ("same row", "same column")
    off = s["centres"][:, 1] - s["centres"][:, 0]
    k = s["distance"].long()
    assert (off.gather(1, s["labels"][:, None]) == 0).all()  # row task: no row step; column task: no column step
    assert torch.equal(off.abs().amax(1), k) and k.min() == ALIGNMENT_MIN_DISTANCE and k.max() == 15
    assert s["centres"].min() >= 1 and s["centres"].max() <= 30  # 3x3 glyphs fit
    for m in (0, 1):
        place = s["centres"][:, m]
        cells = {"distance x row band x col band": k * 16 + (place[:, 0] // 8) * 4 + place[:, 1] // 8,
                 "shape x colour x row band": (s["shapes"][:, m] * 6 + s["colours"][:, m]) * 4 + place[:, 0] // 8}
        for what, cell in cells.items():
            for v in cell.unique():
                sel = cell == v
                n = int(sel.sum())
                if n >= 40:  # 4 standard errors of a fair coin, or 0.08, whichever is larger
                    assert abs(y[sel].mean() - 0.5) < max(0.08, 4 * 0.5 / n**0.5), (m, what, int(v), n)
    # exchangeable: the first and the second centre have the same row histogram
    h0, h1 = (torch.bincount(s["centres"][:, m, 0], minlength=32).float() / 12000 for m in (0, 1))
    assert (h0 - h1).abs().max() < 0.01
    img = render_long_range(s)[:20]
    for i in range(20):
        r, c = s["centres"][i, 1].tolist()
        on = GLYPHS[s["shapes"][i, 1]]
        assert (img[i, :, r - 1:r + 2, c - 1:c + 2].permute(1, 2, 0)[on]
                == MARK_COLOURS[s["colours"][i, 1]].to(torch.uint8)).all()
    two = make_long_range_specs(10, seed=0, attribute="alignment", distances=[7, 15])["distance"]
    assert sorted(two.tolist()) == [7.0] * 5 + [15.0] * 5
    for bad in (6, 16, 9.5):
        with pytest.raises(ValueError, match="alignment task takes whole distances in \\[7, 15\\]"):
            make_long_range_specs(10, seed=0, attribute="alignment", distances=bad)
    with pytest.raises(ValueError, match="needs img_size >= 16"):
        make_long_range_specs(10, seed=0, attribute="alignment", img_size=14)


@pytest.mark.parametrize("attribute, leaks", [
    ("colour", {"appearances, unordered": 1.0}),  # the counting shortcut
    # bounded images: a far plus is pinned near the border the arrow points at
    ("pointing", {"mark 0 shape + offset": 1.0, "mark 0 shape + mark 1 place": 0.85}),
    ("alignment", {"offset between the marks": 1.0, "mark 0 shape + offset": 1.0}),  # only the relation
])
def test_partial_views_show_what_each_task_leaks(attribute, leaks):
    """``view_accuracy`` on held-out images: the views a task leaks reach at least the stated
    accuracy, every other view stays at chance."""
    from vitattn.tasks.classify.longrange import VIEWS, view_accuracy

    train = make_long_range_specs(60_000, seed=0, attribute=attribute)
    test = make_long_range_specs(6_000, seed=1, attribute=attribute)
    for view in VIEWS:
        acc = view_accuracy(train, test, view).float().mean().item()
        if view in leaks:
            assert acc >= leaks[view] - 0.01, (view, acc)
        else:
            assert abs(acc - 0.5) < 0.04, (view, acc)  # 6 standard errors of 6,000 coin flips
    with pytest.raises(ValueError, match="view must be one of"):
        view_accuracy(train, test, "everything")


def test_bag_of_local_features_control_sees_5x5_and_forgets_where():
    import vitattn

    torch.manual_seed(0)
    m = vitattn.create_model("bof_longrange").eval()
    x = torch.randn(4, 3, 32, 32)
    assert m(x).shape == (4, 2)
    fields = effective_receptive_field(m, x)
    assert [f["name"] for f in fields] == ["stages.0", "stages.1"]
    support = fields[1]["grad"] > 0
    rows, cols = support.nonzero(as_tuple=True)
    assert (rows.max() - rows.min() + 1, cols.max() - cols.min() + 1) == (5, 5)  # two 3x3 convs
    f = m.forward_features(x)
    perm = torch.randperm(32 * 32, generator=torch.Generator().manual_seed(0))
    shuffled = f.flatten(2)[..., perm].view_as(f)
    torch.testing.assert_close(m.forward_head(shuffled), m.forward_head(f))  # the head reads a bag


def _two_mark_images() -> torch.Tensor:
    """A grey image, the same with mark A (top left), with mark B (bottom right) and with both:
    ``(4, 3, 32, 32)`` in the order none, A, B, both."""
    x = torch.full((4, 3, 32, 32), 0.1)
    x[1::2, :, 1:4, 1:4] = torch.tensor([1.0, -1.0, 0.5])[:, None, None]  # A in images 1 and 3
    x[2:, :, 26:29, 27:30] = torch.tensor([-1.0, 1.0, 0.2])[:, None, None]  # B in images 2 and 3
    return x


def interaction(model: nn.Module) -> float:
    """``|f(A and B) - f(A) - f(B) + f(none)|``, largest over logits, over the larger effect of
    one mark alone: what the two marks do together beyond what each does alone; zero for a
    read-out that adds up places apart."""
    with torch.no_grad():
        none, a, b, both = model.eval()(_two_mark_images())
    alone = torch.stack([(a - none).abs().max(), (b - none).abs().max()]).max()
    return ((both - a - b + none).abs().max() / alone).item()


def test_average_read_out_adds_up_places_unless_a_layer_reaches_across():
    """With a mean over places and a linear head, marks seen by no common unit add up exactly
    (the ViT without token mixing, the one-stage CNN with 10-px fields), so such a model cannot
    tell the alignment task's two labels apart beyond 3 in 4 (docs/context.md); attention or
    a deep enough CNN lets them interact. A max read-out lets them interact without reach."""
    torch.manual_seed(0)
    gap = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=2,
               class_token=False, global_pool="avg", fc_norm=False)
    local = dict(window_size=1, window_block_indexes=[0, 1])
    assert interaction(ViT(**gap, **local)) < 1e-4  # float error only (measured 2e-6)
    assert interaction(ViT(**gap)) > 1e-3  # at initialisation, near-uniform attention (7e-3)
    assert interaction(ViT(**{**gap, "global_pool": "max"}, **local)) > 0.1
    cnn = dict(stem_width=8, num_classes=2, global_pool="avg")
    assert interaction(SmallCNN(**cnn, widths=(16,))) < 1e-4
    assert interaction(SmallCNN(**cnn, widths=(16, 16, 16))) > 1e-3
    assert interaction(SmallCNN(**{**cnn, "global_pool": "max"}, widths=(16,))) > 0.1
    with pytest.raises(ValueError, match=r"global_pool must be 'max', 'avg' or '' \(no pooling\), got 'token'"):
        CNNConfig(global_pool="token")
