"""Corpus, tokenizer and `glm5mtp train` at a toy size (CPU, well under a minute)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.training import corpus
from glm5mtp_cli.training import tokenizer as tt
from glm5mtp_cli.cli import app
from glm5mtp_cli.errors import Interrupted
from glm5mtp_cli.models.glm5.config import ModelConfig

TOY = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16, "max_position_embeddings": 512,
    "eos_token_id": [0, 1], "bos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float32",
}
FILES = 12  # corpus slice for the toy run (first N files of each split)


def test_corpus_split_is_deterministic_and_disjoint():
    files = corpus.list_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(("/test/" in f"/{f}") or f.startswith(("idlelib/", "lib2to3/tests/", "site-packages/"))
                   for f in files)
    train = [f for f in files if corpus.split_of(f) == "train"]
    held = [f for f in files if corpus.split_of(f) == "heldout"]
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(files)
    assert 0.02 < len(held) / len(files) < 0.10
    assert [corpus.split_of(f) for f in files] == [corpus.split_of(f) for f in corpus.list_files()]
    a = list(corpus.iter_texts("heldout", max_files=3))
    assert a == list(corpus.iter_texts("heldout", max_files=3)) and all(a)


def test_corpus_packages_join_the_train_split_only():
    stdlib_train = [rel for rel, _ in corpus.iter_files("train", max_files=3)]
    with_pkg = [rel for rel, _ in corpus.iter_files("train", max_files=3, packages=("typer",))]
    assert with_pkg[:3] == stdlib_train and len(with_pkg) == 6
    assert all(rel.startswith("typer/") and rel.endswith(".py") for rel in with_pkg[3:])
    held = [rel for rel, _ in corpus.iter_files("heldout", max_files=3, packages=("typer",))]
    assert held == [rel for rel, _ in corpus.iter_files("heldout", max_files=3)]
    assert corpus.package_versions(("typer",))["typer"]
    with pytest.raises(ValueError, match="no installed package named 'no_such_pkg'"):
        list(corpus.iter_files("train", max_files=1, packages=("no_such_pkg",)))


def test_build_corpus_manifest(tmp_path):
    m1 = corpus.build_corpus(tmp_path / "a", max_files=5)
    m2 = corpus.build_corpus(tmp_path / "b", max_files=5)
    assert m1["sha256"] == m2["sha256"] and m1["python_minor"]
    assert m1["splits"]["train"]["files"] == 5 and m1["splits"]["heldout"]["files"] == 5
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == m1
    assert (tmp_path / "a" / "train.txt").read_text().count(corpus.EOS) == 4


def test_chat_samples_use_the_template_layout():
    src = 'def add(a, b):\n    """Add two numbers and return the sum."""\n    return a + b\n'
    (s,) = corpus.chat_samples_of(src)
    prompt = tt.apply_chat_template([{"role": "user", "content": "Write a Python function `add`: "
                                      "Add two numbers and return the sum."}])
    assert s.startswith(prompt) and s.endswith("return a + b" + corpus.EOS)


def test_tokenizer_round_trips(tmp_path):
    tok = tt.build_tokenizer(tmp_path, vocab_size=512, max_files=FILES)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(s) for s in tt.SPECIAL_TOKENS] == [0, 1, 2, 3]
    for text in ["def f(x):\n    return x ** 2  # héllo ✓ 你好\n", "\t\r\n  trailing  ", "",
                 next(corpus.iter_texts("heldout", max_files=1))]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    chat = tt.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat == "<|system|>\nbe brief<|user|>\nhi<|assistant|>\n"
    ids = tok.encode(chat).ids
    assert ids.count(tt.USER_ID) == 1 and ids.count(2) == 1 and ids.count(3) == 1
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and "chat_template" in cfg
    jinja2 = pytest.importorskip("jinja2")
    rendered = jinja2.Environment().from_string(cfg["chat_template"]).render(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True)
    assert rendered == chat


def test_train_toy_loss_goes_down_and_checkpoint_loads(tmp_path):
    config = tmp_path / "toy.json"
    config.write_text(json.dumps(TOY))
    out = tmp_path / "out"
    args = ["train", "--config", str(config), "--out", str(out), "--steps", "30", "--batch-size", "4",
            "--seq-len", "48", "--lr", "3e-3", "--corpus-files", str(FILES), "--cache-dir", str(tmp_path / "cache"),
            "--eval-every", "15", "--eval-tokens", "1024", "--device", "cpu", "--seed", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps_done"] == 30 and report["tokens_seen"] == 30 * 4 * 48
    first, final = report["history"][0], report["heldout"]
    # Held-out loss falls well below the uniform-prediction loss ln(512) = 6.24 and keeps falling.
    assert final["target_ce"] < 5.6 and final["target_ce"] < first["heldout"]["target_ce"] + 0.05
    assert final["mtp_ce"] < 5.9
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (out / f).is_file(), f
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 1]
    cfg = ModelConfig.from_json_file(out / "config.json")
    assert cfg.vocab_size == 512 and cfg.torch_dtype == "bfloat16"

    # A second run refuses to overwrite without --force.
    res2 = CliRunner().invoke(app, args)
    assert res2.exit_code == 2 and "--force" in res2.output

    try:
        from glm5mtp_cli.checkpoint.load import load_models
        from glm5mtp_cli.checkpoint.resolve import resolve_model
    except ImportError as e:  # pragma: no cover - the loader lands separately
        pytest.skip(f"glm5mtp_cli.checkpoint.load not available yet: {e}")
    target, mtp, extras = load_models(resolve_model(str(out), progress=False), dtype=torch.float32)
    assert extras == {}
    ids = torch.tensor([[5, 9, 17, 33, 40, 41]])
    with torch.no_grad():
        o = target(ids, [None])
        m = mtp(ids[:, 1:], o.hidden[:, :-1], [None], target.model.embed_tokens, target.lm_head)
    assert torch.isfinite(o.logits).all() and torch.isfinite(m.logits).all()
    bias = target.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # aux-loss-free balancing moved it


def test_mtp_only_trains_a_fresh_head_against_a_frozen_target(tmp_path):
    config = tmp_path / "toy.json"
    config.write_text(json.dumps(TOY))
    common = ["--batch-size", "2", "--seq-len", "32", "--corpus-files", str(FILES), "--cache-dir",
              str(tmp_path / "cache"), "--eval-tokens", "512", "--device", "cpu"]
    base = tmp_path / "base"
    res = CliRunner().invoke(app, ["train", "--config", str(config), "--out", str(base), "--steps", "4", *common])
    assert res.exit_code == 0, res.output
    out = tmp_path / "mtp"
    res = CliRunner().invoke(app, ["train", "--mtp-only", "--init", str(base), "--out", str(out), "--steps", "6",
                                   *common])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "train_report.json").read_text())
    assert report["mode"] == "mtp_only" and report["steps_done"] == 6
    from safetensors.torch import load_file

    a, b = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    assert torch.equal(a["model.layers.1.mlp.gate.weight"], b["model.layers.1.mlp.gate.weight"])  # target frozen
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert not torch.equal(a["model.layers.2.eh_proj.weight"], b["model.layers.2.eh_proj.weight"])  # MTP trained


def _toy_args(tmp_path, out, *extra):
    config = tmp_path / "toy.json"
    config.write_text(json.dumps(TOY))
    return ["train", "--config", str(config), "--out", str(out), "--batch-size", "2", "--seq-len", "32",
            "--corpus-files", str(FILES), "--cache-dir", str(tmp_path / "cache"), "--eval-tokens", "512",
            "--device", "cpu", *extra]


def test_an_unwritable_out_is_one_line_before_any_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(app, _toy_args(tmp_path, tmp_path / "afile" / "out", "--steps", "2"))
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--out" in res.output and "is a file, not a folder" in res.output
    assert not (tmp_path / "cache").exists()  # refused before the tokenizer or the corpus was touched


def test_an_interrupted_run_leaves_the_old_checkpoint_as_it_was(tmp_path):
    from glm5mtp_cli.training.options import TrainOptions
    from glm5mtp_cli.training.train import train

    out = tmp_path / "out"
    assert CliRunner().invoke(app, _toy_args(tmp_path, out, "--steps", "2")).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class Interrupt:  # Ctrl-C at step 2, as the progress bar hears of it
        def update(self, step, fields):
            if step == 2:
                raise KeyboardInterrupt

        def close(self):
            pass

    opts = TrainOptions(out=out, profile=str(tmp_path / "toy.json"), steps=4, batch_size=2, seq_len=32,
                        corpus_files=FILES, cache_dir=tmp_path / "cache", eval_tokens=512, device="cpu", force=True)
    with pytest.raises(Interrupted, match="is as it was"):
        train(opts, log=lambda m: None, progress_factory=lambda total: Interrupt())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "toy.json"]


def test_a_tokenizer_too_small_for_the_vocabulary_says_what_to_pass(tmp_path):
    config = tmp_path / "toy.json"
    config.write_text(json.dumps({**TOY, "vocab_size": 4096}))
    res = CliRunner().invoke(app, ["train", "--config", str(config), "--out", str(tmp_path / "out"), "--steps", "1",
                                   "--corpus-files", "2", "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"])
    error = res.output.strip().splitlines()[-1]  # after the run's log lines
    assert res.exit_code == 2 and res.output.count("error:") == 1 and error.startswith("error:"), res.output
    assert "the model's vocab_size is 4096" in error and "pass a larger --corpus-files" in error
    assert "--tokenizer" in error  # glm5-nano's shipped tokenizer has 4096 tokens
    assert not (tmp_path / "out").exists()


def test_cpu_runs_default_to_small_batches_unless_flags_say_otherwise(tmp_path):
    from glm5mtp_cli.training.options import CPU_DEFAULTS, TrainOptions

    section = {"batch_size": 16, "seq_len": 2048, "eval_tokens": 131072}  # glm5-nano's, sized for CUDA
    cuda, cpu, given = TrainOptions(out=tmp_path), TrainOptions(out=tmp_path), TrainOptions(out=tmp_path, seq_len=256)
    cuda.resolve(section)
    cpu.resolve(section, on_cpu=True)
    given.resolve(section, on_cpu=True)
    assert {k: cuda.hyper[k] for k in CPU_DEFAULTS} == section
    assert {k: cpu.hyper[k] for k in CPU_DEFAULTS} == CPU_DEFAULTS
    assert given.hyper["seq_len"] == 256 and given.hyper["batch_size"] == CPU_DEFAULTS["batch_size"]
