"""How diagnostics and tests watch the engine's step without patching its names.

The objects a step runs through declare their phases (`PHASES`: a phase's name -> the method that runs
it): the engine's (schedule, draft, accept, commit, ...), the runner's (its verify, its drafter
forwards), a step's grammar masks and a sequence's matcher, a static forward's replay and a static
commit. An observer (anything with `wrap(obj, phase, fn) -> fn`) installed with `observing` wraps the
phases of every such object built while it is installed, on the object itself; `watch(obj, observer)`
wraps an object already built. With no observer nothing is wrapped: a step calls its own methods.
`Lifecycle.hooks` (engine/lifecycle.py) is the other seam: what leak-check and tests steer (a verify
that fails, a sequence cancelled, a component kept), each consulted behind one `is None` check.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Protocol


class Observer(Protocol):
    def wrap(self, obj, phase: str, fn: Callable) -> Callable: ...


_installed: list[Observer] = []


@contextmanager
def observing(observer: Observer):
    """`observer` wraps the phases of every engine object built inside the block."""
    _installed.append(observer)
    try:
        yield observer
    finally:
        _installed.remove(observer)


def watch(obj, *observers: Observer) -> None:
    """Wrap obj's phases by `observers`, or (none given: at construction) by every installed one."""
    for observer in observers or _installed:
        for phase, method in type(obj).PHASES.items():
            setattr(obj, method, observer.wrap(obj, phase, getattr(obj, method)))
