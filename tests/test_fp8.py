"""FP8 weights stay FP8 (models/fp8.py): what is loaded, its bytes, and that it computes what the
checkpoint means: an FP8 checkpoint's logits equal those of its fp32 twin (the same weights
dequantized), and greedy speculation on it equals gamma 0. CPU; tests/test_fp8_cuda.py has the
H200 half."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.checkpoint.load import build_loaded, load_models
from glm5mtp_cli.checkpoint.random import RandomReader
from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import config_from_spec, resolve_model
from glm5mtp_cli.checkpoint.write import init_random, rewrite_checkpoint
from glm5mtp_cli.models.fp8 import FP8_QUANT_CONFIG
from glm5mtp_cli.diagnostics.sizing import predicted_weight_bytes
from glm5mtp_cli.core.parallel import Comm
from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.engine.runtime import Runtime, module_bytes
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models import fp8
from glm5mtp_cli.models.fp8 import Fp8Linear
from glm5mtp_cli.models.glm5.layers import MLP, Experts, Fp8Experts, Router

F8 = torch.float8_e4m3fn


def _runtime(folder, dtype=torch.float32) -> Runtime:
    resolved = resolve_model(str(folder), progress=False)
    target, mtp, _ = load_models(resolved, "cpu", dtype)
    return Runtime(resolved, resolved.config, target.eval(), mtp.eval(), None, torch.device("cpu"), dtype)


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """(FP8 glm5-tiny folder, its fp32 twin's folder): init-random --fp8, then quantize --dequantize."""
    src, twin = tmp_path_factory.mktemp("tiny_fp8"), tmp_path_factory.mktemp("tiny_twin")
    init_random("glm5-tiny", src, seed=1, dtype=torch.float32, fp8=True)
    rewrite_checkpoint(str(src), twin, fp8=False)
    return src, twin


@pytest.fixture(scope="module")
def nano_fp8(tmp_path_factory):
    """(glm5-nano quantized to FP8, its fp32 twin): trained weights, so drafts get accepted."""
    q, twin = tmp_path_factory.mktemp("nano_fp8"), tmp_path_factory.mktemp("nano_twin")
    rewrite_checkpoint("glm5-nano", q, fp8=True)
    rewrite_checkpoint(str(q), twin, fp8=False)
    return q, twin


def test_fp8_checkpoint_loads_as_fp8(tiny_fp8):
    rt = _runtime(tiny_fp8[0])
    layer = rt.target.model.layers[0]  # a full (indexer) dense layer
    attn = layer.self_attn
    for lin in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj,
                attn.indexer.wq_b, attn.indexer.wk, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert isinstance(lin, Fp8Linear) and lin.weight.dtype == F8 and lin.weight_scale_inv.dtype == torch.float32
    # stored unquantized: indexer weighting, routers, norms, MTP glue, embeddings and head
    assert attn.indexer.weights_proj.weight.dtype == torch.float32
    moe = rt.target.model.layers[1].mlp
    assert isinstance(moe.experts, Fp8Experts) and moe.experts.gate.dtype == F8
    assert isinstance(moe.shared_experts.up_proj, Fp8Linear) and isinstance(moe.gate, Router)
    assert isinstance(rt.mtp.block.mlp.experts, Fp8Experts) and isinstance(rt.mtp.block.self_attn.q_b_proj, Fp8Linear)
    assert type(rt.mtp.eh_proj) is torch.nn.Linear and type(rt.target.lm_head) is torch.nn.Linear
    # no dequantized copy anywhere: every float tensor the model holds is a norm, router, glue or embedding
    for m in (rt.target, rt.mtp):
        for name, p in m.named_parameters():
            assert p.dim() == 1 or name.endswith(("weights_proj.weight", "mlp.gate.weight", "eh_proj.weight",
                                                  "embed_tokens.weight", "lm_head.weight")), name
    twin = _runtime(tiny_fp8[1])
    assert type(twin.target.model.layers[1].mlp.experts) is Experts  # the twin is plain fp32


@pytest.mark.parametrize("which", ["tiny", "nano"])
def test_fp8_logits_equal_fp32_twin(tiny_fp8, nano_fp8, which):
    """CPU, fp32 activations: the FP8 run dequantizes exactly the twin's weights (equal to 1e-5)."""
    src, twin = tiny_fp8 if which == "tiny" else nano_fp8
    a, b = _runtime(src), _runtime(twin)
    torch.manual_seed(0)
    ids = torch.randint(2, a.cfg.vocab_size, (2, 40))  # 80 (token, expert) pairs and more: the looped MoE path
    out_a, out_b = a.target(ids, [None, None]), b.target(ids, [None, None])
    torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-5, atol=1e-5 * out_b.logits.abs().max().item())
    emb, head = a.target.model.embed_tokens, a.target.lm_head
    d_a = a.mtp(ids[:, 1:2], out_a.hidden[:, :1], [None, None], emb, head)  # one row: the gathered MoE path
    d_b = b.mtp(ids[:, 1:2], out_b.hidden[:, :1], [None, None], b.target.model.embed_tokens, b.target.lm_head)
    torch.testing.assert_close(d_a.logits, d_b.logits, rtol=1e-5, atol=1e-5 * d_b.logits.abs().max().item())


