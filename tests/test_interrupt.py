"""Ctrl-C: exit 130 and one line on stderr saying what finished and where it went; --trace and --json
hold the requests that finished; a streamed reply ends its line; nothing stays allocated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from typer.testing import CliRunner

from glm5mtp_cli.cli import app
from glm5mtp_cli.engine.hooks import observing
from observe import Around


def test_ctrl_c_keeps_the_finished_requests(tmp_path):
    calls = []
    held = []

    def interrupted_step(engine, step, run):
        calls.append(run)
        held.append(engine.pools)
        if len(calls) == 6:  # the first request ends after 3 steps (4 tokens at gamma 0, one from the prefill)
            raise KeyboardInterrupt
        step(run)

    trace = tmp_path / "t.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [8, 9]}\n')
    with observing(Around({"step": interrupted_step})):
        r = CliRunner().invoke(app, ["generate", "--prompts", str(prompts), "--max-new-tokens", "4", "--gamma", "0",
                                     "--ignore-eos", "--trace", str(trace), "--json", "--device", "cpu"])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines() == [f"interrupted: 1 of 2 requests had finished; their steps are in {trace}; "
                                             "their JSON is on stdout"]
    doc = json.loads(r.stdout)
    assert doc["interrupted"] and [q["id"] for q in doc["requests"]] == [0] and len(doc["requests"][0]["tokens"]) == 4
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows and {row["request"] for row in rows} == {0}
    assert not any(held[-1].blocks_held().values())  # the interrupted request's caches went back


def test_a_real_sigint_ends_the_streamed_line_and_says_so():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-m", "glm5mtp_cli.cli", "generate", "--prompt", "def f(x):",
                          "--max-new-tokens", "1900", "--gamma", "0", "--ignore-eos", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored as in `cmd &`
    first = p.stdout.read(200)  # the header and the first streamed text: decoding has begun
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert (first + rest).endswith(b"\n")
    assert err.decode().strip().splitlines() == ["interrupted: 0 of 1 requests had finished; nothing was written"]
