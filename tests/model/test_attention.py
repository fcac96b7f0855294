"""MultiHeadAttention: both paths equal, every score function against a per-pair loop, masks,
cross-attention, windows, and the symmetry attention has without positions."""

import math

import pytest
import torch
import torch.nn.functional as F

import vitattn
from vitattn import SCORES, AttentionConfig, MultiHeadAttention, window_mask


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def per_pair_reference(attn: MultiHeadAttention, x, context=None, mask=None):
    """Attention computed one (query, key) pair at a time, straight from the definitions."""
    q, k, v = attn.project_qkv(x, context)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    out = torch.zeros_like(q)
    weights = torch.zeros(b, h, nq, nk)
    for bi in range(b):
        for hi in range(h):
            for i in range(nq):
                s = torch.empty(nk)
                for j in range(nk):
                    qi, kj = q[bi, hi, i], k[bi, hi, j]
                    if type(attn.score_fn) is SCORES["dot"]:
                        s[j] = qi @ kj
                    elif type(attn.score_fn) is SCORES["scaled_dot"]:
                        s[j] = qi @ kj / math.sqrt(d)
                    elif type(attn.score_fn) is SCORES["general"]:
                        s[j] = qi @ attn.score_fn.weight[hi] @ kj
                    elif type(attn.score_fn) is SCORES["lsa"]:  # a token's score for itself is dropped
                        s[j] = qi @ kj * attn.score_fn.log_temperature.exp() if i != j else float("-inf")
                    else:  # additive
                        s[j] = attn.score_fn.v[hi] @ torch.tanh(qi @ attn.score_fn.q[hi] + kj @ attn.score_fn.k[hi])
                    if mask is not None and not mask[bi, hi, i, j]:
                        s[j] = float("-inf")
                w = torch.softmax(s, 0)
                weights[bi, hi, i] = w
                out[bi, hi, i] = (w[:, None] * v[bi, hi]).sum(0)
    out = out.transpose(1, 2).reshape(b, nq, h * d)
    return attn.proj(out), weights


@pytest.mark.parametrize("score", SCORES)
def test_scores_match_per_pair_loop(score):
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, score=score, qkv_bias=True).eval()
    x = torch.randn(2, 5, 8)
    out, w = attn(x, return_attention=True)
    with torch.no_grad():
        ref_out, ref_w = per_pair_reference(attn, x)
        assert torch.allclose(w, ref_w, atol=1e-6)
        assert torch.allclose(out, ref_out, atol=1e-6)
        assert torch.allclose(attn(x), ref_out, atol=1e-5)  # the default (fused where possible) path too


@pytest.mark.parametrize("score", ["scaled_dot", "dot", "general"])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_equals_explicit_outputs_and_grads(score, masked):
    torch.manual_seed(1)
    fused = MultiHeadAttention(16, num_heads=4, score=score, qkv_bias=True, fused=True).eval()
    explicit = MultiHeadAttention(16, num_heads=4, score=score, qkv_bias=True, fused=False).eval()
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, 16)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    kpm[2, 1] = True
    kw = dict(key_padding_mask=kpm) if masked else {}
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = fused(x1, **kw), explicit(x2, **kw)
    assert torch.allclose(y1, y2, atol=1e-5)
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    for (n, p1), (_, p2) in zip(fused.named_parameters(), explicit.named_parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-5), n


@pytest.mark.parametrize("grad", [True, False])
def test_bf16_on_a_cpu_takes_the_plain_ops_up_to_the_key_limit_and_equals_the_readable_path(grad, monkeypatch):
    """bf16 on a CPU: up to ``CPU_BF16_PLAIN_MAX_KEYS`` keys the fused path computes the readable
    path's three ops (bit for bit, outputs and gradients) without torch's kernel; beyond, the kernel."""
    from vitattn import attention

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    limit = attention.CPU_BF16_PLAIN_MAX_KEYS["train" if grad else "infer"]
    torch.manual_seed(0)
    fused = MultiHeadAttention(16, num_heads=4, qkv_bias=True).to(torch.bfloat16)
    explicit = MultiHeadAttention(16, num_heads=4, qkv_bias=True, fused=False).to(torch.bfloat16)
    explicit.load_state_dict(fused.state_dict())
    with torch.set_grad_enabled(grad):
        for n, kernel_calls in ((limit, 0), (limit + 1, 1)):
            calls.clear()
            x = torch.randn(2, n, 16, dtype=torch.bfloat16)
            y1, y2 = fused(x), explicit(x)
            assert len(calls) == kernel_calls, n
            if not kernel_calls:
                assert torch.equal(y1, y2)
                if grad:
                    g1 = torch.autograd.grad(y1.float().square().sum(), fused.qkv.weight)
                    g2 = torch.autograd.grad(y2.float().square().sum(), explicit.qkv.weight)
                    assert torch.equal(g1[0], g2[0])


