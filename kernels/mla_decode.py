"""MLA attention over the latent cache in the absorbed form (decode and verify).

With ``W_UK`` folded into the query, each head scores the cached latent ``c`` [T, Lkv] and the
shared rope key ``k_rope`` [T, R] directly (the cache row is ``[c | k_rope]``)::

    score[s, h, t] = (q_nope_absorbed[s, h] . c[t] + q_rope[s, h] . k_rope[t]) * scale
    out[s, h]      = sum_t softmax_t(score[s, h, :]) * c[t]          # still latent; W_UV comes after

Query s sits at absolute position ``causal_offset + s`` and sees keys t <= causal_offset + s.
With ``index`` [S, K] (the indexer's picks per query, -1 padded) only the picked positions count.
Softmax in fp32; a query that sees no key gets zeros. The Triton kernel runs one program per
(query, block of 16 heads) and streams key blocks with an online softmax.
"""

import torch

from ._triton import alloc, interpreting, jit, next_pow2, tl, triton, use_triton


def mla_decode_attention_ref(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                             index: torch.Tensor | None, causal_offset: int, scale: float) -> torch.Tensor:
    """PyTorch reference (fp32 math); returns [S, H, Lkv] in q_nope_absorbed.dtype."""
    s_len, _, lkv = q_nope_absorbed.shape
    r = q_rope.shape[-1]
    t_len = kv_cache.shape[0]
    kv = kv_cache.float()
    c, kr = kv[:, :lkv], kv[:, lkv:lkv + r]
    qn, qr = q_nope_absorbed.float(), q_rope.float()
    limit = causal_offset + torch.arange(s_len, device=kv.device)[:, None]  # [S, 1]
    if index is None:
        pos = torch.arange(t_len, device=kv.device)[None, :]  # [1, T]
        scores = torch.einsum("shl,tl->sht", qn, c) + torch.einsum("shr,tr->sht", qr, kr)
    else:
        pos = index.long()  # [S, K]
        safe = pos.clamp(0, max(t_len - 1, 0))
        c, kr = c[safe], kr[safe]  # [S, K, Lkv], [S, K, R]
        scores = torch.einsum("shl,skl->shk", qn, c) + torch.einsum("shr,skr->shk", qr, kr)
    valid = (pos >= 0) & (pos <= limit) & (pos < t_len)  # [S, T] or [S, K]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(valid.any(-1)[:, None, None], p, torch.zeros_like(p))  # no visible key -> zeros
    out = torch.einsum("sht,tl->shl", p, c) if index is None else torch.einsum("shk,skl->shl", p, c)
    return out.to(q_nope_absorbed.dtype)


