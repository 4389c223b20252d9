"""A test's observer of the engine's phases (engine/hooks.py): a function run in place of a phase."""

from __future__ import annotations


class Around:
    """Runs around[phase](obj, fn, *args, **kwargs) in place of each phase it names: fn is the phase
    itself, obj the engine object it belongs to."""

    def __init__(self, around: dict):
        self.around = around

    def wrap(self, obj, phase: str, fn):
        if phase not in self.around:
            return fn
        f = self.around[phase]
        return lambda *args, **kwargs: f(obj, fn, *args, **kwargs)


def ahead_taken(taken: list) -> Around:
    """Notes the sequences of each draft that took the chain the step before launched ahead."""
    def draft(engine, fn, active, g, masks=None, ahead=None):
        if ahead is not None:
            taken.append(len(active))
        return fn(active, g, masks, ahead)
    return Around({"draft": draft})
