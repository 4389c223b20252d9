"""How the engine runs its decode forwards: one runner (ForwardRunner) owns the three modes.

eager: every forward reads and writes the caches through their block tables. static: the decode
forwards (the target's verify or gamma-0 decode; the drafter's catch-up and chain step, or, greedy,
its whole draft chain in one forward) over static device buffers, run eagerly (the CPU tests compare
this with eager). cuda: the same forwards captured as CUDA graphs and replayed.

Built once per engine (EngineGraphs), for a set of batch-size buckets (1, 2, 4, ... up to the
engine's slot count, as vLLM and nano-vllm do) and, per bucket, for every verify plan the engine may
use in a step (engine/verify.py; a chain of g drafts: g + 1 rows) and a fused greedy chain of g drafts
per gamma g. A step of A active
sequences replays the smallest bucket >= A; its rows 0..A-1 are the active sequences in order and
rows A.. are padding that reads and writes only the scratch block.

Each static forward is a function of its buffers alone: token ids (and drafter hiddens), each row's
cached length, and each row's slot (`idx`): which row of the engine's block tables it reads. The
tables ([slots + 1, NB] per row component, NB blocks: the longest reservation of the engine's
call, rounded up to a power of two, at most --max-seq-len / block_size (table_blocks);
the last row is all scratch) are gathered by `idx` inside the forward, so a replay reads whatever
the buffers hold and the host only copies a step's inputs in (asynchronously, from pinned memory).
The paged attention kernel stops at each row's cached length (kernels/paged.py), but the indexer's
scores and top-k, and the PyTorch attention, span the whole width: hence NB follows the work.

Slot reuse. A graph bakes the addresses of its buffers, of the tables and of the pools, never a
sequence's blocks: those are data in the tables. So the invariant is kept on the tables: a slot's
table rows are written when a sequence takes the slot (`occupy`), and pointed at the scratch
blocks when it leaves, BEFORE its blocks go back to the pools (`retire`); `close` drops every graph
and gives the scratch blocks back. No replay can then read or write a block another sequence owns.
Fixed-size state (GLM-5-Next's KDA state and conv window, models/glm5_next/pooled.py). Per slot
component an index [slots + 1] names each engine slot's SlotPool slot (the last entry a scratch slot
taken once per engine): set by `occupy`, pointed at the scratch slot by `retire`, gathered by `idx`
like the tables. A forward only reads those states; the target's commit records are the graph's
outputs (with the slot indices the forward read), which the runner keeps until the engine's
`commit` after the accept hands the accepted counts to the target (Target.commit, device tensors
alone), before that graph's next replay: on CUDA a graph of its own per verify forward, captured
after it (static.StaticCommit), reading the counts from a buffer. A verify returns what the accept
and the commit need as a VerifyRecord: the runner keeps nothing of it between calls.
One memory pool, the runner's, holds every graph set's captures (decode, verify, draft chain, the
prefill's buckets, bench's steps). Graphs sharing a pool may reuse each other's freed
intermediates, so a replay may overwrite what another graph left; that is safe because every
replay's outputs are consumed before the next replay of any graph: copied out (the verify's
hiddens, the fused chain's drafts, the prefill's logits and hiddens), read (logits by the accept,
a catch-up's by the first draft) or committed (the KDA records) first. The pool lives as long as
the runner: an anchor graph captured into it at the start and kept keeps it open, so rebuilding a
graph set (more slots, wider tables, stepwise drafting: leak-check's rounds) never captures into
a pool PyTorch has closed (with no graph of its own left alive and tensors it allocated still
held, a capture into it trips the allocator's `use_count > 0` internal assert: leak-check at
batch 8, glm5next-nano, H100).
Compiled forwards (--compile, engine/compiled.py): `open` passes each static forward through
torch.compile and runs it once (the compile, timed apart as `compile_s`), before any capture; the
capture then records the compiled forward's kernels like any other.
Catch-up feeds vary from 1 to g + 1 rows; they are padded and the logits are taken at each row's
last real row; padding rows land past the row's length (overwritten later) or, past its
reservation, in the scratch block.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.accept import greedy_verdict
from glm5mtp_cli.engine.hooks import watch
from glm5mtp_cli.engine.cache import CachePools, SlotPool
from glm5mtp_cli.core.cached import cached_rows
from glm5mtp_cli.core.host_copy import copy_ints, copy_ints_many, to_device
from glm5mtp_cli.engine.prefill_graphs import PrefillForwards
from glm5mtp_cli.engine.proposer import Feed
from glm5mtp_cli.engine.static import SlotIndex, StaticCommit, StaticForward, StaticVerdict, Table, sequences_forward
from glm5mtp_cli.engine.verify import VerifyPlan, VerifyRecord
from glm5mtp_cli.errors import UserError
from kernels.bitmask import apply_bitmask


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def table_blocks(tokens: int, block_size: int, max_seq_len: int) -> int:
    """The tables' width in blocks for a reservation of `tokens` rows: rounded up to a power of two
    (a later, longer call rarely outgrows it; never over twice the need), at most --max-seq-len's.
    Not the ceiling itself: the paths that read whole tables (the DSA indexer's scores and top-k,
    the pure-torch attention) cost in proportion to the width, and GLM-5's limit of 202752 rows made
    a 4-layer real-dimension step 2.6x slower on the H200 (5.87 against 2.29 ms)."""
    need = -(-tokens // block_size)
    return min(1 << (need - 1).bit_length(), -(-max_seq_len // block_size))


def buckets_for(slots: int) -> list[int]:
    """The batch sizes captured for an engine of `slots` slots: the powers of two below it, and it."""
    return [b for b in BUCKETS if b < slots] + [slots]


def verify_forward(target, greedy: bool):
    """A static verify: the target forward over its rows [token, drafts...] -> (its outputs, and for a
    greedy engine each row's verdict, accept.greedy_verdict, computed in the same graph: the step's
    accept is then one read instead of half a dozen launches after the replay)."""
    def forward(f):
        out = target.forward_batch(f.ids, f.context(f.starts, f.t), "all")
        return out, greedy_verdict(out.logits, f.ids[:, 1:]) if greedy else None
    return forward


@dataclass
class _Bucket:
    """The static forwards of one batch size: verify[plan] (plan.rows rows), and the drafter's fused
    greedy chain draft[g], or (sampling) its catch-up and chain step. `idx`: each row's table row."""

    size: int
    idx: torch.Tensor
    verify: dict
    draft: dict
    catchup: StaticForward | None = None
    chain: StaticForward | None = None
    commit: dict | None = None  # verify[plan]'s StaticCommit, for targets with fixed-size state
    verdicts: dict | None = None  # verify[plan]'s StaticVerdict, captured for a greedy engine's constrained runs
    idx_slots: list[int] | None = None  # the engine slots `idx` points its rows at now

    def forwards(self) -> list[StaticForward]:
        return [*self.verify.values(), *self.draft.values(), *(f for f in (self.catchup, self.chain) if f)]

    def after_verify(self) -> list:
        """What is captured after its verify and reads its outputs: the commits, the masked verdicts."""
        return [*(self.commit or {}).values(), *(self.verdicts or {}).values()]