def test_return_attention_shape_rows_and_same_output():
    torch.manual_seed(0)
    attn = MultiHeadAttention(12, num_heads=3).eval()
    x = torch.randn(2, 9, 12)
    out, w = attn(x, return_attention=True)
    assert w.shape == (2, 3, 9, 9)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 9), atol=1e-6)
    assert torch.allclose(out, attn(x), atol=1e-5)


def test_notes_example_widths():
    """The notes' selfAttention(2, 10, 20) on (32, 20, 10) gives (32, 20, 20)."""
    attn = MultiHeadAttention(dim=10, num_heads=2, hidden_dim=20)
    assert attn(torch.rand(32, 20, 10)).shape == (32, 20, 20)
    assert attn.head_dim == 10


def test_hidden_not_divisible_by_heads_raises():
    with pytest.raises(ValueError, match="hidden width 20 is not divisible by the number of heads 3"):
        MultiHeadAttention(dim=10, num_heads=3, hidden_dim=20)
    with pytest.raises(ValueError, match="unknown score"):
        MultiHeadAttention(8, 2, score="cosine")


def test_cross_attention_other_length_and_width():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, context_dim=6, out_dim=8).eval()
    x, src = torch.randn(2, 3, 8), torch.randn(2, 11, 6)
    out, w = attn(x, context=src, return_attention=True)
    assert out.shape == (2, 3, 8) and w.shape == (2, 2, 3, 11)
    with torch.no_grad():
        ref, ref_w = per_pair_reference(attn, x, src)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(w, ref_w, atol=1e-6)
    assert torch.allclose(attn(x, context=src), ref, atol=1e-5)
    with pytest.raises(ValueError, match="context"):
        attn(x)


def test_cross_attention_same_width_uses_qkv_slices():
    """With a same-width context the one qkv projection serves: q from x, k and v from the context.
    Self-attention is cross-attention of a sequence with itself."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, qkv_bias=True).eval()
    x = torch.randn(2, 5, 8)
    assert torch.allclose(attn(x, context=x), attn(x), atol=1e-6)
    src = torch.randn(2, 9, 8)
    out = attn(x, context=src)
    with torch.no_grad():
        ref, _ = per_pair_reference(attn, x, src)
    assert torch.allclose(out, ref, atol=1e-5)


def test_key_padding_equals_truncation():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(1, 6, 8)
    src = torch.randn(1, 10, 8)
    kpm = torch.zeros(1, 10, dtype=torch.bool)
    kpm[:, 7:] = True
    for fused in (True, False):
        attn.fused = fused
        assert torch.allclose(attn(x, context=src, key_padding_mask=kpm), attn(x, context=src[:, :7]), atol=1e-5)
    _, w = attn(x, context=src, key_padding_mask=kpm, return_attention=True)
    assert w[..., 7:].abs().max() == 0


def test_attn_mask_causal_and_errors():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(2, 5, 8)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    out, w = attn(x, attn_mask=causal, return_attention=True)
    assert w.triu(1).abs().max() == 0
    assert torch.allclose(out, attn(x, attn_mask=causal), atol=1e-5)
    # the first token can only see itself, so it ignores every later token
    x2 = x.clone()
    x2[:, 1:] += 1.0
    assert torch.allclose(attn(x2, attn_mask=causal)[:, 0], out[:, 0], atol=1e-6)
    with pytest.raises(ValueError, match="boolean"):
        attn(x, attn_mask=causal.float())
    with pytest.raises(ValueError, match="does not broadcast"):
        attn(x, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must be boolean of shape \(B, Nk\) = \(2, 5\)"):
        attn(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected tokens of shape \(B, N, D\)"):
        attn(torch.randn(5, 8))


def test_permutation_equivariant():
    """Without positions attention cannot tell token order: permuting inputs permutes outputs."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2).eval()
    x = torch.randn(2, 7, 8)
    perm = torch.randperm(7, generator=seeded(3))
    assert torch.allclose(attn(x)[:, perm], attn(x[:, perm]), atol=1e-5)


