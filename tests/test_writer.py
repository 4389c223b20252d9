"""init-random / save_checkpoint: Hub layout, determinism, streaming, FP8 block quantization; the
commands' safe writes (quantize's source stays, Ctrl-C leaves nothing)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from glm5mtp_cli.models.glm5 import layout
from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import local_weight_map
from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.checkpoint.write import init_random, parse_size, save_checkpoint
from kernels.fp8_block import fp8_block_quantize
from kernels.fp8_block import fp8_block_dequant_ref

F32 = torch.float32

TINY = ModelConfig.from_json_file(profile_path("glm5-tiny") / "config.json")


def _expected_shapes(cfg: ModelConfig) -> dict:
    return dict(layout.all_tensor_shapes(cfg, mtp=True))


def _read_all(folder) -> dict[str, torch.Tensor]:
    wm = local_weight_map(folder)
    r = CheckpointReader(folder, wm)
    return {n: r.raw(n) for n in wm}


def test_init_random_writes_hub_layout(tmp_path):
    s = init_random("glm5-tiny", tmp_path, seed=1, max_shard_size="40KB")
    assert len(s.files) > 5 and s.files[0] == f"model-00001-of-{len(s.files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert sorted(set(index["weight_map"].values())) == s.files
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["num_hidden_layers"] == 3 and "quantization_config" not in cfg
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1] and gen["bos_token_id"] == 0
    tensors = _read_all(tmp_path)
    expected = _expected_shapes(TINY)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # the MTP block sits at layers.{num_hidden_layers}, with its own indexer and MoE, no head/embeddings
    assert "model.layers.3.eh_proj.weight" in tensors and "model.layers.3.self_attn.indexer.wk.weight" in tensors
    assert "model.layers.3.embed_tokens.weight" not in tensors and "model.layers.3.shared_head.head.weight" not in tensors
    assert "model.layers.1.self_attn.indexer.wk.weight" not in tensors  # glm5-tiny layer 1 is 'shared'
    # init values: unit norms, zero LayerNorm bias, fp32 nonzero routing bias, N(0, 0.02) matrices
    assert torch.all(tensors["model.norm.weight"] == 1)
    assert torch.all(tensors["model.layers.3.self_attn.indexer.k_norm.bias"] == 0)
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    w = tensors["model.layers.3.mlp.experts.0.up_proj.weight"]
    assert w.dtype == torch.float32 and 0.015 < w.std() < 0.025


def test_single_file_when_it_fits_and_determinism(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    init_random("glm5-tiny", a, seed=7, dtype="bf16")
    init_random("glm5-tiny", b, seed=7, dtype="bf16")
    init_random("glm5-tiny", c, seed=8, dtype="bf16")
    assert (a / "model.safetensors").is_file() and not (a / "model.safetensors.index.json").exists()
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ta, tb, tc = _read_all(a), _read_all(b), _read_all(c)
    assert all(torch.equal(ta[n], tb[n]) for n in ta)
    assert not torch.equal(ta["lm_head.weight"], tc["lm_head.weight"])
    assert ta["lm_head.weight"].dtype == torch.bfloat16


def test_layers_truncation_moves_mtp_and_keeps_first_layers(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    init_random("glm5-tiny", full, seed=3)
    init_random("glm5-tiny", cut, seed=3, layers=2)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 2
    tf, tc = _read_all(full), _read_all(cut)
    assert set(tc) == set(_expected_shapes(TINY.with_layers(2)))
    assert "model.layers.2.eh_proj.weight" in tc and "model.layers.3.eh_proj.weight" not in tc
    # per-tensor seeding: the truncated model's target layers are the full model's
    assert torch.equal(tf["model.layers.1.self_attn.q_b_proj.weight"], tc["model.layers.1.self_attn.q_b_proj.weight"])


def test_glm5_layers2_layout_is_small_enough():
    cfg = ModelConfig.from_json_file(profile_path("glm5") / "config.json").with_layers(2)
    shapes = _expected_shapes(cfg)
    assert sum(1 for n in shapes if n.startswith("model.layers.2.")) == 791
    params = sum(math.prod(s) for s in shapes.values())
    assert params * 2 < 30e9  # about 25 GB of bf16 streamed to disk, never held at once


def test_save_streams_shard_by_shard(tmp_path):
    t = torch.zeros(64, 64)  # 16 KiB each, one per shard
    made = []

    def gen():
        for i in range(5):
            # before making tensor i, the shards of tensors 0..i-2 must already be on disk
            assert len(list(tmp_path.glob(".partial-*.safetensors"))) >= max(0, i - 1)
            made.append(i)
            yield f"model.layers.0.mlp.experts.{i}.up_proj.weight", t.clone()

    s = save_checkpoint(gen(), TINY, tmp_path, max_shard_size=t.numel() * 4)
    assert len(s.files) == 5 and made == list(range(5))
    assert not list(tmp_path.glob(".partial-*"))


def test_force_replaces_stale_shards(tmp_path):
    out = tmp_path / "m"
    runner = CliRunner()
    assert runner.invoke(app, ["init-random", "glm5-tiny", str(out), "--max-shard-size", "40KB"]).exit_code == 0
    (out / "notes.txt").write_text("mine")
    r = runner.invoke(app, ["init-random", "glm5-tiny", str(out), "--force"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    with pytest.raises(ValueError, match="holds weights already"):  # the library never mixes shards
        init_random("glm5-tiny", out)


def _dequant_by_hand(w, s, b0, b1):
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = blk * s[i, j]
    return out


def test_dequant_matches_per_block_loop_with_partial_edges():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.1  # 300 = 128+128+44 rows, 200 = 128+72 cols
    assert torch.equal(fp8_block_dequant_ref(w, s, out_dtype=F32), _dequant_by_hand(w, s, 128, 128))
    assert torch.equal(fp8_block_dequant_ref(w, s[:, :1].repeat(1, 4), (128, 64), F32), _dequant_by_hand(w, s[:, :1].repeat(1, 4), 128, 64))
    with pytest.raises(ValueError):
        fp8_block_dequant_ref(w, s[:2])


def test_quantize_roundtrip_and_zero_block():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(260, 130, generator=g) * 0.02
    w[:128, :128] = 0
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    back = fp8_block_dequant_ref(q, s, out_dtype=F32)
    assert torch.all(back[:128, :128] == 0)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4, plus subnormal steps near zero
    assert torch.all((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9)
    assert math.isclose(s[2, 1].item(), w[256:, 128:].abs().max().item() / 448, rel_tol=1e-6)


def test_fp8_write_then_read_dequantizes(tmp_path):
    ref, q8 = tmp_path / "ref", tmp_path / "fp8"
    init_random("glm5-tiny", ref, seed=5, dtype="fp32")
    init_random("glm5-tiny", q8, seed=5, dtype="fp32", fp8=True, max_shard_size="64KB")
    cfg = json.loads((q8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    wm = local_weight_map(q8)
    r, rr = CheckpointReader(q8, wm), CheckpointReader(ref, local_weight_map(ref))
    for name, shape in _expected_shapes(TINY).items():
        quantized = layout.is_fp8_quantized(name, shape)
        assert (r.raw(name).dtype == torch.float8_e4m3fn) == quantized, name
        assert (name + "_scale_inv" in wm) == quantized, name
        orig, got = rr.get(name), r.get(name, torch.float32)
        if quantized:
            tol = orig.abs() * 2**-4 + r.raw(name + "_scale_inv").max() * 2**-9
            assert torch.all((got - orig).abs() <= tol), name
        else:
            assert torch.equal(got, orig), name
    for kept in ("model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.3.self_attn.indexer.weights_proj.weight"):
        assert r.raw(kept).dtype == torch.float32


def test_tokenizer_copy(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "unrelated.bin").write_text("x")
    init_random("glm5-tiny", tmp_path / "m", tokenizer=tok)
    assert (tmp_path / "m" / "tokenizer.json").is_file() and not (tmp_path / "m" / "unrelated.bin").exists()
    with pytest.raises(UserError, match="not found"):
        init_random("glm5-tiny", tmp_path / "m2", tokenizer=tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no tokenizer files"):
        init_random("glm5-tiny", tmp_path / "m3", tokenizer=tmp_path / "empty")
    assert not (tmp_path / "m3").exists()  # checked before anything is written


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("64KiB") == 65536 and parse_size("1000") == 1000
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("lots", "2XB", "0", "-1GB"):
        with pytest.raises(UserError):
            parse_size(bad)


def test_cli_init_random(tmp_path):
    runner = CliRunner()
    out = tmp_path / "m"
    r = runner.invoke(app, ["init-random", "glm5-tiny", str(out), "--fp8", "--max-shard-size", "64KB", "--seed", "2"])
    assert r.exit_code == 0, r.output
    assert "tensors" in r.output and (out / "model.safetensors.index.json").is_file()
    with safe_open(str(out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.0.self_attn.o_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.float8_e4m3fn
    for args in (["init-random", "glm5-tiny", str(out)],                      # exists, no --force
                 ["init-random", "no-such-profile", str(tmp_path / "x")],
                 ["init-random", "glm5-tiny", str(tmp_path / "y"), "--dtype", "int8"],
                 ["init-random", "glm5-tiny", str(tmp_path / "z"), "--layers", "9"],
                 ["init-random", "glm5-tiny", str(tmp_path / "w"), "--max-shard-size", "huge"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = runner.invoke(app, ["init-random", "glm5-tiny", str(out), "--force", "--layers", "1"])
    assert r.exit_code == 0 and (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()


def _one_line_error(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert needle in r.output, r.output


def test_quantize_never_writes_over_its_source(tmp_path):
    src = tmp_path / "src"
    init_random("glm5-tiny", src, seed=1)
    (src / "token_counts.json").write_text('{"ranking": []}')
    before = sorted((p.name, p.stat().st_size) for p in src.iterdir())
    runner = CliRunner()
    for out, relation in ((src, "is"), (tmp_path, "contains"), (src / "fp8", "is inside")):
        r = runner.invoke(app, ["quantize", str(src), str(out), "--force"])
        _one_line_error(r, f"OUT_DIR {out} {relation} the source checkpoint's folder")
    assert sorted((p.name, p.stat().st_size) for p in src.iterdir()) == before
    r = runner.invoke(app, ["quantize", str(src), str(tmp_path / "fp8")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "fp8" / "token_counts.json").read_text() == '{"ranking": []}'  # the counts come along
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "src"]


def test_quantize_of_a_profile_refuses_the_profile_folder(tmp_path):
    r = CliRunner().invoke(app, ["quantize", "glm5-nano", str(profile_path("glm5-nano")), "--force"])
    _one_line_error(r, "is the source checkpoint's folder")


@pytest.mark.parametrize("cmd", [["init-random", "glm5-tiny"], ["quantize", "glm5-nano"]])
def test_unwritable_out_dir_is_one_line_before_any_work(tmp_path, cmd):
    (tmp_path / "afile").write_text("x")
    _one_line_error(CliRunner().invoke(app, [*cmd, str(tmp_path / "afile" / "out")]), "is a file, not a folder")
    _one_line_error(CliRunner().invoke(app, [*cmd, "/proc/no-such/out"]), "cannot write there")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_ctrl_c_during_init_random_leaves_nothing_and_a_rerun_works(tmp_path):
    """A real SIGINT while the shards of a real-width layer are being written."""
    cfg = json.loads((profile_path("glm5") / "config.json").read_text())
    cfg.update(vocab_size=4096, eos_token_id=[1])  # GLM-5's widths; a small embedding so shards come at once
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5mtp_cli.cli", "init-random", str(tmp_path / "cfg"), str(out), "--layers", "1",
         "--dtype", "bf16", "--max-shard-size", "4MB"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell may ignore SIGINT
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.glm5mtp-partial-*/.partial-*.safetensors")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg"]
    said, *rest = err.strip().splitlines()  # the size it was writing, then what became of it
    assert said.startswith("init-random: writing ")
    assert rest == [f"interrupted: the unfinished output was removed; {out} is as it was"]
    r = CliRunner().invoke(app, ["init-random", "glm5-tiny", str(out)])  # no "already holds a checkpoint"
    assert r.exit_code == 0, r.output
