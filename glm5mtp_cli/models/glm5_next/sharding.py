"""GLM-5-Next's tensor/expert-parallel sharding rules (vLLM's Kimi-Linear/KDA split for the linear
attention, the DeepSeek/GLM-5 split for the rest):

- KDA layers: heads split over ranks (linear_num_heads/N each, contiguous). `q_proj`, `k_proj`,
  `v_proj` are column parallel by heads and their short-conv weights split by the same channels;
  `f_b_proj` / `g_b_proj` split by output rows (this rank's heads' channels), `dt_bias` by the same
  channels, `A_log` and `b_proj` by heads; the low-rank down projections `f_a_proj` / `g_a_proj`
  and the per-head `o_norm` are replicated; `o_proj` is row parallel, followed by one all-reduce.
  A rank's recurrent state and conv window hold only its heads' (the family's state_components
  divide them by N).
- indexed (NoPE MLA) layers, as GLM-5: `q_a_proj`, `kv_a_proj_with_mqa`, their norms and the pooled
  DSA indexer are replicated (every rank computes the same pools, scores and top-k); `q_b_proj` and
  `kv_b_proj` are split by heads; `o_proj` is row parallel, one all-reduce. The MLA latent cache and
  the indexer's rows are NOT split.
- MoE: the router is replicated; routed experts are expert parallel (E/N contiguous ids a rank);
  the shared expert is column/row parallel; routed + shared partials are summed in ONE all-reduce
  per layer. Dense MLPs: column/row parallel, one all-reduce.
- mHC parameters, norms and the MTP layer's eh_proj are replicated; `embed_tokens` / `lm_head` are
  split by vocabulary (core.parallel's vocab-parallel modules), the MTP layer uses the target's.
- The MTP layer follows the same rules on every rank (its proposer runs in lockstep: the engine steps every rank alike).

As for GLM-5, a module built on the meta device is sharded in place and the slicing plan
(checkpoint name -> (dim, start, stop)) the loader reads is returned.
"""

from __future__ import annotations

from torch import nn

from glm5mtp_cli.core.parallel import (Comm, Plan, check_divides, shard_linear, shard_mla_heads, shard_mlp, shard_moe,
                                         shard_param, split_even, vocab_parallel)
from glm5mtp_cli.models.glm5.layers import MoE
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.layout import LM_HEAD, PREFIX, layer_prefix


def check_tp(cfg: NextConfig, tp: int) -> None:
    """One clear line when GLM-5-Next cannot be split `tp` (> 1) ways."""
    sizes = {"linear_num_heads (KDA)": cfg.linear_num_heads, "num_attention_heads": cfg.num_attention_heads,
             "n_routed_experts": cfg.n_routed_experts,
             "moe_intermediate_size x n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts}
    if any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
        sizes["intermediate_size (dense MLP)"] = cfg.intermediate_size
    check_divides(tp, sizes)


def _shard_kda(attn: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    h0, h1 = split_even(attn.heads, comm.rank, comm.world)
    c0, c1 = h0 * attn.head_dim, h1 * attn.head_dim
    for x in "qkv":
        shard_linear(getattr(attn, f"{x}_proj"), 0, c0, c1, f"{prefix}{x}_proj", plan)
        shard_param(getattr(attn, f"{x}_conv1d"), "weight", 0, c0, c1, f"{prefix}{x}_conv1d.weight", plan)
    shard_linear(attn.f_b_proj, 0, c0, c1, prefix + "f_b_proj", plan)
    shard_linear(attn.g_b_proj, 0, c0, c1, prefix + "g_b_proj", plan)
    shard_param(attn, "dt_bias", 0, c0, c1, prefix + "dt_bias", plan)
    shard_param(attn, "A_log", 0, h0, h1, prefix + "A_log", plan)
    shard_linear(attn.b_proj, 0, h0, h1, prefix + "b_proj", plan)
    shard_linear(attn.o_proj, 1, c0, c1, prefix + "o_proj", plan)
    attn.heads = h1 - h0
    attn.comm = comm


def _shard_mla(attn: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    qk = attn.q_b_proj.weight.shape[0] // attn.heads
    attn.heads = shard_mla_heads(attn, attn.heads, qk, attn.dn + attn.dv, attn.dv, prefix, comm, plan)


def _shard_mlp(mlp: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    if isinstance(mlp, MoE):
        shard_moe(mlp, prefix, comm, plan)
    else:
        shard_mlp(mlp, prefix, comm, plan, reduce=True)


def shard_target(target: nn.Module, comm: Comm) -> Plan:
    """Shard a PooledTarget (parameters on meta) in place; returns the slicing plan."""
    plan: Plan = {}
    model = target.model
    for i, block in enumerate(model.layers):
        prefix = layer_prefix(i)
        (_shard_kda if block.kda else _shard_mla)(block.self_attn, prefix + "self_attn.", comm, plan)
        _shard_mlp(block.mlp, prefix + "mlp.", comm, plan)
    model.embed_tokens, model.lm_head = vocab_parallel(model.embed_tokens, model.lm_head, comm,
                                                       PREFIX + "embed_tokens.weight", LM_HEAD, plan)
    target.comm = comm
    return plan


def shard_mtp(mtp: nn.Module, comm: Comm, mtp_prefix: str) -> Plan:
    """Shard a PooledMtp (parameters on meta) in place. Its `comm` tells the engine the proposer
    must run on every rank in lockstep (the engine steps every rank alike)."""
    plan: Plan = {}
    _shard_mla(mtp.layer.self_attn, mtp_prefix + "self_attn.", comm, plan)
    _shard_mlp(mtp.layer.mlp, mtp_prefix + "mlp.", comm, plan)
    mtp.comm = comm
    return plan

