"""--prefill-graphs: the admission prefill's forwards (engine/prefill.py: the targets' shared
forwards and the drafters' catch-ups) as static forwards, captured as CUDA graphs on CUDA.

Why: an eager prefill forward is host-bound. On the H200 a glm5-nano admission forward cost ~10 ms
of host time against ~2 ms of GPU work per HumanEval prompt (device runs 5-6), and with speculation
the admissions come more often and each has one more (the drafter's): at HumanEval batch 8 they took
0.99 s of a 3.23 s adaptive run against 0.48 s of gamma 0's (run 12). A replayed graph is one
launch: in device run 13 the batch-8 prefill fell 0.91 -> 0.42 s at gamma 3 and 0.61 -> 0.26 s at
gamma 0. Larger forwards are host-bound too: at batch 32 (device run 22, torch.profiler) admissions
of 3265-5993 prompt rows took 43-147 ms of wall time over 6-8 ms of kernels, their forwards then
over the 2048-row cap this module had, so eager.

Shapes. The forwards a prefill plans vary, (m sequences, t rows), so each runs as its bucket's
static forward: m up to the next power of two (the padding sequences read and write only a scratch
block), t up to the next power of two >= 16 (padding rows land past each sequence's length, inside
its reservation, where the next append overwrites them, or past it, in the scratch block; as in the
eager path, real rows never see them: attention is causal and each sequence's logits come from its
last real row). Buckets stop at `max_rows` rows (m x t): a graph's activations stay allocated, and
a model whose prefill is GPU-bound gains nothing from replaying it. A bucket is captured the first
time a forward needs it: built at its second use (the earlier rule: a one-off shape never pays a
capture back) the batch-64 HumanEval plans of run 15 would have run 16 of their 22 forwards eagerly,
since admissions there come in few, differently shaped groups. A capture costs a few forwards' host
time; it is reported with the decode graphs' capture, apart from end to end.

The members of a forward are not in the engine's slots yet (they are being admitted), so the
forwards read their blocks through tables of their own ([rows + 1, NB] per component, NB the
engine's table width, the last row all scratch), written before each run, and fixed-size state
(GLM-5-Next's KDA state and conv windows) through slot indices of their own ([rows + 1], the last a
scratch slot), the padding rows kept out of it as in the eager path (the context's `real`: each
row's last real row + 1). What such a forward advanced is committed inside it, at each member's real
rows (padding rows keep none), so the commit is part of the one replay. Run eagerly after each
forward it was a dozen launches and a copy (15 ms of host time in a batch-8 HumanEval run's 67
forwards on an H100), but that host time overlapped the replays: in turns on one H100 the
prefill's wall time did not move (profiles/glm5next-nano/RESULTS.md, "At 43feca9").
"""

from __future__ import annotations

import time

import torch

from glm5mtp_cli.engine.cache import BlockPool
from glm5mtp_cli.core.host_copy import copy_ints_many
from glm5mtp_cli.engine.static import SlotIndex, StaticForward, Table

MIN_ROWS = 16  # the shortest bucket: shorter forwards pad up to it
# the largest bucket (sequences x rows) at a hidden size up to NARROW: measured on glm5-nano (384),
# whose batch-32 and 64 HumanEval admissions (8192 prompt rows, --prefill-tokens, pad to at most 4x
# that) all fit it
MAX_ROWS, NARROW = 16384, 768