@jit
def _mla_kernel(qn_ptr, qr_ptr, kv_ptr, idx_ptr, out_ptr, H, L, R, T, NKEYS, causal_offset, scale,
                stride_qns, stride_qnh, stride_qrs, stride_qrh, stride_kv, stride_idx,
                HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_T: tl.constexpr, DOT_BF16: tl.constexpr):
    s = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    hmask, lmask, rmask = offs_h < H, offs_l < L, offs_r < R
    qn = tl.load(qn_ptr + s * stride_qns + offs_h[:, None] * stride_qnh + offs_l[None, :],
                 mask=hmask[:, None] & lmask[None, :], other=0.0)
    qr = tl.load(qr_ptr + s * stride_qrs + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)
    if not DOT_BF16:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)
    limit = causal_offset + s
    if HAS_INDEX:
        n_keys = NKEYS
    else:
        n_keys = tl.minimum(T, limit + 1)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for j0 in range(0, n_keys, BLOCK_T):
        offs_j = j0 + tl.arange(0, BLOCK_T)
        if HAS_INDEX:
            pos = tl.load(idx_ptr + s * stride_idx + offs_j, mask=offs_j < NKEYS, other=-1)
        else:
            pos = offs_j
        valid = (pos >= 0) & (pos <= limit) & (pos < T)
        rows = kv_ptr + tl.where(valid, pos, 0).to(tl.int64) * stride_kv
        c = tl.load(rows[:, None] + offs_l[None, :], mask=valid[:, None] & lmask[None, :], other=0.0)
        kr = tl.load(rows[:, None] + L + offs_r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
        if DOT_BF16:
            sc = tl.dot(qn, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
        else:
            c = c.to(tl.float32)
            sc = (tl.dot(qn, tl.trans(c), input_precision="ieee")
                  + tl.dot(qr, tl.trans(kr.to(tl.float32)), input_precision="ieee"))
        sc = tl.where(valid[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # keeps exp() finite before any key
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if DOT_BF16:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), c)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    dst = out_ptr + (s * H + offs_h[:, None]).to(tl.int64) * L + offs_l[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])


def mla_decode_attention_triton(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                                index: torch.Tensor | None, causal_offset: int, scale: float) -> torch.Tensor:
    """Triton version of :func:`mla_decode_attention_ref`; grid (S, head blocks of 16)."""
    assert q_nope_absorbed.dim() == 3 and q_rope.dim() == 3 and kv_cache.dim() == 2
    s_len, h, lkv = q_nope_absorbed.shape
    r = q_rope.shape[-1]
    t_len = kv_cache.shape[0]
    assert q_rope.shape[:2] == (s_len, h), "q_rope must be [S, H, R]"
    assert kv_cache.shape[1] == lkv + r, f"kv_cache width {kv_cache.shape[1]} != Lkv + R = {lkv + r}"
    for name, ten in (("q_nope_absorbed", q_nope_absorbed), ("q_rope", q_rope), ("kv_cache", kv_cache)):
        assert ten.stride(-1) == 1, f"{name} needs a unit stride in its last dimension"
    if index is not None:
        assert index.dim() == 2 and index.shape[0] == s_len and index.stride(-1) == 1, "index must be [S, K]"
        assert not index.dtype.is_floating_point, "index must be integer"
    out = alloc((s_len, h, lkv), dtype=q_nope_absorbed.dtype, device=q_nope_absorbed.device)
    if s_len and h:
        block_h = 16
        dot_bf16 = (q_nope_absorbed.dtype == q_rope.dtype == kv_cache.dtype == torch.bfloat16
                    and not interpreting())
        idx = index if index is not None else kv_cache  # dummy pointer when there is no index
        _mla_kernel[(s_len, triton.cdiv(h, block_h))](
            q_nope_absorbed, q_rope, kv_cache, idx, out, h, lkv, r, t_len,
            index.shape[1] if index is not None else 0, causal_offset, scale,
            q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_rope.stride(0), q_rope.stride(1),
            kv_cache.stride(0), index.stride(0) if index is not None else 0,
            HAS_INDEX=index is not None, BLOCK_H=block_h, BLOCK_L=next_pow2(lkv), BLOCK_R=next_pow2(r),
            BLOCK_T=32, DOT_BF16=dot_bf16, num_warps=4, num_stages=2)
    return out


def mla_decode_attention(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                         index: torch.Tensor | None, causal_offset: int, scale: float,
                         force_triton: bool = False) -> torch.Tensor:
    """Absorbed-MLA attention of S queries over a latent cache (see the module docstring).

    Args:
        q_nope_absorbed: [S, H, Lkv] no-rope queries already multiplied by W_UK.
        q_rope: [S, H, R] rope part of the queries (rope applied).
        kv_cache: [T, Lkv + R] cache rows [latent | rope key] for positions 0..T-1.
        index: [S, K] selected key positions per query (-1 padded), or None for all keys.
        causal_offset: absolute position of query 0.
        scale: softmax scale.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        [S, H, Lkv] latent outputs in q_nope_absorbed.dtype.
    """
    tensors = (q_nope_absorbed, q_rope, kv_cache) + ((index,) if index is not None else ())
    if use_triton(*tensors, force=force_triton):
        return mla_decode_attention_triton(q_nope_absorbed, q_rope, kv_cache, index, causal_offset, scale)
    return mla_decode_attention_ref(q_nope_absorbed, q_rope, kv_cache, index, causal_offset, scale)
