"""DSA lightning-indexer scores and top-k selection.

``scores[s, t] = scale * sum_h w[s, h] * relu(q[s, h] . k[t])`` for keys t <= causal_offset + s
(query s sits at absolute position ``causal_offset + s``; keys are positions 0..T-1), and -inf
for later keys. Top-k stays in torch (:func:`indexer_topk`) so that ties break exactly as
``torch.topk`` breaks them.
"""

import torch

from ._triton import alloc, interpreting, jit, next_pow2, tl, triton, use_triton


def indexer_scores_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal_offset: int,
                       scale: float) -> torch.Tensor:
    """PyTorch reference: q [S, Hi, D], k [T, D], w [S, Hi] -> fp32 scores [S, T]."""
    logits = torch.einsum("shd,td->sht", q.float(), k.float()).relu()
    scores = (logits * w.float()[:, :, None]).sum(1) * scale
    s, t = scores.shape
    pos = torch.arange(t, device=q.device)[None, :]
    limit = causal_offset + torch.arange(s, device=q.device)[:, None]
    return scores.masked_fill(pos > limit, float("-inf"))


def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [S, min(k, T)] (int64) of the best scores per row, -1 where the pick is masked (-inf)."""
    vals, idx = torch.topk(scores, min(k, scores.shape[-1]), dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1)


@jit
def _scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, S, HI, D, T, causal_offset, scale,
                   stride_qs, stride_qh, stride_kt, stride_ws, S_CHUNK,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DOT_BF16: tl.constexpr):
    # Grid (key blocks, query chunks): a program reads its keys once, then loops over its
    # S_CHUNK queries and over head blocks.
    pid_t = tl.program_id(0)
    s_begin = tl.program_id(1) * S_CHUNK
    s_end = tl.minimum(s_begin + S_CHUNK, S)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    tmask = offs_t < T
    dmask = offs_d < D
    kt = tl.load(k_ptr + offs_d[:, None] + offs_t[None, :].to(tl.int64) * stride_kt,
                 mask=dmask[:, None] & tmask[None, :], other=0.0)  # [BLOCK_D, BLOCK_T] = k^T
    if not DOT_BF16:
        kt = kt.to(tl.float32)
    q_row = q_ptr + s_begin.to(tl.int64) * stride_qs
    w_row = w_ptr + s_begin.to(tl.int64) * stride_ws
    out_row = out_ptr + s_begin.to(tl.int64) * T + offs_t
    for s in range(s_begin, s_end):
        acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for h0 in range(0, HI, BLOCK_H):
            hmask = (h0 + offs_h) < HI
            qb = tl.load(q_row + (h0 + offs_h)[:, None] * stride_qh + offs_d[None, :],
                         mask=hmask[:, None] & dmask[None, :], other=0.0)
            if DOT_BF16:
                logits = tl.dot(qb, kt)
            else:
                logits = tl.dot(qb.to(tl.float32), kt, input_precision="ieee")
            wv = tl.load(w_row + h0 + offs_h, mask=hmask, other=0.0).to(tl.float32)
            acc += tl.sum(tl.maximum(logits, 0.0) * wv[:, None], axis=0)
        res = tl.where(offs_t <= causal_offset + s, acc * scale, float("-inf"))
        tl.store(out_row, res, mask=tmask)
        q_row += stride_qs
        w_row += stride_ws
        out_row += T


def indexer_scores_triton(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal_offset: int,
                          scale: float) -> torch.Tensor:
    """Triton version of :func:`indexer_scores_ref`; grid (key blocks, chunks of 8 queries)."""
    assert q.dim() == 3 and k.dim() == 2 and w.dim() == 2
    s, hi, d = q.shape
    t = k.shape[0]
    assert k.shape[1] == d and w.shape == (s, hi), "shapes: q [S, Hi, D], k [T, D], w [S, Hi]"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and w.stride(-1) == 1, "unit last strides needed"
    out = alloc((s, t), dtype=torch.float32, device=q.device)
    if s and t:
        block_t, s_chunk = 64, 8
        dot_bf16 = q.dtype == k.dtype == torch.bfloat16 and not interpreting()
        _scores_kernel[(triton.cdiv(t, block_t), triton.cdiv(s, s_chunk))](
            q, k, w, out, s, hi, d, t, causal_offset, scale,
            q.stride(0), q.stride(1), k.stride(0), w.stride(0), s_chunk,
            BLOCK_T=block_t, BLOCK_H=min(32, next_pow2(hi)), BLOCK_D=next_pow2(d),
            DOT_BF16=dot_bf16, num_warps=4)
    return out


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal_offset: int, scale: float,
                   force_triton: bool = False) -> torch.Tensor:
    """Indexer scores of S queries against T keys.

    Args:
        q: [S, Hi, D] indexer queries (rope already applied).
        k: [T, D] indexer keys, one per position.
        w: [S, Hi] per-head weights.
        causal_offset: absolute position of query 0; query s sees keys t <= causal_offset + s.
        scale: multiplies every score (idx_dim ** -0.5 in GLM-5).
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        fp32 [S, T], -inf at masked positions.
    """
    if use_triton(q, k, w, force=force_triton):
        return indexer_scores_triton(q, k, w, causal_offset, scale)
    return indexer_scores_ref(q, k, w, causal_offset, scale)
