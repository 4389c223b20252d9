"""GLM-5-Next through the CLI on the CPU: init-random writes a checkpoint in the real layout that
generate, info, profile and leak-check read; bad checkpoints get one line and exit 2."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gn") / "glm5next-tiny"
    r = runner.invoke(app, ["init-random", "glm5next-tiny", str(out), "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    return out


def _json(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_generate_speculates_losslessly(ckpt):
    d = _json(["generate", "--model", str(ckpt), "--prompt-ids", "5,17,99,4,250,31,8,9,10", "--gamma", "3",
               "--max-new-tokens", "12", "--ignore-eos", "--compare", "--json", "--device", "cpu"])
    assert d["compare"]["same_tokens"]
    assert len(d["requests"][0]["tokens"]) == 12
    assert d["graphs"] == "eager"
    assert set(d["memory"]["per_sequence_bytes"]) >= {"target_kda", "target_conv", "target_mla", "drafter_mla"}


def test_info_counts_state_by_component(ckpt):
    d = _json(["info", str(ckpt), "--json"])
    assert d["model_type"] == "glm5_next"
    state = d["state"]["components"]
    assert state["target_kda"]["kind"] == "slot" and state["target_kda"]["bytes_per_token"] == 0
    assert state["target_mla"]["kind"] == "rows" and state["target_mla"]["bytes_per_sequence"] == 0
    assert d["components"]["KDA (linear attention)"]["all"]["params"] > 0
    assert "cache" not in d  # GLM-5's MLA layouts do not apply


def test_profile_state_is_flat_in_max_seq_len_and_measured_equals_predicted(ckpt):
    d = _json(["profile", "--model", str(ckpt), "--max-seq-len", "64,128", "--budget", "32", "--gamma", "2",
               "--repeats", "1", "--json", "--device", "cpu"])
    ceil = [r for r in d["rows"] if r["policy"] == "ceiling"]
    assert ceil[0]["per_sequence_bytes"]["target_kda"] == ceil[1]["per_sequence_bytes"]["target_kda"] > 0
    assert ceil[1]["per_sequence_bytes"]["target_mla"] == 2 * ceil[0]["per_sequence_bytes"]["target_mla"]
    for r in d["rows"]:
        for k, v in r["measured_per_sequence_bytes"].items():
            if k in r["per_sequence_bytes"] and k not in ("total",):
                assert v == r["per_sequence_bytes"][k], (k, r)


@pytest.mark.parametrize("component", ["target_kda", "target_conv", "target_raw", "drafter_pool"])
def test_leak_check_catches_each_new_component(ckpt, component):
    r = runner.invoke(app, ["leak-check", "--model", str(ckpt), "--sequences", "4", "--inject-leak", component,
                            "--device", "cpu"])
    assert r.exit_code == 1, r.output
    assert component in r.output


def test_leak_check_clean(ckpt):
    r = runner.invoke(app, ["leak-check", "--model", str(ckpt), "--sequences", "4", "--device", "cpu"])
    assert r.exit_code == 0, r.output


def _one_line(args, needle):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


def test_bad_checkpoints_are_one_line(ckpt, tmp_path):
    bad = tmp_path / "no_kpool"
    shutil.copytree(ckpt, bad)
    raw = json.loads((bad / "config.json").read_text())
    del raw["text_config"]["index_kpool"]
    (bad / "config.json").write_text(json.dumps(raw))
    _one_line(["info", str(bad)], "index_kpool")
    raw = json.loads((profile_path("glm5next-tiny") / "config.json").read_text())
    raw["text_config"]["index_topk"] = 6
    (bad / "config.json").write_text(json.dumps(raw))
    _one_line(["info", str(bad)], "index_topk")
    trunc = tmp_path / "truncated"
    shutil.copytree(ckpt, trunc)
    shard = next(trunc.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _one_line(["generate", "--model", str(trunc), "--prompt-ids", "5,6,7", "--device", "cpu"], "")


def test_mtp_index_share_flag(ckpt, tmp_path):
    """--mtp-index-share/--no-mtp-index-share override the config (absent here: true) and are
    recorded; output stays gamma 0's. A model without the setting refuses the flag in one line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": list(range(40, 70))}) + "\n")
    base = ["acceptance", "--model", str(ckpt), "--prompts", str(prompts), "--gammas", "3", "--temperatures", "0",
            "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", "--json"]
    for flag, want in (([], True), (["--no-mtp-index-share"], False), (["--mtp-index-share"], True)):
        d = _json(base + flag)
        assert d["mtp_index_share"] is want and d["lossless"]
        assert set(flag) <= set(d["command"].split())
    _one_line(["generate", "--model", "glm5-tiny", "--random-weights", "--prompt-ids", "5,6,7", "--device", "cpu",
               "--no-mtp-index-share"], "only GLM-5-Next")