class EngineGraphs:
    """An engine's static forwards for every bucket, verify plan and gamma, over its block tables."""

    def __init__(self, target, proposer, pools: CachePools, slots: int, max_blocks: int, gammas: list[int],
                 hidden: tuple[int, torch.dtype] | None, device: torch.device, mempool, greedy: bool,
                 stepwise: bool = False, mask_words: int | None = None):
        """mempool: the runner's graph pool (None: static forwards run eagerly, nothing captured).
        greedy: the fused chain; stepwise: the catch-up and chain step too (a greedy engine's
        drafts under a grammar mask, engine/grammar.py, run position by position); mask_words: a
        grammar mask's int32 words, for the verifies' masked verdicts (StaticVerdict: captured
        for a greedy engine's constrained runs)."""
        self.slots = slots
        self.stepwise = stepwise or not greedy  # whether the buckets hold catch-up and chain forwards
        self.mask_words = mask_words
        self.masked = bool(mask_words) and greedy and mempool is not None  # the buckets hold masked verdicts
        self.max_blocks = max_blocks  # the tables' width: the longest sequence they can name
        self.device = device
        self.mempool = mempool
        self.pools = pools
        self.scratch: dict[str, list[int]] = {}
        self.scratch_slots: dict[str, int] = {}
        self.tables: dict[str, dict[str, Table]] = {}
        self.slot_index: dict[str, dict[str, SlotIndex]] = {}
        self.buckets: dict[int, _Bucket] = {}
        try:
            self._tables("target", target.reads_slots, max_blocks)
            if proposer is not None:
                self._tables("drafter", False, max_blocks)  # no proposer's forwards read slot state
            for b in buckets_for(slots):
                self.buckets[b] = self._bucket(b, target, proposer, gammas, hidden, greedy, self.stepwise)
        except BaseException:
            self.close()
            raise

    def _tables(self, owner: str, reads_slots: bool, max_blocks: int) -> None:
        """The owner's block tables, and its slot indices when its forwards read them."""
        self.tables[owner], self.slot_index[owner] = {}, {}
        for component in self.pools.owners[owner]:
            pool = self.pools.pools[component]
            short = component[len(owner) + 1:]
            if isinstance(pool, SlotPool):
                if not reads_slots:
                    raise UserError("this model keeps fixed-size state slots its static forwards cannot read: "
                                    "run it with --no-cuda-graphs")
                self.scratch_slots[component] = pool.take()
                scratch = self.scratch_slots[component]
                index = torch.full((self.slots + 1,), scratch, dtype=torch.long, device=self.device)
                self.slot_index[owner][short] = SlotIndex(pool, index, scratch)
                continue
            self.scratch[component] = pool.take(1)
            scratch = self.scratch[component][0]
            table = torch.full((self.slots + 1, max_blocks), scratch, dtype=torch.long, device=self.device)
            self.tables[owner][short] = Table(pool, table, scratch)

    def _bucket(self, b: int, target, proposer, gammas, hidden, greedy, stepwise) -> _Bucket:
        dev = self.device
        idx = torch.full((b,), self.slots, dtype=torch.long, device=dev)  # every row on the scratch row
        tt, ts = self.tables["target"], self.slot_index["target"]
        plans = [VerifyPlan.chain(g) for g in gammas]  # static forwards verify chains: causal rows
        verify = {p: StaticForward(target.context, verify_forward(target, greedy), b, p.rows, tt, dev, idx=idx, slots=ts)
                  for p in plans}
        commit = {p: StaticCommit(target, f) for p, f in verify.items()} if target.reads_slots else None
        verdicts = {p: StaticVerdict(f, self.mask_words) for p, f in verify.items()} if self.masked else None
        bucket = _Bucket(b, idx, verify, {}, commit=commit, verdicts=verdicts)
        if proposer is None or max(gammas) == 0:
            return bucket
        td, ds = self.tables["drafter"], self.slot_index["drafter"]

        def drafter(f):
            return proposer.drafter_forward(f.ids, f.hidden, f.context(f.starts, f.t),
                                            f.rows if f.rows is not None else "last")

        def chain_of(g):
            return lambda f: proposer.greedy_chain(f.ids, f.hidden, f.starts, f.rows, f.context, g)

        top = max(gammas)
        if greedy:
            # the whole chain in one graph per gamma: catch-up (as wide as the largest gamma's, since a
            # step after a smaller one may bring that many rows), then g - 1 chained steps, argmax inside
            bucket.draft = {g: StaticForward(proposer.context, chain_of(g), b, top + 1, td, dev, hidden,
                                             pick_row=True, idx=idx, slots=ds) for g in gammas if g}
        if stepwise:
            bucket.catchup = StaticForward(proposer.context, drafter, b, top + 1, td, dev, hidden, pick_row=True,
                                           idx=idx, slots=ds)
            if top > 1:
                bucket.chain = StaticForward(proposer.context, drafter, b, 1, td, dev, hidden, idx=idx, slots=ds)
        return bucket

    def compile_all(self, compile: str, mode: str) -> float:
        """Compile every forward (engine/compiled.py), largest bucket first; -> the seconds it took."""
        return sum(f.compile(compile, mode) for b in sorted(self.buckets, reverse=True)
                   for f in self.buckets[b].forwards())

    def capture_all(self) -> None:
        """Capture every forward (CUDA only), largest bucket first (its intermediates size the
        shared pool the smaller ones reuse); every row points at the scratch row meanwhile."""
        if self.mempool is None:
            return
        for b in sorted(self.buckets, reverse=True):
            bucket = self.buckets[b]
            for f in bucket.forwards():
                f.capture(self.mempool)
            for c in bucket.after_verify():
                c.capture(self.mempool)

    def occupy(self, slots: list[int], caches: list[dict[str, object]]) -> None:
        """Sequences take `slots` (caches[i]: slot i's, by owner): their table rows name their blocks
        (scratch past them), their slot indices their state slots; one host-to-device copy for all."""
        writes = []
        for owner in dict.fromkeys(o for c in caches for o in c):
            seated = [(slot, c[owner]) for slot, c in zip(slots, caches) if owner in c]
            rows = [slot for slot, _ in seated]
            for name, t in self.tables.get(owner, {}).items():
                named = [b for _, c in seated for b in t.row_of(c.rows[name].blocks, f"{owner} {name}")]
                writes.append((t.table, rows, named))
            for name, s in self.slot_index.get(owner, {}).items():
                writes.append((s.index, rows, [c.slots[name].slot for _, c in seated]))
        copy_ints_many(writes)

    def retire(self, slot: int) -> None:
        """A slot whose sequence ends: its tables and slot indices point at the scratch blocks and
        slots before its blocks and slots are freed."""
        for tables in self.tables.values():
            for t in tables.values():
                t.table[slot].fill_(t.scratch)
        for indices in self.slot_index.values():
            for s in indices.values():
                s.index[slot].fill_(s.scratch)  # `index[slot] = int` copies from pageable memory: a sync

    def close(self) -> None:
        """Destroy the graphs, then give the scratch blocks and slots back."""
        for bucket in self.buckets.values():
            for f in [*bucket.forwards(), *bucket.after_verify()]:
                f.close()
        self.buckets = {}
        for name, blocks in self.scratch.items():
            self.pools.pools[name].give(blocks)
        for name, slot in self.scratch_slots.items():
            self.pools.pools[name].give(slot)
        self.scratch = {}
        self.scratch_slots = {}
        self.slot_index = {}


