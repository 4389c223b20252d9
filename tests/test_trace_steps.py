"""diagnostics/trace_steps: per-request steps and the in-order schedule, from a real trace."""

import json
import subprocess
import sys

from glm5mtp_cli.diagnostics.trace_steps import greedy_schedule, summarize


def test_schedule_fills_the_first_slot_to_free():
    assert greedy_schedule([5, 3, 4], 1) == 12  # one slot: one after another
    assert greedy_schedule([5, 3, 4], 3) == 5  # a slot each: the slowest
    assert greedy_schedule([5, 3, 4, 2], 2) == 7  # 4 goes after 3 (ends 7), 2 after 5 (ends 7)
    assert greedy_schedule([], 4) == 0


def test_summary_of_a_generate_trace(tmp_path):
    trace, prompts = tmp_path / "steps.jsonl", tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [3, 17, 99]}\n{"prompt": [5, 6]}\n')
    r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", "generate", "--prompts", str(prompts),
                        "--gamma", "2", "--max-new-tokens", "12", "--ignore-eos", "--trace", str(trace), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    doc = summarize(rows, slots=1)
    assert doc["requests"] == 2 and sum(doc["steps"]) == len(rows) == doc["schedule_steps"]
    assert doc["slowest"][0][1] == max(doc["steps"])
    out = subprocess.run([sys.executable, "-m", "glm5mtp_cli.diagnostics.trace_steps", str(trace), "--slots", "2"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["schedule_steps"] == max(doc["steps"])


def test_not_a_trace_is_one_line(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text("not json\n")
    for path in (bad, tmp_path / "missing.jsonl"):
        r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.diagnostics.trace_steps", str(path)],
                           capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout
