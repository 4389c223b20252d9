"""`bench --random-weights --tp N`: each rank builds and times its own shard (gloo, 2 CPU ranks as a
user starts them: one subprocess), and the floors count one rank's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.cli import app
from glm5mtp_cli.diagnostics.sizing import target_step_bytes

ARGS = ["bench", "--random-weights", "--device", "cpu", "--dtype", "fp32", "--draft-context", "64",
        "--target-layers", "2", "--json"]


def _bench(model: str, tp: int) -> dict:
    if tp == 1:
        r = CliRunner().invoke(app, [*ARGS, "--model", model])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)
    r = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", *ARGS, "--model", model, "--tp", str(tp)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _split_halves_glm5(cfg, moe: bool) -> int:
    """Elements of one GLM-5 layer's weights a batch-1 token reads that tp splits (sharding.py's rule,
    written out from the config): q_b and kv_b by heads, o_proj by its input columns, the top-k
    routed experts (E/N whole experts a rank) and the shared expert, or the dense MLP."""
    heads = cfg.num_attention_heads
    attn = (heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * cfg.q_lora_rank
            + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
            + cfg.hidden_size * heads * cfg.v_head_dim)
    ffn = 3 * cfg.hidden_size  # gate, up, down per intermediate channel
    if not moe:
        return attn + ffn * cfg.intermediate_size
    return attn + ffn * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)


def test_bench_random_weights_tp2_glm5_floor_is_one_ranks_bytes():
    one, two = _bench("glm5-tiny", 1), _bench("glm5-tiny", 2)
    assert (one["tp"], two["tp"]) == (1, 2) and two["random_weights"] and two["rows"] == []
    for step in ("draft_step", "target_step"):
        s = two[step]
        assert s["step_ms"] > 0 and s["context"] == 64 and s["bytes"]["total"] > 0
        assert "floor_ms" in s and s["floor_ms"] is None  # no copy bandwidth, so no floor, on the CPU
        assert s["bytes"]["cache"] == one[step]["bytes"]["cache"]  # MLA latent and indexer rows: whole on each rank
    cfg, _ = resolve_config("glm5-tiny")
    head = cfg.vocab_size * cfg.hidden_size  # split by vocabulary
    # fp32: 4 bytes an element; a rank holds half of every split tensor
    draft_split = _split_halves_glm5(cfg, moe=True) + head  # the MTP layer is a MoE layer
    assert one["draft_step"]["bytes"]["total"] - two["draft_step"]["bytes"]["total"] == draft_split * 4 // 2
    target_split = sum(_split_halves_glm5(cfg, moe=i >= cfg.first_k_dense_replace) for i in range(2)) + head
    assert one["target_step"]["bytes"]["total"] - two["target_step"]["bytes"]["total"] == target_split * 4 // 2
    assert two["target_step"]["layers"] == 2


def test_bench_random_weights_tp2_glm5next_runs():
    """GLM-5-Next's shard (KDA heads split) steps too; its KDA state traffic per rank is half."""
    one, two = _bench("glm5next-tiny", 1), _bench("glm5next-tiny", 2)
    assert two["tp"] == 2 and two["draft_step"]["step_ms"] > 0 and two["target_step"]["step_ms"] > 0
    assert two["target_step"]["bytes"]["kda_state"] * 2 == one["target_step"]["bytes"]["kda_state"]
    assert two["target_step"]["bytes"]["cache"] == one["target_step"]["bytes"]["cache"]
    assert two["draft_step"]["bytes"]["lm_head"] * 2 == one["draft_step"]["bytes"]["lm_head"]
    cfg, _ = resolve_config("glm5next-tiny")
    assert two["target_step"]["bytes"] == target_step_bytes(cfg.with_layers(2), 4, 64, tp=2)


@pytest.mark.parametrize("extra, needle", [(["--tp", "2", "--draft-vocab-sizes", "0,64"], "--draft-vocab-sizes under --tp"),
                                           (["--tp", "3"], "does not divide the model's num_attention_heads (4)")])
def test_bench_random_weights_tp_bad_combination_is_one_line(extra, needle):
    r = CliRunner().invoke(app, [*ARGS, "--model", "glm5-tiny", *extra])
    assert r.exit_code == 2, r.output
    assert needle in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_random_drafter_builds_one_ranks_shard():
    """Built (no collective runs) as rank 0 of 2: the drafter holds half of every split tensor, all of
    every replicated one (the MTP layer's whole routed experts: E/2 of them)."""
    import torch

    from glm5mtp_cli.diagnostics.step_bench import random_drafter
    from glm5mtp_cli.core.parallel import Comm
    from glm5mtp_cli.engine.runtime import module_bytes

    cfg, _ = resolve_config("glm5-tiny")
    held = [sum(module_bytes(m) for m in random_drafter(cfg, torch.device("cpu"), torch.float32, comm=comm))
            for comm in (None, Comm(0, 2))]
    experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    split = _split_halves_glm5(cfg, moe=True) + experts + 2 * cfg.vocab_size * cfg.hidden_size  # all experts, embed
    assert held[0] - held[1] == split * 4 // 2
