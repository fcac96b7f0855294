"""vitattn.training.optim: the lr schedule, parameter groups, the EMA, Muon and the optimiser chain."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import needs_cxx

import train_cifar as T
from vitattn.tasks.classify.recipes import RECIPES
from vitattn.training import stack as seedstack
from vitattn.training.optim import get_lr, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lr_schedule_warms_up_then_decays_to_zero():
    for decay in ("cosine", "linear"):
        lrs = [get_lr(p / 100, 1.0, 0.1, decay) for p in range(101)]
        assert lrs[0] == 0 and lrs[10] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.0, abs=1e-12)
        assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))
        assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert get_lr(0.55, 2.0, 0.1, "cosine") == pytest.approx(1.0)  # half way through the cosine


def test_lr_schedule_can_start_and_end_above_zero():
    """airbench's triangle: 0.2 of the peak at the start, the peak at 23%, 0.07 of it at the end."""
    for decay in ("cosine", "linear"):
        lrs = [get_lr(p / 100, 1.0, 0.23, decay, warmup_lr=0.2, min_lr=0.07) for p in range(101)]
        assert lrs[0] == pytest.approx(0.2) and lrs[23] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.07)
        assert min(lrs) == pytest.approx(0.07) and max(lrs) == pytest.approx(1.0)
    assert get_lr(0.115, 1.0, 0.23, "linear", warmup_lr=0.2) == pytest.approx(0.6)  # half way up the ramp
    assert get_lr(0.615, 1.0, 0.23, "linear", min_lr=0.1) == pytest.approx(0.55)  # half way down
    cfg = T.Config(model="cnn", momentum=0.85, warmup_lr=0.1, min_lr=0.05)
    r = cfg.recipe("cnn")
    assert (r.momentum, r.warmup_lr, r.min_lr) == (0.85, 0.1, 0.05)


def test_weight_decay_skips_biases_norms_and_position_tables():
    import vitattn

    m = vitattn.create_model("vit_quick")
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "head.bias"} <= skipped
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0


def test_the_no_decay_names_are_the_models_own_at_any_depth():
    """param_groups asks each part of the model (timm's no_weight_decay()), so a ViT inside a
    detector keeps its table and token out of decay, and a name the model adds is honoured."""
    import vitattn

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(3, 4))
            self.kernel = torch.nn.Parameter(torch.zeros(3, 4))

        def no_weight_decay(self):
            return {"table"}

    outer = torch.nn.ModuleDict({"vit": vitattn.create_model("vit_quick"), "own": Own()})
    decay, no_decay = param_groups(outer, 0.05)
    names = {id(p): n for n, p in outer.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"vit.pos_embed", "vit.cls_token", "own.table"} <= skipped
    assert {"own.kernel", "vit.patch_embed.proj.weight"} <= {names[id(p)] for p in decay["params"]}


def test_bias_lr_scale_speeds_up_only_the_parameters_without_decay():
    import vitattn
    from vitattn.training.optim import create_optimizer, set_lr

    m = vitattn.create_model("cnn_quick")
    for name in ("sgd", "adamw"):
        opt = create_optimizer(m, **replace(RECIPES["cnn"], optimizer=name, bias_lr_scale=64.0).optimizer_kwargs())
        set_lr(opt, 0.1)
        decay, no_decay = opt.param_groups
        assert decay["lr"] == pytest.approx(0.1) and no_decay["lr"] == pytest.approx(6.4)
        assert all(p.ndim == 1 for p in no_decay["params"]) and decay["weight_decay"] > 0 == no_decay["weight_decay"]
    vit = vitattn.create_model("vit_quick")
    opt = create_optimizer(vit, **replace(RECIPES["vit"], bias_lr_scale=3.0).optimizer_kwargs())  # Muon + AdamW
    set_lr(opt, 0.01)
    assert sorted(round(g["lr"], 6) for g in opt.param_groups) == [0.01, 0.01, 0.03]


