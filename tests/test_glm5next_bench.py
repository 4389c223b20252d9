"""GLM-5-Next in `bench --random-weights` (one draft step, one truncated target step, their floors)
and in `profile --predict-only --tp N` (weights, state and concurrency per GPU, bf16 and FP8)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.resolve import profile_path, resolve_config
from glm5mtp_cli.cli import app
from glm5mtp_cli.diagnostics.profile import ProfileConfig, policy_tokens
from glm5mtp_cli.diagnostics.sizing import (checkpoint_tensor_bytes, draft_step_bytes,
                                            target_step_bytes, weight_bytes_per_rank)
from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.core.parallel import check_tp
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models.glm5_next import layout


def _cfg(name):
    return resolve_config(name)[0]


def _module_bytes(module, cfg, skip=()) -> int:
    """Parameter and buffer bytes of a built module as a batch-1 token reads them: of the stacked
    routed experts only top-k of E. A storage counts once: a joined group's buffer (fp8.join_loaded)
    comes first and holds the bytes its projections' weights view."""
    total, seen = 0, set()
    for name, p in (*module.named_buffers(), *module.named_parameters()):
        storage = p.untyped_storage().data_ptr()
        if name.startswith(skip) or storage in seen:
            continue
        seen.add(storage)
        n = p.numel() * p.element_size()
        total += n * cfg.num_experts_per_tok // cfg.n_routed_experts if ".mlp.experts." in name else n
    return total


# ---- bench --------------------------------------------------------------------------------------


def test_the_transformers_baseline_is_quiet():
    """transformers' GLM-5-Next logs a 235-character line per kernel its first forward runs in the
    reference implementation (causal_conv1d, flash-linear-attention: CUDA packages); bench keeps
    them off the terminal as it keeps the load report (a fresh process: transformers says each once)."""
    pytest.importorskip("transformers", minversion="5.24")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", "bench", "--model", "glm5next-nano", "--gammas", "0",
                        "--batch-sizes", "1", "--num-prompts", "1", "--max-new-tokens", "4", "--repeats", "1",
                        "--device", "cpu", "--threads", "1", "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "transformers" in [row["system"] for row in json.loads(r.stdout)["rows"]]
    assert "falling back" not in r.stderr and "[transformers]" not in r.stderr, r.stderr

