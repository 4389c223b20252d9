"""A static forward: one forward shape (B rows x T new rows) over static device buffers, run
eagerly or captured as a CUDA graph and replayed; the block tables and slot indices it reads its
caches through. The runner's graph sets (engine/graphs.py: decode, verify, draft chain;
engine/prefill_graphs.py: admission prefill; bench's steps, sequences_forward) are made of these.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.accept import greedy_verdict
from glm5mtp_cli.engine.cache import BlockPool, SlotPool
from glm5mtp_cli.core.cached import CachedRows, CachedSlots
from glm5mtp_cli.core.host_copy import copy_ints, to_device
from glm5mtp_cli.engine.compiled import PATH_OF, compile_forward
from glm5mtp_cli.core.sync_free import sync_free
from glm5mtp_cli.engine.hooks import watch
from kernels._triton import kernel_path
from kernels.bitmask import apply_bitmask
from kernels.table_slots import table_slots

_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for every capture's warm-up: cuBLAS keeps a workspace per stream
    it ever ran on (never freed), so a fresh stream per capture grew the allocator each batch."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


@dataclass
class Table:
    """One cache component's block tables: [slots + 1, NB] block ids; the last row is all scratch
    (padding rows of a bucket read it)."""

    pool: BlockPool
    table: torch.Tensor
    scratch: int

    def rows(self, idx: torch.Tensor, starts: torch.Tensor, t: int) -> CachedRows:
        new, all_ = table_slots(self.table, self.pool.block_size, starts, t, self.scratch, idx)
        return CachedRows(self.pool.data, new, all_)

    def row_of(self, blocks: list[int], what: str) -> list[int]:
        """The table row naming `blocks` (the scratch block past them)."""
        width = self.table.shape[1]
        if len(blocks) > width:
            raise RuntimeError(f"{what}: {len(blocks)} blocks, over the tables' {width}")
        return list(blocks) + [self.scratch] * (width - len(blocks))


@dataclass
class SlotIndex:
    """One fixed-size component's slot index: [slots + 1] SlotPool slots; the last is scratch."""

    pool: SlotPool
    index: torch.Tensor
    scratch: int

    def slots(self, idx: torch.Tensor) -> CachedSlots:
        return CachedSlots(self.pool.data, self.index.index_select(0, idx))


class StaticForward:
    """One forward shape (B rows x T new rows) over static buffers: a CUDA graph on CUDA (`capture`),
    the same function run eagerly otherwise. Row b reads table row idx[b]."""

    PHASES = {"static.run": "run"}  # as observers see them (engine/hooks.py)

    def __init__(self, context_fn, fn, b: int, t: int, tables: dict[str, Table], device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None, pick_row: bool = False,
                 idx: torch.Tensor | None = None, slots: dict[str, SlotIndex] | None = None):
        self.context_fn = context_fn  # the model's context(starts, t, rows[, slots])
        self.fn = fn  # fn(this StaticForward) -> its outputs, from the buffers alone
        self.b, self.t = b, t
        self.tables = tables
        self.slots = slots or {}
        self.device = device
        self.idx = idx if idx is not None else torch.arange(b, device=device)
        self.ids = torch.zeros(b, t, dtype=torch.long, device=device)
        self.hidden = torch.zeros(b, t, hidden[0], dtype=hidden[1], device=device) if hidden else None
        # each row's cached length, and (pick_row) the row whose logits it takes: one buffer, so
        # that a step's host values for both go in one copy
        self._host_in = torch.zeros(2 if pick_row else 1, b, dtype=torch.long, device=device)
        self.starts = self._host_in[0]
        self.rows = self._host_in[1] if pick_row else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None
        self.path: str | None = None  # the kernel path a compiled forward runs (None: as set outside)
        watch(self)

    def context(self, starts: torch.Tensor, t: int, real: torch.Tensor | None = None):
        """The model's context of a forward appending t rows at `starts` (device) to every row; the
        slot indices, and `real` (each row's real rows, the rest padding kept out of fixed-size
        state), only for an owner with slot components (GLM-5's context takes neither)."""
        rows = {name: table.rows(self.idx, starts, t) for name, table in self.tables.items()}
        if not self.slots:
            return self.context_fn(starts, t, rows)
        return self.context_fn(starts, t, rows, {name: s.slots(self.idx) for name, s in self.slots.items()}, real)

    def _forward(self):
        with sync_free(), kernel_path(self.path) if self.path else contextlib.nullcontext():
            return self.fn(self)

    def compile(self, compile: str, mode: str) -> float:
        """Compile this forward (engine/compiled.py) and run it once, so that the compile happens
        now (the run writes where the buffers point: the scratch block at engine start); -> its
        seconds."""
        self.fn = compile_forward(self.fn, mode)
        self.path = PATH_OF.get(compile)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda device: None
        sync(self.device)
        t0 = time.perf_counter()
        self._forward()
        sync(self.device)
        return time.perf_counter() - t0

    def capture(self, mempool) -> None:
        """Warm up on a side stream (allocator, cuBLAS workspaces, Triton compiles), then capture.
        The warm-up writes rows where the buffers point: the scratch block at engine start. Under
        --tp the forward's collectives run for real in the warm-up and are recorded in the capture:
        every rank captures the same forwards in the same order (EngineGraphs: buckets and gammas
        from the engine's arguments alone), so the warm-ups' collectives pair up across ranks."""
        side = warmup_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.out = self._forward()

    def set_starts(self, lengths: list[int]) -> None:
        copy_ints(self.starts, lengths)

    def set_starts_rows(self, lengths: list[int], rows: list[int]) -> None:
        copy_ints(self._host_in, [lengths, rows])

    def run(self):
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self._forward()

    def close(self) -> None:
        self.graph = None
        self.out = None


