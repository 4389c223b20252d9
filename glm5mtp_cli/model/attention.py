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
        return torch.cat([apply_rope_interleaved(rot, cos, sin), rest], dim=-1)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x: [T, H] -> roped, normed keys [T, D]."""
        return self._rope_first(self.k_norm(self.wk(x)), cos, sin)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, cos, sin) -> torch.Tensor:
        """Index scores [T, L] in fp32 (not yet masked)."""
        t = x.shape[0]
        q = self._rope_first(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        s = torch.einsum("thd,ld->thl", q.float(), keys.float()).relu() * self.head_dim ** -0.5
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return torch.einsum("th,thl->tl", w, s)


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
        """x: [B, T, H] -> (out [B, T, H], topk per sequence).

        kv_layer / idx_layer: this layer's index in the MLA and indexer pools.
        """
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)

        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        q_abs = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # q_nope folded into latent space

        outs, topks = [], []
        for i, ctx in enumerate(ctxs):
            qr = apply_rope_interleaved(q_rope[i], ctx.cos, ctx.sin)
            kr = apply_rope_interleaved(k_rope[i], ctx.cos, ctx.sin)
            rows = torch.cat([latent[i], kr], dim=-1)
            if ctx.cache is not None:
                ctx.cache.mla.write(kv_layer, ctx.kv_slots.new, rows)
                rows = ctx.cache.mla.read(kv_layer, ctx.kv_slots.all)
            keep = self._causal(ctx.start, t, rows.shape[0], x.device)
            if self.indexer is not None:
                idx_x = x[i].detach() if indexer_losses is not None else x[i]
                idx_q = q_resid[i].detach() if indexer_losses is not None else q_resid[i]
                keys = self.indexer.keys(idx_x, ctx.cos, ctx.sin)
                if ctx.cache is not None:
                    ctx.cache.indexer.write(idx_layer, ctx.idx_slots.new, keys)
                    keys = ctx.cache.indexer.read(idx_layer, ctx.idx_slots.all)
                index_scores = self.indexer.scores(idx_x, idx_q, keys, ctx.cos, ctx.sin)
                index_scores = index_scores.masked_fill(~keep, float("-inf"))
                topk = index_scores.topk(min(self.indexer.topk, rows.shape[0]), dim=-1).indices
            else:
                index_scores = None
                topk = prev_topk[i]
            selected = torch.zeros_like(keep).scatter_(-1, topk, True)
            out, probs_dense = self._attend(q_abs[i], qr, rows, keep & selected, keep,
                                            want_dense=index_scores is not None and indexer_losses is not None)
            if probs_dense is not None:
                indexer_losses.append(_indexer_kl(probs_dense, index_scores, keep))
            outs.append(torch.einsum("thc,hvc->thv", out, w_uv))
            topks.append(topk)
        out = self.o_proj(torch.stack(outs).reshape(b, t, self.n_heads * self.v_dim))
        if self.comm is not None:
            out = self.comm.all_reduce_sum(out)
        return out, topks

    @staticmethod
    def _causal(start: int, t: int, length: int, device) -> torch.Tensor:
        q_pos = torch.arange(start, start + t, device=device)
        return torch.arange(length, device=device)[None, :] <= q_pos[:, None]

    def _attend(self, q_abs, q_rope, rows, mask, causal, want_dense: bool):
        """Absorbed attention of T queries over L cached rows. Returns out latent [T, heads, kv_lora]."""
        c, kr = rows[:, : self.kv_lora], rows[:, self.kv_lora:]
        c = c.to(q_abs.dtype)
        kr = kr.to(q_abs.dtype)
        s = (torch.einsum("thc,lc->thl", q_abs, c) + torch.einsum("thr,lr->thl", q_rope, kr)) * self.scale
        s = s.float()
        dense = None
        if want_dense:
            dense = s.detach().masked_fill(~causal[:, None, :], float("-inf")).softmax(-1)
        p = s.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1).to(q_abs.dtype)
        return torch.einsum("thl,lc->thc", p, c), dense


def _indexer_kl(attn_probs: torch.Tensor, index_scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """KL(target || indexer): the target is the dense attention summed over heads (DSA warm-up loss)."""
    target = attn_probs.sum(1)
    target = target / target.sum(-1, keepdim=True)
    logp = index_scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
    logp = logp.masked_fill(~causal, 0.0)
    return (target * (target.clamp_min(1e-12).log() - logp)).sum(-1).mean()
