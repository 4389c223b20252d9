"""The shipped default: `glm5mtp generate` with nothing but a prompt runs profiles/glm5-nano on the CPU."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from glm5mtp_cli.cli import app

runner = CliRunner()


PROMPT = "def add(a, b):"


def test_generate_default_model_prints_continuation_and_acceptance():
    r = runner.invoke(app, ["generate", "--prompt", PROMPT, "--max-new-tokens", "16"])
    assert r.exit_code == 0, r.output
    continuation = r.output.split("acceptance (gamma")[0]
    assert continuation.strip(), r.output
    assert "mean acceptance length" in r.output and "draft acceptance rate" in r.output


def test_generate_default_model_compare_is_lossless():
    r = runner.invoke(app, ["generate", "--prompt", PROMPT, "--max-new-tokens", "16", "--compare", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"] == "glm5-nano"
    if not torch.cuda.is_available():
        assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    req = doc["requests"][0]
    assert req["text"].strip() and (len(req["tokens"]) == 16 or req["finish_reason"] != "length")
    assert doc["acceptance"]["mean_acceptance_length"] >= 1.0
    # fails while the engine emits a 17th token when an EOS lands right after the 16th (gamma > 0 only)
    assert doc["compare"]["same_tokens"] is True
