"""Counters with vLLM's definitions (REFERENCE.md section 6), so numbers compare.

- draft acceptance rate = accepted drafts / proposed drafts
- mean acceptance length = 1 + accepted / verify steps (the bonus token counts)
- per-position acceptance rate k = steps whose first k drafts were all accepted / steps
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Acceptance:
    gamma: int
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    prefix_counts: list[int] = field(default_factory=list)  # [k-1]: steps with the first k drafts accepted

    def __post_init__(self):
        if not self.prefix_counts:
            self.prefix_counts = [0] * self.gamma

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for k in range(accepted):
            self.prefix_counts[k] += 1

    def merge(self, other: "Acceptance") -> None:
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        for k in range(min(len(self.prefix_counts), len(other.prefix_counts))):
            self.prefix_counts[k] += other.prefix_counts[k]

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.steps if self.steps else None

    @property
    def per_position(self) -> list[float]:
        return [c / self.steps if self.steps else 0.0 for c in self.prefix_counts]

    def to_json(self) -> dict:
        return {
            "gamma": self.gamma,
            "verify_steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position": self.per_position,
        }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Latency:
    """Timings in seconds, collected per request and per phase."""

    ttft: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    propose_per_draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)  # per request: decode time / (tokens - 1)
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    decode_tokens: int = 0
    total_tokens: int = 0
    capture_seconds: float = 0.0  # CUDA-graph capture, outside total_seconds
    compile_seconds: float = 0.0  # compiling the static forwards (--compile), outside both
    admissions: int = 0  # admission phases (each prefills the requests that took free slots together)
    gamma_steps: dict[int, int] = field(default_factory=dict)  # batch steps run at each gamma

    def to_json(self) -> dict:
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "ttft_ms": ms(med(self.ttft)),
            "ttft_ms_p50": ms(percentile(self.ttft, 50)),
            "ttft_ms_p99": ms(percentile(self.ttft, 99)),
            "prefill_ms": ms(med(self.prefill)),
            "propose_ms_per_draft": ms(med(self.propose_per_draft)),
            "verify_ms": ms(med(self.verify)),
            "tpot_ms_p50": ms(percentile(self.tpot, 50)),
            "tpot_ms_p99": ms(percentile(self.tpot, 99)),
            "decode_tokens_per_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else None,
            "e2e_tokens_per_s": self.total_tokens / self.total_seconds if self.total_seconds else None,
            # where end to end goes: the admission phases (prefill) and the decode steps, whole run
            "wall_prefill_s": self.total_seconds - self.decode_seconds,
            "wall_decode_s": self.decode_seconds,
            "graph_capture_ms": self.capture_seconds * 1e3,
            "compile_s": self.compile_seconds,
            "admissions": self.admissions,
            "gamma_steps": {str(g): n for g, n in self.gamma_steps.items()},
        }
