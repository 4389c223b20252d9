"""Static decode forwards, captured as CUDA graphs, for one batch of sequences: the target's
verify (or gamma-0 decode) step, and the drafter's whole greedy chain in one forward (sampling:
its catch-up and its chain step apart, the draws made outside the graphs).

Each forward is a function of static device buffers alone: token ids (and drafter hiddens), each
slot's cached length, and each slot's block table per cache component. A replay reads whatever
the buffers hold, so the host only copies a step's inputs in (asynchronously, from pinned memory)
and keeps the caches' lengths; nothing in a step waits for the device except the one read of the
accepted counts. On a CPU the same buffers run eagerly ("static" mode), which is what the CPU
tests compare against the eager engine.

Shapes are fixed per batch: B slots (the batch's sequences, in order) x T rows, and the block
tables as wide as the batch's largest reservation, so attention reads NB * block_size rows, masked
past each slot's length. Catch-up feeds vary from 1 to gamma + 1 rows; they are padded to gamma + 1
and the logits are taken at each slot's last real row; padding rows land past the slot's length
(overwritten later) or, past its reservation, in a scratch block.

Slot reuse. A graph bakes the addresses of its buffers and of the pools, never of a sequence's
blocks: those are data in the table buffers. So the invariant is kept on the tables: a finished
slot's tables are pointed at the scratch blocks BEFORE its blocks go back to the pools (`retire`),
and `close` drops every graph and gives the scratch blocks back before the batch's blocks are
freed. No replay can then write into a block that another sequence owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.cache import BlockPool, CachePools, table_slots, to_device
from glm5mtp_cli.models.glm5.attention import CachedRows
from glm5mtp_cli.models.glm5.decoder import rope_context
from glm5mtp_cli.models.glm5.layers import sync_free


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for every capture's warm-up: cuBLAS keeps a workspace per stream
    it ever ran on (never freed), so a fresh stream per capture grew the allocator each batch."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


@dataclass
class _Table:
    """One cache component's block tables for the batch's slots."""

    pool: BlockPool
    table: torch.Tensor  # [B, NB] block ids
    scratch: int

    def rows(self, starts: torch.Tensor, t: int) -> CachedRows:
        new, all_ = table_slots(self.table, self.pool.block_size, starts, t, self.scratch)
        return CachedRows(self.pool.data, new, all_)


class StaticForward:
    """One forward shape (B slots x T rows) over static buffers: a CUDA graph on CUDA (`capture`),
    the same function run eagerly otherwise."""

    def __init__(self, cfg, fn, b: int, t: int, tables: dict[str, _Table], device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None, pick_row: bool = False):
        self.cfg = cfg
        self.fn = fn  # fn(this StaticForward) -> its outputs, from the buffers alone
        self.b, self.t = b, t
        self.tables = tables
        self.device = device
        self.ids = torch.zeros(b, t, dtype=torch.long, device=device)
        self.hidden = torch.zeros(b, t, hidden[0], dtype=hidden[1], device=device) if hidden else None
        self.starts = torch.zeros(b, dtype=torch.long, device=device)
        self.rows = torch.zeros(b, dtype=torch.long, device=device) if pick_row else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None

    def context(self, starts: torch.Tensor, t: int):
        """The BatchContext of a forward appending t rows at `starts` (device) to every slot."""
        idx = self.tables["indexer"].rows(starts, t) if "indexer" in self.tables else None
        return rope_context(self.cfg, starts, t, self.tables["mla"].rows(starts, t), idx)

    def _forward(self):
        with sync_free():
            return self.fn(self)

    def capture(self, mempool) -> None:
        """Warm up on a side stream (allocator, cuBLAS workspaces, Triton compiles), then capture.
        The warm-up writes rows at each slot's current length: past its valid rows, so harmless."""
        side = _warmup_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.out = self._forward()

    def set_starts(self, lengths: list[int]) -> None:
        self.starts.copy_(to_device(lengths, self.device), non_blocking=True)

    def set_rows(self, rows: list[int]) -> None:
        self.rows.copy_(to_device(rows, self.device), non_blocking=True)

    def run(self):
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self._forward()

    def close(self) -> None:
        self.graph = None
        self.out = None


def draft_chain_greedy(f: StaticForward, head, out_head, gamma: int) -> torch.Tensor:
    """Greedy drafts [B, gamma] of every slot in one pass: the catch-up forward (f.t = gamma + 1
    rows, the real ones first; row f.rows[b] is slot b's last real row) drafts d1, then each
    further draft feeds the previous one with the drafter's carried hidden, one row at a time."""
    out = head.layer.forward_batch(f.ids, f.hidden, f.context(f.starts, f.t), head.embed, out_head, f.rows)
    drafts = [_full_ids(head, out.logits[:, -1].argmax(-1))]
    carried = head._carried(out)[:, -1]
    starts = f.starts + f.rows + 1  # each slot's first chain row: right after its real rows
    for _ in range(gamma - 1):
        out = head.layer.forward_batch(drafts[-1][:, None], carried[:, None], f.context(starts, 1), head.embed,
                                       out_head, "last")
        drafts.append(_full_ids(head, out.logits[:, -1].argmax(-1)))
        carried = head._carried(out)[:, -1]
        starts = starts + 1
    return torch.stack(drafts, dim=1)


def _full_ids(head, local: torch.Tensor) -> torch.Tensor:
    return head.draft_head.to_full(local) if head.draft_head is not None else local


