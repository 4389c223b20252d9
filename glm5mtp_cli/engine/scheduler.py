"""Which requests run in which slots, and when: one generate call's schedule (Run) and the rule
that admits waiting requests, seats them and retires the finished (Scheduler).

Between decode steps, waiting requests are admitted into free slots, in batches of at most
--prefill-tokens prompt tokens whose prompts share prefill forwards (engine/prefill.py); the
schedule decides when. "continuous" rents before it buys (the ski-rental rule): an admission stalls
every running sequence for its whole prefill, and an eager prefill forward costs about the same
whatever its rows (~10 ms on the H200 for glm5-nano, ten batch-8 decode steps), so free slots wait
until the slot-seconds they have stood idle reach what the last admission cost the running ones (its
wall time x the running sequences); then every free slot is filled at once. Nothing running, or free
slots for every waiting request, admits at once. Under --tp the decision is rank 0's (host timings
differ between ranks), broadcast. "static" admits only when every slot is free (the old
batch-by-batch behaviour, kept for comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.graphs import ForwardRunner


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
    ahead: object = None  # drafting.Ahead
    carries: bool = False  # a request hands its caches to a next turn: its verdicts are cut on the device too

    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def active(self) -> list:
        """The running sequences, in slot order."""
        return [s for s in self.slots if s is not None]


class Scheduler:
    """The admission rule over an engine's slots (the module docstring), the batches admitted
    together, and the slots' seating and retirement in the runner's tables."""

    def __init__(self, config: EngineConfig, runner: ForwardRunner, comm=None):
        self.config, self.runner, self.comm = config, runner, comm
        self.admission_s = 0.0  # wall time of the last admission (the rule's price)
        self.idle_s = 0.0  # free-slot seconds since then

    def due(self, run: Run, free: list[int]) -> bool:
        """Whether to admit waiting requests into the free slots before the next step."""
        if not run.waiting or not free:
            return False
        slots = len(run.slots)
        if self.config.schedule == "static":
            return len(free) == slots
        if len(free) == slots or len(free) >= len(run.waiting):
            return True
        admit = self.idle_s >= self.admission_s * (slots - len(free))
        if self.comm is not None:
            admit = bool(self.comm.broadcast_int(int(admit)))
        return admit

    def next_batch(self, waiting: list, free: int) -> list:
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

    def admitted(self, seconds: float) -> None:
        """An admission took `seconds`: the price the next one waits to have rented."""
        self.admission_s, self.idle_s = seconds, 0.0

    def stepped(self, run: Run, active: int, seconds: float) -> None:
        """A step of `seconds` ran with `active` of the slots busy."""
        self.idle_s += (len(run.slots) - active) * seconds

    def seat(self, seqs: list, free: list[int], slots: list) -> None:
        """Prefilled sequences take free slots: their rows of the graphs' tables name their blocks."""
        for seq, slot in zip(seqs, free):
            seq.slot = slot
            slots[slot] = seq
        self.runner.occupy(free, [slot_caches(s) for s in seqs])

    def occupy(self, seqs: list) -> None:
        """Seated sequences' table rows, written again (graphs built after they were seated)."""
        self.runner.occupy([s.slot for s in seqs], [slot_caches(s) for s in seqs])

    def retire(self, seq) -> None:
        """A finished sequence's slot: its table rows on scratch before its blocks go back."""
        self.runner.retire(seq.slot)


def slot_caches(seq) -> dict:
    """A seated sequence's caches by owner, as the runner's tables name them."""
    caches = {"target": seq.cache}
    if seq.state is not None:
        caches["drafter"] = seq.state.cache
    return caches
