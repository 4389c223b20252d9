"""The prefill-then-propose loop: target prefill, drafter prefill, then propose gamma drafts, verify
gamma+1 positions in one target forward, accept, trim both caches, catch the drafter up.

Per sequence the bookkeeping is: the target cache holds n rows (t[0..n-1]); t[n] is the newest
accepted token, not yet in the cache. A step verifies [t[n], d1..dg] at positions n..n+g, keeps
n+a+1 rows (a drafts accepted) and emits d1..da plus the target's own next token. The drafter is
then fed the real rows (t[n+1..n+a+1], h[n..n+a]) at the start of the next propose.
Gamma 0 runs this same loop without a drafter: the baseline.

Scheduling (`generate`): one step loop over a fixed number of slots (the batch size); between decode
steps the scheduler (engine/scheduler.py) admits waiting requests into free slots. Each request
samples from its own stream (sampling.request_stream), so what it samples does not depend on which
requests share its steps.

Wall time of a generate call: prefill = the admission phases (the device caught up at both ends;
one per step that admits anything), capture = building and capturing the graphs (once per engine),
decode = the rest of the call's wall time (decode steps and their host bookkeeping). Per request,
ttft = queue (from the generate call to its admission) + its prefill; decode_s sums its own
steps' propose + verify times.
"""

from __future__ import annotations

import time

import torch

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.core.host_copy import to_device
from glm5mtp_cli.engine.clock import Clock, StepTimes
from glm5mtp_cli.engine.config import MAX_GAMMA, EngineConfig
from glm5mtp_cli.engine.gamma import GammaPolicy
from glm5mtp_cli.engine import drafting
from glm5mtp_cli.engine.accept import Verdict, accept, accept_synthetic, drafter_feed
from glm5mtp_cli.engine.grammar import Grammars, StepMasks, step_masks
from glm5mtp_cli.engine.graphs import ForwardRunner, table_blocks
from glm5mtp_cli.engine.hooks import watch
from glm5mtp_cli.engine.prefill import prefill_drafters
from glm5mtp_cli.engine.prefill_graphs import graph_rows
from glm5mtp_cli.engine.proposer import DraftProposer, Drafts, TreeDrafter
from glm5mtp_cli.engine.scheduler import Run, Scheduler
from glm5mtp_cli.engine.admission import Admission
from glm5mtp_cli.engine.lifecycle import Lifecycle
from glm5mtp_cli.engine.sequence import BatchRow, LiveSequence, Request, SeqResult, pending_feed, whole_batch
from glm5mtp_cli.engine.synthetic import SyntheticAcceptance
from glm5mtp_cli.engine.verify import VerifyPlan, VerifyRecord
from glm5mtp_cli.errors import UserError
from kernels.bitmask import words

