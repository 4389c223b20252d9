"""GLM-5-Next over the engine's pools: the target and the MTP layer read and write their
per-sequence state in engine/cache.py's block pools and slots (models/family.py components).

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
a forward leaves it pending (SequenceCache.leave_pending) and the engine's truncate after a verify
keeps the accepted prefix; forwards of more rows than any verify (prefill chunks) are committed
whole, so they keep only the final state, the rest keep what a replay of a kept prefix needs.

One sequence per forward (the model's math is per sequence); the starts are read on the host, so
these forwards run eagerly only (no CUDA graphs yet).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.cache import CachedRows, cached_rows
from glm5mtp_cli.models.glm5_next.attention import MlaPast, MlaPending
from glm5mtp_cli.models.glm5_next.decoder import DEFAULT_ROLLBACK, Glm5NextForCausalLM
from glm5mtp_cli.models.glm5_next.layout import LM_HEAD, PREFIX
from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer
from glm5mtp_cli.models.glm5_next.state import KdaSlot

# Forwards up to this many rows keep what a partial commit needs (a verify is gamma + 1 <= 17 rows).
MAX_VERIFY_ROWS = 17


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, R, V] for the rows asked for
    hidden: torch.Tensor  # [B, R, D] post-norm (target: model.norm; MTP: shared_head.norm)
    prenorm: torch.Tensor | None = None
    hidden_all: torch.Tensor | None = None  # target: post-norm hiddens of every appended row


def _checkpoint_names(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "model.")]:
        rest = key[len(prefix) + len("model."):]
        state_dict[prefix + (rest if rest == LM_HEAD else PREFIX + rest)] = state_dict.pop(key)


def _unwrap_names(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "layer.")]:
        state_dict[prefix + key[len(prefix) + len("layer."):]] = state_dict.pop(key)


class PagedIndexed:
    """One indexed layer of one sequence as the model's IndexedSlot: past() gathers the rows
    0..n-1 through the block tables, write() stores a forward's new rows at positions n.."""

    def __init__(self, rows: dict[str, CachedRows], layer: int, b: int, n: int, pool: int):
        self.rows, self.layer, self.b, self.length, self.pool = rows, layer, b, n, pool

    def _read(self, name: str, a: int, z: int) -> torch.Tensor:
        r = self.rows[name]
        return r.data[self.layer].index_select(0, r.all[self.b, a:z])

    def past(self) -> MlaPast:
        n, P = self.length, self.pool
        whole = n // P * P
        pooled = self._read("pool", 0, whole).reshape(n // P, P * self.rows["pool"].data.shape[-1])
        return MlaPast(self._read("mla", 0, n), pooled, self._read("raw", whole, n))

    def write(self, p: MlaPending) -> None:
        """Every new row (rejected ones land past the kept length and are overwritten later)."""
        n, P = self.length, self.pool
        self._write("mla", n, p.latent)
        self._write("raw", n, p.raw[n % P:])
        if p.pooled.shape[0]:  # pools completed here, from the one the sequence was filling
            self._write("pool", n // P * P, p.pooled.reshape(-1, self.rows["pool"].data.shape[-1]))

    def _write(self, name: str, at: int, values: torch.Tensor) -> None:
        r = self.rows[name]
        slots = r.all[self.b, at:at + values.shape[0]]
        r.data[self.layer].index_copy_(0, slots, values.to(r.data.dtype))


class _State:
    """The per-sequence state the target's forward_rows reads (SequenceState's shape), as views."""

    def __init__(self, kda: dict, indexed: dict, length: int):
        self.kda, self.indexed, self.length = kda, indexed, length


def _rows(h: torch.Tensor, rows) -> torch.Tensor:
    if isinstance(rows, str):
        return h if rows == "all" else h[:, -1:]
    return h.gather(1, rows.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))


class PooledTarget(torch.nn.Module):
    """Glm5NextForCausalLM's forward over SequenceCaches: the engine's target interface."""

    def __init__(self, model: Glm5NextForCausalLM):
        super().__init__()
        self.model = model
        self.cfg = model.cfg
        # state_dict keys are the checkpoint's names, as the loader reads them
        self.register_state_dict_post_hook(_checkpoint_names)

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, caches: list, rows: str | torch.Tensor = "all") -> ForwardOut:
        cfg, t = self.cfg, input_ids.shape[1]
        starts, paged = cached_rows(caches, t, input_ids.device)
        mode = DEFAULT_ROLLBACK if t <= MAX_VERIFY_ROWS else "final"
        logits, hiddens = [], []
        for b, cache in enumerate(caches):
            n = int(starts[b])
            kda = {}
            for j, i in enumerate(cfg.kda_layers):
                s, w = cache.slots["kda"], cache.slots["conv"]
                kda[i] = KdaSlot(s.pool.data[j, s.slot], w.pool.data[j, w.slot])
            indexed = {i: PagedIndexed(paged, j, b, n, cfg.index_kpool) for j, i in enumerate(cfg.indexed_layers)}
            lg, h, pending = self.model.forward_rows(input_ids[b], _State(kda, indexed, n), mode)
            for i, slot in indexed.items():
                slot.write(pending.layers[i])
            cache.leave_pending(self._commit(kda, {i: pending.layers[i] for i in kda}, n))
            logits.append(lg)
            hiddens.append(h)
        for cache in caches:
            cache.length += t
        h_all = torch.stack(hiddens)
        return ForwardOut(_rows(torch.stack(logits), rows), _rows(h_all, rows), hidden_all=h_all)

    def _commit(self, kda: dict, pending: dict, start: int):
        k = self.cfg.linear_conv_kernel_dim

        def commit(length: int) -> None:
            for i, slot in kda.items():
                slot.apply(*pending[i].commit(length - start, k))

        return commit

    def context(self, starts, t, rows):
        raise NotImplementedError("GLM-5-Next forwards run eagerly (pools read on the host)")


