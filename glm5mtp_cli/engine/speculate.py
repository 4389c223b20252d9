"""The prefill-then-propose loop: target prefill, drafter prefill, then propose gamma drafts, verify
gamma+1 positions in one target forward, accept, trim both caches, catch the drafter up.

Per sequence the bookkeeping is: the target cache holds n rows (t[0..n-1]); t[n] is the newest
accepted token, not yet in the cache. A step verifies [t[n], d1..dg] at positions n..n+g, keeps
n+a+1 rows (a drafts accepted) and emits d1..da plus the target's own next token. The drafter is
then fed the real rows (t[n+1..n+a+1], h[n..n+a]) at the start of the next propose.
Gamma 0 runs this same loop without a drafter: the baseline.

Scheduling (`generate`): one step loop over a fixed number of slots (the batch size). Between decode
steps, waiting requests are admitted into free slots, in batches of at most --prefill-tokens prompt
tokens whose prompts share prefill forwards (engine/prefill.py); the schedule decides when.
"continuous" rents before it buys (the ski-rental rule): an admission stalls every running sequence
for its whole prefill, and an eager prefill forward costs about the same whatever its rows (~10 ms on
the H200 for glm5-nano, ten batch-8 decode steps), so free slots wait until the slot-seconds they
have stood idle reach what the last admission cost the running ones (its wall time x the running
sequences); then every free slot is filled at once. Nothing running, or free slots for every
waiting request, admits at once. Under --tp the decision is rank 0's (host timings differ between
ranks), broadcast. "static" admits only when every slot is free (the old batch-by-batch behaviour,
kept for comparison). Each request samples from its own stream (sampling.request_stream), so what it
samples does not depend on which requests share its steps.

Wall time of a generate call: prefill = the admission phases (the device caught up at both ends;
one per step that admits anything), capture = building and capturing the graphs (once per engine),
decode = the rest of the call's wall time (decode steps and their host bookkeeping). Per request,
ttft = queue (from the generate call to its admission) + its prefill; decode_s sums its own
steps' propose + verify times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.cache import CachePools, SequenceCache
from glm5mtp_cli.core.host_copy import to_device
from glm5mtp_cli.engine.carry import CarryPlan, hand_back, install
from glm5mtp_cli.engine.clock import Clock, StepTimes
from glm5mtp_cli.engine.config import MAX_GAMMA, EngineConfig
from glm5mtp_cli.engine.gamma import GammaPolicy
from glm5mtp_cli.engine import drafting
from glm5mtp_cli.engine.accept import Verdict, accept, accept_synthetic, drafter_feed
from glm5mtp_cli.engine.grammar import Grammars, StepMasks
from glm5mtp_cli.engine.graphs import ForwardRunner, table_blocks
from glm5mtp_cli.engine.hooks import watch
from glm5mtp_cli.engine.metrics import Acceptance
from glm5mtp_cli.engine.prefill import prefill_drafters, prefill_targets
from glm5mtp_cli.engine.prefill_graphs import graph_rows
from glm5mtp_cli.engine.proposer import DraftProposer, Drafts, TreeDrafter
from glm5mtp_cli.engine.sampling import choose, request_stream
from glm5mtp_cli.engine.sequence import (BatchRow, LiveSequence, Request, SeqResult, StepRecord, budget_tokens,
                                         pending_feed, reserve_tokens, whole_batch)
from glm5mtp_cli.engine.synthetic import SyntheticAcceptance
from glm5mtp_cli.engine.verify import VerifyPlan, VerifyRecord
from glm5mtp_cli.errors import UserError
from kernels.bitmask import apply_bitmask, words

@dataclass
class Run:
    """One generate call's schedule: its requests still waiting (popped from the end: request
    order), the slots, each request's result as it ends (after an exception, what ended before it;
    None: aborted), the clock mark queue times count from, the graphs' table width, and the call's
    admission and capture seconds; the next step's drafts when the last step launched them ahead."""

    waiting: list
    slots: list
    results: list
    arrive: object
    width: int
    prefill_s: float = 0.0
    capture_s: float = 0.0
    ahead: drafting.Ahead | None = None
    carries: bool = False  # a request hands its caches to a next turn: its verdicts are cut on the device too


