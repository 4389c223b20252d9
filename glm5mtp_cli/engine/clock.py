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

    def ready(self, mark) -> bool:
        """Whether reading `mark` would not wait for the device."""
        return mark.query() if self.cuda else True

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a