def graph_rows(hidden_size: int) -> int:
    """The largest bucket replayed from a graph for a model this wide: MAX_ROWS up to NARROW, then
    proportionally fewer, since a bucket's activations grow with rows x width and a wide model's
    prefill turns GPU-bound at fewer rows (GLM-5's 6144 gets 2048, this module's earlier cap)."""
    return min(MAX_ROWS, MAX_ROWS * NARROW // hidden_size)


def bucket(n: int, least: int = 1) -> int:
    """The next power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


class PrefillForwards:
    """The static prefill forwards of one engine, for the target and (with a drafter) the drafter."""

    def __init__(self, target, proposer, pools, width: int, device: torch.device, mempool, max_rows: int):
        """mempool: the runner's graph pool (None: the buckets run eagerly, nothing captured)."""
        owners = ["target"] + (["drafter"] if proposer is not None else [])  # `check`ed by the engine
        self.models = {"target": target, "drafter": proposer}
        self.pools = pools
        self.width = width
        self.device = device
        self.mempool = mempool
        self.max_rows = max_rows
        self.rows = max_rows // MIN_ROWS  # the most sequences a bucket holds
        self.scratch: dict[str, list[int]] = {}  # a block per paged component
        self.scratch_slots: dict[str, int] = {}  # a slot per fixed-size component
        self.tables: dict[str, dict[str, Table]] = {}
        self.slot_index: dict[str, dict[str, SlotIndex]] = {}
        self.forwards: dict[tuple, StaticForward] = {}
        self.replays = 0  # forwards run from a bucket (tests; a count, not a timing)
        self.capture_s = 0.0  # capturing since the engine last took it (one-time setup, apart from e2e)
        try:
            for owner in owners:
                self.tables[owner], self.slot_index[owner] = {}, {}
                for name in pools.owners[owner]:
                    pool, short = pools.pools[name], name[len(owner) + 1:]
                    if isinstance(pool, BlockPool):
                        self.scratch[name] = pool.take(1)
                        table = torch.full((self.rows + 1, width), self.scratch[name][0], dtype=torch.long, device=device)
                        self.tables[owner][short] = Table(pool, table, self.scratch[name][0])
                    else:
                        slot = self.scratch_slots[name] = pool.take()
                        index = torch.full((self.rows + 1,), slot, dtype=torch.long, device=device)
                        self.slot_index[owner][short] = SlotIndex(pool, index, slot)
        except BaseException:
            self.close()
            raise

    # ---- the two kinds of forward ---------------------------------------------------------------
    def target(self, ids: torch.Tensor, caches: list, real: list[int]):
        """Append ids [m, t] (host; row j's first real[j] are real) to caches; -> the logits at each
        row's last real row [m, 1, V] and the hiddens [m, t, H] (copies), or None: run it eagerly."""
        m, t = ids.shape
        f = self._forward("target", m, t, None, self._target_fn)
        if f is None:
            return None
        f.ids[:m, :t].copy_(ids.to(self.device, non_blocking=True))
        out = self._run(f, caches, real)
        return type(out)(out.logits[:m].clone(), None, hidden_all=out.hidden_all[:m, :t].clone())

    def drafter(self, ids: torch.Tensor, hidden: torch.Tensor, caches: list, real: list[int]) -> bool:
        """Append drafter rows ids [m, t] with hiddens [m, t, H] (device) to caches; False: run it
        eagerly instead (nothing was done)."""
        m, t = ids.shape
        f = self._forward("drafter", m, t, (hidden.shape[-1], hidden.dtype), self._drafter_fn)
        if f is None:
            return False
        f.ids[:m, :t].copy_(ids)
        f.hidden[:m, :t].copy_(hidden)
        self._run(f, caches, real)
        return True

    def _target_fn(self, target):
        if not target.reads_slots:  # nothing to commit: every component rolls back by length
            return lambda f: target.forward_batch(f.ids, f.context(f.starts, f.t), f.rows)
        padding = self.rows  # the table row a padding row reads

        def forward_and_commit(f):
            real = f.rows + 1
            out = target.forward_batch(f.ids, f.context(f.starts, f.t, real=real), f.rows)
            target.commit(out.pending, torch.where(f.idx < padding, real, 0))
            return out
        return forward_and_commit

    @staticmethod
    def _drafter_fn(proposer):
        return lambda f: proposer.drafter_forward(f.ids, f.hidden, f.context(f.starts, f.t), f.rows)

    # ---- buckets --------------------------------------------------------------------------------
    def _forward(self, owner: str, m: int, t: int, hidden, fn_of) -> StaticForward | None:
        """The bucket's forward, built at its first use; None: eager (a bucket over the row cap)."""
        b, bt = bucket(m), bucket(t, MIN_ROWS)
        if b * bt > self.max_rows:
            return None
        key = (owner, b, bt)
        f = self.forwards.get(key)
        if f is None:
            model = self.models[owner]
            idx = torch.full((b,), self.rows, dtype=torch.long, device=self.device)  # all scratch while built
            f = StaticForward(model.context, fn_of(model), b, bt, self.tables[owner], self.device, hidden,
                              pick_row=True, idx=idx, slots=self.slot_index[owner])
            if self.mempool is not None:
                torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                f.capture(self.mempool)
                torch.cuda.synchronize(self.device)
                self.capture_s += time.perf_counter() - t0
            self.forwards[key] = f
        return f

    def _run(self, f: StaticForward, caches: list, real: list[int]):
        """Point rows 0..m-1 at the caches' blocks and slots, run, and grow each cache by its real
        rows."""
        m = len(caches)
        for c, k in zip(caches, real):
            c.prepare(k)
        writes = [(tab.table[:m], None, [b for c in caches for b in tab.row_of(c.rows[name].blocks, name)])
                  for name, tab in f.tables.items()]
        writes += [(index.index[:m], None, [c.slots[name].slot for c in caches]) for name, index in f.slots.items()]
        writes.append((f.idx, None, list(range(m)) + [self.rows] * (f.b - m)))
        copy_ints_many(writes)
        f.set_starts_rows([c.length for c in caches] + [0] * (f.b - m), [k - 1 for k in real] + [0] * (f.b - m))
        out = f.run()
        for c, k in zip(caches, real):
            c.length += k
        self.replays += 1
        return out

    def take_capture_s(self) -> float:
        """Seconds spent capturing since the last call: one-time setup, which the engine reports with
        the decode graphs' capture, outside end to end as theirs is."""
        built, self.capture_s = self.capture_s, 0.0
        return built

    def close(self) -> None:
        """Drop the forwards (and graphs), then give the scratch blocks back."""
        for f in self.forwards.values():
            f.close()
        self.forwards = {}
        for name, blocks in self.scratch.items():
            self.pools.pools[name].give(blocks)
        for name, slot in self.scratch_slots.items():
            self.pools.pools[name].give(slot)
        self.scratch, self.scratch_slots = {}, {}
        self.tables, self.slot_index = {}, {}