@dataclass
class _Ctx:
    starts: torch.Tensor
    t: int
    rows: dict[str, CachedRows]


class PooledMtp(torch.nn.Module):
    """Glm5NextMtpLayer over the drafter's SequenceCaches, with the MTP-layer interface the engine's
    MtpHead drives (forward over caches, forward_batch over a context).

    index_share_for_mtp_iteration (`share_topk`; --mtp-index-share overrides it): MtpHead runs a
    propose's chained draft steps inside `chained()`. Every forward outside it (a propose's catch-up:
    draft step 0) keeps its last row's pool selection per sequence; a chained forward reuses that
    selection instead of scoring (MlaLayer.forward says how the chain rows enter it). A sequence is
    known by the slot of its drafter row 0, as the catch-up groups sequences by row count while the
    chain steps take them all: no two live sequences share a block."""

    def __init__(self, layer: Glm5NextMtpLayer):
        super().__init__()
        self.layer = layer
        self.cfg = layer.cfg
        self.share_topk = layer.cfg.index_share_for_mtp_iteration
        self._chaining = False
        # row-0 slot -> [1, Np] selection of that sequence's last unchained row; a sequence's next
        # catch-up overwrites it, so it holds at most one entry per block of the pool
        self._step0: dict[int, torch.Tensor] = {}
        self.register_state_dict_post_hook(_unwrap_names)  # keys relative to `layers.{N}.`

    @contextmanager
    def chained(self):
        """Forwards inside are chained draft steps (see the class docstring)."""
        self._chaining = True
        try:
            yield
        finally:
            self._chaining = False

    def context(self, starts: torch.Tensor, t: int, rows: dict[str, CachedRows]) -> _Ctx:
        return _Ctx(starts, t, rows)

    @torch.no_grad()
    def forward(self, token_ids, hidden, caches: list, embed, head, rows="all") -> ForwardOut:
        t = token_ids.shape[1]
        starts, paged = cached_rows(caches, t, token_ids.device)
        out = self.forward_batch(token_ids, hidden, _Ctx(starts, t, paged), embed, head, rows)
        for cache in caches:
            cache.length += t
        return out

    @torch.no_grad()
    def forward_batch(self, token_ids, hidden, ctx: _Ctx, embed, head, rows="all") -> ForwardOut:
        logits, gs = [], []
        for b in range(token_ids.shape[0]):
            slot = PagedIndexed(ctx.rows, 0, b, int(ctx.starts[b]), self.cfg.index_kpool)
            key = int(ctx.rows["mla"].all[b, 0]) if self.share_topk else None
            reuse = self._step0[key] if self.share_topk and self._chaining else None
            lg, g, pending = self.layer.forward_rows(token_ids[b], hidden[b], slot, embed, head, reuse)
            if self.share_topk and not self._chaining:
                self._step0[key] = pending.selected[-1:]
            slot.write(pending)
            logits.append(lg)
            gs.append(g)
        g = _rows(torch.stack(gs), rows)
        return ForwardOut(_rows(torch.stack(logits), rows), g, g)
