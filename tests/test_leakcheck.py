"""leak-check: clean on every lifecycle; each injected component leak caught and named."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.engine.config import EngineConfig, ModelSpec
from glm5mtp_cli.cli import app



def _run(*args):
    return CliRunner().invoke(app, ["leak-check", *args])


def test_clean_run_covers_every_lifecycle(tiny):
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "8", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["leaked_bytes_per_sequence"] == {}
    assert {s["finish_reason"] for s in doc["sequences"]} == {"length", "eos", "cancelled", "failed"}
    assert all(s["finish_reason"] == s["lifecycle"] for s in doc["sequences"])
    assert all(v == 0 for s in doc["sequences"] for v in s["blocks_held"].values())


@pytest.mark.parametrize("component", ["target_mla", "target_indexer", "drafter_mla", "drafter_indexer"])
def test_injected_leak_is_caught_and_named(tiny, component):
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "4", "--inject-leak", component, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "leak"
    assert set(doc["leaked_bytes_per_sequence"]) == {component}  # only the named component leaks
    assert doc["leaked_bytes_per_sequence"][component] > 0
    assert component in r.stderr and "Traceback" not in r.output


def test_ceiling_leak_is_caught_in_table_mode(tiny):
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "4", "--alloc", "ceiling",
             "--inject-leak", "drafter_indexer")
    assert r.exit_code == 1
    assert "leak: drafter_indexer" in r.stderr


@pytest.mark.parametrize("args", [["--inject-leak", "drafter"], ["--inject-leak", "bogus"], ["--sequences", "0"],
                                  ["--max-seq-len", "0"], ["--max-seq-len", "-5"], ["--alloc", "nope"]])
def test_bad_flags_one_line(tiny, args):
    r = _run("--model", tiny, "--device", "cpu", *args)
    assert r.exit_code == 2
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_slot_reuse_is_clean_and_a_leak_is_still_caught(tiny):
    """--batch-size 2: rounds of 4 lives through 2 slots (continuous batching re-occupies them)."""
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "12", "--batch-size", "2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["batch_size"] == 2
    assert {"length", "eos", "cancelled", "failed"} <= {s["finish_reason"] for s in doc["sequences"]}
    assert all(v == 0 for s in doc["sequences"] for v in s["blocks_held"].values())
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "8", "--batch-size", "2",
             "--inject-leak", "target_indexer", "--json")
    assert r.exit_code == 1
    assert set(json.loads(r.stdout)["leaked_bytes_per_sequence"]) == {"target_indexer"}


def test_every_slot_is_busy_before_the_baseline():
    """--batch-size 8, more slots than lifecycles: the warm-up runs a round's worth of lives, so the
    grammar masks' host buffers (as many rows as the most sequences a step met) are at full width
    before the baseline; with one life per lifecycle their growth in the first counted round read
    as a leak (960 B a sequence here)."""
    r = _run("--model", "glm5-nano", "--device", "cpu", "--sequences", "8", "--batch-size", "8",
             "--max-new-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and "grammar" in doc["lifecycles_seen"]


def test_graphs_are_built_once_at_the_warm_up(tiny):
    """The engine's graphs are built for the slots and the longest request they have met; the
    warm-up fills every slot with the longest prompt, so nothing after the baseline rebuilds them
    (on CUDA a rebuild would show as allocator growth)."""
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig, run_leakcheck
    from glm5mtp_cli.engine.hooks import observing
    from glm5mtp_cli.engine.runtime import load_runtime
    from observe import Around

    built = []

    def counting(runner, open_, *args, **kwargs):
        new = runner.graphs is None
        open_(*args, **kwargs)
        if new and runner.graphs is not None:
            built.append((runner.graphs.slots, runner.graphs.max_blocks))
    rt = load_runtime(ModelSpec(tiny, "cpu", "fp32"), progress=False)
    with observing(Around({"runner.open": counting})):
        doc = run_leakcheck(rt, LeakCheckConfig(EngineConfig(max_new_tokens=16, max_seq_len=256, graphs="static",
                                                             batch_size=2), sequences=8, seed=1))
    assert doc["verdict"] == "clean" and len(built) == 1, built


def test_slope_is_least_squares_growth_per_sequence():
    from glm5mtp_cli.diagnostics.leakcheck import slope

    assert slope([(0, 0), (10, 20), (20, 40)]) == 2.0
    assert slope([(0, 0), (10, 512), (20, 512), (30, 512)]) < 512 / 30  # a one-off block is not a slope
    assert slope([(0, 0)]) == 0.0


def test_the_slope_is_of_what_stayed_held():
    """Tensors a snapshot catches in passing (4.6 KiB at one snapshot under --tp 2, gone at the next)
    are not growth; a leak, which never gives memory back, keeps all of its."""
    from glm5mtp_cli.diagnostics.leakcheck import lower_envelope

    assert lower_envelope([6, 4610, 4615, 0, 0]) == [0, 0, 0, 0, 0]
    assert lower_envelope([1024, 2048, 4000, 3072, 4096]) == [1024, 2048, 3072, 3072, 4096]


def test_a_planted_kib_a_sequence_is_caught_over_100_sequences(tiny):
    """The verdict's sensitivity on the CPU: the live-tensor census's slope catches 1 KiB a
    sequence (a fixed tolerance per run would not scale with the run's length)."""
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "100", "--batch-size", "4", "--max-new-tokens", "4",
             "--inject-leak", "tensor:1KiB", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "leak" and set(doc["leaked_bytes_per_sequence"]) == {"live_tensors"}
    assert doc["memory_slope"]["bytes_per_sequence"] == pytest.approx(1024, rel=0.05)
    assert doc["memory_slope"]["limit_bytes"] == 1024 and "live_tensors" in r.stderr


@pytest.mark.parametrize("arg", ["tensor:", "tensor:lots", "tensor:-5"])
def test_a_malformed_planted_tensor_is_one_line(tiny, arg):
    r = _run("--model", tiny, "--device", "cpu", "--inject-leak", arg)
    assert r.exit_code == 2 and "tensor:BYTES" in r.stderr or "BYTES" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_engine_state_that_joins_autograd_is_caught():
    """Parameters that require grad (as the runtime's did before load_runtime froze them) make
    the KDA commit's in-place write chain an autograd node a commit, holding what the census
    cannot see: leak-check runs outside no_grad, as generate does, and counts those nodes."""
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig, run_leakcheck
    from glm5mtp_cli.engine.runtime import load_runtime

    rt = load_runtime(ModelSpec("glm5next-nano", "cpu", "fp32"), progress=False)
    check = LeakCheckConfig(EngineConfig(gamma=2, max_new_tokens=6, graphs="off"), sequences=6)
    doc = run_leakcheck(rt, check)
    assert doc["verdict"] == "clean" and doc["autograd_nodes_after"] == 0
    rt.target.requires_grad_(True)
    doc = run_leakcheck(rt, check)
    assert doc["verdict"] == "leak" and doc["leaked_bytes_per_sequence"]["autograd_nodes"] > 0


@pytest.mark.parametrize("max_new_tokens", ["16", "2"])
def test_every_sequence_ends_as_its_lifecycle_names(max_new_tokens):
    """Batch 4 on glm5next-nano: the EOS lives' tokens ended other lives of a shared round (cancelled
    -> eos), a failure aborted the lives beside it (length -> aborted), and at a budget of 2 a
    cancellation after a step came after the length; each life now ends as named."""
    r = _run("--model", "glm5next-nano", "--device", "cpu", "--sequences", "12", "--batch-size", "4",
             "--max-new-tokens", max_new_tokens, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [(s["sequence"], s["finish_reason"]) for s in doc["sequences"]] == \
        [(s["sequence"], s["lifecycle"]) for s in doc["sequences"]]
    assert doc["ended_otherwise"] == [] and doc["verdict"] == "clean"
    assert set(doc["lifecycles_seen"]) == {"length", "eos", "cancelled", "failed", "aborted", "grammar"}


def test_an_ending_other_than_named_is_said(tiny, monkeypatch):
    """Where a life ends otherwise than named (here a cancellation and a failure placed after the
    length), the report counts what ran and says so beside the verdict."""
    from glm5mtp_cli.diagnostics import leakcheck

    monkeypatch.setattr(leakcheck, "last_safe_step", lambda max_new_tokens, gamma: 2)
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "4", "--max-new-tokens", "2")
    assert r.exit_code == 0, r.output
    assert ("not as named: 2 of 4 sequences ended otherwise than their lifecycle (sequence 2 cancelled -> "
            "length, 3 failed -> length)") in " ".join(r.stdout.split())
    r = _run("--model", tiny, "--device", "cpu", "--sequences", "4", "--max-new-tokens", "2", "--json")
    assert json.loads(r.stdout)["ended_otherwise"] == [
        {"sequence": 2, "lifecycle": "cancelled", "finish_reason": "length"},
        {"sequence": 3, "lifecycle": "failed", "finish_reason": "length"}]
