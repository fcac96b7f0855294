"""ViTDet backbone, torchvision detectors built on it, and the COCO-style AP."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from coco_oracle import average_precision, coco_map_reference

from vitattn import ViT, resample_abs_pos_embed
from vitattn.tasks.detect.coco import coco_map
from vitattn.vitdet import DETECTORS, ViTDetBackbone, build_detector, vitdet_window_blocks


def tiny_vit(**kw) -> ViT:
    torch.manual_seed(0)
    cfg = dict(img_size=64, patch_size=16, embed_dim=32, depth=3, num_heads=2, num_classes=10)
    return ViT(**{**cfg, **kw})


# -- the pyramid ------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", [(64, 64), (96, 160), (112, 80), (100, 70)])
def test_pyramid_strides_and_channels(hw):
    bb = ViTDetBackbone(tiny_vit(), out_channels=24).eval()
    assert bb.out_channels == 24
    assert dict(bb.strides) == {"0": 4, "1": 8, "2": 16, "3": 32, "pool": 64}
    with torch.no_grad():
        out = bb(torch.randn(2, 3, *hw))
    assert list(out) == ["0", "1", "2", "3", "pool"]
    gh, gw = (math.ceil(s / 16) for s in hw)  # sides that do not divide are padded
    expect = {"0": (4 * gh, 4 * gw), "1": (2 * gh, 2 * gw), "2": (gh, gw),
              "3": (math.ceil(gh / 2), math.ceil(gw / 2))}
    expect["pool"] = tuple(math.ceil(s / 2) for s in expect["3"])
    for name, y in out.items():
        assert tuple(y.shape) == (2, 24, *expect[name]), (name, tuple(y.shape), expect[name])
        assert torch.isfinite(y).all()


def test_pyramid_other_patch_and_scales():
    vit = tiny_vit(patch_size=8)
    bb = ViTDetBackbone(vit, out_channels=16, scale_factors=(2, 1, 0.5), top_block=False).eval()
    assert dict(bb.strides) == {"0": 4, "1": 8, "2": 16}
    out = bb(torch.randn(1, 3, 48, 80))
    assert [tuple(y.shape[-2:]) for y in out.values()] == [(12, 20), (6, 10), (3, 5)]
    with pytest.raises(ValueError, match="scale factor 3"):
        ViTDetBackbone(tiny_vit(), scale_factors=(3.0,))
    with pytest.raises(ValueError, match="finest first"):
        ViTDetBackbone(tiny_vit(), scale_factors=(1.0, 2.0))


def test_backbone_drops_head_and_accepts_any_size():
    vit = tiny_vit()
    assert not vit.dynamic_img_size
    bb = ViTDetBackbone(vit)
    assert vit.dynamic_img_size and vit.config.dynamic_img_size and vit.num_classes == 0
    assert not any(k.startswith("vit.head") for k in bb.state_dict())


# -- windows ----------------------------------------------------------------------------------
def test_vitdet_window_layout():
    assert vitdet_window_blocks(12) == (0, 1, 3, 4, 6, 7, 9, 10)  # global in 2, 5, 8, 11
    vit = tiny_vit(depth=6, window_size=14)  # windows are the ViT's config, ViTDet's layout by default
    assert [b.attn.window_size for b in vit.blocks] == [(14, 14), (14, 14), None] * 2
    assert vit.config.window_size == 14 and vit.config.window_block_indexes == (0, 1, 3, 4)
    bb = ViTDetBackbone(vit, 16)
    assert [b.attn.window_size for b in bb.vit.blocks] == [(14, 14), (14, 14), None] * 2
    with pytest.raises(ValueError, match="block indices in 0..5"):
        tiny_vit(depth=6, window_size=4, window_block_indexes=[7])


@pytest.mark.parametrize("window", [6, 9])  # 6 covers the 6x5 grid exactly, 9 overhangs it (padded)
def test_window_covering_grid_equals_global(window):
    x = torch.randn(2, 3, 96, 80)
    glob = ViTDetBackbone(tiny_vit(), 16).eval()
    win = ViTDetBackbone(tiny_vit(window_size=window, window_block_indexes=[0, 1, 2]), 16).eval()
    win.load_state_dict(glob.state_dict())
    with torch.no_grad():
        a, b = glob(x), win(x)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    # and a window smaller than the grid really changes the result
    small = ViTDetBackbone(tiny_vit(window_size=3, window_block_indexes=[0, 1, 2]), 16).eval()
    small.load_state_dict(glob.state_dict())
    with torch.no_grad():
        assert (small(x)["2"] - a["2"]).abs().max() > 1e-3


def test_windows_do_not_see_each_other():
    """With windows in every block (and no class token to carry information across), the map of
    the top-left window ignores pixels in the others, also when the grid does not divide."""
    vit = tiny_vit(class_token=False, global_pool="avg", window_size=3, window_block_indexes=[0, 1, 2])
    bb = ViTDetBackbone(vit, 16).eval()
    x = torch.randn(1, 3, 112, 80)  # grid 7x5: windows of 3 overhang on both sides
    y = x.clone()
    y[:, :, 48:, :] += torch.randn_like(y[:, :, 48:, :])  # rows of windows below the first
    y[:, :, :, 48:] += torch.randn_like(y[:, :, :, 48:])  # columns right of the first
    with torch.no_grad():
        a, b = bb.forward_map(x), bb.forward_map(y)
    torch.testing.assert_close(a[..., :3, :3], b[..., :3, :3])
    assert (a[..., 3:, :] - b[..., 3:, :]).abs().max() > 1e-3


# -- weights ----------------------------------------------------------------------------------
def test_load_vit_weights_resamples_and_skips_head():
    src = ViT(img_size=32, patch_size=16, embed_dim=32, depth=3, num_heads=2, num_classes=7)
    bb = ViTDetBackbone(tiny_vit(img_size=96), 16)  # grid 6x6 against the source's 2x2
    report = bb.load_vit_weights(src)
    assert report["skipped"] == ["head.weight", "head.bias"]
    assert report["missing"] == [] and report["unexpected"] == []
    torch.testing.assert_close(bb.vit.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    torch.testing.assert_close(bb.vit.pos_embed, resample_abs_pos_embed(src.pos_embed, (6, 6), (2, 2)))


def test_avg_pool_vit_drops_fc_norm():
    src = ViT(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2, class_token=False, global_pool="avg")
    bb = ViTDetBackbone(tiny_vit(depth=2, class_token=False, global_pool="avg"), 16)
    assert not any("fc_norm" in k for k in bb.state_dict())
    report = bb.load_vit_weights(src.state_dict())
    assert report["skipped"] == ["head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"]
    sum(y.sum() for y in bb(torch.randn(1, 3, 64, 48)).values()).backward()
    assert all(p.grad is not None for p in bb.parameters())


def test_load_timm_weights():
    timm = pytest.importorskip("timm")
    src = timm.models.vision_transformer.VisionTransformer(
        img_size=48, patch_size=16, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    bb = ViTDetBackbone(tiny_vit(), 16)
    report = bb.load_vit_weights(src.state_dict())
    assert report["skipped"] == ["head.weight", "head.bias"]
    torch.testing.assert_close(bb.vit.blocks[2].mlp.fc2.weight, src.blocks[2].mlp.fc2.weight)
    torch.testing.assert_close(bb.vit.pos_embed, resample_abs_pos_embed(src.pos_embed, (4, 4), (3, 3)))
    with pytest.raises(ValueError, match="width 32 != model width 64"):
        ViTDetBackbone(tiny_vit(embed_dim=64), 16).load_vit_weights(src.state_dict())


# -- the detectors ----------------------------------------------------------------------------
def batch(masks: bool = False):
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 96, generator=g), torch.rand(3, 80, 64, generator=g)]
    targets = []
    for img in images:
        boxes = torch.tensor([[5.0, 6.0, 40.0, 30.0], [20.0, 10.0, 50.0, 60.0]])
        t = {"boxes": boxes, "labels": torch.tensor([1, 2])}
        if masks:
            m = torch.zeros(2, *img.shape[1:], dtype=torch.uint8)
            for i, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
                m[i, y1:y2, x1:x2] = 1
            t["masks"] = m
        targets.append(t)
    return images, targets


SMALL = dict(min_size=64, max_size=128)
RCNN_SMALL = dict(rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100, rpn_pre_nms_top_n_test=100,
                  rpn_post_nms_top_n_test=50, box_batch_size_per_image=32)


def small_detector(kind: str, vit: ViT):
    """Two object classes, labels 1 and 2: ``num_classes=3`` for every detector, as torchvision."""
    extra = RCNN_SMALL if kind in ("fasterrcnn", "maskrcnn") else {}
    return build_detector(kind, vit, 3, out_channels=32, **SMALL, **extra)


@pytest.mark.parametrize("kind", DETECTORS)
def test_detector_train_step_and_eval(kind):
    vit = tiny_vit(depth=2)
    model = small_detector(kind, vit)
    images, targets = batch(masks=kind == "maskrcnn")
    model.train()
    losses = model(images, targets)
    expected = {"fasterrcnn": {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"},
                "retinanet": {"classification", "bbox_regression"},
                "fcos": {"classification", "bbox_regression", "bbox_ctrness"}}
    expected["maskrcnn"] = expected["fasterrcnn"] | {"loss_mask"}
    assert set(losses) == expected[kind]
    assert all(torch.isfinite(v) for v in losses.values()), losses
    sum(losses.values()).backward()
    no_grad = [n for n, p in vit.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == [], f"no gradient reached {no_grad}"

    model.eval()
    with torch.no_grad():
        out = model(images)
    assert len(out) == 2
    for o, img in zip(out, images):
        assert {"boxes", "labels", "scores"} <= set(o)
        n = len(o["boxes"])
        assert o["boxes"].shape == (n, 4) and o["labels"].shape == (n,) and o["scores"].shape == (n,)
        h, w = img.shape[1:]
        assert (o["boxes"][:, 2] <= w).all() and (o["boxes"][:, 3] <= h).all()


@pytest.mark.parametrize("kind", ["fcos", "fasterrcnn"])
def test_under_autocast_the_backbone_computes_in_bf16_and_the_heads_and_boxes_in_fp32(kind):
    """The loop runs the whole forward pass under autocast; fp32_heads (Float32 modules) keeps the
    heads, anchors and boxes in fp32 with every weight under its name, in training and in eval."""
    from vitattn.vitdet import Float32, fp32_heads

    torch.manual_seed(0)
    plain = small_detector(kind, tiny_vit(depth=2))
    model = fp32_heads(small_detector(kind, tiny_vit(depth=2)))
    assert isinstance(model.backbone, Float32) and list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())  # a checkpoint loads either way
    seen = {}

    def record(name, dtype_of):
        def hook(module, inputs, output) -> None:  # a hook that returns a value would replace the output
            seen.setdefault(name, dtype_of(inputs, output))
        return hook

    model.backbone.vit.blocks[0].attn.qkv.register_forward_hook(record("qkv", lambda i, o: o.dtype))
    head = model.head.classification_head.cls_logits if kind == "fcos" else model.roi_heads.box_predictor.cls_score
    head.register_forward_hook(record("head", lambda i, o: o.dtype))
    images, targets = batch()
    model.train()
    assert model.head.training if kind == "fcos" else model.roi_heads.training and model.rpn.training
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(images, targets)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    model.eval()
    assert not (model.head.training if kind == "fcos" else model.roi_heads.training)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images)
    assert seen == {"qkv": torch.bfloat16, "head": torch.float32}
    assert all(o["boxes"].dtype == o["scores"].dtype == torch.float32 for o in out)


class TwoLevels(torch.nn.Module):
    """A stand-in for any other backbone: what build_detector reads is out_channels and strides."""

    out_channels = 32
    strides = {"0": 8, "pool": 16}

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 32, 8, stride=8)

    def forward(self, x):
        y = self.conv(x)
        return OrderedDict([("0", y), ("pool", torch.nn.functional.max_pool2d(y, 1, 2))])


def test_build_detector_other_backbone():
    model = build_detector("fasterrcnn", TwoLevels(), 3, **SMALL, **RCNN_SMALL)
    assert model.roi_heads.box_roi_pool.featmap_names == ["0"]
    assert model.rpn.anchor_generator.sizes == ((64,), (128,))
    images, targets = batch()
    losses = model(images, targets)
    assert all(torch.isfinite(v) for v in losses.values())
    with pytest.raises(ValueError, match="out_channels and strides"):
        build_detector("fcos", torch.nn.Conv2d(3, 8, 1), 3)


def test_build_detector_checks():
    with pytest.raises(ValueError, match="unknown detector"):
        build_detector("yolo", tiny_vit(), 3)
    with pytest.raises(ValueError, match="anchor size tuples for 5"):
        build_detector("fcos", tiny_vit(), 3, anchor_sizes=((8,), (16,)))
    with pytest.raises(ValueError, match="multiple of 32, got 24"):
        build_detector("fcos", tiny_vit(), 3, out_channels=24)
    bb = ViTDetBackbone(tiny_vit(), 32)
    with pytest.raises(ValueError, match="belongs to ViTDetBackbone"):
        build_detector("fcos", bb, 3, out_channels=64)
    model = build_detector("retinanet", bb, 3)
    assert model.backbone is bb
    # anchors follow the strides: RetinaNet's 4x stride, three octave scales
    sizes = model.anchor_generator.sizes
    assert [round(s[0]) for s in sizes] == [16, 32, 64, 128, 256] and len(sizes[0]) == 3


# -- COCO-style AP ----------------------------------------------------------------------------
def det(boxes, scores, labels):
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "scores": torch.tensor(scores, dtype=torch.float32), "labels": torch.tensor(labels)}


def gt(boxes, labels):
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}


def test_ap_perfect_and_empty():
    t = [gt([[0, 0, 10, 10], [20, 20, 30, 40]], [1, 2])]
    p = [det([[0, 0, 10, 10], [20, 20, 30, 40]], [0.9, 0.8], [1, 2])]
    r = coco_map(p, t)
    assert r["map"] == pytest.approx(1.0) and r["map_50"] == pytest.approx(1.0)
    r = coco_map([det([], [], [])], t)
    assert r["map"] == 0.0 and r["map_small"] == 0.0


def test_ap_by_object_size_follows_cocos_area_ranges():
    # a small (10x10 = 100 px^2), a medium (40x40) and a large (100x100) object of one class;
    # the detector finds the small and the large one: AP small 1, medium 0, large 1.
    t = [gt([[0, 0, 10, 10], [20, 20, 60, 60], [100, 100, 200, 200]], [1, 1, 1])]
    p = [det([[0, 0, 10, 10], [100, 100, 200, 200]], [0.9, 0.8], [1, 1])]
    r = coco_map(p, t)
    assert (r["map_small"], r["map_medium"], r["map_large"]) == (pytest.approx(1.0), 0.0, pytest.approx(1.0))
    # no ground truth in a range reads -1, as pycocotools' summary does
    r = coco_map([det([[0, 0, 10, 10]], [0.9], [1])], [gt([[0, 0, 10, 10]], [1])])
    assert r["map_small"] == pytest.approx(1.0) and r["map_medium"] == r["map_large"] == -1.0


def test_ap_hand_computed_ranking():
    # two objects; detections TP (0.9), FP (0.8), TP (0.7): recall .5 .5 1, precision 1 .5 .667.
    # The envelope reads 1 at recall 0..0.50 (51 points) and 2/3 at 0.51..1 (50 points).
    t = [gt([[0, 0, 10, 10]], [1]), gt([[5, 5, 25, 25]], [1])]
    p = [det([[0, 0, 10, 10], [50, 50, 60, 60]], [0.9, 0.8], [1, 1]), det([[5, 5, 25, 25]], [0.7], [1])]
    expect = (51 * 1.0 + 50 * 2 / 3) / 101
    r = coco_map(p, t)
    assert r["map"] == pytest.approx(expect) and r["map_50"] == pytest.approx(expect)
    assert average_precision(torch.tensor([0.9, 0.8, 0.7]), torch.tensor([True, False, True]), 2) == \
        pytest.approx(expect)


def test_ap_iou_thresholds():
    # IoU 0.62: a hit at thresholds 0.50, 0.55, 0.60 only -> mAP = 3/10.
    r = coco_map([det([[0, 0, 10, 6.2]], [0.9], [1])], [gt([[0, 0, 10, 10]], [1])])
    assert r["map_50"] == pytest.approx(1.0) and r["map_75"] == 0.0 and r["map"] == pytest.approx(0.3)


def test_ap_duplicates_and_matching_per_threshold():
    t = [gt([[0, 0, 10, 10]], [1])]
    # A (0.9) overlaps 0.72, B (0.8) overlaps exactly. Up to IoU 0.70 A matches and B is a
    # duplicate (AP 1); from 0.75 A misses and B matches second (precision 1/2 -> AP 0.5).
    p = [det([[0, 0, 10, 7.2], [0, 0, 10, 10]], [0.9, 0.8], [1, 1])]
    r = coco_map(p, t)
    assert r["map_50"] == pytest.approx(1.0) and r["map_75"] == pytest.approx(0.5)
    assert r["map"] == pytest.approx(0.75)


def test_ap_classes():
    t = [gt([[0, 0, 10, 10], [20, 20, 30, 30]], [1, 2])]
    # right box, wrong label for class 2; a false positive of class 3 (no ground truth) is ignored
    p = [det([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]], [0.9, 0.9, 0.9], [1, 1, 3])]
    r = coco_map(p, t)
    # class 1: TP then FP at equal score (stable order) -> AP 1; class 2: no detection -> 0
    assert r["per_class"] == {1: pytest.approx(1.0), 2: 0.0}
    assert r["map"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="predictions for"):
        coco_map(p, t + t)


def test_coco_map_agrees_with_the_hand_written_oracle_on_a_varied_fixture():
    """Several images, three classes, misses, duplicates, false positives, a class predicted but
    never present, an image with no detections: pycocotools and the oracle give the same AP."""
    g = torch.Generator().manual_seed(0)
    preds, targets = [], []
    for i in range(12):
        n = int(torch.randint(1, 5, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * 80
        wh = 8 + torch.rand(n, 2, generator=g) * 30
        boxes = torch.cat([xy, xy + wh], 1)
        labels = torch.randint(1, 4, (n,), generator=g)
        targets.append({"boxes": boxes, "labels": labels})
        if i == 5:
            preds.append(det([], [], []))
            continue
        keep = torch.rand(n, generator=g) > 0.25  # misses
        jitter = (torch.rand(n, 4, generator=g) - 0.5) * 10
        pb, pl = (boxes + jitter)[keep], labels[keep]
        dup = pb[:1] + 2.0  # a near-duplicate of the first kept box
        fp = torch.tensor([[90.0, 90.0, 110.0, 105.0]])  # background
        pb = torch.cat([pb, dup, fp])
        pl = torch.cat([pl, pl[:1], torch.tensor([4 if i % 3 == 0 else 1])])
        scores = torch.rand(len(pb), generator=g)
        preds.append({"boxes": pb, "scores": scores, "labels": pl})
    got, want = coco_map(preds, targets), coco_map_reference(preds, targets)
    assert 0.05 < got["map"] < 0.95  # a fixture where the details matter
    for k in ("map", "map_50", "map_75"):
        assert got[k] == pytest.approx(want[k], abs=1e-9), k
    assert got["per_class"].keys() == want["per_class"].keys() == {1, 2, 3}
    for c in got["per_class"]:
        assert got["per_class"][c] == pytest.approx(want["per_class"][c], abs=1e-9), c