@pytest.mark.parametrize("grid,window,prefix", [((4, 6), 2, 0), ((5, 7), 3, 1), ((3, 3), 2, 2), ((4, 4), (2, 4), 0)])
def test_window_fast_path_equals_masked_global(grid, window, prefix):
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, window_size=window).eval()
    n = prefix + grid[0] * grid[1]
    x = torch.randn(2, n, 8, requires_grad=True)
    fast = attn(x, grid=grid, num_prefix_tokens=prefix)
    readable, w = attn(x, grid=grid, num_prefix_tokens=prefix, return_attention=True)
    assert torch.allclose(fast, readable, atol=1e-5)
    # the weights vanish outside each token's window
    allowed = window_mask(grid, attn.window_size, prefix)
    assert w[..., ~allowed].abs().max() == 0
    gx_fast, = torch.autograd.grad(fast.sum(), x)
    gx_read, = torch.autograd.grad(readable.sum(), x)
    assert torch.allclose(gx_fast, gx_read, atol=1e-5)


def test_window_covering_grid_equals_global():
    torch.manual_seed(0)
    glob = MultiHeadAttention(8, num_heads=2).eval()
    win = MultiHeadAttention(8, num_heads=2, window_size=8).eval()
    win.load_state_dict(glob.state_dict())
    x = torch.randn(2, 1 + 30, 8)
    assert torch.allclose(win(x, grid=(5, 6), num_prefix_tokens=1), glob(x), atol=1e-5)
    with pytest.raises(ValueError, match="needs the patch grid"):
        win(x)
    with pytest.raises(ValueError, match="means 31 tokens, got 30"):
        win(x[:, 1:], grid=(5, 6), num_prefix_tokens=1)


def test_window_mask_pattern():
    m = window_mask((2, 4), (2, 2), num_prefix_tokens=1)
    assert m.shape == (9, 9)
    assert m[0].all() and m[:, 0].all()
    # token 1 (row 0, col 0) shares a window with (0,1), (1,0), (1,1) -> tokens 1, 2, 5, 6
    assert m[1, 1:].nonzero().flatten().add(1).tolist() == [1, 2, 5, 6]


def test_dropout_only_in_training():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, attn_drop=0.5, proj_drop=0.5)
    x = torch.randn(2, 5, 8)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    assert not torch.allclose(attn(x), attn(x))


def test_qk_norm_normalises_each_head():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, num_heads=2, qk_norm=True).eval()
    q, k, _ = attn.project_qkv(torch.randn(2, 5, 8) * 10, None)
    assert torch.allclose(q.mean(-1), torch.zeros(2, 2, 5), atol=1e-5)
    assert torch.allclose(k.var(-1, unbiased=False), torch.ones(2, 2, 5), atol=1e-3)


