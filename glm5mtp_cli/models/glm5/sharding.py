"""GLM-5's tensor/expert-parallel sharding rules (the split follows vLLM's / SGLang's DeepSeek-V2/V3
and GLM-5 models):

- attention: `q_a_proj`, `kv_a_proj_with_mqa`, their norms and the DSA indexer are replicated (every
  rank computes the same latent, the same index scores and the same top-k); `q_b_proj` and
  `kv_b_proj` are split by heads (column parallel, n_heads/N heads per rank); `o_proj` is row
  parallel (this rank's heads' input columns) and followed by one all-reduce. The MLA cache holds
  the latent shared by all heads, so it is NOT split: every rank keeps the whole latent cache.
- MoE: the router is replicated (all ranks route identically); routed experts are split over ranks
  (expert parallel, E/N each, contiguous ids); the shared expert is column/row parallel; the routed
  partial and the shared partial are added and summed over ranks in ONE all-reduce per layer.
- dense MLPs: column (gate, up) / row (down) parallel, one all-reduce.
- `embed_tokens` / `lm_head`: split by vocabulary (core.parallel's vocab-parallel modules).

Sharding happens on a module built on the meta device: parameters are replaced by meta tensors of
the per-rank shape, and shard_target / shard_mtp return the slicing plan (checkpoint name ->
(dim, start, stop)) the loader reads.
"""

from __future__ import annotations

from torch import nn

from glm5mtp_cli.core.parallel import (Comm, Plan, check_divides, shard_mla_heads, shard_mlp, shard_moe,
                                         vocab_parallel)
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.models.glm5.layers import MoE


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """One clear line when GLM-5 cannot be split `tp` (> 1) ways."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "n_routed_experts": cfg.n_routed_experts,
             "intermediate_size (dense MLP)": cfg.intermediate_size,
             "moe_intermediate_size x n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts}
    check_divides(tp, sizes)


# ---- sharding a (meta) model ----------------------------------------------------------------------

def _shard_attention(attn: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    attn.n_heads = shard_mla_heads(attn, attn.n_heads, attn.nope + attn.rope, attn.nope + attn.v_dim, attn.v_dim,
                                   prefix, comm, plan)


def _shard_layer(layer: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    _shard_attention(layer.self_attn, prefix + "self_attn.", comm, plan)
    if isinstance(layer.mlp, MoE):
        shard_moe(layer.mlp, prefix + "mlp.", comm, plan)
    else:
        shard_mlp(layer.mlp, prefix + "mlp.", comm, plan, reduce=True)


def shard_target(model: nn.Module, comm: Comm) -> Plan:
    """Shard a Glm5ForCausalLM (parameters on meta) in place; returns the slicing plan."""
    plan: Plan = {}
    for i, layer in enumerate(model.model.layers):
        _shard_layer(layer, f"model.layers.{i}.", comm, plan)
    model.model.embed_tokens, model.lm_head = vocab_parallel(model.model.embed_tokens, model.lm_head, comm,
                                                             "model.embed_tokens.weight", "lm_head.weight", plan)
    model.comm = comm
    return plan


def shard_mtp(layer: nn.Module, comm: Comm, mtp_prefix: str) -> Plan:
    """Shard a Glm5MtpLayer (parameters on meta) in place; eh_proj and the norms stay replicated.
    The drafter uses the target's (sharded) embed_tokens and lm_head."""
    plan: Plan = {}
    _shard_layer(layer.block, mtp_prefix, comm, plan)
    layer.comm = comm
    return plan

