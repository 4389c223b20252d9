"""GLM-5-Next with FP8 weights resident (models/fp8.py, as GLM-5-FP8 in tests/test_fp8.py): init-random
--fp8 and quantize write exactly the official tensor choice (layout.fp8_quantized), the loader keeps
those tensors FP8 (Fp8Linear, Fp8Experts with the swiglu clamp), an FP8 checkpoint's logits equal its
fp32 twin's, greedy speculation equals gamma 0, predicted bytes equal loaded bytes, the commands run
on it, and under --tp 2 (gloo) its tokens equal tp 1's. CPU, fp32 activations."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
import rank_sections  # noqa: E402

from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.checkpoint.load import build_loaded  # noqa: E402
from glm5mtp_cli.checkpoint.random import RandomReader  # noqa: E402
from glm5mtp_cli.checkpoint.read import CheckpointReader  # noqa: E402
from glm5mtp_cli.checkpoint.resolve import config_from_spec, resolve_model  # noqa: E402
from glm5mtp_cli.checkpoint.write import init_random, rewrite_checkpoint  # noqa: E402
from glm5mtp_cli.cli import app  # noqa: E402
from glm5mtp_cli.diagnostics.sizing import checkpoint_tensor_bytes, predicted_weight_bytes  # noqa: E402
from glm5mtp_cli.engine import launch  # noqa: E402
from glm5mtp_cli.engine.cache import CachePools  # noqa: E402
from glm5mtp_cli.engine.run import run_generate  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime  # noqa: E402
from glm5mtp_cli.engine.sampling import SamplingParams  # noqa: E402
from glm5mtp_cli.errors import UserError  # noqa: E402
from glm5mtp_cli.core.families import family_of  # noqa: E402
from glm5mtp_cli.models.fp8 import FP8, Fp8Linear  # noqa: E402
from glm5mtp_cli.models.glm5.layers import Experts, Fp8Experts  # noqa: E402

PROMPTS = [[5, 17, 99, 4, 250, 31, 8], list(range(40, 60))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(FP8 glm5next-tiny folder, its fp32 twin): init-random --fp8, then quantize --dequantize."""
    src, twin = tmp_path_factory.mktemp("gn_fp8") / "q", tmp_path_factory.mktemp("gn_fp8_twin") / "t"
    r = CliRunner().invoke(app, ["init-random", "glm5next-tiny", str(src), "--fp8", "--dtype", "fp32", "--seed", "1"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["quantize", str(src), str(twin), "--dequantize"])
    assert r.exit_code == 0, r.output
    return str(src), str(twin)


def _rt(folder, dtype="fp32", comm=None):
    return load_runtime(ModelSpec(folder, "cpu", dtype), progress=False, comm=comm)


def _stored_fp8(folder) -> set[str]:
    resolved = resolve_model(folder, progress=False)
    reader = CheckpointReader(resolved.folder, resolved.weight_map)
    try:
        return {n for n in resolved.weight_map if reader.stored_fp8(n)}
    finally:
        reader.close()


def test_written_fp8_tensors_are_the_official_choice(tiny):
    cfg = config_from_spec(tiny[0])
    family = family_of(cfg)
    assert cfg.fp8 and cfg.fp8_block == (128, 128)
    want = {n for n, s in family.tensor_shapes(cfg) if family.is_fp8_quantized(cfg, n, s)}
    assert _stored_fp8(tiny[0]) == want
    layer = "model.language_model.layers."
    assert f"{layer}1.self_attn.o_proj.weight" in want and f"{layer}0.self_attn.o_proj.weight" not in want  # MLA, KDA
    assert f"{layer}0.mlp.gate_proj.weight" in want and f"{layer}3.mlp.experts.7.down_proj.weight" in want
    assert not any(n.startswith(f"{layer}{cfg.mtp_layer_index}.") or "kv_b_proj" in n or ".indexer." in n
                   or "hc_" in n for n in want)
    assert not _stored_fp8(tiny[1]) and not config_from_spec(tiny[1]).fp8  # the twin is plain fp32


def test_fp8_checkpoint_loads_as_fp8(tiny):
    rt = _rt(tiny[0])
    m = rt.target.model
    kda, mla = m.layers[0].self_attn, m.layers[1].self_attn
    for lin in (mla.q_a_proj, mla.q_b_proj, mla.kv_a_proj_with_mqa, mla.o_proj, m.layers[0].mlp.down_proj,
                m.layers[1].mlp.shared_experts.up_proj):
        assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8
    for lin in (kda.q_proj, kda.o_proj, mla.kv_b_proj, mla.indexer.wk, m.lm_head):
        assert type(lin) is torch.nn.Linear
    ex = m.layers[2].mlp.experts
    assert isinstance(ex, Fp8Experts) and ex.gate.dtype == FP8 and ex.swiglu_limit == 10.0
    assert type(rt.mtp.layer.mlp.experts) is Experts  # the MTP block stays unquantized
    held = sum(t.dtype == FP8 for mod in (rt.target, rt.mtp) for t in mod.state_dict().values())
    assert held == len(_stored_fp8(tiny[0]))  # every stored FP8 tensor is held FP8 (per-expert views counted)


def _logits(rt, ids):
    pools = CachePools.create(rt.cfg, 16, 4, torch.float32, rt.device)
    t = rt.target(ids, [pools.target_cache()])
    d = rt.mtp(ids[:, 1:], t.hidden_all[:, :-1], [pools.drafter_cache()], rt.target.model.embed_tokens,
               rt.target.lm_head)
    return t.logits, d.logits


def test_fp8_logits_equal_fp32_twin(tiny):
    """40 rows: 80 (token, expert) pairs, the looped MoE path; the decode below: the gathered one."""
    a, b = _rt(tiny[0]), _rt(tiny[1])
    ids = torch.randint(2, a.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    for x, y in zip(_logits(a, ids), _logits(b, ids)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
    one = [run_generate(rt, PROMPTS[:1], EngineConfig(gamma=0, max_new_tokens=8, sampling=SamplingParams(), batch_size=1, max_seq_len=64, alloc="budget", draft_conf_tau=None, eos_ids=(), graphs="eager"))[0][0].tokens
           for rt in (a, b)]
    assert one[0] == one[1]


@pytest.fixture(scope="module")
def nano_fp8(tmp_path_factory):
    """The trained glm5next-nano quantized to FP8: its drafter still gets accepted."""
    out = tmp_path_factory.mktemp("gn_nano_fp8") / "q"
    rewrite_checkpoint("glm5next-nano", out, fp8=True)
    return str(out)


def test_fp8_greedy_speculation_equals_gamma0(nano_fp8):
    rt = _rt(nano_fp8)
    prompts = [rt.tokenizer.encode("def binary_search(items, target):\n"), rt.tokenizer.encode("import os\n")]

    def run(gamma):
        res, acc, *_ = run_generate(rt, prompts, EngineConfig(gamma=gamma, max_new_tokens=20, sampling=SamplingParams(), batch_size=2, max_seq_len=128, alloc="budget", draft_conf_tau=None, eos_ids=(), graphs="eager"))
        return [r.tokens for r in res], acc

    base, _ = run(0)
    spec, acc = run(2)
    assert spec == base
    assert acc.mean_acceptance_length > 1.2  # drafts were accepted, not only rejected


def test_predicted_weight_bytes_equal_loaded(tiny):
    for folder in tiny:
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            rt = _rt(folder, dtype)
            assert sum(rt.weight_bytes().values()) == predicted_weight_bytes(rt.cfg, torch_dtype), (folder, dtype)
    # the checkpoint's bytes as `info` counts them: the FP8 bytes and scales written
    cfg = config_from_spec(tiny[0])
    on_disk = sum(os.path.getsize(os.path.join(tiny[0], f)) for f in os.listdir(tiny[0]) if f.endswith(".safetensors"))
    counted = sum(checkpoint_tensor_bytes(cfg, n, s) for n, s in family_of(cfg).tensor_shapes(cfg))
    assert 0 < on_disk - counted < 64 * 1024  # the safetensors header


def test_commands_on_an_fp8_folder(tiny):
    run = CliRunner().invoke
    loaded = sum(_rt(tiny[0]).weight_bytes().values())
    r = run(app, ["profile", "--model", tiny[0], "--predict-only", "--json", "--dtype", "fp32", "--max-seq-len", "64"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["weights_bytes_predicted"] == loaded
    r = run(app, ["generate", "--model", tiny[0], "--prompt-ids", "5,17,99,4", "--gamma", "2", "--max-new-tokens", "6",
                  "--ignore-eos", "--json", "--device", "cpu", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert sum(json.loads(r.stdout)["memory"]["weights_bytes"].values()) == loaded
    r = run(app, ["leak-check", "--model", tiny[0], "--sequences", "3", "--max-new-tokens", "4", "--max-seq-len", "64",
                  "--gamma", "2", "--device", "cpu", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["verdict"] == "clean", r.output
    r = run(app, ["info", tiny[0], "--json"])
    assert r.exit_code == 0 and "fp8" in json.loads(r.stdout)["checkpoint_dtype"], r.output


def test_random_fp8_reader_equals_init_random_fp8(tiny):
    """bench's --random-weights --fp8 (a RandomReader over an FP8 config) holds what init-random --fp8 writes."""
    cfg = config_from_spec(tiny[0])
    family = family_of(cfg)
    rand = build_loaded(lambda: family.build_target(cfg), RandomReader(cfg, seed=1), "", torch.float32,
                        keeps_fp32=family.keeps_fp32)
    disk = _rt(tiny[0]).target
    a, b = rand.state_dict(), disk.state_dict()
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n].float(), b[n].float()), n


def test_bench_random_fp8_target_step_counts_fp8():
    """bench --random-weights --fp8: the random target step holds FP8 trunk matrices and its floor
    counts them at 1 byte + block scales; the draft step (the bf16 nextn block) is unchanged."""
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.diagnostics.sizing import draft_step_bytes, target_step_bytes
    from glm5mtp_cli.models.fp8 import fp8_config

    r = CliRunner().invoke(app, ["bench", "--model", "glm5next-tiny", "--random-weights", "--fp8", "--draft-context",
                                 "32", "--target-layers", "4", "--device", "cpu", "--dtype", "bf16", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    plain = resolve_config("glm5next-tiny")[0]
    cfg = fp8_config(plain)
    assert d["fp8_weights"] and d["target_step"]["bytes"] == target_step_bytes(cfg, 2, 32)
    assert d["target_step"]["bytes"]["layer_weights"] < 0.85 * target_step_bytes(plain, 2, 32)["layer_weights"]
    assert d["draft_step"]["bytes"] == draft_step_bytes(cfg, 2, 32) == draft_step_bytes(plain, 2, 32)


def test_quantize_refuses_an_fp8_source(tiny, tmp_path):
    with pytest.raises(UserError, match="already FP8"):
        rewrite_checkpoint(tiny[0], tmp_path / "again", fp8=True)


# ---- --tp 2 (gloo): FP8 weights and their scales sliced together ----------------------------------------

def _tp_config():
    """glm5next-tiny widened so every FP8 split falls on 128-wide scale blocks at tp 2: 2 MLA heads of
    q/v 128 (q_b rows and o_proj columns 128 a rank), dense MLP and shared expert inner 256."""
    return dataclasses.replace(config_from_spec("glm5next-tiny"), hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=2, q_lora_rank=128, qk_nope_head_dim=128, v_head_dim=128,
                               intermediate_size=256, moe_intermediate_size=128, n_shared_experts=2)


def _generate(rt, gamma, prompts=PROMPTS, graphs="eager", batch=1, device="cpu"):
    from glm5mtp_cli.engine.runtime import make_engine
    from glm5mtp_cli.engine.sequence import Request

    pools = rt.make_pools(96, len(prompts), block_size=4)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=96, eos_ids=(), check_invariants=True, graphs=graphs))
    res = engine.generate([Request(p, 10, i) for i, p in enumerate(prompts)], batch_size=batch)
    engine.close()
    assert not any(pools.blocks_held().values())
    return [r.tokens for r in res]


def _section_tokens(comm, folder):
    """tp 1 at gamma 0 (rank 0's reference) against tp 2 at gamma 2, eager and in the static forwards
    (the CUDA graphs' path, collectives inside) over 2 slots, the third prompt re-occupying one."""
    rt1, rt2 = _rt(folder), _rt(folder, comm=comm)
    q_b = rt2.target.model.layers[1].self_attn.q_b_proj
    three = PROMPTS + [[9, 8, 7, 6, 5]]
    return {"q_b": [type(q_b).__name__, *q_b.weight.shape, *q_b.weight_scale_inv.shape],
            "experts": type(rt2.target.model.layers[1].mlp.experts).__name__,
            "tp1_gamma0": _generate(rt1, 0, three), "tp2_gamma2": _generate(rt2, 2, three),
            "tp2_static": _generate(rt2, 2, three, "static", 2)}


def _rank_main(folder: str, out_dir: str) -> None:
    comm = launch.rank_comm(2, "cpu")
    report = {}
    try:
        report["tokens"] = _section_tokens(comm, folder)
    except Exception:
        report["tokens"] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gn_fp8_tp") / "q"
    init_random(_tp_config(), folder, seed=2, dtype=torch.float32, fp8=True)
    return rank_sections.spawn(_rank_main, str(folder), tmp_path_factory.mktemp("gn_fp8_tp_group"))


def test_tp2_fp8_tokens_equal_tp1(tp_group):
    d = rank_sections.section(tp_group, "tokens")
    assert d["q_b"] == ["Fp8Linear", 128, 128, 1, 1] and d["experts"] == "Fp8Experts"  # one head, one block row
    assert d["tp2_gamma2"] == d["tp1_gamma0"] and d["tp2_static"] == d["tp1_gamma0"]


# ---- CUDA (H200): the Triton FP8 GEMM and the clamped FP8 MoE kernel, in CUDA graphs ----------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_equals_cpu_and_graphs_equal_eager(nano_fp8):
    """fp32 activations: the CUDA FP8 kernels' logits equal the CPU path's (which equals the fp32 twin)
    to 1e-4 of the largest logit; greedy tokens in CUDA graphs equal eager ones, gamma 2 equals gamma 0."""
    gpu, cpu = load_runtime(ModelSpec(nano_fp8, "cuda", "fp32"), progress=False), _rt(nano_fp8)
    ids = torch.tensor([gpu.tokenizer.encode("def binary_search(items, target):\n    lo, hi = 0, len(items)\n")])
    for want, got in zip(_logits(cpu, ids), _logits(gpu, ids.cuda())):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    prompts = [gpu.tokenizer.encode(t) for t in ("def binary_search(items, target):\n", "import os\n", "x")]
    base = _generate(gpu, 0, prompts, device="cuda")
    for gamma in (0, 2):
        assert _generate(gpu, gamma, prompts, "cuda", 2, device="cuda") == base, gamma