def test_qk_norm_attention_does_not_depend_on_the_scale_of_the_qk_weights():
    """Without it, small q/k weights (timm's init) give near-uniform attention whose logits move
    with the product of two small matrices; with it, scaling the q and k projections leaves the
    weights unchanged."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    for qk_norm in (False, True):
        attn = MultiHeadAttention(16, num_heads=2, qkv_bias=True, qk_norm=qk_norm).eval()
        _, before = attn(x, return_attention=True)
        with torch.no_grad():
            attn.qkv.weight[:32] *= 0.1
            attn.qkv.bias[:32] *= 0.1
        _, after = attn(x, return_attention=True)
        assert torch.allclose(before, after, atol=1e-3) == qk_norm  # up to the norm's eps
        if not qk_norm:  # a hundredth of the logits: close to uniform
            assert (after - 1 / 6).abs().max() < (before - 1 / 6).abs().max() / 10




# -- one class, one options object ----------------------------------------------------------------
def test_the_attention_class_equals_its_fused_path_and_timms_attention():
    """The whole computation in one class: its explicit path (scores, softmax, weighted sum)
    equals its fused kernel and timm's Attention with the same weights, in outputs and gradients;
    ``Attention`` is timm's name for the same class."""
    from vitattn.attention import Attention

    assert Attention is MultiHeadAttention
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, requires_grad=True)
    attn = MultiHeadAttention(32, num_heads=4, qkv_bias=True).eval()
    out_explicit, weights = attn(x, return_attention=True)
    out_fused = attn(x)
    torch.testing.assert_close(out_fused, out_explicit, atol=1e-5, rtol=1e-5)
    assert weights.shape == (2, 4, 7, 7) and torch.allclose(weights.sum(-1), torch.ones(2, 4, 7))
    (g_fused,) = torch.autograd.grad(out_fused.square().sum(), x)
    (g_explicit,) = torch.autograd.grad(out_explicit.square().sum(), x)
    torch.testing.assert_close(g_fused, g_explicit, atol=1e-5, rtol=1e-5)

    timm_vit = pytest.importorskip("timm.models.vision_transformer")
    theirs = timm_vit.Attention(32, num_heads=4, qkv_bias=True).eval()
    theirs.load_state_dict(attn.state_dict())
    torch.testing.assert_close(theirs(x), out_fused, atol=1e-5, rtol=1e-5)


def test_options_come_as_one_config_passed_down_or_as_keywords():
    """A config and the same keywords build the same layer; the ViT builds one config and hands
    it to every block, where only the window differs (set by the ViT's config alone)."""
    cfg = AttentionConfig(num_heads=2, qkv_bias=True, score="general", window_size=2)
    a, b = MultiHeadAttention(8, config=cfg), MultiHeadAttention(8, 2, qkv_bias=True, score="general", window_size=2)
    assert a.config == b.config and a.window_size == b.window_size == (2, 2)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    with pytest.raises(TypeError, match="either as config= or as keywords"):
        MultiHeadAttention(8, 2, config=cfg)
    vit = vitattn.ViT(img_size=32, patch_size=8, embed_dim=16, depth=3, num_heads=2, score="dot", window_size=2,
                      window_block_indexes=(0, 2))
    configs = [blk.attn.config for blk in vit.blocks]
    assert [c.window_size for c in configs] == [2, None, 2]
    assert {c.score for c in configs} == {"dot"} and {c.qkv_bias for c in configs} == {True}
    default = vitattn.ViT(img_size=32, patch_size=8, embed_dim=16, depth=6, num_heads=2, window_size=2)
    assert default.config.window_block_indexes == (0, 1, 3, 4)  # ViTDet's layout: every third block global


def test_a_score_module_is_a_piece_of_its_own():
    """Scores are modules: a score built by the caller (here an additive one of width 3) works
    in the layer as the named one does, on the explicit path (it has no fused form); the fused
    form of each other score computes that score."""
    from vitattn import scores

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    score = scores.Additive(2, 4, additive_dim=3)
    attn = MultiHeadAttention(8, num_heads=2, score=score).eval()
    assert attn.score_fn is score and score.q.shape == (2, 4, 3) and score.fused(x) is None
    out, w = attn(x, return_attention=True)
    q, k, _ = attn.project_qkv(x, None)
    torch.testing.assert_close(w, score(q, k).softmax(-1))
    torch.testing.assert_close(out, attn(x))
    qq, kk = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4)
    for name in ("scaled_dot", "dot", "general"):
        s = SCORES[name](2, 4)
        fq, scale = s.fused(qq)
        torch.testing.assert_close(fq @ kk.transpose(-2, -1) * scale, s(qq, kk))




def test_a_forward_hook_on_a_blocks_attention_sees_each_call():
    """Blocks call their attention through the module (not a method of it), so hooks registered
    on ``attn`` (a common way to read attention out of a model) fire in every forward."""
    import vitattn

    model = vitattn.create_model("vit_quick", num_classes=3).eval()
    seen = []
    model.blocks[0].attn.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
        model.get_attention_maps(torch.randn(2, 3, 32, 32))
    assert len(seen) == 2 and torch.is_tensor(seen[0]) and isinstance(seen[1], tuple)


