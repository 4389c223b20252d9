"""The engine's step clock: CUDA events on the GPU (read without waiting where it can), host time
otherwise."""

from __future__ import annotations

import time

import torch


class Clock:
    """Wall time that waits for the device only where a number is read (end of a request)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def wait(self, mark) -> None:
        """The host waits until the device has reached `mark` (its copies before it have landed)."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


class StepTimes:
    """One step's marks (propose start, verify start, verify end), shared by every sequence in the
    step and read once: a finishing sequence reads each of its steps, and at batch 64 reading the
    events per sequence (two waits and elapsed times per step each) cost the H200 run a third of
    its decode loop's host time."""

    __slots__ = ("marks", "times")

    def __init__(self, p0, v0, v1):
        self.marks = (p0, v0, v1)
        self.times: tuple[float, float] | None = None

    def read(self, clock: Clock) -> tuple[float, float]:
        """(propose seconds, verify seconds)."""
        if self.times is None:
            p0, v0, v1 = self.marks
            self.times = (clock.seconds(p0, v0), clock.seconds(v0, v1))
            self.marks = None  # the events are not needed again
        return self.times
