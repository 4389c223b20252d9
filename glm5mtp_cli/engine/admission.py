"""How requests enter a generate call: each checked against the engine's limits, its state reserved
(its budget, or the --max-seq-len ceiling; a carried turn's caches installed), the targets and then
the drafters prefilled in shared forwards (engine/prefill.py), the first tokens emitted. A failure
leaves nothing allocated."""

from __future__ import annotations

import torch

from glm5mtp_cli.core.host_copy import to_device
from glm5mtp_cli.engine.carry import CarryPlan, install
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.grammar import step_masks
from glm5mtp_cli.engine.metrics import Acceptance
from glm5mtp_cli.engine.prefill import prefill_drafters, prefill_targets
from glm5mtp_cli.engine.sampling import choose, request_stream
from glm5mtp_cli.engine.sequence import BatchRow, LiveSequence, Request, SeqResult, budget_tokens, reserve_tokens
from glm5mtp_cli.errors import UserError
from kernels.bitmask import apply_bitmask


class Admission:
    """Admits requests for an engine (its model config, target and drafter, pools, config, runner,
    grammars, clock and device); the sequences' ends are the lifecycle's."""

    def __init__(self, model_cfg, target, head, pools, config: EngineConfig, runner, grammars, clock, device,
                 lifecycle):
        self.cfg, self.target, self.head, self.pools, self.config = model_cfg, target, head, pools, config
        self.runner, self.grammars, self.clock, self.device, self.lifecycle = runner, grammars, clock, device, lifecycle

    def budget_tokens(self, req: Request) -> int:
        return budget_tokens(len(req.prompt), req.max_new_tokens, self.config.gamma)

    def reserve_tokens(self, req: Request) -> int:
        return reserve_tokens(len(req.prompt), req.max_new_tokens, self.config.gamma, self.config.alloc,
                              self.config.max_seq_len)

    def check(self, req: Request) -> None:
        """A request this engine can run, or one line saying why not (before anything is allocated)."""
        if not req.prompt:
            raise UserError(f"request {req.request_id}: empty prompt")
        if req.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {req.max_new_tokens}")
        bad = [t for t in req.prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise UserError(f"request {req.request_id}: token id {bad[0]} outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        need, limit = self.budget_tokens(req), self.config.max_seq_len
        if need > limit:
            raise UserError(
                f"request {req.request_id}: prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new + "
                f"gamma {self.config.gamma} needs {need} rows, over --max-seq-len {limit}")
        if self.constraint(req) is not None and (self.grammars is None or self.config.synthetic_acceptance is not None):
            raise UserError(f"request {req.request_id}: a constraint needs the checkpoint's tokenizer.json and no "
                            "--synthetic-acceptance")

    def constraint(self, req: Request):
        """A request's constraint: its own, else the config's (None: unconstrained)."""
        return req.constraint if req.constraint is not None else self.config.constraint

    def start(self, req: Request, arrive=None) -> LiveSequence:
        """Admit one request (see `admit`). Public for diagnostics and tests that drive single
        steps (release it after: the lifecycle's)."""
        return self.admit([req], arrive)[0]

    def admit(self, reqs: list[Request], arrive=None) -> list[LiveSequence]:
        """Admit requests together: reserve each one's state, prefill the targets in shared
        forwards, then the drafters in shared forwards (engine/prefill.py), emit the first tokens.
        arrive: the clock mark their queue time counts from (default: now). A failure leaves
        nothing allocated."""
        for req in reqs:
            self.check(req)
        t0 = self.clock.now()
        seqs: list[LiveSequence] = []
        plans: list[CarryPlan] = []
        try:
            for req in reqs:
                seq = LiveSequence(req, self.pools.target_cache(), None, [], Acceptance(self.config.gamma), t0, arrive=arrive)
                seqs.append(seq)
                if not self.config.sampling.greedy:
                    seq.gen = request_stream(self.config.sampling.seed, req.request_id, self.device)
                rows = self.reserve_tokens(req)  # its budget, or the --max-seq-len ceiling
                plans.append(install(seq, self.head, rows) if req.carry is not None else CarryPlan(0, 0))
                seq.cache.reserve(rows)
                if self.head is not None and seq.state is None:
                    seq.state = self.head.alloc_state_for(rows)
                if self.constraint(req) is not None:
                    seq.grammar = self.grammars.open(self.constraint(req), self.lifecycle.eos)
                if seq.state is not None:
                    seq.state.gen = seq.gen
            self._fill(seqs, plans)
        except BaseException:
            for seq in seqs:
                self.lifecycle.release(seq)
            raise
        return seqs

    def _fill(self, seqs: list[LiveSequence], plans: list[CarryPlan]) -> None:
        """Prefill the targets, then the drafters, each in shared forwards; emit the first tokens."""
        held = [state_bytes(s) for s in seqs]
        logits, hiddens = prefill_targets(self.target, [s.cache for s in seqs],
                                          [s.req.prompt[pl.target_start:] for s, pl in zip(seqs, plans)],
                                          self.config.prefill_chunk, self.config.prefill_tokens, self.device, self.runner.prefill)
        masks = step_masks(self.grammars, seqs, 0, self.device)
        if masks is not None:
            apply_bitmask(logits[:, None], masks.verify(None).to(self.device, non_blocking=True))
        if self.config.sampling.greedy:
            first = logits.argmax(-1)
        else:
            first = torch.cat([choose(logits[i:i + 1], self.config.sampling, [s.gen])[0] for i, s in enumerate(seqs)])
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
                                state_bytes=held[i], prefilled_target_rows=p - pl.target_start,
                                prefilled_drafter_rows=max(p - 1 - d, 0) if seq.state is not None else 0,
                                carried_target_rows=pl.target_start, carried_drafter_rows=d)
            seq.prefill_marks = (seq.t0, t1)
            self.lifecycle.maybe_finish(seq)
            if self.lifecycle.on_tokens is not None:
                self.lifecycle.on_tokens(req.request_id, list(seq.out))


def state_bytes(s: LiveSequence) -> dict[str, int]:
    """A sequence's bytes held per component, target's and drafter's, as reserved at admission."""
    out = {f"target_{k}": v for k, v in s.cache.bytes_held().items()}
    if s.state is not None and s.state.cache is not None:
        out.update({f"drafter_{k}": v for k, v in s.state.cache.bytes_held().items()})
    return out