def _masks(b: int, h: int, nq: int, nk: int) -> dict[str, dict]:
    """Masks of every kind, each with at least one query that may attend to no key."""
    g = seeded(3)
    rand = torch.rand(b, h, nq, nk, generator=g) < 0.6
    rand[0, 1, 2] = False  # a query with every key masked
    causal = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=-1)  # strictly before: the first query sees nothing
    pad = torch.zeros(b, nk, dtype=torch.bool)
    pad[1] = True  # a sample all padding
    pad[0, -2:] = True
    return {"random": dict(attn_mask=rand), "strictly causal": dict(attn_mask=causal), "padding": dict(
        key_padding_mask=pad), "both": dict(attn_mask=rand[:, :1], key_padding_mask=pad)}


PATHS = {"fused fp32": (torch.float32, True), "readable fp32": (torch.float32, False),
         "fused bf16": (torch.bfloat16, True), "readable bf16": (torch.bfloat16, False)}


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("score", ["scaled_dot", "general"])
@pytest.mark.parametrize("keys", ["plain", "kernel"])  # bf16 on a CPU: the three plain ops, or torch's kernel
def test_every_path_gives_sdpas_answer_under_every_mask(cross, score, keys):
    """One semantics for masks, torch's SDPA's: a query whose keys are all masked gets zero weights and
    a zero output before ``proj``, and no NaN reaches any output or gradient, on every path (fused,
    readable, bf16's plain ops or torch's bf16 kernel), in self- and cross-attention."""
    from vitattn import attention

    b, h, nq = 2, 2, 5
    nk = 7 if keys == "plain" else attention.CPU_BF16_PLAIN_MAX_KEYS["train"] + 3
    nq = nk if not cross else nq
    torch.manual_seed(0)
    ref_model = MultiHeadAttention(16, num_heads=h, score=score, qkv_bias=True, context_dim=16 if cross else None)
    x0 = torch.randn(b, nq, 16, generator=seeded(1))
    c0 = torch.randn(b, nk, 16, generator=seeded(2)) if cross else None
    for name, mask in _masks(b, h, nq, nk).items():
        results = {}
        for path, (dtype, fused) in PATHS.items():
            attn = MultiHeadAttention(16, num_heads=h, score=score, qkv_bias=True, fused=fused,
                                      context_dim=16 if cross else None).to(dtype)
            attn.load_state_dict(ref_model.state_dict())
            x = x0.to(dtype).detach().clone().requires_grad_()
            c = None if c0 is None else c0.to(dtype).detach().clone().requires_grad_()
            q, k, v = attn.project_qkv(x, c)
            out, _ = attn.attend(q, k, v, attention.merge_masks(mask.get("attn_mask"), mask.get("key_padding_mask"),
                                                                 q.shape, k.shape))
            y = attn(x, c, **mask)
            y.float().square().sum().backward()
            grads = [x.grad] + ([c.grad] if cross else []) + [p.grad for p in attn.parameters()]
            assert not any(t.isnan().any() for t in [out, y, *grads]), (name, path)
            results[path] = (out.float(), y.float(), [t.float() for t in grads])
        allowed = attention.merge_masks(mask.get("attn_mask"), mask.get("key_padding_mask"), (b, h, nq, 16),
                                        (b, h, nk, 16)).expand(b, h, nq, nk)
        empty = ~allowed.any(-1)
        assert empty.any(), name
        for path, (out, y, grads) in results.items():
            assert (out[empty] == 0).all(), (name, path)
            ref_out, ref_y, ref_grads = results["fused fp32"]
            tol = 1e-5 if "fp32" in path else 5e-2
            torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol, msg=f"{name}, {path}")
            torch.testing.assert_close(y, ref_y, atol=tol, rtol=tol, msg=f"{name}, {path}")
            for a, r in zip(grads, ref_grads):
                torch.testing.assert_close(a, r, atol=tol * 10, rtol=tol, msg=f"{name}, {path} gradients")
