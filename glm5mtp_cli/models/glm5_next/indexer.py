"""The pooled DSA indexer of GLM-5-Next (REFERENCE-glm5next section 6).

Keys are scored per POOL of P = index_kpool consecutive tokens, not per token: each complete pool
has one key, a per-channel softmax-weighted mix of its tokens' LayerNormed keys (weights from a
gate projection plus a learned per-slot bias `ape`). A query selects the best index_topk / P
complete pools it can see, and always sees the incomplete tail pool (its newest (s+1) mod P
tokens). So a sequence caches one pooled key per complete pool plus the raw (key, gate) rows of
its tail (at most P-1), never all raw keys.

Pools start at position 0 (one unpadded sequence per call: left padding is the engine's concern).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5mtp_cli.models.glm5_next.config import NextConfig
from kernels.pool_keys import pool_keys_ref


class Indexer(nn.Module):
    """Parameters named as the checkpoint's `self_attn.indexer.*`."""

    def __init__(self, cfg: NextConfig):
        super().__init__()
        d, di, hi = cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
        self.heads, self.head_dim, self.pool = hi, di, cfg.index_kpool
        self.n_select = cfg.index_topk // cfg.index_kpool
        self.always_tail = cfg.index_kpool_always_select_tail
        self.wq_b = nn.Linear(cfg.q_lora_rank, hi * di, bias=False)
        self.wk = nn.Linear(d, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)
        self.weights_proj = nn.Linear(d, hi, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.index_kpool, di))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(di, d))

    def raw_keys(self, a: torch.Tensor, wk_a: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token cacheable rows [T, 2 di]: LayerNorm(wk a) | gate logits (both read a, the normed
        input); wk_a: wk(a) where the caller's joined GEMM made it."""
        k = self.wk(a) if wk_a is None else wk_a
        return torch.cat([self.k_norm(k), F.linear(a, self.index_kpool_compress_gate)], dim=-1)

    def queries(self, a: torch.Tensor, cq: torch.Tensor, wq_cq: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [..., T, Hi, di] from the MLA query latent, head weights [..., T, Hi] fp32 scaled by
        Hi^-1/2); wq_cq: wq_b(cq) where the caller's joined GEMM made it."""
        q = (self.wq_b(cq) if wq_cq is None else wq_cq).view(*cq.shape[:-1], self.heads, self.head_dim)
        w = self.weights_proj(a.to(self.weights_proj.weight.dtype)).float() * self.heads ** -0.5
        return q, w

    def pool_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """Pooled keys of complete pools: raw [m*P, 2 di] -> [m, di]."""
        return pool_keys_ref(raw, self.index_kpool_compress_ape, self.pool)


def pool_scores(q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """I[s, p] = sum_h w[s,h] ReLU(q[s,h] . K̄_p / sqrt(di)) in fp32: [..., T, Np] (q [..., T, Hi, di],
    w [..., T, Hi], pooled [..., Np, di]: the leading dims are a batch of sequences)."""
    s = torch.einsum("...thc,...pc->...thp", q.float(), pooled.float()) * q.shape[-1] ** -0.5
    return torch.einsum("...th,...thp->...tp", w, F.relu(s))


def select_pools(scores: torch.Tensor, visible: torch.Tensor, n_select: int) -> torch.Tensor:
    """Boolean [..., T, Np]: for each query the top min(n_select, visible) pools among its `visible`
    [..., T] first ones (complete pools whose last token it can see)."""
    np_ = scores.shape[-1]
    if np_ == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    valid = torch.arange(np_, device=scores.device) < visible[..., None]
    masked = scores.masked_fill(~valid, float("-inf"))
    k = min(n_select, np_)
    top = masked.topk(k, dim=-1).indices
    sel = torch.zeros_like(valid).scatter_(-1, top, True)
    return sel & valid


def key_mask(sel: torch.Tensor, start: int, total: int, pool: int, always_tail: bool) -> torch.Tensor:
    """Token-level attention mask [T, total] of queries at positions start..start+T-1: tokens of
    selected pools, plus the query's incomplete tail pool {P floor((s+1)/P) .. s}."""
    t = sel.shape[0]
    dev = sel.device
    tok = torch.arange(total, device=dev)
    np_ = sel.shape[1]
    if np_:
        in_pool = tok < np_ * pool
        mask = sel[:, (tok // pool).clamp(max=np_ - 1)] & in_pool[None, :]
    else:
        mask = torch.zeros(t, total, dtype=torch.bool, device=dev)
    if always_tail:
        s = start + torch.arange(t, device=dev)
        tail_start = (s + 1) // pool * pool
        mask |= (tok[None, :] >= tail_start[:, None]) & (tok[None, :] <= s[:, None])
    return mask