class SpecEngine:
    """The loop over any model family: `target` appends rows to its SequenceCaches and returns
    logits and final hiddens; `proposer` (a DraftProposer, None for gamma 0) drafts; `runner`
    decides how the decode forwards run (eager, static buffers, CUDA graphs)."""

    # the step's phases, as observers see them (engine/hooks.py)
    PHASES = {"step": "step", "schedule": "_schedule", "admit": "_admit_into", "choose_gamma": "_choose_gamma",
              "catch_up_backlog": "_catch_up_backlog", "masks": "_masks", "draft": "draft", "propose": "_propose",
              "verify_ids": "_verify_ids", "accept": "_accept", "commit_device": "_commit_device",
              "draft_ahead": "_draft_ahead", "read": "_read", "commit": "_commit", "finish": "_finish"}

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
        self.device = torch.device(device)
        self.policy = GammaPolicy(config.gamma, config.gamma_policy)
        # each gamma's verify: a chain of its drafts, or the configured tree at its depth
        self.plans = {g: VerifyPlan.tree(config.tree) if config.tree and g == config.gamma else VerifyPlan.chain(g)
                      for g in range(MAX_GAMMA + 1)}
        self.comm = comm
        self.runner = ForwardRunner(config.graphs, self.device, config.compile, config.compile_mode)
        self.scheduler = Scheduler(config, self.runner, comm)
        self.clock = Clock(self.device)
        self.wall_prefill_s = 0.0
        self.admissions = 0
        self.wall_decode_s = 0.0
        self.wall_capture_s = 0.0  # building (compiling: runner.compile_s) and capturing the graphs (one-time setup)
        self.results: list[SeqResult | None] = []  # the last generate call's (Run.results)
        self.head = proposer if config.gamma > 0 else None
        self.grammars = grammars
        eos = set(model_cfg.eos_token_id if config.eos_ids is None else config.eos_ids)
        # hooks (leak-check's faults), on_tokens (streaming) and eos are the lifecycle's
        self.lifecycle = Lifecycle(eos, pools, self.head, grammars, self.scheduler, self.clock)
        self.admission = Admission(model_cfg, target, self.head, pools, config, self.runner, grammars, self.clock,
                                   self.device, self.lifecycle)
        self._stepwise = False  # this generate call masks drafts (_open_graphs builds the forwards it needs)
        self._mask_words = None  # a grammar mask's words where this call has constrained requests (the masked verdicts)
        watch(self)

    # ---- the loop ---------------------------------------------------------------------------
    def generate(self, requests: list[Request], batch_size: int | None = None) -> list[SeqResult]:
        """Every request through `batch_size` slots (default: the config's; module docstring);
        results in request order."""
        batch_size = batch_size or self.config.batch_size
        batch_size = min(batch_size, max(len(requests), 1))  # no slot (nor graph bucket) that nothing could fill
        for r in requests:
            self.admission.check(r)  # refuse before anything is allocated
        run = self._start_run(requests, batch_size)
        w0 = self._wall()
        try:
            while run.waiting or any(run.slots):
                self.step(run)
        finally:
            for s in run.slots:
                if s is not None:
                    self.lifecycle.release(s)
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
        constrained = any(self.admission.constraint(r) is not None for r in requests)
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
        if self.lifecycle.hooks is not None:
            self.lifecycle.hooks.before_verify(active)
        if masks is not None:
            masks.read_drafts(drafts)  # queued before the verify, so the walk below overlaps it
        starts = [s.cache.length for s in active]
        record = self.runner.verify(self.target, self._verify_ids(active, drafts), [s.cache for s in active],
                                    self.plans[g])
        if masks is not None:
            self.runner.mask(record, masks.verify(drafts))
        verdict = self._accept(drafts, record, active)
        if run.carries:
            eos = to_device(sorted(self.lifecycle.eos), self.device)
            verdict.clip_device(to_device(self._caps(active), self.device), eos)
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
        self.scheduler.stepped(run, len(active), time.perf_counter() - s0)
        run.capture_s += self.runner.take_capture_s()  # a catch-up's bucket

    def _schedule(self, run: "Run") -> list[LiveSequence]:
        """Admit waiting requests into free slots when the schedule says so, build the graphs once;
        -> the active sequences, in slot order."""
        free = run.free()
        if self.scheduler.due(run, free):
            self._admit_into(run, free)
        active = run.active()
        if active and not self.runner.ready:
            c0 = self._wall()
            self._open_graphs(active, len(run.slots), run.width)
            run.capture_s += self._wall() - c0
        return active

    def _admit_into(self, run: "Run", free: list[int]) -> None:
        """One admission phase: waiting requests into the free slots, in batches whose prompts share
        prefill forwards; its wall time is the rent-or-buy rule's price."""
        a0 = self._wall()
        while run.waiting and free:
            batch = self.scheduler.next_batch(run.waiting, len(free))
            seated = []
            for (i, _), seq in zip(batch, self.admission.admit([r for _, r in batch], run.arrive)):
                run.results[i] = seq.res
                if seq.done is None:
                    seated.append(seq)
            self.scheduler.seat(seated, [free.pop(0) for _ in seated], run.slots)
        captured = self.runner.take_capture_s()
        self.scheduler.admitted(self._wall() - a0 - captured)
        run.prefill_s += self.scheduler.admission_s
        run.capture_s += captured
        self.admissions += 1

    def _table_blocks(self, requests: list[Request]) -> int:
        """The graphs' table width in blocks: for the longest reservation among `requests`
        (graphs.table_blocks)."""
        block = min(p.block_size for p in self.pools.pools.values() if hasattr(p, "block_size"))
        need = max((self.admission.reserve_tokens(r) for r in requests), default=1)
        return table_blocks(need, block, self.max_seq_len)

    def _open_graphs(self, active: list[LiveSequence], slots: int, width: int) -> None:
        """Build (CUDA: capture) the static forwards once per engine, for every bucket up to
        `slots` and tables `width` blocks wide, then write the seated sequences' table rows. A later
        call with more slots or longer sequences rebuilds."""
        h = active[0].pend.tensors()[1] if active[0].pend is not None else None  # the hiddens the drafter takes
        hidden = (h.shape[-1], h.dtype) if h is not None else None
        self.runner.open(self.target, self.head, self.pools, slots, width, self.policy.gammas(),
                         hidden, greedy=drafting.fusable(self.sampling, self.config.draft_conf_tau),
                         stepwise=self._stepwise, mask_words=self._mask_words)
        self.scheduler.occupy(active)

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

    def draft(self, active: list[LiveSequence], g: int, masks: StepMasks | None = None,
              ahead: Drafts | None = None) -> Drafts:
        """The proposer's drafts for the active sequences' next verify (g of them each), under the
        grammar masks when given; ahead: theirs from the chain the last step launched, settled."""
        feed, states = pending_feed([s.pend for s in active]), [s.state for s in active]
        if ahead is not None:
            drafts = drafting.settle_ahead(ahead, feed, states)
        else:
            drafts = self._propose(feed, states, g, masks)
        if self.config.check_invariants:
            for s in active:
                assert s.state.real_rows == s.cache.length, "drafter rows != accepted target rows"
        return drafts

    def _propose(self, feed, states: list, g: int, masks: StepMasks | None) -> Drafts:
        """A propose over the batch's pending feed: the plan's tree, or a chain of g drafts."""
        if not self.plans[g].is_chain:
            return drafting.propose_tree(self.head, feed, states, self.plans[g])
        return drafting.propose(self.head, self.runner, feed, states, g, self.config.draft_conf_tau, masks)

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
        v.clip(self._caps(active), self.lifecycle.eos)

    @staticmethod
    def _caps(active: list[LiveSequence]) -> list[int]:
        """The most drafts each sequence's token budget still takes (its last token is the target's)."""
        return [s.req.max_new_tokens - len(s.out) - 1 for s in active]

    def _masks(self, seqs: list[LiveSequence], g: int) -> StepMasks | None:
        """This step's grammar masks, or None when no sequence in it is constrained."""
        return step_masks(self.grammars, seqs, g, self.device)

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
            self.lifecycle.emit(s, v, i, times, starts[i], masks.valid[i] if masks is not None else None)
            if s.done is not None:
                slots[s.slot] = None

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
