"""The tp tests' shared pair of gloo ranks: each rank runs named sections of a test file and writes
its report after every section, so one spawn serves a whole file and a rank that dies leaves what
it had; the tests then read a section's report (or fail with what broke it)."""

import json
from pathlib import Path

import pytest

from glm5mtp_cli.engine import launch


def spawn(rank_fn, folder: str, out: Path) -> tuple[list[dict], str | None]:
    """Every section's report per rank from one spawned pair running rank_fn(folder, out_dir)."""
    failure = None
    try:
        launch.spawn(2, "gloo", _call, (rank_fn, folder, str(out)))
    except BaseException as e:  # the sections that finished still count; the rest fail with this
        failure = f"{type(e).__name__}: {e}"
    reports = []
    for rank in range(2):
        p = out / f"rank{rank}.json"
        reports.append(json.loads(p.read_text()) if p.exists() else {})
    return reports, failure


def _call(args) -> None:
    rank_fn, folder, out_dir = args
    rank_fn(folder=folder, out_dir=out_dir)


def section(tp_group, name: str, rank: int = 0) -> dict:
    reports, failure = tp_group
    for r, rep in enumerate(reports):
        if name not in rep:
            pytest.fail(f"section {name} did not finish on rank {r}: {failure or 'no report'}")
        if rep[name].get("error"):
            pytest.fail(f"section {name} raised on rank {r}:\n{rep[name]['error']}")
    return reports[rank][name]
