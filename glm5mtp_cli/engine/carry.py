"""Carry across conversation turns: a finished turn's caches seed the next turn of the same chat.

A turn's prompt extends the previous turn's tokens (history + reply + the new user text), so the
rows already computed for that prefix stay valid: target row j holds token t[j]; drafter row i
pairs t[i+1] with the target hidden h[i]. Rows are kept only where every token they depend on
matches the new prompt, so a carried turn computes exactly what a fresh one would.

A target with fixed-size recurrent state (GLM-5-Next's KDA layers) cannot be cut back to a shorter
prefix: its carry is used only when the new prompt extends every token the previous turn's target
saw (the usual next turn); when the prompt diverges earlier, the target is prefilled afresh and
only the drafter's rows up to the divergence are reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from glm5mtp_cli.engine.cache import CachePools, SequenceCache
from glm5mtp_cli.engine.proposer import DrafterKV

CARRY_MODES = ("none", "drafter", "all")


@dataclass
class Carry:
    """What one conversation holds between turns."""

    target: SequenceCache | None  # the target's rows, when --carry all
    target_tokens: list[int]  # t[0..] the target rows were built from (rows past len(...) are junk)
    drafter: DrafterKV | None  # the drafter's real rows and their tokens t[1..]

    def bytes_held(self) -> int:
        total = 0
        for cache in (self.target, self.drafter.cache if self.drafter else None):
            if cache is not None:
                total += sum(cache.bytes_held().values())
        return total

    def release(self, head) -> None:
        if self.target is not None:
            self.target.release()
            self.target = None
        if self.drafter is not None:
            head.free_drafter_kv(self.drafter)
            self.drafter = None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CarryPlan:
    """Where a carried turn starts: rows reused, rows to compute."""

    target_start: int  # target rows kept; the prefill covers prompt[target_start:]
    drafter_rows: int  # drafter rows kept; the catch-up covers rows drafter_rows..P-2


def plan(carry: Carry, prompt: list[int], with_target: bool) -> CarryPlan:
    """How much of a carry a prompt can reuse.

    Target row j is valid while t[0..j] match. Drafter row i needs t[0..i+1] to match and h[i],
    which this turn must either carry (target row i kept) or recompute; the target restarts at the
    earlier of the two so every drafter row fed later has its hidden.
    """
    p = len(prompt)
    t_rows = 0
    if with_target and carry.target is not None:
        t_rows = min(carry.target.length, common_prefix(carry.target_tokens, prompt), p - 1)
    d_rows = 0
    if carry.drafter is not None:
        d_rows = min(carry.drafter.rows, common_prefix(carry.drafter.tokens, prompt[1:]),
                     common_prefix(carry.target_tokens, prompt), p - 1)
    if with_target:
        t_rows = min(t_rows, d_rows) if carry.drafter is not None else t_rows
        if carry.target is not None and carry.target.slots and t_rows != carry.target.length:
            t_rows = 0  # a recurrent state holds the whole prefix: reuse all of it or none
    return CarryPlan(t_rows, d_rows)


def install(seq, head, budget_tokens: int) -> CarryPlan:
    """Move the previous turn's caches (the request's carry) into a sequence being admitted (a
    sequence.LiveSequence, not imported: it holds a Carry), trimmed to what its prompt reuses; a
    carried drafter gets a state of `budget_tokens` rows (head None: no drafter). Whatever is not
    installed is released."""
    carry, seq.req.carry = seq.req.carry, None
    try:
        plan_ = plan(carry, seq.req.prompt, with_target=carry.target is not None)
        if carry.target is not None and plan_.target_start:
            seq.cache = carry.target  # the fresh cache holds no blocks yet
            carry.target = None
            seq.cache.truncate(plan_.target_start)
        if carry.drafter is not None and head is not None:
            kv, carry.drafter = carry.drafter, None
            kv.cache.truncate(plan_.drafter_rows)
            kv.rows = plan_.drafter_rows
            kv.tokens = kv.tokens[: plan_.drafter_rows]
            seq.state = head.alloc_state_for(budget_tokens)
            head.install_drafter_kv(kv, seq.state)
        else:
            plan_.drafter_rows = 0
        return plan_
    finally:
        if head is not None:
            carry.release(head)  # anything not installed
        elif carry.target is not None:
            carry.target.release()


def hand_back(seq, head, pools: CachePools) -> None:
    """End of a turn kept for the next (its request's carry_mode): feed the drafter its pending
    real rows, then move the caches out of the sequence into its result's carry_out, so that
    releasing the sequence leaves them alone."""
    drafter = None
    if seq.state is not None and seq.state.cache is not None:
        seq.join_backlog()
        head.catchup_drafter(*seq.pend.tensors(), seq.state.real_rows, seq.state)
        drafter = head.take_drafter_kv(seq.state)
    target = None
    if seq.req.carry_mode == "all":
        target, seq.cache = seq.cache, pools.target_cache()
        seq.cache.released = True
    tokens = seq.all_tokens[: target.length] if target is not None else list(seq.all_tokens)
    seq.res.carry_out = Carry(target, tokens, drafter)


class CarryStore:
    """Held carries by conversation, least recently used first; evicted past a byte budget."""

    def __init__(self, head, budget_bytes: int | None = None):
        self.head = head
        self.budget = budget_bytes
        self.entries: OrderedDict[object, Carry] = OrderedDict()
        self.evictions = 0

    def take(self, key) -> Carry | None:
        return self.entries.pop(key, None)

    def put(self, key, carry: Carry) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            old.release(self.head)
        self.entries[key] = carry
        while self.budget is not None and self.entries and self.bytes_held() > self.budget:
            _, victim = self.entries.popitem(last=False)
            victim.release(self.head)
            self.evictions += 1

    def drop(self, key) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            old.release(self.head)

    def bytes_held(self) -> int:
        return sum(c.bytes_held() for c in self.entries.values())

    def clear(self) -> None:
        for key in list(self.entries):
            self.drop(key)
