"""How the engine runs its decode forwards: one runner (ForwardRunner) owns the three modes.

eager: every forward reads and writes the caches through their block tables. static: one batch's
decode forwards (the target's verify or gamma-0 decode; the drafter's catch-up and chain step, or,
greedy, its whole draft chain in one forward) over static device buffers, run eagerly (the CPU
tests compare this with eager). cuda: the same forwards captured as CUDA graphs and replayed.

Each static forward is a function of its buffers alone: token ids (and drafter hiddens), each
slot's cached length, and each slot's block table per row component. A replay reads whatever the
buffers hold, so the host only copies a step's inputs in (asynchronously, from pinned memory) and
keeps the caches' lengths; nothing in a step waits for the device except the one read of the
accepted counts.

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

from collections import defaultdict

from glm5mtp_cli.engine.cache import BlockPool, CachedRows, CachePools, cached_rows, table_slots, to_device
from glm5mtp_cli.errors import UserError
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

    def __init__(self, context_fn, fn, b: int, t: int, tables: dict[str, _Table], device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None, pick_row: bool = False):
        self.context_fn = context_fn  # the model's context(starts, t, rows)
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
        """The model's context of a forward appending t rows at `starts` (device) to every slot."""
        return self.context_fn(starts, t, {name: table.rows(starts, t) for name, table in self.tables.items()})

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


class BatchGraphs:
    """The static forwards of one batch: the target step; with a proposer, either its whole greedy
    draft chain as one forward, or (sampling) its catch-up and chain step."""

    def __init__(self, target, proposer, pools: CachePools, target_caches: list, drafter_caches: list | None,
                 gamma: int, hidden: tuple[int, torch.dtype], device: torch.device, capture: bool, greedy: bool):
        self.b = len(target_caches)
        self.device = device
        self.capture = capture
        self.pools = pools
        self.scratch: dict[str, list[int]] = {}
        self.forwards: list[StaticForward] = []
        self.tables: list[dict[str, _Table]] = []
        try:
            self._build(target, proposer, target_caches, drafter_caches, gamma, hidden, greedy)
        except BaseException:
            self.close()
            raise

    def _tables(self, owner: str, caches: list) -> dict[str, _Table]:
        """Block tables of every slot; a slot whose sequence already finished (None, or a cache
        holding no blocks) points at the scratch block from the start."""
        out = {}
        live = [c for c in caches if c is not None and c.holds_blocks]
        if live and live[0].slots:
            raise UserError("static and CUDA-graph forwards cover paged row components only; this model "
                            "keeps fixed-size state slots: run it with --no-cuda-graphs")
        for component in self.pools.owners[owner]:
            short = component[len(owner) + 1:]
            pool = self.pools.pools[component]
            self.scratch[component] = pool.take(1)
            scratch = self.scratch[component][0]
            nb = max([len(c.rows[short].blocks) for c in live] + [1])
            rows = []
            for c in caches:
                if c is None or not c.holds_blocks:
                    rows.append(torch.full((nb,), scratch, dtype=torch.long, device=self.device))
                else:
                    rows.append(c.rows[short].padded_table(nb))
            out[short] = _Table(pool, torch.stack(rows), scratch)
        self.tables.append(out)
        return out

    def _build(self, target, proposer, target_caches, drafter_caches, gamma, hidden, greedy):
        dev = self.device
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        tables = self._tables("target", target_caches)
        self.verify = StaticForward(target.context, lambda f: target.forward_batch(f.ids, f.context(f.starts, f.t), "all"),
                                    self.b, gamma + 1, tables, dev)
        self.forwards.append(self.verify)
        self.catchup = self.chain = self.draft = None
        if proposer is None:
            return
        tables = self._tables("drafter", drafter_caches)

        def drafter(f):
            return proposer.drafter_forward(f.ids, f.hidden, f.context(f.starts, f.t),
                                            f.rows if f.rows is not None else "last")

        def greedy_chain(f):
            return proposer.greedy_chain(f.ids, f.hidden, f.starts, f.rows, f.context, gamma)

        if greedy:
            # the whole chain in one graph: catch-up, then gamma - 1 chained steps, argmax inside
            self.draft = StaticForward(proposer.context, greedy_chain, self.b, gamma + 1, tables, dev, hidden,
                                       pick_row=True)
            self.forwards.append(self.draft)
        else:
            self.catchup = StaticForward(proposer.context, drafter, self.b, gamma + 1, tables, dev, hidden,
                                         pick_row=True)
            self.forwards.append(self.catchup)
            if gamma > 1:
                self.chain = StaticForward(proposer.context, drafter, self.b, 1, tables, dev, hidden)
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
        for tables in self.tables:
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