def test_bench_random_weights_tiny_cpu():
    r = CliRunner().invoke(app, ["bench", "--model", "glm5next-tiny", "--random-weights", "--draft-context", "32",
                                 "--draft-vocab-sizes", "0,64", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["rows"] == [] and doc["graphs"] == "eager"
    full, sub = doc["draft_steps"]
    assert sub["bytes"]["lm_head"] == full["bytes"]["lm_head"] * 64 // 256
    t = doc["target_step"]
    assert t["layers"] == 4 and t["timing"] == "eager" and t["context"] == 32  # default: 4 layers
    for step in (full, t):
        assert step["step_ms"] > 0 and step["floor_ms"] is None and step["ratio_to_floor"] is None  # CPU
        assert step["bytes"]["total"] == sum(v for k, v in step["bytes"].items() if k != "total")
    cfg = _cfg("glm5next-tiny")
    assert t["bytes"] == target_step_bytes(cfg, 4, 32) and full["bytes"] == draft_step_bytes(cfg, 4, 32)


def test_target_layers_must_hold_kda_and_mla():
    # glm5next-tiny is KDA, MLA, KDA, MLA: its first layer alone has no indexed MLA layer
    r = CliRunner().invoke(app, ["bench", "--model", "glm5next-tiny", "--random-weights", "--target-layers", "1",
                                 "--device", "cpu"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "target_mla" in r.output and "more layers" in r.output
    r = CliRunner().invoke(app, ["bench", "--model", "glm5next-tiny", "--random-weights", "--target-layers", "5",
                                 "--device", "cpu"])
    assert r.exit_code != 0 and "1..4" in r.output


def test_step_floors_are_the_built_modules_weights():
    """The floors' weight terms equal what the built modules hold (experts at top-k of E), their KDA
    term the engine pools' slot bytes read and written, their cache term the rows a query reads."""
    from glm5mtp_cli.diagnostics.step_bench import random_drafter, random_target

    cfg = _cfg("glm5next-tiny")
    dt, dev = torch.bfloat16, torch.device("cpu")
    mtp, embed, head = random_drafter(cfg, dev, dt)
    b = draft_step_bytes(cfg, 2, context=64)
    assert b["mtp_weights"] == _module_bytes(mtp, cfg)
    assert b["lm_head"] == head.weight.numel() * 2 and b["embed_row"] == cfg.hidden_size * 2
    # 64 rows, pool 4, top-k 8 tokens: 16 pooled keys, no tail, 8 latent rows
    assert b["cache"] == (16 * cfg.index_head_dim + 8 * cfg.kv_lora_rank) * 2
    assert draft_step_bytes(cfg, 2, context=6)["cache"] == (1 * 16 + 2 * 2 * 16 + 6 * 32) * 2  # all 6 latents
    target = random_target(cfg, 4, dev, dt)
    t = target_step_bytes(target.cfg, 2, context=64)
    assert t["layer_weights"] == _module_bytes(target, cfg, skip=("model.embed_tokens.", "model.norm.", "model.lm_head."))
    assert t["embed_norm_head"] == (2 * cfg.hidden_size + cfg.vocab_size * cfg.hidden_size) * 2
    pools = CachePools.create(cfg, 4, 16, dt, dev, with_drafter=False)
    cache = pools.target_cache()
    cache.reserve(1)
    held = cache.bytes_held()
    assert t["kda_state"] == 2 * (held["kda"] + held["conv"])
    assert t["cache"] == 2 * b["cache"]  # two indexed layers, each read like the MTP layer's


# ---- profile --predict-only --tp -----------------------------------------------------------------

def _held_extra(cfg, names_shapes) -> int:
    """Bytes the model adds over the bf16 checkpoint by holding some tensors in fp32 (2 per value)."""
    fam = family_of(cfg)
    return sum(2 * math.prod(s) for n, s in names_shapes if fam.keeps_fp32(n) and not fam.stored_fp32(n))


def test_tp1_weights_are_the_checkpoint_bytes():
    """At tp 1 the per-GPU weights are the checkpoint's tensor bytes (published config, bf16) plus
    the fp32 copies of what the model keeps in fp32; the checkpoint formula matches a real file."""
    import struct

    cfg = _cfg("glm5next")
    shapes = family_of(cfg).tensor_shapes(cfg)
    ckpt = sum(checkpoint_tensor_bytes(cfg, n, s) for n, s in shapes)
    assert abs(ckpt / 2 / 1e9 - (312.69 + 0.63 + 7.43)) < 0.1  # REFERENCE-glm5next section 1's counts, bf16
    w = weight_bytes_per_rank(cfg, 1, "bf16")
    assert w["total"] == ckpt + _held_extra(cfg, shapes)
    nano = _cfg("glm5next-nano")  # a bf16 checkpoint on disk: its header's bytes are the formula's
    with open(profile_path("glm5next-nano") / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    on_disk = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    nano_shapes = family_of(nano).tensor_shapes(nano)
    assert on_disk == sum(checkpoint_tensor_bytes(nano, n, s) for n, s in nano_shapes)
    assert weight_bytes_per_rank(nano, 1, "bf16")["total"] == on_disk + _held_extra(nano, nano_shapes)


def _replicated_bf16(cfg) -> int:
    """What every rank holds whole, from the dimensions (bytes as held: mHC and routers fp32)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    q, r, di, hi, hd = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_n_heads, cfg.linear_head_dim
    layers = cfg.num_hidden_layers
    mla = len(cfg.indexed_layers) + 1  # and the MTP layer's
    moe = sum(cfg.is_moe(i) for i in range(layers)) + 1
    per_layer = 2 * d * 2 + 2 * ((2 + n) * n * n * d + (2 + n) * n + 3) * 4  # norms, mHC
    kda = 2 * hd * d * 2 + hd * 4  # f_a, g_a, o_norm
    attn = ((q + r) * d + q + r) * 2  # q_a, kv_a and their norms
    indexer = (hi * di * q + di * d + 2 * di + hi * d + cfg.index_kpool * di + di * d) * 2
    router = cfg.n_routed_experts * d * 4 + cfg.n_routed_experts * 4
    mtp = (2 * d * d + 5 * d) * 2  # eh_proj, enorm, hnorm, shared_head.norm, its two layer norms
    return (layers * per_layer + len(cfg.kda_layers) * kda + mla * (attn + indexer) + moe * router
            + d * 2 + mtp)  # + the final norm


def test_tp8_per_rank_weights_sum_to_tp1_plus_replication():
    cfg = _cfg("glm5next")
    for fmt in ("bf16", "fp8"):
        one, eight = weight_bytes_per_rank(cfg, 1, fmt), weight_bytes_per_rank(cfg, 8, fmt)
        assert eight["replicated"] == one["replicated"]
        assert 8 * eight["total"] == one["total"] + 7 * eight["replicated"]
    assert weight_bytes_per_rank(cfg, 8, "bf16")["replicated"] == _replicated_bf16(cfg)
    # FP8 replicates the same tensors; of them only q_a and kv_a are quantized (11 trunk MLA layers:
    # the MTP block stays bf16)
    q, r, d = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.hidden_size
    fp8_gain = 11 * ((q + r) * d * 2 - ((q + r) * d + 4 * (q // 128 + r // 128) * (d // 128)))
    assert weight_bytes_per_rank(cfg, 8, "fp8")["replicated"] == _replicated_bf16(cfg) - fp8_gain


def test_fp8_prediction_follows_the_official_checkpoint():
    cfg = _cfg("glm5next")
    p = layout.layer_prefix
    yes = [p(3) + "self_attn.q_a_proj.weight", p(3) + "self_attn.q_b_proj.weight", p(3) + "self_attn.o_proj.weight",
           p(43) + "self_attn.kv_a_proj_with_mqa.weight", p(0) + "mlp.gate_proj.weight", p(1) + "mlp.down_proj.weight",
           p(5) + "mlp.experts.287.up_proj.weight", p(5) + "mlp.shared_experts.down_proj.weight"]
    no = [p(0) + "self_attn.o_proj.weight", p(0) + "self_attn.q_proj.weight", p(0) + "self_attn.f_a_proj.weight",
          p(3) + "self_attn.kv_b_proj.weight", p(3) + "self_attn.indexer.wq_b.weight", p(3) + "hc_attn_fn",
          p(5) + "mlp.gate.weight", p(45) + "eh_proj.weight", layout.PREFIX + "embed_tokens.weight", layout.LM_HEAD,
          p(45) + "self_attn.q_b_proj.weight", p(45) + "mlp.experts.0.gate_proj.weight"]  # the nextn block: bf16
    assert [n for n in yes if not layout.fp8_quantized(cfg, n)] == []
    assert [n for n in no if layout.fp8_quantized(cfg, n)] == []
    with pytest.raises(UserError, match="linear_num_heads"):
        check_tp(dataclasses.replace(cfg, linear_num_heads=12), 8)  # 64 MLA heads divide, 12 KDA do not
    with pytest.raises(UserError, match="--tp 3"):
        check_tp(cfg, 3)


def test_profile_predict_only_tp8_cli():
    r = CliRunner().invoke(app, ["profile", "--model", "glm5next", "--predict-only", "--max-seq-len", "131072",
                                 "--budget", "2048", "--tp", "8", "--json"])
    assert r.exit_code == 0, r.output
    rows = {(x["tp"], x["format"]): x for x in json.loads(r.stdout)["tp_per_gpu"]["rows"]}
    assert set(rows) == {(n, f) for n in (1, 2, 4, 8) for f in ("bf16", "fp8")}
    for f in ("bf16", "fp8"):
        w = [rows[(n, f)]["weights_per_gpu_bytes"] for n in (1, 2, 4, 8)]
        assert w[0] > w[1] > w[2] > w[3]
        # KDA state is split by heads: a rank's state shrinks with tp, the MLA/indexer rows do not
        st = [rows[(n, f)]["state_per_sequence_bytes"]["budget"] for n in (1, 2, 4, 8)]
        assert st[0] > st[1] > st[2] > st[3]
    # about half: KDA, the MTP block (7.4 B parameters), embeddings and lm_head stay bf16
    assert rows[(8, "fp8")]["weights_per_gpu_bytes"] < 0.53 * rows[(8, "bf16")]["weights_per_gpu_bytes"]
    r = CliRunner().invoke(app, ["profile", "--model", "glm5next", "--predict-only", "--max-seq-len", "131072",
                                 "--tp", "3"])
    assert r.exit_code != 0 and "Traceback" not in r.output and "--tp 3" in r.output


def test_tp_table_is_the_pools_ledger(monkeypatch):
    """Per-rank state in the table equals what CachePools hold for one sequence (budget and ceiling
    reservations) when the pools are made from the family's components at that tp; the concurrency
    is (gpu-mem - weights/GPU) // (that + scratch + graphs)."""
    r = CliRunner().invoke(app, ["profile", "--model", "glm5next-tiny", "--predict-only", "--max-seq-len", "1024",
                                 "--budget", "64", "--tp", "2", "--dtype", "bf16", "--gpu-mem", "16MB", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    cfg, fam = _cfg("glm5next-tiny"), family_of(_cfg("glm5next-tiny"))
    c = ProfileConfig([1024], budget=64, gamma=3)
    orig = fam.state_components
    seen = set()
    for row in doc["tp_per_gpu"]["rows"]:
        n = row["tp"]
        seen.add(n)
        monkeypatch.setattr(fam, "state_components", lambda cf, dt, w=True, tp=1, n=n: orig(cf, dt, w, tp=n))
        for policy in ("ceiling", "budget"):
            tokens = policy_tokens(c, policy, 1024)
            pools = CachePools.create(cfg, math.ceil(tokens / 16), 16, torch.bfloat16, "cpu")
            for cache in (pools.target_cache(), pools.drafter_cache()):
                cache.reserve(tokens)
            ledger = sum(pools.bytes_held().values())
            assert row["state_per_sequence_bytes"][policy] == ledger, (n, policy)
            per = ledger + row["scratch_graphs_per_sequence_bytes"][policy]
            free = doc["gpu_mem_bytes"] - row["weights_per_gpu_bytes"]
            assert row["max_concurrent_sequences"][policy] == free // per > 0
        monkeypatch.setattr(fam, "state_components", orig)
    assert seen == {1, 2}  # tiny: 2 KDA heads, so 4 and 8 do not divide it
