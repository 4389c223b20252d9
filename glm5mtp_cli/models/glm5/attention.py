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

from kernels._triton import use_kernels
from kernels.fp8_block import fp8_heads_matmul, heads_tile
from kernels.paged import MAX_SELECTED, indexer_scores_paged, mla_attention_paged
from kernels.rope import rope_interleaved

from glm5mtp_cli.core.cached import CachedRows
from glm5mtp_cli.models.fp8 import Fp8Linear, joined, linear_weight
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.models.glm5.layers import RMSNorm


def rope_gt(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope of x [G, T, ..., D] with each sequence's positions' cos/sin [G, T, D/2]
    (pairs (x0,x1),(x2,x3),... rotated, laid out as [rotated evens, rotated odds]). At inference on
    CUDA: kernels/rope.py, one kernel instead of about nine, fp32 math rounded once."""
    if use_kernels(x) and not torch.is_grad_enabled():
        n = cos.shape[0] * cos.shape[1]
        out = rope_interleaved(x.reshape(n, *x.shape[2:]), cos.reshape(n, -1), sin.reshape(n, -1))
        return out.view(x.shape)
    shape = cos.shape[:2] + (1,) * (x.dim() - 3) + cos.shape[-1:]
    cos = cos.view(shape).to(x.dtype)
    sin = sin.view(shape).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


@dataclass
class BatchContext:
    """What every layer of one forward shares: B sequences appending T rows each.

    starts [B]: rows each sequence had cached before this forward (0 without a cache), on the
    device; cos/sin [B, T, rope/2]: rope of this forward's positions; mla / indexer: the cached
    rows, or None for a cache-free (training) forward. Everything is a device tensor, so a forward
    built from one can be captured in a CUDA graph and replayed with new contents.
    """

    starts: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mla: CachedRows | None = None
    indexer: CachedRows | None = None


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

    def keys(self, x: torch.Tensor, cos, sin, projected: torch.Tensor | None = None) -> torch.Tensor:
        """x: [G, T, H] -> roped, normed keys [G, T, D]; projected: wk(x) when already computed."""
        return self._rope_first(self.k_norm(self.wk(x) if projected is None else projected), cos, sin)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos, sin,
                projected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(roped queries [G, T, heads, D], fp32 head weights [G, T, heads] scaled by heads^-0.5);
        projected: wq_b(q_resid) when already computed."""
        g, t = x.shape[:2]
        q = self.wq_b(q_resid) if projected is None else projected
        q = self._rope_first(q.view(g, t, self.n_heads, self.head_dim), cos, sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q, w

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, cos, sin,
               projected: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores [G, T, L] in fp32 (not yet masked); keys [G, L, D]; projected as for queries."""
        q, w = self.queries(x, q_resid, cos, sin, projected)
        s = torch.einsum("gthd,gld->gthl", q.float(), keys.float()).relu() * self.head_dim ** -0.5
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
        self.index_topk = cfg.index_topk

    def forward(self, x: torch.Tensor, bc: BatchContext, kv_layer: int, idx_layer: int | None,
                prev_topk: list[torch.Tensor] | None, indexer_losses: list | None = None):
        """x: [B, T, H] -> (out [B, T, H], the top-k selection [B, T, K]).

        kv_layer / idx_layer: this layer's index in the MLA and indexer pools.
        """
        b, t, _ = x.shape
        q_a, kv_a, wk_x = self._project(x)
        q_resid = self.q_a_layernorm(q_a)
        q, wq_b_q = self._project_q(q_resid)
        q = q.view(b, t, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = kv_a.split([self.kv_lora, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)

        q_abs, values = self._absorbed(x, q_nope)

        # All sequences of a forward append the same number of rows, so they run as one group:
        # cache-free (training) ones all start at 0; cached ones read their own rows through padded
        # slot tables. topk is that group's [B, T, K] selection, reused by the next shared layer.
        out, topk = self._group(bc, q_resid, q_abs, q_rope, latent, k_rope, x, (wk_x, wq_b_q), kv_layer,
                                idx_layer, prev_topk, indexer_losses, t, values)
        out = self.o_proj(out.reshape(b, t, self.n_heads * self.v_dim))
        if self.comm is not None:
            out = self.comm.all_reduce_sum(out)
        return out, topk

    def joined_groups(self) -> dict[str, list[nn.Module]]:
        """The projections of one input each, in the order one FP8 GEMM reads them (models/fp8.join_inputs):
        of the layer's input x, and of q_resid (q_b's and the indexer's query heads)."""
        indexer = self.indexer is not None
        return {"x": [self.q_a_proj, *([self.indexer.wk] if indexer else []), self.kv_a_proj_with_mqa],
                "q_resid": [self.q_b_proj, *([self.indexer.wq_b] if indexer else [])]}

    def _project(self, x: torch.Tensor):
        """(q_a(x), kv_a(x), the indexer's wk(x) or None: the indexer then projects x itself); one
        GEMM where the loader joined them."""
        parts = joined(self, "x", x)
        if parts is None:
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None
        q_a, *wk_x, kv_a = parts
        return q_a, kv_a, (wk_x[0] if wk_x else None)

    def _project_q(self, q_resid: torch.Tensor):
        """(q_b(q_resid), the indexer's wq_b(q_resid) or None), as _project."""
        parts = joined(self, "q_resid", q_resid)
        if parts is None:
            return self.q_b_proj(q_resid), None
        return parts[0], (parts[1] if len(parts) > 1 else None)

    def _absorbed(self, x: torch.Tensor, q_nope: torch.Tensor):
        """(q_nope folded through kv_b's key half into latent space [B, T, heads, kv_lora], the function
        taking an output latent [G, T, heads, kv_lora] through the value half to [G, T, heads, v]).

        kv_b as [heads, nope + v, kv_lora]. FP8 on CUDA: kernels/fp8_block.fp8_heads_matmul reads it in
        place; else an FP8 kv_b (models/fp8.py) is dequantized for this forward (on the CPU: exactly
        the weights an unquantized twin holds)."""
        lin, r = self.kv_b_proj, self.nope + self.v_dim
        if use_kernels(x) and isinstance(lin, Fp8Linear) and heads_tile(r, self.nope, lin.block):
            w, s, b, h = lin.weight, lin.weight_scale_inv, lin.block, self.n_heads
            return (fp8_heads_matmul(q_nope, w, s, h, 0, self.nope, True, b),
                    lambda out: fp8_heads_matmul(out.contiguous(), w, s, h, self.nope, self.v_dim, False, b))
        kv_b = linear_weight(lin, q_nope.dtype).view(self.n_heads, r, self.kv_lora)
        w_uv = kv_b[:, self.nope:]
        return (torch.einsum("bthn,hnc->bthc", q_nope, kv_b[:, : self.nope]),
                lambda out: torch.einsum("gthc,hvc->gthv", out, w_uv))

    def _group(self, bc: BatchContext, q_resid, q_abs, q_rope, latent, k_rope, x, projected, kv_layer, idx_layer,
               prev_topk, indexer_losses, t, values):
        """Attention for G sequences at once. Cached sequences of different lengths are read
        through slot tables padded to the longest; padded keys are masked out like future ones.
        projected: the indexer's wk(x) and wq_b(q_resid), each None when not yet computed;
        values: the output latent through kv_b's value half (_absorbed)."""
        cos, sin = bc.cos, bc.sin
        qr = rope_gt(q_rope, cos, sin)
        rows = torch.cat([latent, rope_gt(k_rope, cos, sin)], dim=-1)  # [G, T, C+R]
        if bc.mla is not None and indexer_losses is None and self.use_paged_kernels(x):
            return self._group_paged(bc, q_resid, q_abs, qr, rows, x, projected, kv_layer, idx_layer, prev_topk, values)
        if bc.mla is not None:
            rows = bc.mla.write_read(kv_layer, rows)
        keep = self._causal(bc.starts, t, rows.shape[1], x.device)  # [G, T, L]
        index_scores = None
        if self.indexer is not None:
            training = indexer_losses is not None
            idx_x = x.detach() if training else x
            idx_q = q_resid.detach() if training else q_resid
            wk_x, wq_b_q = (None, None) if training else projected
            keys = self.indexer.keys(idx_x, cos, sin, wk_x)
            if bc.indexer is not None:
                keys = bc.indexer.write_read(idx_layer, keys)
            index_scores = self.indexer.scores(idx_x, idx_q, keys, cos, sin, wq_b_q).masked_fill(~keep, float("-inf"))
            topk = index_scores.topk(min(self.indexer.topk, rows.shape[1]), dim=-1, sorted=False).indices
        else:
            topk = prev_topk
        selected = torch.zeros_like(keep).scatter_(-1, topk, True)
        want_dense = index_scores is not None and indexer_losses is not None
        out, probs_dense = self._attend(q_abs, qr, rows, keep & selected, keep, want_dense)
        if probs_dense is not None:
            indexer_losses.append(_indexer_kl(probs_dense, index_scores, keep))
        return values(out), topk

    PAGED_MAX_TOPK = MAX_SELECTED  # kernels/paged.py says why

    def use_paged_kernels(self, x: torch.Tensor) -> bool:
        """Cached inference on CUDA reads the pools through kernels/paged.py (small selections)."""
        return use_kernels(x) and not torch.is_grad_enabled() and self.index_topk <= self.PAGED_MAX_TOPK

    def _group_paged(self, bc: BatchContext, q_resid, q_abs, qr, rows, x, projected, kv_layer, idx_layer, prev_topk,
                     values):
        """The cached path on CUDA: kernels/paged.py score the indexer keys and attend over the
        selected latent rows in place in the pools (no gathered copy, no [G, T, H, L] scores)."""
        bc.mla.write(kv_layer, rows)
        topk = prev_topk
        if self.indexer is not None:
            bc.indexer.write(idx_layer, self.indexer.keys(x, bc.cos, bc.sin, projected[0]))
            q, w = self.indexer.queries(x, q_resid, bc.cos, bc.sin, projected[1])
            scores = indexer_scores_paged(q, bc.indexer.data[idx_layer], bc.indexer.all, bc.starts, w,
                                          self.indexer.head_dim ** -0.5)
            # a set (the kernel reads the picked keys in any order): sorting it cost a radix sort per
            # layer, 90 us of the 4-layer real-dimension target step on the H200 (device run 12)
            topk = scores.topk(min(self.indexer.topk, scores.shape[-1]), dim=-1, sorted=False).indices
        # the kernel reads q through its strides: the absorbed product's view needs no copy
        out = mla_attention_paged(q_abs, qr, bc.mla.data[kv_layer], bc.mla.all, bc.starts, topk, self.scale)
        return values(out), topk

    @staticmethod
    def _causal(starts: torch.Tensor, t: int, length: int, device) -> torch.Tensor:
        """keep[g, s, l]: key l is visible to query s of sequence g (at position starts[g] + s)."""
        q_pos = starts[:, None] + torch.arange(t, device=device)
        return torch.arange(length, device=device)[None, None, :] <= q_pos[:, :, None]

    def _attend(self, q_abs, q_rope, rows, mask, causal, want_dense: bool):
        """Absorbed attention of G x T queries over L rows each: out latent [G, T, heads, kv_lora].

        mask [G, T, L] (causal and selected); causal [G, T, L]."""
        c, kr = rows[..., : self.kv_lora].to(q_abs.dtype), rows[..., self.kv_lora:].to(q_abs.dtype)
        s = (torch.einsum("gthc,glc->gthl", q_abs, c) + torch.einsum("gthr,glr->gthl", q_rope, kr)) * self.scale
        s = s.float()
        dense = None
        if want_dense:
            dense = s.detach().masked_fill(~causal[:, :, None, :], float("-inf")).softmax(-1)
        p = s.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1).to(q_abs.dtype)
        return torch.einsum("gthl,glc->gthc", p, c), dense


def _indexer_kl(attn_probs: torch.Tensor, index_scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """KL(target || indexer): the target is the dense attention summed over heads (DSA warm-up loss)."""
    target = attn_probs.sum(2)  # [G, T, L]
    target = target / target.sum(-1, keepdim=True)
    logp = index_scores.masked_fill(~causal, float("-inf")).log_softmax(-1)
    logp = logp.masked_fill(~causal, 0.0)
    return (target * (target.clamp_min(1e-12).log() - logp)).sum(-1).mean()
