"""Whether the forward running now must stay free of host reads: the runner's static forwards
(engine/graphs.py), which may be captured into CUDA graphs, run inside `sync_free()`; a model's
layer that has a cheaper path with a host read (a data-dependent gather) asks `active()` and takes
its fixed-shape path instead."""

from __future__ import annotations

import contextlib

_active = False


def active() -> bool:
    return _active


@contextlib.contextmanager
def sync_free():
    """Forwards run inside take only paths with no host reads (CUDA-graph capturable)."""
    global _active
    before, _active = _active, True
    try:
        yield
    finally:
        _active = before