def _anchor_graph(mempool, device: torch.device) -> tuple:
    """A graph captured into `mempool` that allocates nothing, with the buffer it writes: held, it
    keeps the pool open (the module docstring)."""
    with torch.cuda.device(device):
        buffer = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            buffer.add_(1)
    return graph, buffer


class ForwardRunner:
    """Runs the engine's decode forwards in one of three modes (module docstring). The engine opens
    it once (`open`), tells it when a slot is taken or left (`occupy`, `retire`) and each step's
    active slots (`step`); the engine's drafting (engine/drafting.py) asks it for the proposer's
    catch-up, chain-step and fused-chain forwards; nothing else in the engine knows the mode."""

    MODES = ("eager", "static", "cuda")
    PHASES = {"runner.open": "open", "runner.step": "step", "runner.verify": "verify", "runner.mask": "mask", "runner.catchup": "catchup",
              "runner.chain_step": "chain_step", "runner.fused_chain": "fused_chain",
              "runner.fused_chain_ahead": "fused_chain_ahead"}  # as observers see them (engine/hooks.py)

    def __init__(self, mode: str, device: torch.device, compile: str = "off", compile_mode: str = "default"):
        """mode, compile, compile_mode: a resolved EngineConfig's (runtime.resolve)."""
        if mode not in self.MODES:
            raise ValueError(f"forward mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        if mode == "cuda" and device.type != "cuda":
            raise UserError("CUDA graphs need --device cuda")
        self.mode = mode
        self.device = device
        self.compile = compile
        self.compile_mode = compile_mode
        self.compile_s = 0.0  # compiling the static forwards (in open), apart from their capture
        # every graph set's one pool, kept open by its anchor (module docstring); None: nothing is captured
        self.mempool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self._anchor = _anchor_graph(self.mempool, device) if mode == "cuda" else None
        self.graphs: EngineGraphs | None = None
        self.prefill: PrefillForwards | None = None  # --prefill-graphs: the admission prefill's graph set
        self.sequences: list[StaticForward] = []  # bench's steps (sequences_step)
        self.bucket: _Bucket | None = None
        self.active = 0
        watch(self)

    # ---- the engine's lifetime --------------------------------------------------------------
    def open(self, target, proposer, pools: CachePools, slots: int, max_blocks: int, gammas: list[int],
             hidden: tuple[int, torch.dtype] | None, greedy: bool, stepwise: bool = False,
             mask_words: int | None = None) -> None:
        """Build (compile, and on CUDA capture) the engine's static forwards; a no-op when eager
        (greedy, stepwise and mask_words: EngineGraphs')."""
        if self.mode == "eager" or self.graphs is not None:
            return
        self.graphs = EngineGraphs(target, proposer, pools, slots, max_blocks, gammas, hidden, self.device,
                                   self.mempool, greedy=greedy, stepwise=stepwise, mask_words=mask_words)
        try:
            if self.compile != "off":
                self.compile_s += self.graphs.compile_all(self.compile, self.compile_mode)
            self.graphs.capture_all()
        except BaseException:
            self.close()
            raise

    @property
    def ready(self) -> bool:
        """Whether the decode forwards can run now: eager, or static ones built (`open`)."""
        return self.mode == "eager" or self.graphs is not None

    def open_prefill(self, target, proposer, pools: CachePools, width: int, max_rows: int) -> None:
        """The admission prefill's static forwards over tables `width` blocks wide (captured per
        bucket at its first use on CUDA); kept while they are wide enough."""
        if self.prefill is not None and self.prefill.width >= width:
            return
        self.close_prefill()
        self.prefill = PrefillForwards(target, proposer, pools, width, self.device, self.mempool, max_rows=max_rows)

    def take_capture_s(self) -> float:
        """Seconds the prefill forwards spent capturing since the last call (one-time setup)."""
        return self.prefill.take_capture_s() if self.prefill is not None else 0.0

    def close_prefill(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
            self.prefill = None

    def occupy(self, slots: list[int], caches: list[dict[str, object]]) -> None:
        if self.graphs is not None and slots:
            self.graphs.occupy(slots, caches)

    def retire(self, slot: int | None) -> None:
        if self.graphs is not None and slot is not None:
            self.graphs.retire(slot)

    def step(self, slots: list[int]) -> None:
        """The slots of this step's active sequences, in the order inputs come: picks the bucket and
        points its rows at those slots (padding rows at the scratch row)."""
        self.active = len(slots)
        if self.graphs is None:
            return
        size = next(b for b in sorted(self.graphs.buckets) if b >= len(slots))
        self.bucket = self.graphs.buckets[size]
        if self.bucket.idx_slots != slots:  # most steps run the batch of the step before: nothing to copy
            copy_ints(self.bucket.idx, list(slots) + [self.graphs.slots] * (size - len(slots)))
            self.bucket.idx_slots = list(slots)

    def sequences_step(self, context_fn, fn, caches: list, ids: torch.Tensor,
                       hidden: torch.Tensor | None = None) -> StaticForward:
        """bench's step timing: a one-row static forward over the given sequences' caches at their
        lengths (static.sequences_forward), its inputs ids [B, 1] (and hidden [B, 1, H]), built as
        the graph sets are: compiled (compile_s) and, on CUDA, captured in the runner's pool."""
        f = sequences_forward(context_fn, fn, caches, 1, self.device,
                              (hidden.shape[-1], hidden.dtype) if hidden is not None else None)
        self.sequences.append(f)
        f.ids.copy_(ids)
        if hidden is not None:
            f.hidden.copy_(hidden)
        f.set_starts([c.length for c in caches])
        if self.compile != "off":
            self.compile_s += f.compile(self.compile, self.compile_mode)
        if self.mempool is not None:
            f.capture(self.mempool)
        return f

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.bucket = None
        for f in self.sequences:
            f.close()
        self.sequences = []

    # ---- the target -------------------------------------------------------------------------
    def verify(self, target, ids: torch.Tensor, caches: list, plan: VerifyPlan) -> VerifyRecord:
        """The target forward over ids [A, plan.rows] appended to each active sequence's cache."""
        if self.graphs is None:
            out = target(ids, caches, rows="all", plan=plan)
            return VerifyRecord(plan, out.logits, out.hidden_all, target, out.pending)
        f = self.bucket.verify.get(plan)
        if f is None:
            raise UserError(f"a verify of plan {plan.parents} runs eagerly only, as yet: run it with --no-cuda-graphs")
        a = len(caches)
        f.ids[:a].copy_(ids)
        f.set_starts(self._starts(f, caches, [f.t] * a, "verify"))
        for c in caches:
            c.prepare(f.t)  # within capacity (_starts): reserves nothing
        out, verdict = f.run()
        for c in caches:
            c.length += f.t
        # logits are read before the next replay, the commit records committed before it; the hiddens
        # and the verdict's device tokens are kept a step (the next verify's first ids; a backlog's
        # rows): copied out
        return VerifyRecord(plan, out.logits[:a], out.hidden_all[:a].clone(), target, out.pending,
                            self.bucket.commit[plan] if self.bucket.commit else None,
                            verdict[:a].clone() if verdict is not None else None,
                            self.bucket.verdicts.get(plan) if self.bucket.verdicts else None)

    @staticmethod
    def mask(record: VerifyRecord, rows: torch.Tensor) -> None:
        """The step's grammar masks, host rows [A, T, W] (engine/grammar.py), applied in place to the
        record's logits [A, T, V]. Where its verify was captured with its masked verdict, that is one
        replay and becomes the record's verdict; else the masks go to the device and the verdict is
        left to the accept."""
        if record.masked is None:
            apply_bitmask(record.logits, rows.to(record.logits.device, non_blocking=True))
            record.verdict = None
            return
        record.verdict = record.masked.run(rows).clone()

    # ---- the drafter (called by the engine's drafting) ----------------------------------------
    def catchup(self, proposer, feed: Feed, caches: list):
        """Append each sequence's pending real rows (feed row b); -> the logits and carried hidden
        at each sequence's last row ([A, V], [A, H])."""
        if self.graphs is None:
            return self._catchup_eager(proposer, feed, caches)
        f = self.bucket.catchup
        self._load(f, feed, caches, feed.counts, "drafter catch-up")
        logits, carried = f.run()
        return logits[: len(caches)], carried[: len(caches)]

    def chain_step(self, proposer, drafts: torch.Tensor, carried: torch.Tensor, caches: list):
        """One chained draft row per sequence: drafts [A] with the carried hiddens [A, H]."""
        if self.graphs is None:
            starts, rows = cached_rows(caches, 1, drafts.device)
            out = proposer.drafter_forward(drafts[:, None], carried[:, None], proposer.context(starts, 1, rows), "last")
        else:
            f = self.bucket.chain
            a = len(caches)
            f.ids[:a, 0].copy_(drafts)
            f.hidden[:a, 0].copy_(carried)
            f.set_starts(self._starts(f, caches, [1] * a, "draft chain"))
            logits, hidden = f.run()
            out = logits[:a], hidden[:a]
        for c in caches:
            c.length += 1
        return out

    def fused_chain(self, feed: Feed, caches: list, num_drafts: int) -> torch.Tensor | None:
        """Greedy drafts [A, num_drafts] from the bucket's one-forward draft chain, or None when the
        engine has no such forward (eager, or sampling)."""
        if self.graphs is None or not self.bucket.draft:
            return None
        f = self.bucket.draft.get(num_drafts)
        if f is None:
            raise ValueError(f"no fused draft forward for {num_drafts} drafts (built: {sorted(self.bucket.draft)})")
        self._load(f, feed, caches, [n + num_drafts - 1 for n in feed.counts], "draft chain")
        return f.run()[: len(caches)].clone()

    def fused_chain_ahead(self, tokens: torch.Tensor, hiddens: torch.Tensor, accepted: torch.Tensor, caches: list,
                          starts: list[int], num_drafts: int) -> torch.Tensor | None:
        """The next step's fused chain, launched before this step's verdict is read: feed row b is
        tokens[b], hiddens[b] (its first accepted[b] + 1 real; accepted on the device), appended at
        starts[b] (its drafter's real rows). The caches' lengths are the caller's to move once the
        counts are read (drafting.settle_ahead). None where the bucket has no such forward or a
        cache could outgrow its reservation (2 g rows at the most)."""
        f = self.bucket.draft.get(num_drafts) if self.graphs is not None else None
        if f is None or any(n + 2 * num_drafts > c.capacity for c, n in zip(caches, starts)):
            return None
        a = len(caches)
        self._feed_rows(f, tokens, hiddens)
        f.set_starts_rows(starts + [0] * (f.b - a), [0] * f.b)
        f.rows[:a].copy_(accepted)  # each row's last real one: its accepted drafts' count
        return f.run()[:a].clone()

    def _catchup_eager(self, proposer, feed: Feed, caches: list):
        """Sequences grouped by how many rows they append, one forward per group."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, n in enumerate(feed.counts):
            groups[n].append(i)
        if len(groups) == 1:  # the common step: every sequence appends as many rows
            (k,) = groups
            return self._drafter_rows(proposer, feed.tokens[:, :k], feed.hiddens[:, :k], caches, k)
        logits, carried = [None] * len(caches), [None] * len(caches)
        for k, members in groups.items():
            at = to_device(members, feed.tokens.device)
            lg, h = self._drafter_rows(proposer, feed.tokens[at, :k], feed.hiddens[at, :k],
                                       [caches[i] for i in members], k)
            for j, i in enumerate(members):
                logits[i], carried[i] = lg[j], h[j]
        return torch.stack(logits), torch.stack(carried)

    @staticmethod
    def _drafter_rows(proposer, ids: torch.Tensor, hidden: torch.Tensor, caches: list, k: int):
        """One eager forward appending k rows to each of `caches`."""
        starts, rows = cached_rows(caches, k, ids.device)
        out = proposer.drafter_forward(ids, hidden, proposer.context(starts, k, rows), "last")
        for c in caches:
            c.length += k
        return out

    def _load(self, f: StaticForward, feed: Feed, caches, grow: list[int], what: str) -> None:
        """A padded feed into f's rows 0..A-1 (past a row's count: whatever follows in the feed,
        its padding rows); each cache grows by grow[b] rows."""
        a = len(feed)
        self._feed_rows(f, feed.tokens, feed.hiddens)
        last = [n - 1 for n in feed.counts] + [0] * (f.b - a)
        f.set_starts_rows(self._starts(f, caches, grow, what), last)
        for c, n in zip(caches, grow):
            c.length += n

    @staticmethod
    def _feed_rows(f: StaticForward, tokens: torch.Tensor, hiddens: torch.Tensor) -> None:
        """Feed rows [A, W] (and their hiddens) into f's rows 0..A-1, cut to its T."""
        a = tokens.shape[0]
        f.ids[:a, : min(f.t, tokens.shape[1])].copy_(tokens[:, : f.t])
        f.hidden[:a, : min(f.t, hiddens.shape[1])].copy_(hiddens[:, : f.t])

    @staticmethod
    def _starts(f: StaticForward, caches: list, grow: list[int], what: str) -> list[int]:
        """Each row's cached length; padding rows start at 0 (in the scratch block)."""
        for c, n in zip(caches, grow):
            if c.length + n > c.capacity:
                raise RuntimeError(f"{what} past the reservation of its sequence")
        return [c.length for c in caches] + [0] * (f.b - len(caches))

