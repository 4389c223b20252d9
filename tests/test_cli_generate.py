"""`glm5mtp generate` through CliRunner: JSON schema, trace, one clear line for every bad input, what
text mode says of each reply, and Ctrl-C (during the run, and once the output is whole)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app
from glm5mtp_cli.engine.hooks import observing
from observe import Around

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
NARROW = {"COLUMNS": "80"}


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


def _fits_80(text: str) -> None:
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text.replace("…[cut]", ""), text  # nothing cut to fit (…[cut]: the text's own mark)


def test_text_mode_says_whether_each_constrained_reply_is_complete_and_valid(tmp_path):
    """Under each reply, its finish (no longer a rule's title, which cut it at 80 columns: `finish:
    grammar (the constraint admits no… ─`), then --json's complete and valid in words; the same
    for a streamed reply."""
    lines = (ROOT / "profiles" / "constrained" / "prompts.jsonl").read_text().splitlines()
    prompts = tmp_path / "p.jsonl"  # a tool call cut at 16 tokens, a point its schema ends, a json_object
    prompts.write_text("\n".join(lines[i] for i in (0, 8, 13)) + "\n")
    r = _run("--prompts", prompts, "--max-new-tokens", 16, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert re.findall(r"^finish: (\w+) .*, \d+ new tokens\n(.*)$", r.stdout, re.M) == [
        ("length", "json_schema: incomplete (cut), not checked"), ("grammar", "json_schema: complete, valid"),
        ("length", "json_object: incomplete (cut), not checked")]
    assert "finish: grammar (the constraint admits nothing more)" in r.stdout
    _fits_80(r.stdout)
    r = runner.invoke(app, ["generate", "--prompt", "x = ", "--json-object", "--device", "cpu"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "x = {}\nfinish: grammar (the constraint admits nothing more), 1 new token\njson_object: complete, " \
           "valid\n" in r.stdout
    _fits_80(r.stdout)


def _interrupt_at_step(n: int):
    """An observer (engine/hooks.py) pressing Ctrl-C at the engine's n-th step."""
    calls = []

    def interrupted_step(engine, step, run):
        calls.append(run)
        if len(calls) == n:
            raise KeyboardInterrupt
        step(run)

    return observing(Around({"step": interrupted_step}))


def test_ctrl_c_in_text_mode_prints_the_finished_replies(tmp_path):
    """As --json prints their JSON: the replies that finished, listed as a whole run lists them, then
    the interrupted line; they were dropped (stdout empty)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [8, 9]}\n')
    with _interrupt_at_step(6):  # request 0 ends after 3 steps (4 tokens at gamma 0, one from the prefill)
        r = runner.invoke(app, ["generate", "--prompts", str(prompts), "--max-new-tokens", "4", "--gamma", "0",
                                "--ignore-eos", "--device", "cpu"], env=NARROW)
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines() == ["interrupted: 1 of 2 requests had finished; their replies are on stdout"]
    assert r.stdout.startswith("request 0: 3 prompt tokens ─") and "request 1" not in r.stdout
    assert r.stdout.endswith("\nfinish: length (--max-new-tokens reached), 4 new tokens\n")


def test_ctrl_c_once_the_output_is_whole_leaves_exit_0():
    """A Ctrl-C after the JSON is written, while the model is freed and while the interpreter tears
    down (about a second with torch): the run is complete, so exit 0 and nothing more said, not 130
    with `interrupted: nothing was written` or a SIGINT death."""
    script = """if True:
        import os, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell's child ignores it
        import glm5mtp_cli.commands.generate as generate
        from glm5mtp_cli.cli import main

        single = generate._single

        def then_ctrl_c(*args):
            single(*args)
            os.kill(os.getpid(), signal.SIGINT)

        generate._single = then_ctrl_c
        sys.argv = ["glm5mtp", "generate", "--prompt", "x = ", "--max-new-tokens", "4", "--device", "cpu",
                    "--threads", "1", "--json"]
        code = main()
        os.kill(os.getpid(), signal.SIGINT)
        sys.exit(code)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["requests"][0]["tokens"]) <= 4 and p.stderr.strip() == ""