class SpecEngine:
    """The loop over any model family: `target` appends rows to its SequenceCaches and returns
    logits and final hiddens; `proposer` (a DraftProposer, None for gamma 0) drafts; `runner`
    decides how the decode forwards run (eager, static buffers, CUDA graphs)."""

    # the step's phases, as observers see them (engine/hooks.py)
    PHASES = {"step": "step", "schedule": "_schedule", "admit": "_admit_into", "catch_up_backlog": "_catch_up_backlog",
              "masks": "_masks", "draft": "draft", "verify_ids": "_verify_ids", "accept": "_accept",
              "commit_device": "_commit_device", "draft_ahead": "_draft_ahead", "read": "_read", "commit": "_commit",
              "finish": "_finish", "judge": "_judge"}

    def __init__(self, model_cfg, target, proposer: DraftProposer | None, pools: CachePools, config: EngineConfig,
                 device: torch.device | str = "cpu", comm=None, grammars: Grammars | None = None):
        """model_cfg: the family's config (vocab, EOS); config: resolved (runtime.resolve: max_seq_len,
        compile and the forward mode concrete); comm: parallel.Comm under --tp (the adaptive gamma and
        the admission decision are rank 0's); grammars: the matchers of constrained requests
        (engine/grammar.py; None: the checkpoint has no tokenizer to match over)."""
        if config.gamma > 0 and proposer is None:
            raise UserError(f"gamma {config.gamma} needs a draft proposer (the checkpoint's MTP layer)")
        if config.tree is not None and not isinstance(proposer, TreeDrafter):
            raise UserError("this drafter drafts chains only: a tree of drafts needs one that drafts trees")
        self.cfg = model_cfg
        self.config = config
        self.target = target
        self.pools = pools
        self.gamma = config.gamma
        self.sampling = config.sampling
        self.synthetic = (SyntheticAcceptance(config.synthetic_acceptance, config.sampling.seed, device)
                          if config.synthetic_acceptance is not None else None)
        self.max_seq_len = config.max_seq_len
        self.eos = set(model_cfg.eos_token_id if config.eos_ids is None else config.eos_ids)
        self._eos_dev = to_device(sorted(self.eos), device)
        self.device = torch.device(device)
        self.policy = GammaPolicy(config.gamma, config.gamma_policy)
        # each gamma's verify: a chain of its drafts, or the configured tree at its depth
        self.plans = {g: VerifyPlan.tree(config.tree) if config.tree and g == config.gamma else VerifyPlan.chain(g)
                      for g in range(MAX_GAMMA + 1)}
        self.comm = comm
        self.hooks = None  # diagnostics' EngineHooks (leak-check's faults); None costs one check per step
        self._admission_s = 0.0  # wall time of the last admission (the rent-or-buy rule's price)
        self._idle_s = 0.0  # free-slot seconds since then
        self.runner = ForwardRunner(config.graphs, self.device, config.compile, config.compile_mode)
        self.clock = Clock(self.device)
        self.wall_prefill_s = 0.0
        self.admissions = 0
        self.wall_decode_s = 0.0
        self.wall_capture_s = 0.0  # building (compiling: runner.compile_s) and capturing the graphs (one-time setup)
        self.on_tokens = None  # callback(request_id, new token ids) for streaming
        self.results: list[SeqResult | None] = []  # the last generate call's (Run.results)
        self.head = proposer if config.gamma > 0 else None
        self.grammars = grammars
        self._stepwise = False  # this generate call masks drafts (_open_graphs builds the forwards it needs)
        self._mask_words = None  # a grammar mask's words where this call has constrained requests (the masked verdicts)
        watch(self)

    # ---- sizing -----------------------------------------------------------------------------
    def budget_tokens(self, req: Request) -> int:
        return budget_tokens(len(req.prompt), req.max_new_tokens, self.gamma)

    def reserve_tokens(self, req: Request) -> int:
        return reserve_tokens(len(req.prompt), req.max_new_tokens, self.gamma, self.config.alloc, self.max_seq_len)

    def check_request(self, req: Request) -> None:
        if not req.prompt:
            raise UserError(f"request {req.request_id}: empty prompt")
        if req.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {req.max_new_tokens}")
        bad = [t for t in req.prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise UserError(f"request {req.request_id}: token id {bad[0]} outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        need = self.budget_tokens(req)
        if need > self.max_seq_len:
            raise UserError(
                f"request {req.request_id}: prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new + "
                f"gamma {self.gamma} needs {need} rows, over --max-seq-len {self.max_seq_len}")
        if self._constraint(req) is not None and (self.grammars is None or self.synthetic is not None):
            raise UserError(f"request {req.request_id}: a constraint needs the checkpoint's tokenizer.json and no "
                            "--synthetic-acceptance")

    def _constraint(self, req: Request):
        return req.constraint if req.constraint is not None else self.config.constraint

    # ---- the loop ---------------------------------------------------------------------------
    def generate(self, requests: list[Request], batch_size: int | None = None) -> list[SeqResult]:
        """Every request through `batch_size` slots (default: the config's; module docstring);
        results in request order."""
        batch_size = batch_size or self.config.batch_size
        batch_size = min(batch_size, max(len(requests), 1))  # no slot (nor graph bucket) that nothing could fill
        for r in requests:
            self.check_request(r)  # refuse before anything is allocated
        run = self._start_run(requests, batch_size)
        w0 = self._wall()
        try:
            while run.waiting or any(run.slots):
                self.step(run)
        finally:
            for s in run.slots:
                if s is not None:
                    self.release(s)
        self.wall_prefill_s += run.prefill_s
        self.wall_capture_s += run.capture_s
        self.wall_decode_s += self._wall() - w0 - run.prefill_s - run.capture_s
        return run.results

    def _start_run(self, requests: list[Request], batch_size: int) -> "Run":
        """A generate call's schedule; graphs built for fewer slots or narrower tables are dropped
        (built again at the first step), the prefill's opened."""
        built = self.runner.graphs  # a rebuild for more slots keeps the width (it never narrows)
        width = max(self._table_blocks(requests), built.max_blocks if built is not None else 0)
        # masked drafting runs the chain position by position: a greedy engine's graphs need those forwards too
        constrained = any(self._constraint(r) is not None for r in requests)
        self._stepwise = self.config.draft_mask and constrained
        self._mask_words = words(self.cfg.vocab_size) if constrained else None
        if built is not None and (built.slots < batch_size or built.max_blocks < width
                                  or (self._stepwise and not built.stepwise)
                                  or (self._mask_words and not built.mask_words)):
            self.runner.close()
        if self.config.prefill_graphs:
            self.runner.open_prefill(self.target, self.head, self.pools, width, graph_rows(self.cfg.hidden_size))
        self.results = [None] * len(requests)
        return Run(list(enumerate(requests))[::-1], [None] * batch_size, self.results, self.clock.now(), width,
                   carries=any(r.carry_mode != "none" for r in requests))

    def step(self, run: "Run") -> None:
        """One engine step, top-down: schedule (admit waiting requests into free slots), draft,
        verify [t_n, d1..dg] in one target forward, accept (decided on the device where greedy),
        commit both caches to the accepted prefix (the device's part queued before the step's one
        host read, the verdict's), finish (emit; the finished leave their slots)."""
        active = self._schedule(run)
        if not active:
            return
        s0 = time.perf_counter()  # the step ends in a host read of its tokens: no sync needed
        g = self._choose_gamma(len(active))
        if g > 0:
            self._catch_up_backlog(active)
        h0, p0 = time.perf_counter(), self.clock.now()  # h0: the step's cost for the gamma policy
        self.runner.step([s.slot for s in active])
        masks = self._masks(active, g)
        ahead = run.ahead.take(active, g) if run.ahead is not None and g > 0 else None
        if ahead is not None:
            p0 = run.ahead.start  # this step's propose started before its chain, in the last step
        run.ahead = None  # taken, or dropped: its rows lie past the drafters' real ones
        drafts = self.draft(active, g, masks if self.config.draft_mask else None, ahead) if g > 0 else None
        v0 = self.clock.now()
        if self.hooks is not None:
            self.hooks.before_verify(active)
        if masks is not None:
            masks.read_drafts(drafts)  # queued before the verify, so the walk below overlaps it
        starts = [s.cache.length for s in active]
        record = self.runner.verify(self.target, self._verify_ids(active, drafts), [s.cache for s in active],
                                    self.plans[g])
        if masks is not None:
            self.runner.mask(record, masks.verify(drafts))
        verdict = self._accept(drafts, record, active)
        if run.carries:
            verdict.clip_device(to_device(self._caps(active), self.device), self._eos_dev)
        times = StepTimes(p0, v0, self.clock.now())
        fed = self._commit_device(verdict, drafts, record)
        verdict.fetch()
        run.ahead = self._draft_ahead(active, g, verdict, fed, masks)
        self._read(verdict, active)  # after the device work above is queued: it runs while the host waits
        self._commit(active, verdict, drafts, fed, record.hidden_all, starts)
        self._finish(active, verdict, times, starts, run.slots, masks)
        # a step ends in a host read of its tokens, so its host wall time is its device time plus the
        # per-sequence bookkeeping, which at batch 64 outweighs the graph replay (and drafting
        # amortizes it over more tokens): the device time alone undervalued drafting there
        self.policy.record_cost(len(active), g, time.perf_counter() - h0)
        self._idle_s += (len(run.slots) - len(active)) * (time.perf_counter() - s0)
        run.capture_s += self.runner.take_capture_s()  # a catch-up's bucket

    def _schedule(self, run: "Run") -> list[LiveSequence]:
        """Admit waiting requests into free slots when the schedule says so, build the graphs once;
        -> the active sequences, in slot order."""
        free = [i for i, s in enumerate(run.slots) if s is None]
        n = len(run.slots)
        if run.waiting and free and self._admit_now(len(free), n, len(run.waiting), len(free) < n):
            self._admit_into(run, free)
        active = [s for s in run.slots if s is not None]
        if active and not self.runner.ready:
            c0 = self._wall()
            self._open_graphs(active, n, run.width)
            run.capture_s += self._wall() - c0
        return active

    def _admit_into(self, run: "Run", free: list[int]) -> None:
        """One admission phase: waiting requests into the free slots, in batches whose prompts share
        prefill forwards; its wall time is the rent-or-buy rule's price."""
        a0 = self._wall()
        while run.waiting and free:
            batch = self._next_batch(run.waiting, len(free))
            seated = []
            for (i, _), seq in zip(batch, self.admit([r for _, r in batch], run.arrive)):
                run.results[i] = seq.res
                if seq.done is None:
                    seated.append(seq)
            self._seat(seated, [free.pop(0) for _ in seated], run.slots)
        captured = self.runner.take_capture_s()
        self._admission_s = self._wall() - a0 - captured
        self._idle_s = 0.0
        run.prefill_s += self._admission_s
        run.capture_s += captured
        self.admissions += 1

    def _admit_now(self, free: int, slots: int, waiting: int, running: bool) -> bool:
        """Whether to admit before the next step (module docstring: the schedules)."""
        if self.config.schedule == "static":
            return free == slots
        if not running or free >= waiting:
            return True
        admit = self._idle_s >= self._admission_s * (slots - free)
        if self.comm is not None:
            admit = bool(self.comm.broadcast_int(int(admit)))
        return admit

    def _next_batch(self, waiting: list, free: int) -> list:
        """The next requests admitted together: in order, at most `free`, and (past the first)
        within --prefill-tokens prompt tokens."""
        batch, tokens = [], 0
        while waiting and len(batch) < free:
            n = len(waiting[-1][1].prompt)
            if batch and tokens + n > self.config.prefill_tokens:
                break
            batch.append(waiting.pop())
            tokens += n
        return batch

    def _seat(self, seqs: list[LiveSequence], free: list[int], slots: list) -> None:
        """Prefilled sequences take free slots: their rows of the graphs' tables name their blocks."""
        for seq, slot in zip(seqs, free):
            seq.slot = slot
            slots[slot] = seq
        self.runner.occupy(free, [self._slot_caches(s) for s in seqs])

    def _slot_caches(self, seq: LiveSequence) -> dict:
        caches = {"target": seq.cache}
        if seq.state is not None:
            caches["drafter"] = seq.state.cache
        return caches

    def _table_blocks(self, requests: list[Request]) -> int:
        """The graphs' table width in blocks: for the longest reservation among `requests`
        (graphs.table_blocks)."""
        block = min(p.block_size for p in self.pools.pools.values() if hasattr(p, "block_size"))
        return table_blocks(max((self.reserve_tokens(r) for r in requests), default=1), block, self.max_seq_len)

    def _open_graphs(self, active: list[LiveSequence], slots: int, width: int) -> None:
        """Build (CUDA: capture) the static forwards once per engine, for every bucket up to
        `slots` and tables `width` blocks wide, then write the seated sequences' table rows. A later
        call with more slots or longer sequences rebuilds."""
        h = active[0].pend.tensors()[1] if active[0].pend is not None else None  # the hiddens the drafter takes
        hidden = (h.shape[-1], h.dtype) if h is not None else None
        self.runner.open(self.target, self.head, self.pools, slots, width, self.policy.gammas(),
                         hidden, greedy=drafting.fusable(self.sampling, self.config.draft_conf_tau),
                         stepwise=self._stepwise, mask_words=self._mask_words)
        self.runner.occupy([s.slot for s in active], [self._slot_caches(s) for s in active])

    def close(self) -> None:
        """Drop the engine's graphs and give their scratch blocks back (the pools' ledger is then
        what the sequences hold); generate builds them again if called after."""
        self.runner.close()
        self.runner.close_prefill()

    def _wall(self) -> float:
        """Host time after the device caught up: read around admissions and captures, never inside a step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, req: Request, arrive=None) -> LiveSequence:
        """Admit one request (see `admit`). Public for diagnostics and tests that drive single
        steps (release it after)."""
        return self.admit([req], arrive)[0]

    def admit(self, reqs: list[Request], arrive=None) -> list[LiveSequence]:
        """Admit requests together: reserve each one's state, prefill the targets in shared
        forwards, then the drafters in shared forwards (engine/prefill.py), emit the first tokens.
        arrive: the clock mark their queue time counts from (default: now). A failure leaves
        nothing allocated."""
        for req in reqs:
            self.check_request(req)
        t0 = self.clock.now()
        seqs: list[LiveSequence] = []
        plans: list[CarryPlan] = []
        try:
            for req in reqs:
                seq = LiveSequence(req, self.pools.target_cache(), None, [], Acceptance(self.gamma), t0, arrive=arrive)
                seqs.append(seq)
                if not self.sampling.greedy:
                    seq.gen = request_stream(self.sampling.seed, req.request_id, self.device)
                rows = self.reserve_tokens(req)  # its budget, or the --max-seq-len ceiling
                plans.append(install(seq, self.head, rows) if req.carry is not None else CarryPlan(0, 0))
                seq.cache.reserve(rows)
                if self.head is not None and seq.state is None:
                    seq.state = self.head.alloc_state_for(rows)
                if self._constraint(req) is not None:
                    seq.grammar = self.grammars.open(self._constraint(req), self.eos)
                if seq.state is not None:
                    seq.state.gen = seq.gen
            self._fill(seqs, plans)
        except BaseException:
            for seq in seqs:
                self.release(seq)
            raise
        return seqs

    def _fill(self, seqs: list[LiveSequence], plans: list[CarryPlan]) -> None:
        state_bytes = [self._state_bytes(s) for s in seqs]
        logits, hiddens = prefill_targets(self.target, [s.cache for s in seqs],
                                          [s.req.prompt[pl.target_start:] for s, pl in zip(seqs, plans)],
                                          self.config.prefill_chunk, self.config.prefill_tokens, self.device, self.runner.prefill)
        masks = self._masks(seqs, 0)
        if masks is not None:
            apply_bitmask(logits[:, None], masks.verify(None).to(self.device, non_blocking=True))
        if self.sampling.greedy:
            first = logits.argmax(-1)
        else:
            first = torch.cat([choose(logits[i:i + 1], self.sampling, [s.gen])[0] for i, s in enumerate(seqs)])
        # the first tokens are read after the drafters' prefill is launched, so that its host work
        # overlaps the targets' forwards, and its device work the bookkeeping below
        first_host = first.to("cpu", non_blocking=True)
        t1 = self.clock.now()
        drafted = [0] * len(seqs)
        if self.head is not None:
            prompts = to_device([t for s in seqs for t in s.req.prompt], self.device)
            feeds, at = [], 0
            for i, (s, pl) in enumerate(zip(seqs, plans)):
                p = len(s.req.prompt)
                d = drafted[i] = self.head.drafter_rows(s.state)
                # rows d..P-2: (t[i+1], h[i]); hiddens[k] is h[target_start + k]
                feeds.append((prompts[at + d + 1: at + p], hiddens[i][d - pl.target_start: p - 1 - pl.target_start]))
                at += p
            prefill_drafters(self.head, [f[0] for f in feeds], [f[1] for f in feeds], [s.state for s in seqs],
                             self.config.prefill_chunk, self.config.prefill_tokens, self.runner.prefill)
        self.clock.wait(t1)
        firsts, firsts_dev = first_host.tolist(), (first[:, None],)
        for i, (seq, pl) in enumerate(zip(seqs, plans)):
            req, p, d = seq.req, len(seq.req.prompt), drafted[i]
            seq.last = firsts[i]
            seq.last_row = BatchRow(firsts_dev, i, 1)
            if seq.state is not None:
                seq.pend = BatchRow.own(seq.last_dev, hiddens[i][-1:])
            seq.out.append(seq.last)
            if seq.grammar is not None:
                seq.grammar_stop = seq.grammar.commit([seq.last])
            seq.all_tokens = list(req.prompt) + [seq.last]
            seq.res = SeqResult(req.request_id, p, seq.out, "", seq.acc, 0.0, 0.0, 0.0,
                                state_bytes=state_bytes[i], prefilled_target_rows=p - pl.target_start,
                                prefilled_drafter_rows=max(p - 1 - d, 0) if seq.state is not None else 0,
                                carried_target_rows=pl.target_start, carried_drafter_rows=d)
            seq.prefill_marks = (seq.t0, t1)
            self._maybe_finish(seq)
            if self.on_tokens is not None:
                self.on_tokens(req.request_id, list(seq.out))

    def draft(self, active: list[LiveSequence], g: int, masks: StepMasks | None = None,
              ahead: Drafts | None = None) -> Drafts:
        """The proposer's drafts for the active sequences' next verify (g of them each), under the
        grammar masks when given; ahead: theirs from the chain the last step launched, settled."""
        feed, states = pending_feed([s.pend for s in active]), [s.state for s in active]
        if ahead is not None:
            drafts = drafting.settle_ahead(ahead, feed, states)
        elif not self.plans[g].is_chain:
            drafts = drafting.propose_tree(self.head, feed, states, self.plans[g])
        else:
            drafts = drafting.propose(self.head, self.runner, feed, states, g, self.config.draft_conf_tau, masks)
        if self.config.check_invariants:
            for s in active:
                assert s.state.real_rows == s.cache.length, "drafter rows != accepted target rows"
        return drafts

    def _draft_ahead(self, active: list[LiveSequence], g: int, v: Verdict, fed, masks: StepMasks | None
                     ) -> drafting.Ahead | None:
        """The next step's greedy draft chain, launched before this step's read where the next step
        will most likely draft for the same sequences at the same gamma: the device runs it while
        the host reads the verdict and does the step's bookkeeping, instead of idling until the
        next step launches it. Only where the drafts are fused into one forward and unmasked (no
        sequence constrained, or --no-draft-mask: the chain needs no matcher state), gamma is fixed,
        and no sequence can reach its token budget in this step. A sequence ending (EOS, grammar)
        leaves the others their rows of it; an admission drops it (drafting.Ahead.take)."""
        if (fed is None or (masks is not None and self.config.draft_mask) or self.policy.adaptive
                or self.synthetic is not None or not drafting.fusable(self.sampling, self.config.draft_conf_tau)
                or any(s.state is None or len(s.out) + g + 1 >= s.req.max_new_tokens for s in active)):
            return None
        return drafting.launch_ahead(self.head, self.runner, active, fed, v.accepted_dev, g, self.clock.now())

    def _choose_gamma(self, active: int) -> int:
        """This step's gamma for the whole batch (engine/gamma.py); under --tp rank 0's, broadcast."""
        g = self.policy.choose(active)
        return self.comm.broadcast_int(g) if self.comm is not None and self.policy.adaptive else g

    def _catch_up_backlog(self, active: list[LiveSequence]) -> None:
        """Before a drafting step's clock starts: the rows left pending by steps without drafts,
        beyond what one draft forward takes (gamma + 1), go into the drafters in shared forwards.
        Outside the step's measured cost on purpose (engine/gamma.py: what a cost holds), so the
        device finishes it before the clock starts: a step ends in a host read, which would otherwise
        wait for the catch-up's kernels too (a probe after 128 steps off at batch 64 feeds 8192 rows)."""
        late = []
        for s in active:
            s.join_backlog()
            if s.pend.n > self.gamma + 1:
                late.append((s, s.pend.n - (self.gamma + 1), *s.pend.tensors()))
        if late:
            prefill_drafters(self.head, [t[:e] for _, e, t, _ in late], [h[:e] for _, e, _, h in late],
                             [s.state for s, *_ in late], self.config.prefill_chunk, self.config.prefill_tokens,
                             self.runner.prefill)
            for s, e, t, h in late:
                s.pend = BatchRow.own(t[e:], h[e:])
            self._wall()

    def _read(self, v: Verdict, active: list[LiveSequence]) -> None:
        """The step's one host read: the verdict's rows, each sequence's cut at its reply's end."""
        v.read()
        v.clip(self._caps(active), self.eos)

    @staticmethod
    def _caps(active: list[LiveSequence]) -> list[int]:
        """The most drafts each sequence's token budget still takes (its last token is the target's)."""
        return [s.req.max_new_tokens - len(s.out) - 1 for s in active]

    def _masks(self, seqs: list[LiveSequence], g: int) -> StepMasks | None:
        """This step's grammar masks, or None when no sequence in it is constrained."""
        if self.grammars is None or all(s.grammar is None for s in seqs):
            return None
        return StepMasks(self.grammars, [s.grammar for s in seqs], g, self.device)

    def _verify_ids(self, active: list[LiveSequence], drafts: Drafts | None) -> torch.Tensor:
        """[A, g + 1]: each sequence's newest token, then its drafts."""
        last = self._last_tokens(active)
        return last[:, None] if drafts is None else torch.cat([last[:, None], drafts.tokens], dim=1)

    def _commit_device(self, v: Verdict, drafts: Drafts | None, record: VerifyRecord):
        """The device half of the commit, from the verdict's device rows (before its host read): the
        target's fixed-size state keeps each sequence's accepted path; -> the drafter's next feed
        (accept.drafter_feed), None after a step without drafts."""
        record.commit(v.last_row_dev)
        return drafter_feed(v, drafts.tokens, record.hidden_all) if drafts is not None else None

    def _commit(self, active: list[LiveSequence], v: Verdict, drafts: Drafts | None, fed, hidden_all: torch.Tensor,
                starts: list[int]) -> None:
        """Both caches back to each sequence's accepted prefix (v read): the target keeps n + a + 1
        rows, the drafter drops its speculative rows and is fed the accepted ones (`fed`) at the next
        draft (or, after a step without drafts, at the next drafting one)."""
        if self.policy.adaptive:
            self.policy.record_acceptance(v.proposed, v.accepted)
        # the next verify's token; after a step without drafts, with its hidden: the drafter's row too
        next_rows = (v.next_dev[:, None],) if drafts is not None else (v.next_dev[:, None], hidden_all)
        for i, s in enumerate(active):
            a = v.accepted[i]
            if v.path is not None:
                s.cache.keep_path(starts[i], v.path[i][:a])
            s.cache.truncate(starts[i] + a + 1)
            s.last_row = BatchRow(next_rows, i, 1)
            if s.state is None:
                continue
            if drafts is not None:
                self.head.after_verify(a, s.state)
                s.pend = BatchRow(fed, i, a + 1)
            else:
                s.backlog.append(s.last_row)

    def _finish(self, active: list[LiveSequence], v: Verdict, times: StepTimes, starts: list[int],
                slots: list, masks: StepMasks | None) -> None:
        """Each sequence's tokens of this step; one that finished (EOS, length, grammar, cancel:
        released) leaves its slot to the next admission."""
        for i, s in enumerate(active):
            self._emit(s, v, i, times, starts[i], masks.valid[i] if masks is not None else None)
            if s.done is not None:
                slots[s.slot] = None

    def _emit(self, s: LiveSequence, v: Verdict, i: int, times: StepTimes, start: int,
              grammar_valid: int | None = None) -> None:
        """Sequence i's tokens of this step (a accepted drafts and the target's own), its record of
        the step, then whether it finished."""
        a, drafted = v.accepted[i], v.draft_ids[i] if v.draft_ids is not None else []
        new = drafted[:a] + [v.next[i]]
        s.acc.record(v.proposed[i], a)
        s.records.append(StepRecord(times, v.proposed[i], a, start, new, drafted[: v.proposed[i]], grammar_valid))
        s.steps += 1
        s.last = new[-1]
        s.all_tokens.extend(new)
        before = len(s.out)
        if s.grammar is not None:
            stop = s.grammar.commit(new)
            s.grammar_stop = before + stop if stop is not None else None
        s.out.extend(new)
        self._maybe_finish(s)
        if self.on_tokens is not None and len(s.out) > before:
            self.on_tokens(s.req.request_id, s.out[before:])

    @staticmethod
    def _last_tokens(active: list[LiveSequence]) -> torch.Tensor:
        """The active sequences' newest tokens [A] on the device: the previous step's tensor itself
        when the batch is unchanged (the common step), else gathered row by row."""
        whole = whole_batch([s.last_row for s in active])
        return whole[0][:, 0] if whole is not None else torch.cat([s.last_dev for s in active])

    def _accept(self, drafts: Drafts | None, record: VerifyRecord, active: list[LiveSequence]) -> Verdict:
        """This step's Verdict (engine/accept.py): the models' or, under --synthetic-acceptance, drawn;
        the record's where its verify (masked, if a grammar masked the step) decided it."""
        gens = [s.gen for s in active]
        if self.synthetic is not None and drafts is not None:
            return accept_synthetic(drafts, record.logits, gens, self.sampling, self.synthetic)
        return accept(drafts, record.logits, gens, self.sampling, record.verdict, record.plan)

    def _maybe_finish(self, s: LiveSequence) -> None:
        """Whether s ended with its newest tokens (the verdict cut them at its budget or an EOS)."""
        req = s.req
        if s.grammar_stop is not None and s.grammar_stop < len(s.out):
            del s.out[s.grammar_stop + 1:]  # past it the mask admitted only EOS
            s.done = "grammar"
        if s.done is None and s.out[-1] in self.eos:  # the verdict's clip ends a step's tokens at an EOS
            s.done = "eos"
        if s.done is None and len(s.out) >= req.max_new_tokens:
            s.done = "length"
        if s.done is None and self.hooks is not None and self.hooks.cancels(s):
            s.done = "cancelled"
        if s.done is not None:
            s.finalize(self.clock)
            if s.grammar is not None:
                self._judge(s)
            if s.done in ("eos", "length") and req.carry_mode != "none":
                hand_back(s, self.head, self.pools)
            self.release(s)

    def _judge(self, s: LiveSequence) -> None:
        """A constrained result's verdict: complete where the grammar ended it (or an EOS it accepted),
        valid where a fresh matcher accepts the constrained part whole."""
        res, g = s.res, s.grammar
        res.constraint = g.constraint.describe()
        part = g.constrained_part(s.out)
        res.complete = s.done in ("grammar", "eos") and part is not None
        res.valid = self.grammars.validates(g.constraint, part) if res.complete else None

    def _state_bytes(self, s: LiveSequence) -> dict[str, int]:
        out = {f"target_{k}": v for k, v in s.cache.bytes_held().items()}
        if s.state is not None and s.state.cache is not None:
            out.update({f"drafter_{k}": v for k, v in s.state.cache.bytes_held().items()})
        return out

    def release(self, s: LiveSequence) -> None:
        """Give back every per-sequence allocation; safe to call twice (finish, then finally)."""
        self.runner.retire(s.slot)  # before the blocks its tables name go back
        if s.grammar is not None:
            s.grammar.free()
        self._release_cache(s.cache, "target")
        if s.state is not None and self.head is not None:
            if s.state.cache is not None:
                self._release_cache(s.state.cache, "drafter")
                s.state.cache = None
            self.head.free_state(s.state)

    def _release_cache(self, cache: SequenceCache, owner: str) -> None:
        cache.release(keep=self.hooks.kept_component(owner) if self.hooks is not None else None)
