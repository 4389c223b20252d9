"""How many drafts a step proposes: --gamma-policy fixed (always --gamma) or adaptive.

Adaptive picks one gamma per step for the whole batch, 0..--gamma, maximising predicted tokens per
second: E(g) / C(b, g), where

- E(g) = 1 + sum over k = 1..g of a_1 * ... * a_k is the expected tokens a step emits with g drafts,
  a_k the rolling rate at which draft k is accepted given that drafts 1..k-1 were (counters that
  decay by 1 / window per recorded step, so the rate follows the text being generated);
- C(b, g) is the measured wall time of a step (draft + verify + bookkeeping) at batch bucket b (the
  next power of two >= the active sequences) with g drafts: the median of its last `cost_window`
  measurements once it has `warm` of them, else linear between the nearest gammas that have.

Drafting is measured before it is judged. The rates: every step runs at --gamma until each draft
position has been judged `warm_judged` times (once per run). The costs: a bucket's first steps run
at --gamma and at 0 until each has `warm` measurements, so both ends of its cost line are known,
unless a larger bucket's line already is: then the bucket is judged on that line (relative costs
are what the choice compares) until its own has both ends. A continuous run starts at its largest
bucket and shrinks through the smaller ones in its tail, which otherwise spent `warm` steps without
drafts in each. Only larger buckets lend their line: verifying g + 1 rows per sequence weighs more
the larger the batch, so a larger bucket's verdict on drafting is the cautious one for a smaller
one, and a verdict below --gamma is checked by the probes below, which measure the smaller
bucket's own line. A gamma measured fewer than `warm` times is interpolated, not judged on its
first step (which replays its graphs for the first time).

Probes. While the choice stays below --gamma (drafting off, e.g. at large batches where verifying
g + 1 rows costs g + 1 times one row, or fewer drafts), a step at --gamma is still run after
`probe_every` such steps: it re-measures the cost of drafting and, as important, the acceptance of
the positions the shorter steps never judge (their counters decay alike, so their rates would stay
what they were when those positions were last drafted: on the H200 the first steps' low acceptance,
HumanEval's completions starting less predictably, kept batch 8 at gamma 1 for 63 steps). Each
probe that does not change the choice doubles that gap (up to `probe_max`), since a probe after
steps without drafts costs a drafter catch-up of every row since the last one. This is
TensorRT-LLM's rolling-acceptance switch generalised from on/off to 0..gamma with measured costs.

What a cost holds, and why. A step without drafts leaves its row pending for the drafter; the next
drafting step must first feed the drafter every row it missed. That catch-up is not the price of
the gamma the step drafts with (it is the deferred price of the steps that did not draft), so the
engine runs it, in shared forwards, BEFORE the step's clock starts, and waits for the device to
finish it (otherwise the step's closing host read waits for its kernels, and the probe's measured
cost holds it after all). Charging it to the step (as the first version did, and eagerly, one
forward per sequence) made a probe after 32 steps off look many times as costly as drafting is,
so drafting stayed off for good: at batch 1 the run kept a mean acceptance length of 1.08 where
fixed gamma 3 reached 3.46, and at batch 64 those catch-ups made the steps 6x slower than gamma 0's.
The median (rather than an average seeded by the first measurement) keeps one slow step, such as a
first replay, from deciding the same way.

Leaving --gamma takes a predicted gain of more than `margin` (5%). Below that the prediction is
within its own errors: a cost line's medians move by a few percent as the lent H200s drift within
one call, an unmeasured gamma between two measured ones is costed on a straight line (which flatters
it: a step's cost jumps from no drafter to any, and a gamma-2 step costs nearly a gamma-3 one), and
steps below --gamma stop judging the deeper positions. On one H200 (device run 24, batch 64) the
policy without it spent 38 of 132 steps at gamma 2 and decoded 10% slower than fixed gamma 3.

A step's cost is its host wall time, from after any catch-up to the end of its bookkeeping: every
step ends in a host read of its tokens, so that is its device time plus the per-sequence host work,
which at batch 64 on the H200 outweighed the graph replay (device time alone, CUDA events, made
drafting look break-even there while it decoded 1.37x faster). Under --tp the decision is rank 0's,
broadcast by the engine, so every rank runs the same gamma.
"""

from __future__ import annotations

import statistics
from collections import deque

def expected_tokens(rates: list[float], g: int) -> float:
    """E(g): tokens a step with g drafts emits, from a_k = rates[k-1], the acceptance of draft k given
    drafts 1..k-1 were accepted (also bench's gamma recommendation, diagnostics/recommend.py)."""
    total, run = 1.0, 1.0
    for a in rates[:g]:
        run *= a
        total += run
    return total


def bucket_of(active: int) -> int:
    """The cost bucket of a step with `active` sequences: the next power of two."""
    return 1 << max(active - 1, 0).bit_length()


