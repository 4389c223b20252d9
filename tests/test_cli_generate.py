"""`glm5mtp generate` through CliRunner: JSON schema, trace, and one clear line for every bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["generate", *map(str, args)])


def test_json_document_and_trace(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    trace = tmp_path / "trace.jsonl"
    r = _run("--model", folder, "--prompt-ids", "3,17,99,4,250,6,7,8,9,10", "--gamma", 3, "--max-new-tokens", 12,
             "--ignore-eos", "--json", "--trace", trace, "--compare", "--device", "cpu")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    req = doc["requests"][0]
    assert req["prompt_tokens"] == 10 and len(req["tokens"]) == 12
    acc = doc["acceptance"]
    assert set(acc) >= {"proposed", "accepted", "draft_acceptance_rate", "mean_acceptance_length", "per_position"}
    assert len(acc["per_position"]) == 3
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["accepted"] / acc["verify_steps"])
    assert set(doc["latency"]) >= {"ttft_ms", "tpot_ms_p50", "tpot_ms_p99", "decode_tokens_per_s", "e2e_tokens_per_s"}
    assert doc["memory"]["per_sequence_bytes"]["drafter_mla"] > 0
    assert doc["compare"]["same_tokens"] is True
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows and set(rows[0]) >= {"step", "request", "position", "drafts", "accepted", "emitted"}
    assert sum(row["emitted"] for row in rows) + 1 >= 12


def test_tables_print(spec_ckpt):
    folder, _ = spec_ckpt
    r = _run("--model", folder, "--prompt-ids", "1,2,3,4", "--gamma", 2, "--max-new-tokens", 6, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "mean acceptance" in r.output and "TPOT p50" in r.output and "drafter_mla" in r.output


def test_latency_table_shows_setup_only_where_it_happened():
    from rich.console import Console

    from glm5mtp_cli.diagnostics.report import latency_table

    def text(lat):
        c = Console(record=True, width=100)
        c.print(latency_table(lat))
        return c.export_text()

    base = {"ttft_ms": 1.0, "tpot_ms_p50": 2.0}
    assert "setup" not in text(base)
    shown = text(dict(base, compile_s=57.45, graph_capture_ms=223.0))
    assert "compiling the forwards" in shown and "57.45 s" in shown and "223.00 ms" in shown
    assert "TTFT (queue + prefill)" in text(base)  # from the run's start: a request's wait for a slot counts


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model-here"], "not found"),
    (["--gamma", "-1"], "--gamma"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--batch-size", "0"], "--batch-size"),
    (["--prefill-tokens", "0"], "--prefill-tokens"),
    (["--alloc", "sometimes"], "--alloc"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "int3"], "--dtype"),
    (["--max-seq-len", "8"], "max-seq-len"),
    (["--prompt-ids", "1,x,3"], "--prompt-ids"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt", "hello"], "tokenizer"),
    (["--prompts", "/nonexistent/p.jsonl"], "p.jsonl"),
])
def test_bad_input_is_one_line(spec_ckpt, args, needle):
    folder, _ = spec_ckpt
    base = ["--model", str(folder), "--device", "cpu"]
    if not any(a in args for a in ("--prompt", "--prompts", "--prompt-ids")):
        base += ["--prompt-ids", "1,2,3,4,5,6,7,8,9,10"]
    r = runner.invoke(app, ["generate", *base, *args])
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


def test_bad_prompts_file(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompts", str(bad)])
    assert r.exit_code != 0 and "Traceback" not in r.output
