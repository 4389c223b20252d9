"""MLA attention over the latent cache in the absorbed form (decode and verify).

With ``W_UK`` folded into the query, each head scores the cached latent ``c`` [T, Lkv] and the
shared rope key ``k_rope`` [T, R] directly (the cache row is ``[c | k_rope]``)::

    score[s, h, t] = (q_nope_absorbed[s, h] . c[t] + q_rope[s, h] . k_rope[t]) * scale
    out[s, h]      = sum_t softmax_t(score[s, h, :]) * c[t]          # still latent; W_UV comes after

Query s sits at absolute position ``causal_offset + s`` and sees keys t <= causal_offset + s.
With ``index`` [S, K] (the indexer's picks per query, -1 padded) only the picked positions count.
Softmax in fp32; a query that sees no key gets zeros. The Triton path is kernels/paged.py's kernel
(one program per query and block of 16 heads, key blocks streamed with an online softmax) over a
single sequence.
"""

import torch

from ._triton import use_triton


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


def mla_decode_attention_triton(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                                index: torch.Tensor | None, causal_offset: int, scale: float) -> torch.Tensor:
    """Triton version of :func:`mla_decode_attention_ref`: the paged kernel (kernels/paged.py) over
    one sequence whose rows sit in rows 0..T-1."""
    from .paged import mla_attention_paged_triton  # paged.py builds its reference on this module

    assert q_nope_absorbed.dim() == 3 and q_rope.dim() == 3 and kv_cache.dim() == 2
    if index is not None:
        assert index.dim() == 2 and index.shape[0] == q_nope_absorbed.shape[0], "index must be [S, K]"
    slots = torch.arange(kv_cache.shape[0], device=kv_cache.device)[None]
    starts = torch.tensor([causal_offset], device=kv_cache.device)
    return mla_attention_paged_triton(q_nope_absorbed[None], q_rope[None], kv_cache, slots, starts,
                                      None if index is None else index[None], scale)[0]


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
