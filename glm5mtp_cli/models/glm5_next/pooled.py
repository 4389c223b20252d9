"""GLM-5-Next over the engine's pools: the target and the MTP layer read and write their
per-sequence state in engine/cache.py's block pools and slots (core/family.py components).

Components, per owner (target: every KDA and indexed layer; drafter: the MTP layer):
- `kda`  (slot, fp32)  the recurrent state S [H, d, d] of each KDA layer;
- `conv` (slot)        the short-conv window [K-1, 3C] of each KDA layer;
- `mla`  (rows)        the latent row of each token (kv_lora_rank);
- `pool` (rows)        pooled indexer keys: pool j's key (index_head_dim values) is split over
                       the pool's own P rows, index_head_dim / P values a row;
- `raw`  (rows)        each token's raw indexer row (key and gate, 2 x index_head_dim).
Keeping the raw rows of every token (not only the incomplete pool's tail) makes every indexed
component roll back by length alone, also across the several forwards of a draft chain; it costs
2 x index_head_dim values a token beside the latent's kv_lora_rank. Only KDA state needs a commit:
a forward only reads it and returns what it advanced in `out.pending`; the target's commit after it
(PooledTarget.commit, the Target protocol's) keeps each sequence's accepted prefix; forwards of more rows than any verify (prefill chunks) are committed
whole, so they keep only the final state, the rest keep what a replay of a kept prefix needs.

Forwards run B sequences at once with fixed shapes per (B, T, table width) and no host reads
(paged.py), so a runner can capture them (engine/graphs.py). What a runner provides and does:

    ctx = target.context(starts, t, rows, slots)
        starts [B] long (device): each sequence's cached length before the forward;
        rows {"mla", "pool", "raw"}: CachedRows through [B, NB] block tables (as GLM-5's), NB * block
            size >= starts + t; a row past a slot's reservation goes to a scratch block;
        slots {"kda", "conv"}: CachedSlots(pool.data, index [B] long on the device), the SlotPool
            slot of each batch row's sequence (cache.slots[name].slot; a padding row names a scratch
            slot taken from the pool). KDA state is only read inside the forward.
    cache.prepare(t)                                        # host, before each run: room for t rows
    out = target.forward_batch(ids [B, T], ctx, rows)      # capture this (inside sync_free())
    ... cache.length += t
    target.commit(out.pending, kept [B] long, device)       # before the next replay overwrites
                                                            # out.pending; device tensors alone
        (t <= MAX_VERIFY_ROWS: a masked replay of the kept rows from the untouched slots; longer
        forwards keep the final state and commit whole); then the engine's cache.truncate(kept).
The drafter: mtp.context(starts, t, rows) and mtp.forward_batch(ids, hidden, ctx, embed, head,
rows), called by MtpHead's drafter_forward / greedy_chain; its rows roll back by length alone
(share_topk: PooledMtp says where the step-0 selection lives).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from glm5mtp_cli.core.cached import CachedRows, CachedSlots, cached_rows, cached_slots
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core import sync_free
from glm5mtp_cli.core.family import refuse_tree
from glm5mtp_cli.models.glm5_next.decoder import DEFAULT_ROLLBACK, Glm5NextForCausalLM
from glm5mtp_cli.models.glm5_next.kda import KdaBatchPending
from glm5mtp_cli.models.glm5_next.layout import LM_HEAD, PREFIX
from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer
from glm5mtp_cli.models.glm5_next.paged import PagedContext, chain_selection, mtp_forward, target_forward

# Forwards up to this many rows keep what a partial commit needs (a verify is gamma + 1 <= 17 rows).
MAX_VERIFY_ROWS = 17


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, R, V] for the rows asked for
    hidden: torch.Tensor  # [B, R, D] post-norm (target: model.norm; MTP: shared_head.norm)
    prenorm: torch.Tensor | None = None
    hidden_all: torch.Tensor | None = None  # target: post-norm hiddens of every appended row
    pending: KdaBatchPending | None = None  # target: KDA state to commit (commit)


def _checkpoint_names(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "model.")]:
        rest = key[len(prefix) + len("model."):]
        state_dict[prefix + (rest if rest == LM_HEAD else PREFIX + rest)] = state_dict.pop(key)


def _unwrap_names(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "layer.")]:
        state_dict[prefix + key[len(prefix) + len("layer."):]] = state_dict.pop(key)


def _rows(h: torch.Tensor, rows) -> torch.Tensor:
    if isinstance(rows, str):
        return h if rows == "all" else h[:, -1:]
    return h.gather(1, rows.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))


class PooledTarget(torch.nn.Module):
    """Glm5NextForCausalLM's forward over SequenceCaches: the engine's Target (engine/target.py)."""

    reads_slots = True

    def __init__(self, model: Glm5NextForCausalLM):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        # state_dict keys are the checkpoint's names, as the loader reads them
        self.register_state_dict_post_hook(_checkpoint_names)

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.embed_tokens

    def context(self, starts: torch.Tensor, t: int, rows: dict[str, CachedRows],
                slots: dict[str, CachedSlots], real: torch.Tensor | None = None) -> PagedContext:
        """The context of a forward appending t rows at `starts` [B] (device) to B sequences:
        rows `mla`/`pool`/`raw` through their tables, slots `kda`/`conv` through their slot indices;
        real [B] (device): each sequence's real rows when the rest are padding (PagedContext)."""
        return PagedContext(starts, t, rows, slots, DEFAULT_ROLLBACK if t <= MAX_VERIFY_ROWS else "final", real)

    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, ctx: PagedContext, rows: str | torch.Tensor = "all") -> ForwardOut:
        """The forward as a function of device tensors alone (what a CUDA graph captures): input_ids
        [B, T]; the caller keeps the caches' lengths and commits `out.pending` (commit)."""
        h_all, pending = target_forward(self.model, input_ids, ctx)
        h = _rows(h_all, rows)
        return ForwardOut(self.model.lm_head(h), h, hidden_all=h_all, pending=pending)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, caches: list, rows: str | torch.Tensor = "all",
                real: torch.Tensor | None = None, plan=None) -> ForwardOut:
        """Append input_ids [B, T] to each sequence's cache (one batched forward); real [B] (device):
        rows past real[b] are padding, kept out of the KDA state (the caller truncates them away).
        The KDA state is as it was until the caller commits out.pending. plan: a verify's (None or a
        chain: causal rows)."""
        refuse_tree(plan)
        t, dev = input_ids.shape[1], input_ids.device
        starts, paged = cached_rows(caches, t, dev)
        out = self.forward_batch(input_ids, self.context(starts, t, paged, cached_slots(caches, dev), real), rows)
        for cache in caches:
            cache.length += t
        return out

    def commit(self, pending: KdaBatchPending | None, kept: torch.Tensor) -> None:
        """Batch row b of the forward that left `pending` keeps its first kept[b] rows (kept [B] on
        the device) in its KDA state and conv window, written to the slots the forward read. No
        host value on the way, so a captured forward can run it; a padding row (the scratch slot)
        keeps 0 rows, which rewrites the scratch slot with what it holds."""
        if pending is not None:
            pending.commit(kept, self.cfg.linear_conv_kernel_dim)


