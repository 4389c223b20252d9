"""The kernels' PyTorch references, pinned independently of the kernels (plain loops and hand-worked
values): what tests/test_kernels.py compares every Triton kernel against."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_kernels import BF16, _fp8, _moe_fp8_inputs, _moe_inputs  # noqa: E402
from test_kernels_paged import _seq_indexer, _seq_mla  # noqa: E402

from kernels.fp8_block import fp8_block_dequant_ref  # noqa: E402
from kernels.moe import moe_experts_fp8_ref, moe_experts_ref  # noqa: E402
from kernels.paged import indexer_scores_paged_ref, mla_attention_paged_ref  # noqa: E402
from kernels.rmsnorm import rmsnorm_ref  # noqa: E402
from kernels.rope import rope_interleaved_ref  # noqa: E402


def test_rmsnorm_ref_casts_before_weight():
    x = torch.randn(4, 64).to(BF16)
    w = (torch.randn(64) * 3).to(BF16)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)
    assert torch.equal(rmsnorm_ref(x, w, 1e-5), normed * w)
    assert rmsnorm_ref(x, w.float(), 1e-5).dtype == torch.float32  # promoted, like HF with an fp32 weight
    r = torch.randn(4, 64).to(BF16)
    y, h = rmsnorm_ref(x, w, 1e-5, r)
    assert torch.equal(h, x + r) and torch.equal(y, rmsnorm_ref(x + r, w, 1e-5))


def test_rope_ref_layout():
    # pair 0 (1, 2) turned by 90 degrees -> (-2, 1); pair 1 (3, 4) by 0 -> (3, 4); output
    # [rotated evens | rotated odds] = [-2, 3, 1, 4]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = rope_interleaved_ref(x, torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(out, torch.tensor([[-2.0, 3.0, 1.0, 4.0]]))


def test_rope_ref_matches_complex_rotation():
    x = torch.randn(5, 3, 16)
    ang = torch.randn(5, 8, dtype=torch.float64)
    z = torch.view_as_complex(x.double().reshape(5, 3, 8, 2)) * torch.polar(torch.ones_like(ang), ang)[:, None]
    out = rope_interleaved_ref(x, ang.cos().float(), ang.sin().float())
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1).float(), rtol=1e-5, atol=1e-5)


def test_fp8_dequant_ref_partial_blocks():
    w, s = _fp8(130, 260, "cpu")
    d = fp8_block_dequant_ref(w, s, 128, torch.float32)
    for i, j in [(0, 0), (129, 259), (127, 128), (128, 127), (64, 256)]:
        assert d[i, j] == w[i, j].float() * s[i // 128, j // 128]


def test_indexer_scores_ref_explicit():
    q, k, w = torch.randn(2, 3, 8), torch.randn(6, 8), torch.randn(2, 3)
    sc = _seq_indexer(indexer_scores_paged_ref, q, k, w, 2, 0.25)
    for s in range(2):
        for t in range(6):
            want = sum(w[s, h] * torch.relu(q[s, h] @ k[t]) for h in range(3)) * 0.25
            if t > 2 + s:
                assert sc[s, t] == float("-inf")
            else:
                torch.testing.assert_close(sc[s, t], want)


def test_mla_ref_matches_naive_loop():
    s_len, h, lkv, r, t, off, scale = 3, 4, 16, 8, 10, 6, 0.3
    qn, qr, kv = torch.randn(s_len, h, lkv), torch.randn(s_len, h, r), torch.randn(t, lkv + r)
    idx = torch.tensor([[0, 3, -1, 8], [9, 1, 2, -1], [5, 0, 4, 7]])
    for index in (None, idx):
        out = _seq_mla(mla_attention_paged_ref, qn, qr, kv, index, off, scale)
        for s in range(s_len):
            keys = range(t) if index is None else [int(p) for p in index[s] if p >= 0]
            keys = [p for p in keys if p <= off + s]
            for hh in range(h):
                sc = torch.stack([(qn[s, hh] @ kv[p, :lkv] + qr[s, hh] @ kv[p, lkv:]) * scale for p in keys])
                want = (torch.softmax(sc, 0)[:, None] * kv[keys, :lkv]).sum(0)
                torch.testing.assert_close(out[s, hh], want)
    full = torch.arange(t).expand(s_len, t).contiguous()
    torch.testing.assert_close(_seq_mla(mla_attention_paged_ref, qn, qr, kv, full, off, scale),
                               _seq_mla(mla_attention_paged_ref, qn, qr, kv, None, off, scale))
    assert (_seq_mla(mla_attention_paged_ref, qn, qr, kv, None, -1, scale)[0] == 0).all()


def test_moe_ref_matches_naive_loop():
    x, gate, up, down, weights, ids = _moe_inputs("cpu", torch.float64, 3, 2, 4, 12, 10)
    ids[2] = torch.tensor([1, 1])
    out = moe_experts_ref(x, gate, up, down, weights, ids)
    for n in range(3):
        want = torch.zeros(12, dtype=torch.float64)
        for k in range(2):
            e = int(ids[n, k])
            h = torch.nn.functional.silu(gate[e] @ x[n]) * (up[e] @ x[n])
            want += weights[n, k].double() * (down[e] @ h)
        torch.testing.assert_close(out[n], want)
    assert out.dtype == torch.float64
    xb, gb, ub, db = (t.to(BF16) for t in (x, gate, up, down))
    assert moe_experts_ref(xb, gb, ub, db, weights, ids).dtype == BF16  # fp32 routing weights keep x's dtype


def test_moe_ref_clamp_is_the_models_swiglu():
    """moe_experts_ref / moe_experts_fp8_ref with swiglu_limit compute what the model's experts
    (models/glm5/layers.py's gathered path, GLM-5-Next's clamp 10) compute, bit for bit; the clamp bites."""
    from glm5mtp_cli.models.glm5.layers import Experts, Fp8Experts

    torch.manual_seed(0)
    x, gate, up, down, weights, ids = _moe_inputs("cpu", torch.float32, 3, 2, 5, 48, 40)
    x = x * 30
    ex = Experts(5, 48, 40, swiglu_limit=10.0)
    with torch.no_grad():
        ex.gate.copy_(gate), ex.up.copy_(up), ex.down.copy_(down)
    want = ex(x, weights, ids)
    assert torch.equal(moe_experts_ref(x, gate, up, down, weights, ids, swiglu_limit=10.0), want)
    assert not torch.allclose(moe_experts_ref(x, gate, up, down, weights, ids), want)
    xq, *stacks, weights, ids = _moe_fp8_inputs("cpu", torch.float32, 3, 2, 5, 48, 40, 16)
    fp8 = Fp8Experts(5, 48, 40, swiglu_limit=10.0, block=16)
    for t, name in zip(stacks, ("gate", "gate_scale_inv", "up", "up_scale_inv", "down", "down_scale_inv")):
        getattr(fp8, name).copy_(t)
    want = fp8(xq * 30, weights, ids)
    assert torch.equal(moe_experts_fp8_ref(xq * 30, *stacks, weights, ids, 16, swiglu_limit=10.0), want)
    assert not torch.allclose(moe_experts_fp8_ref(xq * 30, *stacks, weights, ids, 16), want)
