"""GLM-5-Next over the engine's pools, B sequences per forward with fixed shapes: what the engine's
static and CUDA-graph forwards run, and its eager forwards too (pooled.py).

Every shape depends only on (B, T, the tables' width L): no sequence length is read on the host.
Per indexed layer (NoPE MLA + pooled indexer, REFERENCE-glm5next section 6):
- the new rows' latent and raw indexer rows are written through the tables;
- pools: the pools the new rows complete get their keys (kernels/pool_keys.py: a key is split over
  its pool's P rows, read from the raw rows through the table);
- scores over all L // P pools (on the kernels' path read in place by kernels/paged.py's scores,
  else every complete pool's key read back), top-min(k, L // P) of each query's complete ones;
- attention over the latent rows of the selected pools and the query's own tail pool (on the
  kernels' path, for small selections and decode or verify widths, read in place by kernels/paged.py's
  attention; else all L rows read back and masked).
Per KDA layer: each sequence's S and conv window are read through its slot index (CachedSlots;
a decode or verify on the kernel path reads S in place, kernels/kda.py's kda_slots), the
recurrence runs for all B sequences at once (heads folded), and a KdaBatchPending is left for the
commit after the forward: nothing writes S inside a forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5mtp_cli.core.cached import CachedRows, CachedSlots
from glm5mtp_cli.models.glm5.layers import norm_pair
from glm5mtp_cli.models.glm5_next.attention import MlaLayer
from glm5mtp_cli.models.glm5_next.indexer import pool_scores, select_pools
from glm5mtp_cli.models.glm5_next.kda import KERNEL_ROWS, KdaBatchPending
from glm5mtp_cli.models.glm5_next.mhc import contract_streams, expand_streams
from kernels._triton import use_kernels
from kernels.paged import MAX_SELECTED, Pools, indexer_scores_paged, mla_attention_paged
from kernels.pool_keys import write_pool_keys


@dataclass
class PagedContext:
    """One forward of B sequences appending t rows each. starts [B] (device): rows each sequence
    held before; rows: `mla`, `pool`, `raw` (CachedRows over tables L rows wide, L >= starts + t);
    slots: `kda`, `conv` (target only); kda_mode: "replay" (verify-sized) or "final" (prefill);
    real [B] (device, None: all t): the rows of each sequence that are real, the rest padding of a
    shared prefill forward, kept out of the KDA state (KdaLayer.forward_batch); paged rows past a
    sequence's real ones are cut back by the caller, as GLM-5's are."""

    starts: torch.Tensor
    t: int
    rows: dict[str, CachedRows]
    slots: dict[str, CachedSlots] = field(default_factory=dict)
    kda_mode: str = "replay"
    real: torch.Tensor | None = None
    _positions: torch.Tensor | None = field(default=None, init=False, repr=False)

    def positions(self) -> torch.Tensor:
        """[B, t] position of each new row (computed once a forward: each op is a graph launch)."""
        if self._positions is None:
            self._positions = self.starts[:, None] + torch.arange(self.t, device=self.starts.device)
        return self._positions


def indexer_scores(qi: torch.Tensor, w: torch.Tensor, ctx: PagedContext, layer: int, pool: int) -> torch.Tensor:
    """The pooled indexer's scores [B, T, L//P] of queries qi [B, T, Hi, di] (head weights w): on the
    kernels' path kernels/paged.py's scores, reading the pooled keys in place (-inf past each
    query's complete pools, which select_pools masks anyway); else every complete pool's key read
    back and scored."""
    rows = ctx.rows["pool"]
    data = rows.data[layer]
    if use_kernels(qi):
        return indexer_scores_paged(qi, data, rows.all, ctx.starts, w, qi.shape[-1] ** -0.5, pool)
    b, length = rows.all.shape
    keys = data.index_select(0, rows.all[:, : length // pool * pool].reshape(-1))
    return pool_scores(qi, w, keys.view(b, length // pool, pool * data.shape[-1]))


def key_mask(sel: torch.Tensor, pos: torch.Tensor, length: int, pool: int, always_tail: bool) -> torch.Tensor:
    """[B, T, L]: keys of the selected pools up to the query itself (a chained draft's selection may
    name pools past it: mla_paged), plus each query's tail {P floor((s+1)/P) .. s}."""
    tok = torch.arange(length, device=pos.device)
    np_ = sel.shape[-1]
    if np_:
        mask = sel.gather(-1, (tok // pool).clamp(max=np_ - 1).expand(*sel.shape[:-1], length))
        mask &= (tok < np_ * pool) & (tok <= pos[..., None])
    else:
        mask = torch.zeros(*pos.shape, length, dtype=torch.bool, device=pos.device)
    if always_tail:
        mask |= (tok >= ((pos + 1) // pool * pool)[..., None]) & (tok <= pos[..., None])
    return mask


def attend(attn: MlaLayer, q_lat: torch.Tensor, pools: Pools, ctx: PagedContext, layer: int) -> torch.Tensor:
    """Latent outputs [B, T, H, R] of the absorbed queries q_lat over the chosen pools' latent rows
    and each query's tail: on the kernels' path, for selections GLM-5's measurement says it pays
    (kernels/paged.MAX_SELECTED; its decode and verify widths), kernels/paged.py's attention,
    reading the pool in place; else every row 0..L-1 read back, masked (key_mask) and attended."""
    mla = ctx.rows["mla"]
    data = mla.data[layer]
    selected = attn.indexer.n_select * pools.size + pools.size - 1  # the chosen pools' rows and a tail
    if use_kernels(q_lat) and selected <= MAX_SELECTED and q_lat.shape[1] <= KERNEL_ROWS:
        # the kernel reads q through its strides: the absorbed product's [B, T, H] view needs no copy
        return mla_attention_paged(q_lat, q_lat[..., :0], data, mla.all, ctx.starts, None, attn.scale, pools)
    latent = data.index_select(0, mla.all.reshape(-1)).view(*mla.all.shape, -1).to(q_lat.dtype)
    mask = key_mask(pools.chosen, ctx.positions(), latent.shape[1], pools.size, pools.tail)
    att = torch.einsum("bthr,blr->bthl", q_lat, latent).float() * attn.scale
    att = att.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1).to(latent.dtype)
    return torch.einsum("bthl,blr->bthr", att, latent)


def mla_paged(attn: MlaLayer, a: torch.Tensor, ctx: PagedContext, layer: int, reuse: torch.Tensor | None = None):
    """An indexed layer over the pools: a [B, T, D] normed rows -> (out [B, T, D], pool selection
    [B, T, L//P], visible pools [B, T] or None where a chained step needs none). reuse (MTP
    chaining, MlaLayer.forward's reuse_selection): [B, L//P] each sequence's draft-step-0 selection
    with every pool past that step's visible ones selected (chain_selection); each row keeps of it
    the pools it sees."""
    b, t = a.shape[:2]
    P = attn.pool
    q_a, kv_a, wk_a = attn.project(a)
    cq = attn.q_a_layernorm(q_a)
    q, wq_cq = attn.project_q(cq)
    q = q.view(b, t, attn.heads, attn.dn)
    ctx.rows["mla"].write(layer, attn.kv_a_layernorm(kv_a))
    ctx.rows["raw"].write(layer, attn.indexer.raw_keys(a, wk_a))
    pool, raw = ctx.rows["pool"], ctx.rows["raw"]
    ape = attn.indexer.index_kpool_compress_ape
    write_pool_keys(pool.data, raw.data, layer, pool.all, raw.all, ctx.starts, t, ape)
    if reuse is not None and attn.indexer.always_tail:
        # past the pools a row sees lie only its tail pool, attended anyway, and rows after it, which
        # attention never reads (key_mask, the kernel): the chain's selection serves every row uncut
        sel, visible = reuse[:, None, :], None
    else:
        visible = (ctx.positions() + 1) // P
        if reuse is None:
            qi, w = attn.indexer.queries(a, cq, wq_cq)
            sel = select_pools(indexer_scores(qi, w, ctx, layer, P), visible, attn.indexer.n_select)
        else:
            sel = reuse[:, None, :] & (torch.arange(reuse.shape[1], device=a.device) < visible[..., None])
    wkv = attn.kv_b_proj.weight.view(attn.heads, attn.dn + attn.dv, attn.rank)
    q_lat = torch.einsum("bthd,hdr->bthr", q, wkv[:, : attn.dn])
    o_lat = attend(attn, q_lat, Pools(sel, P, attn.indexer.always_tail), ctx, layer)
    o = torch.einsum("bthr,hvr->bthv", o_lat, wkv[:, attn.dn:]).reshape(b, t, attn.heads * attn.dv)
    out = attn.o_proj(o)
    return (out if attn.comm is None else attn.comm.all_reduce_sum(out)), sel, visible


def target_forward(model, ids: torch.Tensor, ctx: PagedContext) -> tuple[torch.Tensor, KdaBatchPending | None]:
    """Glm5NextForCausalLM over the pools: ids [B, T] -> (post-norm hiddens [B, T, D], the KDA
    layers' records stacked in cfg.kda_layers order; None without KDA layers)."""
    cfg = model.cfg
    kda_at = {i: j for j, i in enumerate(cfg.kda_layers)}
    idx_at = {i: j for j, i in enumerate(cfg.indexed_layers)}
    streams = expand_streams(model.embed_tokens(ids), cfg.hc_mult)
    pending: dict[int, KdaBatchPending] = {}
    for i, block in enumerate(model.layers):
        if block.kda:
            j = kda_at[i]
            window = ctx.slots["conv"].read(j)
            streams, pending[j] = block.run(
                streams, lambda a: block.self_attn.forward_batch(a, ctx.slots["kda"], j, window, ctx.kda_mode,
                                                                 real=ctx.real))
        else:
            streams, _ = block.run(streams, lambda a: mla_paged(block.self_attn, a, ctx, idx_at[i])[:2])
    return model.norm(contract_streams(streams)), KdaBatchPending.stack(list(pending.values()), ctx.slots) if pending else None


def chain_selection(step0: torch.Tensor, width: torch.Tensor, np_: int) -> torch.Tensor:
    """What a chained draft step reuses (mla_paged's reuse), [B, np_]: step0 [B, W] each
    sequence's draft-step-0 selection over its first width[b] pools, every pool past them selected
    (they completed after step 0: each chained row keeps those it sees). Built once a chain."""
    n = min(step0.shape[1], np_)
    chosen = step0[:, :n]
    if n < np_:
        chosen = torch.cat([chosen, chosen.new_zeros(chosen.shape[0], np_ - n)], dim=1)
    return chosen | (torch.arange(np_, device=step0.device) >= width[:, None])


def mtp_forward(layer, ids: torch.Tensor, hidden: torch.Tensor, ctx: PagedContext, embed,
                reuse: torch.Tensor | None = None, chained: bool = False):
    """Glm5NextMtpLayer over the drafter's pools: ids [B, T] (t[i+1]), hidden [B, T, D] (h[i]) ->
    (g [B, T, D] post shared_head.norm, pool selection [B, T, Np], visible pools [B, T] or None: as
    mla_paged's). chained: the rows are a chain's drafts, which follow a sequence's real rows, so
    none is row 0."""
    e = embed(ids)
    if not chained:
        e = e.masked_fill((ctx.positions() == 0)[..., None], 0.0)  # no embedding at row 0 (mtp.py)
    x = layer.eh_proj(norm_pair(layer.enorm, e, layer.hnorm, hidden.to(e.dtype)))
    y, sel, visible = mla_paged(layer.self_attn, layer.input_layernorm(x), ctx, 0, reuse)
    normed, x = layer.post_attention_layernorm.after_add(y, x)
    g, _ = layer.shared_head.norm.after_add(layer.mlp(normed), x)
    return g, sel, visible