class GammaPolicy:
    def __init__(self, max_gamma: int, policy: str = "fixed", window: int = 64, probe_every: int = 32,
                 probe_max: int = 128, cost_window: int = 9, warm: int = 3, warm_judged: int = 32,
                 margin: float = 0.05):
        self.max_gamma = max_gamma
        self.adaptive = policy == "adaptive" and max_gamma > 0
        self.decay = 1.0 - 1.0 / window
        self.probe_every = probe_every
        self.probe_max = probe_max
        self.cost_window = cost_window
        self.warm = warm
        self.warm_judged = warm_judged
        self.margin = margin  # a gamma below --gamma must predict this much more than --gamma (docstring)
        self.rates_warm = False  # every position judged warm_judged times (then stays true)
        self.tried = [0.0] * max_gamma  # [k-1]: decayed count of drafts k that were verified
        self.kept = [0.0] * max_gamma  # [k-1]: of those, accepted
        self.costs: dict[int, dict[int, deque]] = {}  # bucket -> gamma -> recent seconds per step
        self.steps: dict[int, int] = {}  # gamma -> steps run at it (what a run's rows report)
        self.short_steps: dict[int, int] = {}  # bucket -> steps chosen below gamma since the last probe
        self.probe_gap: dict[int, int] = {}  # bucket -> steps below gamma before the next probe

    def gammas(self) -> list[int]:
        """Every gamma a step may use (the static forwards are built for each)."""
        return list(range(self.max_gamma + 1)) if self.adaptive else [self.max_gamma]

    # ---- observations -----------------------------------------------------------------------
    def record_acceptance(self, drafts: list[int], accepted: list[int]) -> None:
        """One step: per sequence, drafts proposed and accepted."""
        if not self.adaptive:
            return
        for k in range(self.max_gamma):
            self.tried[k] *= self.decay
            self.kept[k] *= self.decay
        for n, a in zip(drafts, accepted):
            for k in range(min(n, a + 1)):  # drafts 1..a+1 were judged (a + 1 rejected, if proposed)
                self.tried[k] += 1
                self.kept[k] += k < a

    def record_cost(self, active: int, gamma: int, seconds: float) -> None:
        self.steps[gamma] = self.steps.get(gamma, 0) + 1
        if not self.adaptive:
            return
        costs = self.costs.setdefault(bucket_of(active), {})
        costs.setdefault(gamma, deque(maxlen=self.cost_window)).append(seconds)

    # ---- predictions ------------------------------------------------------------------------
    def rates(self) -> list[float]:
        """a_k: the rolling acceptance of draft k given the ones before it (unjudged: a_{k-1})."""
        out = []
        for k in range(self.max_gamma):
            if self.tried[k] > 1e-9:
                out.append(self.kept[k] / self.tried[k])
            else:
                out.append(out[-1] if out else 0.0)
        return out

    def expected_tokens(self, g: int) -> float:
        return expected_tokens(self.rates(), g)

    def cost(self, active: int, g: int) -> float | None:
        """Seconds per step at this batch and gamma: measured, else interpolated (None: unknown)."""
        return _cost(self.costs.get(bucket_of(active), {}), g, self.warm)

    def _warm(self, costs: dict) -> bool:
        return all(len(costs.get(g, ())) >= self.warm for g in (0, self.max_gamma))

    def line(self, active: int) -> dict | None:
        """The costs this batch is judged on: its bucket's once both ends are warm, else the
        smallest larger bucket's that are (module docstring), else None (measure first)."""
        b = bucket_of(active)
        own = self.costs.get(b, {})
        if self._warm(own):
            return own
        lenders = [x for x, c in self.costs.items() if x > b and self._warm(c)]
        return self.costs[min(lenders)] if lenders else None

    # ---- the decision -----------------------------------------------------------------------
    def choose(self, active: int) -> int:
        if not self.adaptive:
            return self.max_gamma
        b = bucket_of(active)
        self.rates_warm = self.rates_warm or min(self.tried) >= self.warm_judged
        if not self.rates_warm:
            return self.max_gamma
        line = self.line(active)
        if line is None:
            own = self.costs.get(b, {})
            return self.max_gamma if len(own.get(self.max_gamma, ())) < self.warm else 0
        rate = [self.expected_tokens(g) / _cost(line, g, self.warm) for g in range(self.max_gamma + 1)]
        best = max(range(self.max_gamma + 1), key=rate.__getitem__)
        if rate[best] <= rate[self.max_gamma] * (1 + self.margin):
            best = self.max_gamma
            self.short_steps[b] = 0
            self.probe_gap[b] = self.probe_every
            return best
        self.short_steps[b] = self.short_steps.get(b, 0) + 1
        gap = self.probe_gap.get(b, self.probe_every)
        if self.short_steps[b] >= gap:
            self.short_steps[b] = 0
            self.probe_gap[b] = min(2 * gap, self.probe_max)
            return self.max_gamma  # re-measure every position's acceptance and the cost of drafting
        return best


def _cost(costs: dict[int, deque], g: int, warm: int) -> float | None:
    """A cost line's seconds per step at gamma g: the median of its measurements once it has `warm`
    of them, else linear between the nearest gammas that have (None: outside them). A gamma tried
    once is not judged on that step alone: its first step replays its graphs for the first time
    (on the H200 gamma 1's first step at batch 64 took 3.39 ms, its median over the next 2.6 ms)."""
    known = {x: d for x, d in costs.items() if len(d) >= warm}
    if g in known:
        return statistics.median(known[g])
    lo = max((x for x in known if x < g), default=None)
    hi = min((x for x in known if x > g), default=None)
    if lo is None or hi is None:
        return None
    c_lo, c_hi = statistics.median(known[lo]), statistics.median(known[hi])
    return c_lo + (c_hi - c_lo) * (g - lo) / (hi - lo)