def test_fp8_greedy_speculation_equals_gamma0(nano_fp8):
    rt = _runtime(nano_fp8[0])
    prompts = [[5, 17, 99, 300, 12, 7], [40, 41, 42, 43]]

    def run(gamma):
        res, acc, *_ = run_generate(rt, prompts, EngineConfig(gamma=gamma, max_new_tokens=24, sampling=SamplingParams(), batch_size=2, max_seq_len=256, alloc="budget", draft_conf_tau=None, eos_ids=(), graphs="eager"))
        return [r.tokens for r in res], acc

    base, _ = run(0)
    spec, acc = run(3)
    assert spec == base
    assert acc.mean_acceptance_length > 1.2  # drafts were accepted, not only rejected


def test_fp8_predicted_weight_bytes_equal_loaded(tiny_fp8):
    rt = _runtime(tiny_fp8[0])
    loaded = sum(rt.weight_bytes().values())
    assert loaded == predicted_weight_bytes(rt.cfg, torch.float32)
    twin = _runtime(tiny_fp8[1])
    assert sum(twin.weight_bytes().values()) == predicted_weight_bytes(twin.cfg, torch.float32)
    assert loaded < 0.5 * sum(twin.weight_bytes().values())
    # bf16 activations: the FP8 bytes do not change, the rest halves
    rt16 = _runtime(tiny_fp8[0], torch.bfloat16)
    assert sum(rt16.weight_bytes().values()) == predicted_weight_bytes(rt.cfg, torch.bfloat16) < loaded


def test_profile_predict_only_counts_fp8(tiny_fp8):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    r = CliRunner().invoke(app, ["profile", "--model", str(tiny_fp8[0]), "--predict-only", "--json",
                                 "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["weights_bytes_predicted"] == sum(_runtime(tiny_fp8[0]).weight_bytes().values())


def test_random_fp8_reader_equals_init_random_fp8(tiny_fp8):
    """--random-weights of an FP8 config builds FP8 modules holding what init-random --fp8 writes."""
    cfg = config_from_spec(str(tiny_fp8[0]))
    family = family_of(cfg)
    rand = build_loaded(lambda: family.build_target(cfg), RandomReader(cfg, seed=1), "", torch.float32,
                        keeps_fp32=family.keeps_fp32)
    disk = _runtime(tiny_fp8[0]).target
    for (n, a), (_, b) in zip(sorted(rand.state_dict().items()), sorted(disk.state_dict().items())):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), n


def test_fp8_linear_cpu_chunks(monkeypatch):
    """The CPU path dequantizes whole 16-row blocks a chunk at a time: same result as all at once."""
    torch.manual_seed(0)
    w = (torch.randn(70, 40) * 40).clamp(-448, 448).to(F8)
    s = torch.rand(5, 3) * 0.02 + 0.001
    x = torch.randn(3, 40)
    whole = fp8.fp8_linear(x, w, s, 16)
    monkeypatch.setattr(fp8, "CPU_CHUNK_BYTES", 16 * 40 * 4 * 2)  # two blocks of rows per chunk
    chunked = fp8.fp8_linear(x, w, s, 16)
    from kernels.fp8_block import fp8_block_matmul_ref

    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole, fp8_block_matmul_ref(x, w, s, 16), rtol=1e-5, atol=1e-5)