class PooledMtp(torch.nn.Module):
    """Glm5NextMtpLayer over the drafter's SequenceCaches, with the MTP-layer interface the engine's
    MtpHead drives (forward over caches, forward_batch over a context).

    index_share_for_mtp_iteration (`share_topk`; --mtp-index-share overrides it): MtpHead runs a
    propose's chained draft steps inside `chained()`. Every forward outside it (a propose's catch-up:
    draft step 0) keeps its last row's pool selection per sequence; a chained forward reuses that
    selection instead of scoring (MlaLayer.forward says how the chain rows enter it). Eager, a
    sequence is known by the slot of its drafter row 0, as the catch-up groups sequences by row count
    while the chain steps take them all: no two live sequences share a block. In a static forward
    (sync_free: no host reads) the selection stays on the device by batch row (static batches keep
    a sequence's row), from the last unchained forward to the chained ones after it: inside
    MtpHead.greedy_chain, the fused chain a runner captures whole, or between a static catch-up and
    chain step run eagerly. A runner's separate chain-step CUDA graph is captured outside chained(),
    so its steps score their own pools (sharing moves only acceptance, never the output)."""

    def __init__(self, layer: Glm5NextMtpLayer):
        super().__init__()
        self.layer = layer
        self.cfg = layer.cfg
        self.share_topk = layer.cfg.index_share_for_mtp_iteration
        self._chaining = False
        # row-0 slot -> [Np] selection of that sequence's last unchained row, for the chained steps
        # of the same propose (MtpHead.start_propose empties it: nothing outlives its sequence)
        self._step0: dict[int, torch.Tensor] = {}
        self._step0_rows: torch.Tensor | None = None  # static: [B, Np], chain_selection's
        self.register_state_dict_post_hook(_unwrap_names)  # keys relative to `layers.{N}.`

    def start_propose(self) -> None:
        """A propose's catch-up comes next and keeps a selection for every sequence it drafts:
        those an earlier forward kept are never read again."""
        self._step0.clear()

    @contextmanager
    def chained(self):
        """Forwards inside are chained draft steps (see the class docstring)."""
        self._chaining = True
        try:
            yield
        finally:
            self._chaining = False

    def context(self, starts: torch.Tensor, t: int, rows: dict[str, CachedRows],
                slots: dict[str, CachedSlots] | None = None) -> PagedContext:
        """As PooledTarget.context; the drafter has no slot components."""
        return PagedContext(starts, t, rows, slots or {})

    @torch.no_grad()
    def forward(self, token_ids, hidden, caches: list, embed, head, rows="all") -> ForwardOut:
        t = token_ids.shape[1]
        starts, paged = cached_rows(caches, t, token_ids.device)
        out = self.forward_batch(token_ids, hidden, self.context(starts, t, paged), embed, head, rows)
        for cache in caches:
            cache.length += t
        return out

    @torch.no_grad()
    def forward_batch(self, token_ids, hidden, ctx: PagedContext, embed, head, rows="all") -> ForwardOut:
        """token_ids [B, T] (t[i+1]) with hidden [B, T, D] (h[i]): a function of device tensors alone
        inside sync_free(); eager, share_topk keeps its step-0 selections on the host (class doc)."""
        static = sync_free.active()
        reuse = None
        if self.share_topk and self._chaining:
            reuse = self._step0_rows if static else self._reused(ctx)
            if reuse is None or reuse.shape != (token_ids.shape[0], self._pools(ctx)):
                raise UserError("a static chained draft step reuses the step-0 pool selection of its own fused "
                                "chain only: run the chain in one forward, or pass --no-mtp-index-share")
        g_all, sel, visible = mtp_forward(self.layer, token_ids, hidden, ctx, embed, reuse, self._chaining)
        if self.share_topk and not self._chaining:
            if static:
                self._step0_rows = chain_selection(_rows(sel, rows)[:, -1], _rows(visible[..., None], rows)[:, -1, 0],
                                                   sel.shape[-1])
            else:
                self._keep_step0(ctx, sel, visible, rows)
                self._step0_rows = None
        g = _rows(g_all, rows)
        return ForwardOut(head(g), g, g)

    def _keys(self, ctx: PagedContext) -> list[int]:
        return ctx.rows["mla"].all[:, 0].tolist()

    def _keep_step0(self, ctx: PagedContext, sel: torch.Tensor, visible: torch.Tensor, rows) -> None:
        """Each sequence's selection at its last real row (`rows`, else the last), as wide as the
        pools that row sees."""
        t = sel.shape[1]
        last = [t - 1] * sel.shape[0] if isinstance(rows, str) else rows.tolist()
        for b, (key, r) in enumerate(zip(self._keys(ctx), last)):
            self._step0[key] = sel[b, r, : int(visible[b, r])].clone()  # not a view pinning the whole batch's

    def _pools(self, ctx: PagedContext) -> int:
        """The pools a forward's tables span (its selections' width)."""
        return ctx.rows["pool"].all.shape[1] // self.layer.self_attn.pool

    def _reused(self, ctx: PagedContext) -> torch.Tensor:
        kept = [self._step0[key] for key in self._keys(ctx)]
        step0 = torch.zeros(len(kept), max([k.shape[0] for k in kept] + [1]), dtype=torch.bool, device=ctx.starts.device)
        for b, k in enumerate(kept):
            step0[b, : k.shape[0]] = k
        return chain_selection(step0, torch.tensor([k.shape[0] for k in kept], device=ctx.starts.device),
                               self._pools(ctx))