class ForwardRunner:
    """Runs the engine's decode forwards in one of three modes (module docstring). The engine opens
    it per batch after the prefill, tells it each step's active slots, and the proposer asks it for
    its catch-up, chain-step and fused-chain forwards; nothing else in the engine knows the mode."""

    MODES = ("eager", "static", "cuda")

    def __init__(self, mode: str, device: torch.device):
        if mode not in self.MODES:
            raise UserError(f"forward mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        if mode == "cuda" and device.type != "cuda":
            raise UserError("CUDA graphs need --device cuda")
        self.mode = mode
        self.device = device
        self.graphs: BatchGraphs | None = None
        self._slot_index: dict[tuple, torch.Tensor] = {}
        self.slot_list: list[int] = []
        self.slots_dev: torch.Tensor | None = None

    # ---- a batch's lifetime -----------------------------------------------------------------
    def open(self, target, proposer, pools: CachePools, target_caches: list, drafter_caches: list | None,
             gamma: int, hidden: tuple[int, torch.dtype], greedy: bool) -> None:
        """Build (and on CUDA capture) the batch's static forwards; a no-op when eager. Caches of
        sequences that already finished are None."""
        if self.mode == "eager":
            return
        self.graphs = BatchGraphs(target, proposer, pools, target_caches, drafter_caches, gamma, hidden,
                                  self.device, capture=self.mode == "cuda", greedy=greedy)
        self.graphs.capture_all([c.length if c is not None else 0 for c in target_caches],
                                [c.length if c is not None else 0 for c in drafter_caches] if drafter_caches else None)

    def step(self, slots: list[int]) -> None:
        """The slots (batch rows) of this step's active sequences, in the order inputs come."""
        self.slot_list = slots
        key = tuple(slots)
        if self.graphs is not None and key not in self._slot_index:
            self._slot_index[key] = to_device(slots, self.device)
        self.slots_dev = self._slot_index.get(key)

    def retire(self, slot: int | None) -> None:
        if self.graphs is not None and slot is not None:
            self.graphs.retire(slot)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._slot_index = {}

    # ---- the target -------------------------------------------------------------------------
    def verify(self, target, ids: torch.Tensor, caches: list):
        """The target forward over ids [A, T] appended to each active sequence's cache."""
        if self.graphs is None:
            return target(ids, caches, rows="all")
        f = self.graphs.verify
        load_rows(f.ids, self.slots_dev, self.slot_list, ids)
        f.set_starts(self._starts(f, caches, [f.t] * len(caches), "verify"))
        out = f.run()
        for c in caches:
            c.length += f.t
        return type(out)(out.logits.index_select(0, self.slots_dev), None,
                         hidden_all=out.hidden_all.index_select(0, self.slots_dev))

    # ---- the drafter (called by the proposer) -----------------------------------------------
    def catchup(self, proposer, tokens: list[torch.Tensor], hiddens: list[torch.Tensor], caches: list):
        """Append each sequence's pending real rows (tokens[b] with hiddens[b]); -> the logits and
        carried hidden at each sequence's last row ([A, V], [A, H])."""
        if self.graphs is None:
            return self._catchup_eager(proposer, tokens, hiddens, caches)
        f = self.graphs.catchup
        self._load(f, tokens, hiddens, caches, [tok.shape[0] for tok in tokens], "drafter catch-up")
        logits, carried = f.run()
        return logits.index_select(0, self.slots_dev), carried.index_select(0, self.slots_dev)

    def chain_step(self, proposer, drafts: torch.Tensor, carried: torch.Tensor, caches: list):
        """One chained draft row per sequence: drafts [A] with the carried hiddens [A, H]."""
        if self.graphs is None:
            starts, rows = cached_rows(caches, 1, drafts.device)
            out = proposer.drafter_forward(drafts[:, None], carried[:, None], proposer.context(starts, 1, rows), "last")
        else:
            f = self.graphs.chain
            load_rows(f.ids, self.slots_dev, self.slot_list, drafts[:, None])
            load_rows(f.hidden, self.slots_dev, self.slot_list, carried[:, None])
            f.set_starts(self._starts(f, caches, [1] * len(caches), "draft chain"))
            logits, hidden = f.run()
            out = logits.index_select(0, self.slots_dev), hidden.index_select(0, self.slots_dev)
        for c in caches:
            c.length += 1
        return out

    def fused_chain(self, tokens: list[torch.Tensor], hiddens: list[torch.Tensor], caches: list,
                    num_drafts: int) -> torch.Tensor | None:
        """Greedy drafts [A, num_drafts] from the batch's one-forward draft chain, or None when the
        batch has no such forward (eager, or sampling)."""
        if self.graphs is None or self.graphs.draft is None:
            return None
        f = self.graphs.draft
        if num_drafts != f.t - 1:
            raise ValueError(f"the fused draft forward was built for {f.t - 1} drafts, asked for {num_drafts}")
        self._load(f, tokens, hiddens, caches, [tok.shape[0] + num_drafts - 1 for tok in tokens], "draft chain")
        return f.run().index_select(0, self.slots_dev)

    def _catchup_eager(self, proposer, tokens, hiddens, caches):
        """Sequences grouped by how many rows they append, one forward per group."""
        logits = [None] * len(caches)
        carried = [None] * len(caches)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, tok in enumerate(tokens):
            groups[tok.shape[0]].append(i)
        for k, members in groups.items():
            group = [caches[i] for i in members]
            starts, rows = cached_rows(group, k, tokens[members[0]].device)
            lg, h = proposer.drafter_forward(torch.stack([tokens[i] for i in members]),
                                             torch.stack([hiddens[i] for i in members]),
                                             proposer.context(starts, k, rows), "last")
            for j, i in enumerate(members):
                logits[i], carried[i] = lg[j], h[j]
                caches[i].length += k
        return torch.stack(logits), torch.stack(carried)

    def _load(self, f: StaticForward, tokens, hiddens, caches, grow: list[int], what: str) -> None:
        """A padded catch-up feed into f's buffers; each cache grows by grow[b] rows."""
        load_rows(f.ids, self.slots_dev, self.slot_list, tokens)
        load_rows(f.hidden, self.slots_dev, self.slot_list, hiddens)
        rows = [0] * f.b
        for slot, tok in zip(self.slot_list, tokens):
            rows[slot] = tok.shape[0] - 1
        f.set_starts(self._starts(f, caches, grow, what))
        f.set_rows(rows)
        for c, n in zip(caches, grow):
            c.length += n

    def _starts(self, f: StaticForward, caches: list, grow: list[int], what: str) -> list[int]:
        starts = [0] * f.b
        for slot, c, n in zip(self.slot_list, caches, grow):
            if c.length + n > c.capacity:
                raise RuntimeError(f"{what} past the reservation its graph was built for")
            starts[slot] = c.length
        return starts


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


def sequence_forward(context_fn, fn, cache, t: int, device: torch.device,
                     hidden: tuple[int, torch.dtype] | None = None) -> StaticForward:
    """A static forward over ONE sequence's cache (benchmarks): its own tables; rows past its
    reservation would go to its last block, so callers keep starts + t within the reservation."""
    tables = {name: _Table(rows.pool, rows.table[None].clone(), rows.blocks[-1]) for name, rows in cache.rows.items()}
    return StaticForward(context_fn, fn, 1, t, tables, device, hidden)