def test_model_ema_is_the_closed_form_average_of_weights_and_buffers():
    from vitattn.training.optim import ModelEma, ema_decay_at

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(m, 0.9)
    expect_w, expect_mean = None, None
    for n in range(6):
        with torch.no_grad():
            m[0].weight.normal_()
        m(torch.randn(5, 3))  # moves the BatchNorm statistics
        ema.update_parameters(m)
        if n == 0:  # the first update copies
            expect_w, expect_mean = m[0].weight.detach().clone(), m[1].running_mean.clone()
        else:
            d = ema_decay_at(0.9, n)
            expect_w = d * expect_w + (1 - d) * m[0].weight.detach()
            expect_mean = d * expect_mean + (1 - d) * m[1].running_mean
        torch.testing.assert_close(ema.module[0].weight, expect_w)
        torch.testing.assert_close(ema.module[1].running_mean, expect_mean)
    assert ema.module[1].num_batches_tracked == m[1].num_batches_tracked == 6  # integers are copied
    assert [ema_decay_at(0.9, n) for n in (0, 8, 100)] == [0.1, 0.5, 0.9]  # fast at first, then the decay
    assert not torch.equal(ema.module[0].weight, m[0].weight)  # an average, not the last weights
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        ModelEma(m, 1.0)


def _muon_steps(opt_cls, shapes, steps=3, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = opt_cls(ps, lr=0.02, weight_decay=0.1, **kw)
    for i in range(steps):
        torch.manual_seed(10 + i)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_in_bfloat16_steps_exactly_as_torch_and_in_fp32_close_to_it(adjust, nesterov):
    from vitattn.training.optim import Muon
    shapes = [(48, 16), (16, 40), (24, 24)]  # tall, wide, square
    ref, ref_opt = _muon_steps(torch.optim.Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust)
    ours, ours_opt = _muon_steps(Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust, ns_dtype=torch.bfloat16)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)
    fast, fast_opt = _muon_steps(Muon, shapes, nesterov=nesterov, adjust_lr_fn=adjust)  # CPU: fp32
    torch.manual_seed(0)
    start = [torch.randn(*s) for s in shapes]  # as _muon_steps draws them
    for a, b, p0 in zip(ref, fast, start):
        assert not torch.equal(a, b)  # it is another dtype
        moved = (a - p0 * (1 - 0.02 * 0.1) ** 3).norm()  # the updates' part of the change
        assert (a - b).norm() < 0.05 * moved
    # the state is torch's: a checkpoint of one loads into the other
    torch.optim.Muon(fast, lr=0.02).load_state_dict(fast_opt.state_dict())


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muon_batched_by_shape_equals_one_matrix_at_a_time(ns_dtype):
    """Matrices of one shape share one batched Newton-Schulz (a few kernels instead of a few dozen
    per matrix); each still steps exactly as if it were alone."""
    from vitattn.training.optim import Muon
    shapes = [(32, 16), (32, 16), (16, 48), (32, 16), (16, 48)]
    together, _ = _muon_steps(Muon, shapes, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw")
    torch.manual_seed(0)
    alone = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]  # as _muon_steps draws them
    opts = [Muon([p], lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw") for p in alone]
    for i in range(3):
        torch.manual_seed(10 + i)
        for p in alone:
            p.grad = torch.randn_like(p)
        for o in opts:
            o.step()
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_orthogonalize_keeps_singular_vectors_and_pulls_singular_values_near_one():
    from vitattn.training.optim import orthogonalize
    g = torch.randn(64, 24, generator=torch.Generator().manual_seed(0)) @ torch.diag(torch.logspace(-2, 1, 24))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = torch.optim.Muon([torch.nn.Parameter(g)]).defaults  # torch's coefficients, steps and eps
    x = orthogonalize(g, d["ns_coefficients"], d["ns_steps"], d["eps"], torch.float32)
    s = torch.diagonal(u.T @ x @ vh.T)  # x in g's singular bases
    assert torch.allclose(u.T @ x @ vh.T, torch.diag(s), atol=1e-4)  # the same singular vectors
    assert s[:16].min() > 0.5 and s.max() < 1.3  # all but the ~1e-2-scaled directions lifted near 1
    assert torch.linalg.matrix_norm(g, 2) > 1000 * torch.linalg.matrix_norm(g, -2)  # while g spans 3 decades


def test_muon_takes_the_block_matrices_adamw_the_rest_and_the_chain_resumes_exactly():
    import vitattn
    from vitattn.training.optim import Muon, OptimizerChain, create_optimizer

    def make():
        torch.manual_seed(0)
        m = vitattn.create_model("vit_quick", depth=2, embed_dim=32, num_heads=2)
        return m, create_optimizer(m, **replace(RECIPES["vit"], optimizer="muon", lr=3e-3).optimizer_kwargs())

    m, opt = make()
    assert isinstance(opt, OptimizerChain) and isinstance(opt.optimizers[0], Muon)
    names = {id(p): n for n, p in m.named_parameters()}
    muon = {names[id(p)] for g in opt.optimizers[0].param_groups for p in g["params"]}
    adamw = [names[id(p)] for g in opt.optimizers[1].param_groups for p in g["params"]]
    assert muon == {n for n, p in m.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight"} <= muon and "head.weight" in adamw
    assert len(muon) + len(adamw) == len(names) and not muon & set(adamw)  # each parameter once
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def steps(model, o, n):
        losses = []
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            losses.append(loss.item())
        return losses

    losses = steps(m, opt, 20)
    assert losses[-1] < 0.6 * losses[0]  # it learns the batch
    weights, state = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())  # a checkpoint mid-run
    steps(m, opt, 3)
    m2, opt2 = make()
    m2.load_state_dict(weights)
    opt2.load_state_dict(state)
    steps(m2, opt2, 3)
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="state of 2 chained optimisers"):
        opt2.load_state_dict({"chain": state["chain"][:1]})
    with pytest.raises(ValueError, match="needs 2-D weights in blocks"):
        create_optimizer(vitattn.create_model("cnn_quick"), "muon", lr=0.1, weight_decay=0.0)


def _update_case(kind: str):
    """A model (one, or a stack of two seeds), the module its optimiser steps, the lead axes, the
    optimiser's arguments and a batch."""
    import vitattn

    cnn, size = kind.startswith("cnn"), 32 if kind.startswith("cnn") else 16

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return vitattn.create_model("cnn_quick", num_classes=10) if cnn else \
            vitattn.ViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10)

    # the ViT: Muon on the blocks' matrices, AdamW on the rest
    kw = dict(opt="sgd", lr=0.05, weight_decay=5e-4) if cnn else dict(opt="muon", lr=1e-3, weight_decay=0.05)
    if "stack" not in kind:
        model = build(0)
        return model, model, 0, kw, torch.randn(8, 3, size, size)
    stack = seedstack.SeedStack([build(0), build(1)], (0, 1))
    return stack, stack.module, 1, kw, torch.randn(2, 8, 3, size, size)