def capture_after(fn, device: torch.device, mempool) -> tuple:
    """fn (what runs after a verify, reading its outputs) run once on the warm-up side stream, then
    captured; -> (its graph, the outputs the capture left)."""
    side = warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), sync_free():
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool), sync_free():
        out = fn()
    return graph, out


class StaticCommit:
    """The target's commit after one static verify forward (Target.commit), as a function of a
    buffer of the kept counts [B]: captured right after that verify on CUDA, reading the verify's
    commit records where its graph leaves them, so a step's commit is one replay, not its dozens of
    launches; run eagerly otherwise."""

    PHASES = {"static.commit": "run"}  # as observers see them (engine/hooks.py)

    def __init__(self, target, verify: StaticForward):
        self.target, self.verify = target, verify
        self.kept = torch.zeros(verify.b, dtype=torch.long, device=verify.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        watch(self)

    def capture(self, mempool) -> None:
        """After verify.capture: replay the verify once, so that its records hold values (a capture
        runs nothing: until a replay its outputs are uninitialised memory, slot indices included,
        and a commit of those wrote through garbage indices), then warm up and capture the commit.
        At engine start every row names the scratch slot and the buffer keeps no rows: no state moves."""
        self.verify.run()
        pending = self.verify.out[0].pending  # (outputs, verdict): graphs.verify_forward
        self.graph, _ = capture_after(lambda: self.target.commit(pending, self.kept), self.verify.device, mempool)

    def run(self, pending, accepted: torch.Tensor) -> None:
        """Commit `pending` (the verify's last outputs): row b keeps accepted[b] + 1 rows (the
        accepted drafts and the row before them); rows past accepted's length keep none (padding)."""
        a = accepted.shape[0]
        torch.add(accepted, 1, out=self.kept[:a])
        if a < self.kept.shape[0]:
            self.kept[a:].zero_()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.target.commit(pending, self.kept)

    def close(self) -> None:
        self.graph = None


class StaticVerdict:
    """A greedy static verify's verdict under a step's grammar masks (engine/grammar.py): the host's
    mask rows copied into a buffer [B, T, W], applied to the logits where the verify's graph leaves
    them, then accept.greedy_verdict of those logits and the verify's drafts. Captured after that
    verify on CUDA, so a constrained step's masks and accept are a copy and one replay instead of
    the mask kernel and half a dozen launches (0.26 ms of host time a step at batch 8 on an H100
    host). The masks enter after the verify is launched: the host fills them while it runs."""

    def __init__(self, verify: StaticForward, words: int):
        self.verify = verify
        self.masks = torch.full((verify.b, verify.t, words), -1, dtype=torch.int32, device=verify.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _verdict(self) -> torch.Tensor:
        logits = apply_bitmask(self.verify.out[0].logits, self.masks)
        return greedy_verdict(logits, self.verify.ids[:, 1:])

    def capture(self, mempool) -> None:
        """After verify.capture: warm up (the mask kernel compiles) on the side stream, then capture.
        Both read the verify's outputs as its capture left them; nothing they write is kept."""
        self.graph, self.out = capture_after(self._verdict, self.verify.device, mempool)

    def run(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [A, T, W] (host, pinned) -> the verdict's rows [A, 2 + T - 1] (the replay's buffer:
        read or copy before the next). A bucket's padding rows keep the masks they had: their
        verdicts are not read."""
        a = rows.shape[0]
        self.masks[:a].copy_(rows, non_blocking=True)
        self.graph.replay()
        return self.out[:a]

    def close(self) -> None:
        self.graph = None
        self.out = None


def sequences_forward(context_fn, fn, caches: list, t: int, device: torch.device,
                      hidden: tuple[int, torch.dtype] | None = None) -> StaticForward:
    """A static forward over the given sequences' caches (benchmarks), row b over caches[b]: their
    own tables and state slots (a forward reads the states; nothing commits them). Every cache
    holds the same reservation (the tables stack), and callers keep starts + t within it: a row past
    it would go to the first cache's last block."""
    first = caches[0]
    tables = {name: Table(rows.pool, to_device([c.rows[name].blocks for c in caches], device), rows.blocks[-1])
              for name, rows in first.rows.items()}
    slots = {name: SlotIndex(ref.pool, to_device([c.slots[name].slot for c in caches], device), ref.slot)
             for name, ref in first.slots.items()}
    return StaticForward(context_fn, fn, len(caches), t, tables, device, hidden, slots=slots)