# ---- tensor parallel: FP8 weights and their scales sliced together -------------------------------------

def _tp_config(tmp_path):
    """glm5-tiny widened so every split falls on 128-wide blocks at tp 2: 4 heads of q 64+64, kv 64+64,
    v 64 (2 heads per rank: 256, 256 and 128 rows/columns), dense and shared inner 256."""
    cfg = dataclasses.replace(config_from_spec("glm5-tiny"), hidden_size=128, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                              qk_rope_head_dim=64, v_head_dim=64, intermediate_size=256, moe_intermediate_size=128,
                              n_shared_experts=2, n_routed_experts=4, index_head_dim=64)
    init_random(cfg, tmp_path, seed=3, dtype=torch.float32, fp8=True)
    return resolve_model(str(tmp_path), progress=False)


def test_tp_slices_fp8_weights_with_their_scales(tmp_path):
    resolved = _tp_config(tmp_path)
    cfg, family = resolved.config, family_of(resolved.config)
    full = _runtime(tmp_path).target
    reader = CheckpointReader(resolved.folder, resolved.weight_map)
    for rank in (0, 1):
        comm = Comm(rank, 2)
        part = build_loaded(lambda: family.build_target(cfg), reader, "", torch.float32,
                            keeps_fp32=family.keeps_fp32, shard=lambda m: family.shard_target(m, comm))
        for name in ("self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.gate_proj"):
            a, b = part.model.layers[0].get_submodule(name), full.model.layers[0].get_submodule(name)
            rows = b.weight.shape[0] // 2
            assert isinstance(a, Fp8Linear)
            assert torch.equal(a.weight.view(torch.uint8), b.weight[rank * rows:(rank + 1) * rows].view(torch.uint8))
            assert torch.equal(a.weight_scale_inv, b.weight_scale_inv[rank * rows // 128:(rank + 1) * rows // 128])
        a, b = part.model.layers[0].self_attn.o_proj, full.model.layers[0].self_attn.o_proj  # row parallel: columns
        cols = b.weight.shape[1] // 2
        assert torch.equal(a.weight.view(torch.uint8), b.weight[:, rank * cols:(rank + 1) * cols].view(torch.uint8))
        assert torch.equal(a.weight_scale_inv, b.weight_scale_inv[:, rank * cols // 128:(rank + 1) * cols // 128])
        ex = part.model.layers[1].mlp.experts
        assert isinstance(ex, Fp8Experts) and ex.n_experts == 2
        assert torch.equal(ex.down_scale_inv, full.model.layers[1].mlp.experts.down_scale_inv[2 * rank:2 * rank + 2])


def test_tp_slice_cutting_a_scale_block_is_refused(tiny_fp8):
    """glm5-tiny's q_b_proj has 96 rows: half of them is not a 128-block boundary."""
    resolved = resolve_model(str(tiny_fp8[0]), progress=False)
    cfg, family = resolved.config, family_of(resolved.config)
    reader = CheckpointReader(resolved.folder, resolved.weight_map)
    with pytest.raises(UserError, match="does not fall on the 128-wide scale blocks"):
        build_loaded(lambda: family.build_target(cfg), reader, "", torch.float32, keeps_fp32=family.keeps_fp32,
                     shard=lambda m: family.shard_target(m, Comm(1, 2)))


def test_quantize_command_refuses_fp8_source(tiny_fp8, tmp_path):
    with pytest.raises(UserError, match="already FP8"):
        rewrite_checkpoint(str(tiny_fp8[0]), tmp_path / "again", fp8=True)
    assert dict(FP8_QUANT_CONFIG)["weight_block_size"] == [128, 128]


# ---- random FP8 weights on the device (the 8-GPU run has no checkpoint to read) -----------------------

def test_generate_and_leak_check_on_random_fp8_weights(tmp_path):
    """generate/leak-check --random-weights --fp8 build what init-random --fp8 writes (same seed),
    kept FP8: the same tokens as that checkpoint's, and every allocation comes back."""
    import json

    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    init_random("glm5-tiny", tmp_path, seed=0, dtype=torch.float32, fp8=True)
    args = ["generate", "--prompt-ids", "5,17,99,3", "--gamma", "2", "--max-new-tokens", "8", "--device", "cpu",
            "--dtype", "fp32", "--json"]
    runs = [CliRunner().invoke(app, [*args, "--model", m, *extra])
            for m, extra in (("glm5-tiny", ["--random-weights", "--fp8"]), (str(tmp_path), []))]
    docs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert docs[0]["requests"][0]["tokens"] == docs[1]["requests"][0]["tokens"]
    assert docs[0]["memory"]["weights_bytes"] == docs[1]["memory"]["weights_bytes"]
    r = CliRunner().invoke(app, ["leak-check", "--model", "glm5-tiny", "--random-weights", "--fp8", "--device", "cpu",
                                 "--sequences", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["verdict"] == "clean"


@pytest.mark.parametrize("cmd", ["generate", "leak-check", "bench"])
def test_fp8_without_random_weights_is_one_line(cmd):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    extra = ["--prompt-ids", "5,6"] if cmd == "generate" else []
    r = CliRunner().invoke(app, [cmd, "--model", "glm5-tiny", "--device", "cpu", "--fp8", *extra])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--fp8 makes random FP8 weights" in lines[0], r.output


def _tiny_fp8_block(block: int):
    cfg = config_from_spec("glm5-tiny")
    return dataclasses.replace(cfg, quantization_config={**FP8_QUANT_CONFIG, "weight_block_size": [block, block]})


def _joined_groups(*modules):
    """(submodule, its joined buffer, its projections) of every group the loader joined."""
    return [(sub, sub._buffers[f"joined_{g}_weight"], linears) for m in modules for sub in m.modules()
            if hasattr(sub, "joined_groups") for g, linears in sub.joined_groups().items()
            if f"joined_{g}_weight" in sub._buffers]


def test_projections_of_one_input_share_one_matrix(monkeypatch):
    """FP8 projections of one input (each but the last ending on a scale block: 16-blocks on
    glm5-tiny) are loaded into one matrix (models/fp8.join_inputs) that one GEMM reads on the kernels'
    path: the attention's q_a / indexer wk / kv_a and q_b / indexer wq_b, every MLP's gate / up. The
    same logits as each projection by itself, no byte held twice, the checkpoint's names kept."""
    from kernels._triton import kernel_path

    cfg = _tiny_fp8_block(16)
    family = family_of(cfg)
    target = build_loaded(lambda: family.build_target(cfg), RandomReader(cfg), "", torch.float32, "cpu",
                          family.keeps_fp32).eval()
    mtp = build_loaded(lambda: family.build_mtp(cfg), RandomReader(cfg), family.mtp_prefix(cfg), torch.float32,
                       "cpu", family.keeps_fp32).eval()
    groups = _joined_groups(target, mtp)
    attn = [layer.self_attn for layer in target.model.layers] + [mtp.block.self_attn]
    assert {(id(sub), len(linears)) for sub, _, linears in groups} >= {(id(a), 3 if a.indexer is not None else 2)
                                                                       for a in attn}
    mlps = [m for m in list(target.modules()) + list(mtp.modules()) if isinstance(m, MLP)]  # dense, and shared experts
    # every attention's x group, the q_resid group where an indexer shares it, every MLP's gate / up
    assert len(groups) == sum(1 + (a.indexer is not None) for a in attn) + len(mlps) and mlps
    for sub, weight, linears in groups:
        assert weight.shape[0] == sum(m.out_features for m in linears)
        for m in linears:  # views of the joined matrix, not copies
            assert m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert not any("joined_" in k for k in list(target.state_dict()) + list(mtp.state_dict()))
    assert module_bytes(target) + module_bytes(mtp) == predicted_weight_bytes(cfg, torch.float32)

    read = []
    real = fp8.fp8_block_matmul
    monkeypatch.setattr(fp8, "fp8_block_matmul", lambda x, w, *a: read.append(w.data_ptr()) or real(x, w, *a))
    ids = torch.randint(2, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        with kernel_path("all"):
            together = target(ids, [None, None]).logits
        alone = target(ids, [None, None]).logits  # the CPU's own path: each Fp8Linear by itself
    target_groups = _joined_groups(target)
    assert {w.data_ptr() for _, w, _ in target_groups} <= set(read)  # every joined matrix read as one
    assert not {m.weight.data_ptr() for _, _, linears in target_groups for m in linears[1:]} & set(read)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


def test_projections_loaded_in_the_model_dtype_share_one_matrix(monkeypatch):
    """Without FP8 the loader joins the same groups after loading (models/fp8.join_loaded): GLM-5-Next's
    KDA layers read q, k, v, f_a, g_a and beta's projection as one GEMM on the kernels' path and their
    three conv weights as one tensor. Views, no joined name in the state_dict, and the same logits as
    each projection by itself."""
    from kernels._triton import kernel_path

    from glm5mtp_cli.engine.config import ModelSpec
    from glm5mtp_cli.engine.runtime import load_runtime
    from glm5mtp_cli.models.glm5_next.kda import KdaLayer

    rt = load_runtime(ModelSpec("glm5next-nano", "cpu", "fp32"), progress=False)
    kda = [m for m in rt.target.modules() if isinstance(m, KdaLayer)]
    groups = _joined_groups(rt.target)
    assert kda and {(id(sub), n) for sub in kda for n in sub._buffers if n.startswith("joined_")} == {
        (id(sub), f"joined_{g}_weight") for sub in kda for g in ("a", "conv")}
    for sub, weight, mods in groups:
        assert weight.dtype == torch.float32 and weight.shape[0] == sum(m.weight.shape[0] for m in mods)
        for m in mods:
            assert m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert not any("joined_" in k for k in rt.target.state_dict())

    gemms = []
    real = fp8.F.linear
    monkeypatch.setattr(fp8.F, "linear", lambda x, w, *a: gemms.append((w.data_ptr(), w.shape)) or real(x, w, *a))
    pools = rt.make_pools(32, 2)
    ids = torch.randint(2, rt.cfg.vocab_size, (2, 9))

    def logits():
        caches = [pools.target_cache() for _ in range(2)]
        for c in caches:
            c.reserve(9)
        out = rt.target(ids, caches).logits
        for c in caches:
            c.release()
        return out

    joined = {(w.data_ptr(), w.shape) for w in (sub._buffers["joined_a_weight"] for sub in kda)}
    alone = logits()  # the CPU's own path: each projection by itself
    assert not joined & set(gemms)
    with kernel_path("all"):
        together = logits()
    assert joined <= set(gemms)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


def test_projections_ending_inside_a_scale_block_stay_apart():
    cfg = _tiny_fp8_block(128)  # q_a's 48 rows end inside the first 128-row block
    family = family_of(cfg)
    target = build_loaded(lambda: family.build_target(cfg), RandomReader(cfg), "", torch.float32, "cpu",
                          family.keeps_fp32)
    assert not any("joined_x_weight" in layer.self_attn._buffers for layer in target.model.layers)
