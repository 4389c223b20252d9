"""DSA lightning-indexer scores and top-k selection.

``scores[s, t] = scale * sum_h w[s, h] * relu(q[s, h] . k[t])`` for keys t <= causal_offset + s
(query s sits at absolute position ``causal_offset + s``; keys are positions 0..T-1), and -inf
for later keys. Top-k stays in torch (:func:`indexer_topk`) so that ties break exactly as
``torch.topk`` breaks them. The Triton path is kernels/paged.py's kernel over a single sequence.
"""

import torch

from ._triton import use_triton


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


def indexer_scores_triton(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal_offset: int,
                          scale: float) -> torch.Tensor:
    """Triton version of :func:`indexer_scores_ref`: the paged kernel (kernels/paged.py) over one
    sequence whose keys sit in rows 0..T-1."""
    from .paged import indexer_scores_paged_triton  # paged.py builds its reference on this module

    assert q.dim() == 3 and k.dim() == 2 and w.dim() == 2
    s, hi, d = q.shape
    t = k.shape[0]
    assert k.shape[1] == d and w.shape == (s, hi), "shapes: q [S, Hi, D], k [T, D], w [S, Hi]"
    slots = torch.arange(t, device=q.device)[None]
    starts = torch.tensor([causal_offset], device=q.device)
    return indexer_scores_paged_triton(q[None], k, slots, starts, w[None], scale)[0]


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