class BatchGraphs:
    """The static forwards of one batch: the target step; with a drafter, either the whole greedy
    draft chain as one forward, or (sampling) its catch-up and chain step."""

    def __init__(self, cfg, target, head, pools: CachePools, target_caches: list, drafter_caches: list | None,
                 gamma: int, device: torch.device, capture: bool, greedy: bool = False):
        self.b = len(target_caches)
        self.device = device
        self.capture = capture
        self.pools = pools
        self.scratch: dict[str, list[int]] = {}
        self.forwards: list[StaticForward] = []
        try:
            self._build(cfg, target, head, target_caches, drafter_caches, gamma, greedy)
        except BaseException:
            self.close()
            raise

    def _tables(self, owner: str, caches: list) -> dict[str, _Table]:
        """Block tables of every slot; a slot whose sequence already finished (None, or a cache
        holding no blocks) points at the scratch block from the start."""
        out = {}
        live = [c for c in caches if c is not None and c.mla.blocks]
        for component in ("mla", "indexer"):
            if live and getattr(live[0], component) is None:
                continue
            name = f"{owner}_{component}"
            pool = self.pools.pools[name]
            self.scratch[name] = pool.take(1)
            scratch = self.scratch[name][0]
            nb = max([len(getattr(c, component).blocks) for c in live] + [1])
            rows = []
            for c in caches:
                if c is None or not c.mla.blocks:
                    rows.append(torch.full((nb,), scratch, dtype=torch.long, device=self.device))
                else:
                    rows.append(getattr(c, component).padded_table(nb))
            out[component] = _Table(pool, torch.stack(rows), scratch)
        return out

    def _build(self, cfg, target, head, target_caches, drafter_caches, gamma, greedy):
        dev = self.device
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.target_tables = self._tables("target", target_caches)
        self.verify = StaticForward(cfg, lambda f: target.forward_batch(f.ids, f.context(f.starts, f.t), "all"),
                                    self.b, gamma + 1, self.target_tables, dev)
        self.forwards.append(self.verify)
        self.catchup = self.chain = self.draft = None
        if head is not None:
            self.drafter_tables = self._tables("drafter", drafter_caches)
            layer = head.layer
            out_head = head.draft_head or head.head
            hidden = (cfg.hidden_size, target.model.embed_tokens.weight.dtype)

            def drafter(f):
                rows = f.rows if f.rows is not None else "last"
                return layer.forward_batch(f.ids, f.hidden, f.context(f.starts, f.t), head.embed, out_head, rows)

            def greedy_chain(f):
                return draft_chain_greedy(f, head, out_head, gamma)

            if greedy:
                # the whole chain in one graph: catch-up, then gamma - 1 chained steps, argmax inside
                self.draft = StaticForward(cfg, greedy_chain, self.b, gamma + 1, self.drafter_tables, dev, hidden,
                                           pick_row=True)
                self.forwards.append(self.draft)
            else:
                self.catchup = StaticForward(cfg, drafter, self.b, gamma + 1, self.drafter_tables, dev, hidden,
                                             pick_row=True)
                self.forwards.append(self.catchup)
                if gamma > 1:
                    self.chain = StaticForward(cfg, drafter, self.b, 1, self.drafter_tables, dev, hidden)
                    self.forwards.append(self.chain)

    def capture_all(self, target_lengths: list[int], drafter_lengths: list[int] | None) -> None:
        """Capture every forward (CUDA only), starting each slot at its current length."""
        if not self.capture:
            return
        for f in self.forwards:
            f.set_starts(drafter_lengths if f is not self.verify else target_lengths)
            f.capture(self.mempool)

    def retire(self, slot: int) -> None:
        """A finished slot: point its tables at the scratch blocks before its blocks are freed."""
        for tables in (self.target_tables, getattr(self, "drafter_tables", {})):
            for t in tables.values():
                t.table[slot].fill_(t.scratch)

    def close(self) -> None:
        """Destroy the graphs, then give the scratch blocks back (before the batch's blocks go)."""
        for f in self.forwards:
            f.close()
        self.forwards = []
        self.mempool = None
        for name, blocks in self.scratch.items():
            self.pools.pools[name].give(blocks)
        self.scratch = {}


def load_rows(buf: torch.Tensor, slots: torch.Tensor, slot_list: list[int], values) -> None:
    """Write the active slots' rows into a static buffer: values[j] (a tensor [A, k, ...] or a list
    of A tensors of k_j rows) goes to buf[slot_list[j], :k]; `slots` is slot_list on the device."""
    if isinstance(values, torch.Tensor):
        stacked = values
    elif len({v.shape[0] for v in values}) == 1:
        stacked = torch.stack(values)
    else:
        for slot, v in zip(slot_list, values):
            buf[slot, : v.shape[0]].copy_(v)
        return
    k = stacked.shape[1]
    if k == buf.shape[1] and slot_list == list(range(buf.shape[0])):
        buf.copy_(stacked)
    else:
        buf[:, :k].index_copy_(0, slots, stacked.to(buf.dtype))


def sequence_forward(cfg, fn, cache, t: int, device: torch.device,
                     hidden: tuple[int, torch.dtype] | None = None) -> StaticForward:
    """A static forward over ONE sequence's cache (benchmarks): its own tables; rows past its
    reservation would go to its last block, so callers keep starts + t within the reservation."""
    tables = {}
    for component in ("mla", "indexer"):
        rows = getattr(cache, component)
        if rows is not None:
            tables[component] = _Table(rows.pool, rows.table[None].clone(), rows.blocks[-1])
    return StaticForward(cfg, fn, 1, t, tables, device, hidden)
