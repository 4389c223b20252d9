"""MLA attention with the DSA indexer, over a paged cache of latent rows and indexer keys.

The cache keeps, per token, only what MLA needs (REFERENCE section 3): the kv_a_layernorm'ed
latent (kv_lora_rank) and the roped shared key (qk_rope_head_dim). Attention runs in the absorbed
form: q_nope is folded through kv_b_proj's key half so scores are taken against the latent
directly, and the output latent goes through the value half at the end. That equals expanding
K and V per head (what transformers does) up to rounding, without materialising them.

DSA: a `full` layer scores every cached key with its indexer and keeps the best min(index_topk, L)
per query; attention sees only those (and only causal ones). A `shared` layer reuses the previous
full layer's selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .layers import RMSNorm, apply_rope_interleaved


def rope_gt(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope of x [G, T, ..., D] with the T positions' cos/sin [T, D/2]."""
    return apply_rope_interleaved(x.transpose(0, 1), cos, sin).transpose(0, 1)


@dataclass
class AttnContext:
    """Per-sequence inputs of one forward, shared by every layer.

    kv / idx: (read_rows(layer_slot) -> rows, write_rows(layer_slot, rows)) closures or None for
    a cache-free (training) forward; `start` is the number of rows cached before this forward.
    """

    start: int
    cos: torch.Tensor  # [T, rope/2]
    sin: torch.Tensor
    cache: object | None = None  # SequenceCache
    kv_slots: object | None = None  # StepSlots
    idx_slots: object | None = None


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope_first(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rope_gt(rot, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x: [G, T, H] -> roped, normed keys [G, T, D]."""
        return self._rope_first(self.k_norm(self.wk(x)), cos, sin)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, cos, sin) -> torch.Tensor:
        """Index scores [G, T, L] in fp32 (not yet masked); keys [G, L, D]."""
        g, t = x.shape[:2]
        q = self._rope_first(self.wq_b(q_resid).view(g, t, self.n_heads, self.head_dim), cos, sin)
        s = torch.einsum("gthd,gld->gthl", q.float(), keys.float()).relu() * self.head_dim ** -0.5
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return torch.einsum("gth,gthl->gtl", w, s)


class MLAttention(nn.Module):
    # Set by parallel.shard_model when q_b/kv_b hold this rank's heads and o_proj its input columns:
    # o_proj's partial output is then summed over ranks. None (one device): no reduction.
    comm = None

    def __init__(self, cfg: ModelConfig, has_indexer: bool):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg) if has_indexer else None

    def forward(self, x: torch.Tensor, ctxs: list[AttnContext], kv_layer: int, idx_layer: int | None,
                prev_topk: list[torch.Tensor] | None, indexer_losses: list | None = None):
        """x: [B, T, H] -> (out [B, T, H], the top-k selection of each group of sequences).

        kv_layer / idx_layer: this layer's index in the MLA and indexer pools.
        """
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)

        w_uk = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)[:, : self.nope]
        q_abs = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # q_nope folded into latent space

        # Cache-free (training) forwards start every sequence at 0: one batched pass. Cached
        # sequences each have their own length, so each is its own group of one. topks holds one
        # [G, T, K] selection per group, which the next `shared` layer reuses group by group.
        cache_free = all(ctx.cache is None for ctx in ctxs)
        spans = [(0, b)] if cache_free else [(i, i + 1) for i in range(b)]
        outs, topks = [], []
        for n, (i, j) in enumerate(spans):
            out, topk = self._group(ctxs[i], q_resid[i:j], q_abs[i:j], q_rope[i:j], latent[i:j], k_rope[i:j],
                                    x[i:j], kv_layer, idx_layer, None if prev_topk is None else prev_topk[n],
                                    indexer_losses, t)
            outs.append(out)
            topks.append(topk)
        out = self.o_proj(torch.cat(outs).reshape(b, t, self.n_heads * self.v_dim))
        if self.comm is not None:
            out = self.comm.all_reduce_sum(out)
        return out, topks

    def _group(self, ctx, q_resid, q_abs, q_rope, latent, k_rope, x, kv_layer, idx_layer, prev_topk,
               indexer_losses, t):
        """Attention for G sequences sharing start and cache-ness (G = 1 whenever a cache is used)."""
        w_uv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)[:, self.nope:]
        qr = rope_gt(q_rope, ctx.cos, ctx.sin)
        rows = torch.cat([latent, rope_gt(k_rope, ctx.cos, ctx.sin)], dim=-1)  # [G, T, C+R]
        if ctx.cache is not None:
            ctx.cache.mla.write(kv_layer, ctx.kv_slots.new, rows[0])
            rows = ctx.cache.mla.read(kv_layer, ctx.kv_slots.all)[None]
        keep = self._causal(ctx.start, t, rows.shape[1], x.device)
        index_scores = None
        if self.indexer is not None:
            training = indexer_losses is not None
            idx_x = x.detach() if training else x
            idx_q = q_resid.detach() if training else q_resid
            keys = self.indexer.keys(idx_x, ctx.cos, ctx.sin)
            if ctx.cache is not None:
                ctx.cache.indexer.write(idx_layer, ctx.idx_slots.new, keys[0])
                keys = ctx.cache.indexer.read(idx_layer, ctx.idx_slots.all)[None]
            index_scores = self.indexer.scores(idx_x, idx_q, keys, ctx.cos, ctx.sin).masked_fill(~keep, float("-inf"))
            topk = index_scores.topk(min(self.indexer.topk, rows.shape[1]), dim=-1).indices
        else:
            topk = prev_topk
        selected = torch.zeros(topk.shape[:2] + keep.shape[-1:], dtype=torch.bool, device=x.device)
        selected.scatter_(-1, topk, True)
        want_dense = index_scores is not None and indexer_losses is not None
        out, probs_dense = self._attend(q_abs, qr, rows, keep & selected, keep, want_dense)
        if probs_dense is not None:
            indexer_losses.append(_indexer_kl(probs_dense, index_scores, keep))
        return torch.einsum("gthc,hvc->gthv", out, w_uv), topk

    @staticmethod
    def _causal(start: int, t: int, length: int, device) -> torch.Tensor:
        q_pos = torch.arange(start, start + t, device=device)
        return torch.arange(length, device=device)[None, :] <= q_pos[:, None]

    def _attend(self, q_abs, q_rope, rows, mask, causal, want_dense: bool):
        """Absorbed attention of G x T queries over L rows each: out latent [G, T, heads, kv_lora].

        mask [G, T, L] (causal and selected); causal [T, L]."""
        c, kr = rows[..., : self.kv_lora].to(q_abs.dtype), rows[..., self.kv_lora:].to(q_abs.dtype)
        s = (torch.einsum("gthc,glc->gthl", q_abs, c) + torch.einsum("gthr,glr->gthl", q_rope, kr)) * self.scale
        s = s.float()
        dense = None
        if want_dense:
            dense = s.detach().masked_fill(~causal[None, :, None, :], float("-inf")).softmax(-1)
        p = s.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1).to(q_abs.dtype)
        return torch.einsum("gthl,glc->gthc", p, c), dense


def _indexer_kl(attn_probs: torch.Tensor, index_scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """KL(target || indexer): the target is the dense attention summed over heads (DSA warm-up loss)."""
    target = attn_probs.sum(2)  # [G, T, L]
    target = target / target.sum(-1, keepdim=True)
    logp = index_scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
    logp = logp.masked_fill(~causal, 0.0)
    return (target * (target.clamp_min(1e-12).log() - logp)).sum(-1).mean()
