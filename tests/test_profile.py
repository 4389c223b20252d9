"""profile: budget vs ceiling sizing, predicted == measured on the ledger, glm5 predict-only numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app
CACHES = ("target_mla", "target_indexer", "drafter_mla", "drafter_indexer")  # GLM-5's state components


def _run(*args):
    return CliRunner().invoke(app, ["profile", *args])


def _rows(doc):
    return {(r["max_seq_len"], r["policy"]): r for r in doc["rows"]}


def test_measured_budget_and_ceiling(tiny):
    r = _run("--model", tiny, "--device", "cpu", "--max-seq-len", "256,1024", "--budget", "64",
             "--repeats", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = _rows(doc)
    # budget follows the request, ceiling follows --max-seq-len
    b256, b1024 = rows[(256, "budget")], rows[(1024, "budget")]
    c256, c1024 = rows[(256, "ceiling")], rows[(1024, "ceiling")]
    for comp in CACHES:
        assert b256["measured_per_sequence_bytes"][comp] == b1024["measured_per_sequence_bytes"][comp] > 0
        assert c1024["measured_per_sequence_bytes"][comp] == 4 * c256["measured_per_sequence_bytes"][comp]
    # predicted vs measured on the CPU ledger, within 2%
    for row in doc["rows"]:
        for comp in CACHES:
            p, m = row["per_sequence_bytes"][comp], row["measured_per_sequence_bytes"][comp]
            assert abs(p - m) <= 0.02 * m, (row["max_seq_len"], row["policy"], comp, p, m)
        lat = row["latency_ms"]
        assert lat["verify_ms"] > 0 and lat["propose_per_draft_ms"] > 0 and lat["step_ms"] > 0
        assert row["per_sequence_bytes"]["cuda_graphs"] > 0  # tests/test_graphs.py checks the formula
    assert doc["weights_bytes"] == doc["weights_bytes_measured"] > 0
    assert abs(doc["weights_bytes_predicted"] - doc["weights_bytes_measured"]) <= 0.02 * doc["weights_bytes_measured"]


def test_predict_only_glm5_matches_reference():
    r = _run("--model", "glm5", "--predict-only", "--max-seq-len", "4096,131072", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["bytes_per_token"]["drafter_mla"] == 1152  # one layer, bf16 MLA (REFERENCE section 5)
    assert doc["bytes_per_token"]["target_mla"] == 1152 * doc["model_layers"]
    row = _rows(doc)[(131072, "ceiling")]
    assert abs(row["per_sequence_bytes"]["drafter_mla"] - 151e6) < 0.01 * 151e6
    assert 17e6 <= row["per_sequence_bytes"]["drafter_indexer"] <= 34.5e6
    assert row["measured_per_sequence_bytes"] is None and row["latency_ms"] is None
    assert _rows(doc)[(131072, "budget")]["per_sequence_bytes"]["total"] < row["per_sequence_bytes"]["total"] / 50


def test_plot_has_a_title_and_latency_beside_memory(tiny, tmp_path):
    """The picture says what it was taken at (model, dtype, budget, gamma) and puts the measured latency
    per phase against --max-seq-len beside the per-sequence bytes; predicted only, the bytes alone."""
    pytest.importorskip("matplotlib")
    from glm5mtp_cli.commands.profile import _figure

    png = tmp_path / "p.png"
    r = _run("--model", tiny, "--device", "cpu", "--max-seq-len", "256,1024", "--budget", "64", "--repeats", "1",
             "--plot", str(png), "--json")
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 0
    doc = json.loads(r.stdout)
    fig = _figure(doc)
    title = fig._suptitle.get_text()
    assert f"{tiny} ({doc['model_layers']} target layers, float32) on cpu: budget 64 tokens, gamma 3" == title
    memory, latency = fig.axes[:2]
    assert memory.get_ylabel() == "MiB per sequence" and latency.get_xlabel().startswith("--max-seq-len")
    lines = {line.get_label(): line for line in latency.get_lines()}
    assert set(lines) == {"step", "verify 4 tok", "draft", "prefill 32 tok"}
    rows = [row for row in doc["rows"] if row["policy"] == "ceiling"]
    assert list(lines["step"].get_xdata()) == [256, 1024]
    assert list(lines["step"].get_ydata()) == [row["latency_ms"]["step_ms"] for row in rows]
    r = _run("--model", "glm5", "--predict-only", "--max-seq-len", "4096", "--json")
    fig = _figure(json.loads(r.stdout))
    assert len(fig.axes) == 1 and "predicted only: budget 2048 tokens, gamma 3" in fig._suptitle.get_text()


def test_plot_without_matplotlib_exits_with_the_install_hint(tmp_path, monkeypatch):
    """Issue 16 item 4: no silent fallback; one line naming the plot extra, before any work."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    r = _run("--model", "glm5", "--predict-only", "--max-seq-len", "4096", "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 2, r.output
    assert "glm5mtp[plot]" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("args", [["--max-seq-len", "0"], ["--max-seq-len", "-4096"], ["--max-seq-len", "abc"],
                                  ["--max-seq-len", "1024", "--budget", "2048"], ["--gpu-mem", "lots"]])
def test_bad_flags_one_line(args):
    r = _run("--model", "glm5", "--predict-only", *args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
