"""How a running sequence takes its tokens and how it ends: each step's tokens emitted and recorded,
then whether it finished (EOS, length, its grammar complete, cancelled), a constrained result's
verdict, a turn's caches handed to the next, and every per-sequence allocation given back."""

from __future__ import annotations

from glm5mtp_cli.engine.cache import CachePools, SequenceCache
from glm5mtp_cli.engine.carry import hand_back
from glm5mtp_cli.engine.clock import StepTimes
from glm5mtp_cli.engine.hooks import watch
from glm5mtp_cli.engine.sequence import LiveSequence, StepRecord


class Lifecycle:
    """The ends of a generate call's sequences. eos: the token ids that end a sequence; hooks:
    diagnostics' EngineHooks (leak-check's faults: a cancel, a component kept; None costs one check a
    sequence); on_tokens: callback(request_id, new token ids) for streaming."""

    PHASES = {"judge": "judge"}  # as observers see them (engine/hooks.py)

    def __init__(self, eos: set[int], pools: CachePools, head, grammars, scheduler, clock):
        self.eos, self.pools, self.head, self.grammars = eos, pools, head, grammars
        self.scheduler, self.clock = scheduler, clock
        self.hooks = None
        self.on_tokens = None
        watch(self)

    def emit(self, s: LiveSequence, v, i: int, times: StepTimes, start: int, grammar_valid: int | None = None) -> None:
        """Sequence i's tokens of a step (its verdict's accepted drafts and the target's own), its
        record of the step, then whether it finished."""
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
        self.maybe_finish(s)
        if self.on_tokens is not None and len(s.out) > before:
            self.on_tokens(s.req.request_id, s.out[before:])

    def maybe_finish(self, s: LiveSequence) -> None:
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
                self.judge(s)
            if s.done in ("eos", "length") and req.carry_mode != "none":
                hand_back(s, self.head, self.pools)
            self.release(s)

    def judge(self, s: LiveSequence) -> None:
        """A constrained result's verdict: complete where the grammar ended it (or an EOS it accepted),
        valid where a fresh matcher accepts the constrained part whole."""
        res, g = s.res, s.grammar
        res.constraint = g.constraint.describe()
        part = g.constrained_part(s.out)
        res.complete = s.done in ("grammar", "eos") and part is not None
        res.valid = self.grammars.validates(g.constraint, part) if res.complete else None

    def release(self, s: LiveSequence) -> None:
        """Give back every per-sequence allocation; safe to call twice (finish, then finally)."""
        self.scheduler.retire(s)  # before the blocks its tables name go back
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
