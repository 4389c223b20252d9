"""NoPE MLA with the pooled DSA indexer: the indexed layers of GLM-5-Next and its MTP layer
(REFERENCE-glm5next section 6).

Per token the layer caches only the kv_a_layernorm'ed latent (kv_lora_rank values; no rope part),
plus the indexer's pooled keys / raw tail (indexer.py). Attention runs absorbed: each head's query
is folded through kv_b_proj's key half so scores are taken against the latent, and the attended
latent goes through the value half at the end. Scale is qk_head_dim^-1/2 with no yarn mscale, and
q_a/kv_a norms use rms_norm_eps (GLM-5 uses 1e-6 there).

`MlaLayer.forward` reads the past (never writes it) and returns an `MlaPending`; `commit(keep)` gives
the rows to write when the first `keep` new rows are kept. Pools completed by rejected rows are dropped by
construction, and the tail is rebuilt from the untouched old tail + the kept new rows, so drafts
behind a rejected pool-completing draft can never overwrite what the redo needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5mtp_cli.models.fp8 import joined
from glm5mtp_cli.models.glm5.layers import RMSNorm
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.indexer import Indexer, key_mask, pool_scores, select_pools


@dataclass
class MlaPast:
    """A sequence's cached rows for one indexed layer (views; read only)."""

    latent: torch.Tensor   # [p, R]
    pooled: torch.Tensor   # [p // P, di]
    tail: torch.Tensor     # [p % P, 2 di]

    @property
    def length(self) -> int:
        return self.latent.shape[0]


@dataclass
class MlaCommit:
    """Rows to write after accepting: latent rows at `start`, pooled keys at `pool_start`, the new tail."""

    start: int
    latent: torch.Tensor
    pool_start: int
    pooled: torch.Tensor
    tail: torch.Tensor


@dataclass
class MlaPending:
    start: int                 # p: position of the first new row
    pool: int                  # P
    latent: torch.Tensor       # [T, R] new latent rows
    raw: torch.Tensor          # [p % P + T, 2 di]: old tail + new raw indexer rows
    pooled: torch.Tensor       # [(p+T)//P - p//P, di]: pools completed inside the T rows
    selected: torch.Tensor | None = None  # [T, Np] pool selection of each new row (diagnostics / reuse)
    scores: torch.Tensor | None = None    # [T, Np] indexer scores

    def commit(self, keep: int) -> MlaCommit:
        """Keep the first `keep` new rows (0..T): length becomes p + keep."""
        p, P = self.start, self.pool
        n = p + keep
        base = p // P * P                      # position of raw[0]
        keep_pools = n // P - p // P           # pools completed by dropped rows are not kept
        tail = self.raw[n // P * P - base: n - base].clone()
        return MlaCommit(p, self.latent[:keep], p // P, self.pooled[:keep_pools], tail)


class MlaLayer(nn.Module):
    """Parameters named as the checkpoint's `self_attn.*` of an indexed layer. Under --tp it holds
    `heads` of the model's heads (the latent and the indexer are whole) and o_proj's partial sum is
    added over ranks (`comm`)."""

    comm = None

    def __init__(self, cfg: NextConfig):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.heads, self.dn, self.dv, self.rank = h, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        self.pool = cfg.index_kpool
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        self.indexer = Indexer(cfg)

    def joined_groups(self) -> dict[str, list[nn.Module]]:
        """The projections of one input each, in the order one GEMM reads them (models/fp8.py): of the
        normed rows a, and of the query latent cq (q_b's and the indexer's query heads)."""
        return {"a": [self.q_a_proj, self.kv_a_proj_with_mqa, self.indexer.wk], "cq": [self.q_b_proj, self.indexer.wq_b]}

    def project(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_a(a), kv_a(a), the indexer's wk(a) or None: the indexer then projects a itself); one GEMM
        where the loader joined them."""
        parts = joined(self, "a", a)
        return (self.q_a_proj(a), self.kv_a_proj_with_mqa(a), None) if parts is None else tuple(parts)

    def project_q(self, cq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q_b(cq), the indexer's wq_b(cq) or None), as `project`."""
        parts = joined(self, "cq", cq)
        return (self.q_b_proj(cq), None) if parts is None else tuple(parts)

    def forward(self, a: torch.Tensor, past: MlaPast, reuse_selection: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, MlaPending]:
        """a [T, D] normed rows at positions p..p+T-1 (p = past.length).

        reuse_selection [T, Np'] (optional, MTP chaining with index_share_for_mtp_iteration): the
        pool selection of draft step 0's row r (Np' = the pools complete at r) used instead of
        running the indexer's scoring. Pools beyond its width are all selected: they hold the rows
        r's always-selected tail held, or rows appended after r (the chain rows), so a chain row at s
        attends KeySet_r plus rows r+1..s. REFERENCE-glm5next section 9 says the step-0 top-k row is
        reused but not how later rows enter; dropping them would hide the newest tokens (even the
        step-0 row) from the draft whenever a chain row completes a pool.
        """
        T, p, P = a.shape[0], past.length, self.pool
        cq = self.q_a_layernorm(self.q_a_proj(a))
        q = self.q_b_proj(cq).view(T, self.heads, self.dn)
        c_new = self.kv_a_layernorm(self.kv_a_proj_with_mqa(a))
        latent = torch.cat([past.latent.to(c_new.dtype), c_new], dim=0)           # [p+T, R]

        # indexer: raw rows of the new tokens, pools they complete, selection per query
        raw = torch.cat([past.tail.to(a.dtype), self.indexer.raw_keys(a)], dim=0)
        new_pools = self.indexer.pool_keys(raw)
        pooled = torch.cat([past.pooled.to(new_pools.dtype), new_pools], dim=0)  # [(p+T)//P, di]
        visible = (p + 1 + torch.arange(T, device=a.device)) // P
        scores = None
        if reuse_selection is None:
            qi, w = self.indexer.queries(a, cq)
            scores = pool_scores(qi, w, pooled)
            sel = select_pools(scores, visible, self.indexer.n_select)
        else:
            sel = torch.ones(T, pooled.shape[0], dtype=torch.bool, device=a.device)
            width = min(reuse_selection.shape[1], pooled.shape[0])
            sel[:, :width] = reuse_selection[:, :width]
            sel &= torch.arange(pooled.shape[0], device=a.device)[None, :] < visible[:, None]
        mask = key_mask(sel, p, p + T, P, self.indexer.always_tail)

        # absorbed attention over the latent
        wkv = self.kv_b_proj.weight.view(self.heads, self.dn + self.dv, self.rank)
        w_uk, w_uv = wkv[:, : self.dn], wkv[:, self.dn:]
        q_lat = torch.einsum("thd,hdr->thr", q, w_uk)
        att = torch.einsum("thr,lr->thl", q_lat, latent).float() * self.scale
        att = att.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1).to(latent.dtype)
        o_lat = torch.einsum("thl,lr->thr", att, latent)
        o = torch.einsum("thr,hvr->thv", o_lat, w_uv).reshape(T, self.heads * self.dv)
        pending = MlaPending(p, P, c_new, raw, new_pools, sel, scores)
        out = self.o_proj(o)
        return (out if self.comm is None else self.comm.all_reduce_sum(out)), pending