@needs_cxx
@pytest.mark.parametrize("kind", ["vit-muon", "vit-stack-muon", "cnn-stack-sgd"])
def test_the_compiled_update_steps_as_the_eager_one(kind):
    """--compile's update (clipping, the optimiser, the EMA, at a tensor lr, as one compiled
    function) moves the weights, the EMA and the lr as the eager update does, and a new lr each
    step compiles nothing new."""
    from vitattn.training import optim

    lrs, clip, ends = (0.0, 1.0, 3.0, 0.5), 0.1, []  # a warmup starts at 0
    for compiled in (False, True):
        model, stepped, lead, kw, x = _update_case(kind)
        model.train()
        opt = optim.create_optimizer(stepped, **kw, lead=lead)
        ema = optim.ModelEma(model, 0.9)
        update = optim.Update(opt, model, ema, clip, lead) if compiled else None
        torch.manual_seed(5)
        y = torch.randint(0, 10, x.shape[:-3])
        for i, scale in enumerate(lrs):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum") / 8
            if update is None:
                optim.set_lr(opt, kw["lr"] * scale)
                optim.backward_step(loss, opt, torch.amp.GradScaler("cpu", enabled=False), model.parameters(), clip,
                                    lead)
                ema.update_parameters(model)
            else:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                with torch._dynamo.config.patch(error_on_recompile=i > 0):
                    update(kw["lr"] * scale)
        ends.append((model, ema, opt))
    (eager, eager_ema, _), (comp, comp_ema, opt) = ends
    for what, want, got in (("", eager, comp), ("EMA ", eager_ema, comp_ema)):
        for (name, a), b in zip(want.state_dict().items(), got.state_dict().values()):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{what}{name} differs")
    assert comp_ema.updates == eager_ema.updates == len(lrs)
    last = kw["lr"] * lrs[-1]
    assert all(torch.is_tensor(g["lr"]) and g["lr"].item() == pytest.approx(last * g.get("lr_scale", 1.0))
               for g in opt.param_groups)
    head = "module." * lead + "head.weight"
    assert not torch.equal(eager_ema.module.state_dict()[head], eager.state_dict()[head])  # an average, not a copy
