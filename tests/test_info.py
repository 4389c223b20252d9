"""`glm5mtp info`: numbers from the config alone, pinned against REFERENCE.md and against what
init-random actually writes."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import local_weight_map
from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.diagnostics.info import GIB, info_dict
from glm5mtp_cli.checkpoint.write import init_random
from glm5mtp_cli.models.fp8 import FP8_QUANT_CONFIG

GLM5 = ModelConfig.from_json_file(profile_path("glm5") / "config.json")
TINY = ModelConfig.from_json_file(profile_path("glm5-tiny") / "config.json")


@pytest.fixture(scope="module")
def glm5_json():
    r = CliRunner().invoke(app, ["info", "glm5", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # one JSON document and nothing else


def test_glm5_mtp_layer_matches_reference(glm5_json):
    mtp = glm5_json["totals"]["mtp_layer"]
    assert mtp["tensors"] == 791
    assert 9.9e9 < mtp["params"] < 10.0e9               # "about 9.95 B parameters"
    assert math.isclose(mtp["bytes"] / 1e9, 19.9, abs_tol=0.05)  # "about 19.9 GB in BF16"
    assert glm5_json["mtp_layer_index"] == 78


def test_glm5_totals(glm5_json):
    t = glm5_json["totals"]
    assert math.isclose(t["target"]["params"] / 1e9, 744, abs_tol=1)   # GLM-5: 744 B parameters
    assert 38e9 < t["active_params_per_token_target"] < 44e9            # about 40 B active
    c = glm5_json["components"]
    assert c["routed experts"]["target"]["tensors"] == 75 * 256 * 3
    assert c["dense MLPs"]["target"]["tensors"] == 3 * 3
    assert c["embeddings"]["all"]["params"] == 154880 * 6144 == c["head"]["all"]["params"]
    assert c["MTP eh_proj"]["mtp"]["params"] == 6144 * 12288
    assert sum(v["all"]["params"] for v in c.values()) == t["all"]["params"]


def test_glm5_cache_matches_reference(glm5_json):
    k = glm5_json["cache"]["per_kind"]
    assert glm5_json["cache"]["tokens"] == 131072
    assert k["mla_bf16"]["bytes_per_token_per_layer"] == 1152 == 576 * 2
    assert k["mla_fp8"]["bytes_per_token_per_layer"] == 656
    assert k["indexer_bf16"]["bytes_per_token_per_layer"] == 256
    assert k["indexer_fp8"]["bytes_per_token_per_layer"] == 132
    assert round(k["mla_bf16"]["bytes_at_tokens_all"] / GIB, 1) == 11.1     # 79 layers x 131072
    assert round(k["mla_fp8"]["bytes_at_tokens_all"] / GIB, 1) == 6.3
    assert round(k["indexer_bf16"]["bytes_at_tokens_all"] / GIB, 1) == 2.5
    assert round(k["indexer_fp8"]["bytes_at_tokens_all"] / GIB, 2) == 1.27
    assert round(k["mla_bf16"]["bytes_at_tokens_mtp"] / 1e6) == 151          # MTP alone: about 151 MB
    assert 17e6 <= k["indexer_fp8"]["bytes_at_tokens_mtp"] < k["indexer_bf16"]["bytes_at_tokens_mtp"] <= 34e6


def test_fp8_checkpoint_bytes():
    fp8 = dataclasses.replace(GLM5, quantization_config=dict(FP8_QUANT_CONFIG))
    d, b = info_dict(fp8), info_dict(GLM5)
    # quantized experts: 1 byte a weight + one fp32 scale per 128x128 block
    per_expert = 3 * (2048 * 6144 + 4 * 16 * 48)
    assert d["components"]["routed experts"]["mtp"]["bytes"] == 256 * per_expert
    assert d["components"]["embeddings"]["all"]["bytes"] == b["components"]["embeddings"]["all"]["bytes"]
    assert d["components"]["router"]["mtp"]["bytes"] == b["components"]["router"]["mtp"]["bytes"]
    assert 0.5 < d["totals"]["all"]["bytes"] / b["totals"]["all"]["bytes"] < 0.52


def test_info_agrees_with_what_init_random_writes(tmp_path):
    init_random("glm5-tiny", tmp_path, seed=0, fp8=False)
    wm = local_weight_map(tmp_path)
    r = CheckpointReader(tmp_path, wm)
    d = info_dict(TINY)
    params = sum(math.prod(r.shape(n)) for n in wm)
    assert params == d["totals"]["all"]["params"] and len(wm) == d["totals"]["all"]["tensors"]
    mtp_params = sum(math.prod(r.shape(n)) for n in wm if n.startswith("model.layers.3."))
    assert mtp_params == d["totals"]["mtp_layer"]["params"]
    size = sum((tmp_path / f).stat().st_size for f in set(wm.values()))
    assert d["totals"]["all"]["bytes"] <= size < d["totals"]["all"]["bytes"] + 64 * 1024  # plus headers
    # glm5-tiny layer 1 uses a shared indexer: no index keys cached for it
    assert d["cache"]["layers"] == {"mla_target": 3, "indexer_target": 2, "mla_mtp": 1, "indexer_mtp": 1}


def test_info_on_local_folder_and_table(tmp_path):
    init_random("glm5-tiny", tmp_path / "m", layers=2)
    r = CliRunner().invoke(app, ["info", str(tmp_path / "m"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["mtp_layer_index"] == 2
    r = CliRunner().invoke(app, ["info", "glm5"])
    assert r.exit_code == 0 and "routed experts" in r.stdout and "MLA latent+rope bf16" in r.stdout


def test_info_bad_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("\x00\x01 not json")
    for args, needle in ((["info", "org/nothing"], "not in the Hugging Face cache (offline)"),
                         (["info", str(tmp_path / "junk")], "not valid JSON"),
                         (["info", "glm5", "--tokens", "0"], "--tokens")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, r.output
        assert needle in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_info_takes_the_model_as_every_command_does():
    """MODEL, or --model / -m as every other command takes it; both given and differing: one line."""
    by_arg = CliRunner().invoke(app, ["info", "glm5next-nano", "--json"])
    for args in (["--model", "glm5next-nano"], ["-m", "glm5next-nano"], ["glm5next-nano", "--model", "glm5next-nano"]):
        r = CliRunner().invoke(app, ["info", *args, "--json"])
        assert r.exit_code == 0, r.output
        assert r.stdout == by_arg.stdout
    r = CliRunner().invoke(app, ["info", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["model"] == "glm5-nano"  # the commands' default
    r = CliRunner().invoke(app, ["info", "glm5", "--model", "glm5-nano"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip() == "error: MODEL glm5 and --model glm5-nano differ: give the model once"


def test_info_imports_no_torch(tmp_path):
    """info reads a config alone: both nano profiles, GLM-5 and GLM-5-Next, an FP8 GLM-5 folder, with
    and without --json, in a fresh interpreter that must end without torch (1.9 s of info's import)."""
    fp8 = tmp_path / "glm5-fp8"
    fp8.mkdir()
    raw = json.loads((profile_path("glm5") / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_QUANT_CONFIG}))
    models = ["glm5-nano", "glm5next-nano", "glm5", "glm5next", str(fp8)]
    probe = ("import sys\nfrom glm5mtp_cli.cli import main\n"
             f"for model in {models!r}:\n"
             "    for extra in ([], ['--json']):\n"
             "        assert main(['info', model, *extra]) == 0, model\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH", r.stderr
    assert r.stdout.count('"model_type"') == len(models) and "fp8-e4m3 (block scales)" in r.stdout
