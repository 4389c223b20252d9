"""Tensor and expert parallelism over torch.distributed (NCCL on CUDA, gloo on the CPU).

The split follows vLLM's / SGLang's DeepSeek-V2/V3 (and GLM-5) models:

- attention: `q_a_proj`, `kv_a_proj_with_mqa`, their norms and the DSA indexer are replicated (every
  rank computes the same latent, the same index scores and the same top-k); `q_b_proj` and
  `kv_b_proj` are split by heads (column parallel, n_heads/N heads per rank); `o_proj` is row
  parallel (this rank's heads' input columns) and followed by one all-reduce. The MLA cache holds
  the latent shared by all heads, so it is NOT split: every rank keeps the whole latent cache.
- MoE: the router is replicated (all ranks route identically); routed experts are split over ranks
  (expert parallel, E/N each, contiguous ids); the shared expert is column/row parallel; the routed
  partial and the shared partial are added and summed over ranks in ONE all-reduce per layer.
- dense MLPs: column (gate, up) / row (down) parallel, one all-reduce.
- `embed_tokens`: split by vocabulary, masked lookup, all-reduce. `lm_head`: split by vocabulary;
  the local logits are gathered into the full distribution (for sampling; greedy takes the argmax
  of the gathered logits, which equals the (max, index) exchange of `Comm.argmax`).

Sharding happens on a module built on the meta device: parameters are replaced by meta tensors of
the per-rank shape, and `shard_model` returns the slicing plan (checkpoint name -> (dim, start,
stop)) that `checkpoint.load_module` reads with safetensors' lazy slices, so a rank never holds
more than its own part of a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.errors import UserError

Plan = dict[str, tuple[int, int, int]]  # checkpoint name -> (dim, start, stop) of this rank's slice


@dataclass
class Comm:
    """This process's place in the tensor-parallel group and the collectives the model uses."""

    rank: int
    world: int
    group: object = None  # None: the default process group
    local_rank: int = 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape on all ranks) along `dim`, in rank order."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def argmax(self, local_logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
        """Global argmax over the last dim of vocabulary-sharded logits, exchanging only a (max, index)
        pair per row. Ties go to the lowest global index, as torch.argmax on the full row does:
        within a rank argmax takes the first maximum, and across ranks the lowest rank (lower ids)
        among those holding the maximum wins."""
        vals, idx = local_logits.float().max(-1)
        if self.world == 1:
            return idx + vocab_start
        pair = torch.stack([vals, (idx + vocab_start).float()], dim=-1)  # ids < 2^24: exact in fp32
        every = self.all_gather(pair[None], dim=0)  # [world, ..., 2]
        best = every[..., 0].argmax(0)  # first (lowest) rank holding the maximum
        return every[..., 1].gather(0, best[None])[0].long()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)


# ---- checks ---------------------------------------------------------------------------------------

def check_tp(cfg: ModelConfig, tp: int) -> None:
    """One clear line when the model cannot be split `tp` ways."""
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return
    sizes = {"num_attention_heads": cfg.num_attention_heads, "n_routed_experts": cfg.n_routed_experts,
             "intermediate_size (dense MLP)": cfg.intermediate_size,
             "moe_intermediate_size x n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts}
    for what, n in sizes.items():
        if n and n % tp:
            raise UserError(f"--tp {tp} does not divide the model's {what} ({n}); "
                            f"choose a divisor of {math.gcd(*[v for v in sizes.values() if v])}")


def _split(n: int, rank: int, world: int) -> tuple[int, int]:
    """Even contiguous split of n (n % world == 0)."""
    per = n // world
    return rank * per, (rank + 1) * per


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows of the vocabulary on `rank`: ceil(V/N) each, the last rank possibly fewer."""
    per = -(-vocab // world)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


# ---- sharded vocabulary modules -------------------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """embed_tokens split by vocabulary: look up own rows, zero the others, all-reduce."""

    def __init__(self, vocab: int, hidden: int, comm: Comm, dtype=None, device=None):
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab
        self.start, self.stop = vocab_range(vocab, comm.rank, comm.world)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        out = F.embedding(local.clamp(0, max(self.stop - self.start - 1, 0)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce_sum(out)


class VocabParallelHead(nn.Module):
    """lm_head split by vocabulary: local logits, gathered into the full row (padded when V % N)."""

    def __init__(self, vocab: int, hidden: int, comm: Comm, dtype=None, device=None):
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab
        self.start, self.stop = vocab_range(vocab, comm.rank, comm.world)
        self.per = -(-vocab // comm.world)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden, dtype=dtype, device=device))

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.local_logits(h)
        pad = self.per - out.shape[-1]
        if pad:
            out = F.pad(out, (0, pad), value=float("-inf"))
        return self.comm.all_gather(out, dim=-1)[..., : self.vocab_size]

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy token by the (max, index) exchange, without gathering the logits."""
        return self.comm.argmax(self.local_logits(h), self.start)


# ---- sharding a (meta) model ----------------------------------------------------------------------

def _meta_param(shape, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=like.requires_grad)


def _shard_linear(lin: nn.Linear, dim: int, start: int, stop: int, name: str, plan: Plan) -> None:
    """Replace lin.weight by its [start, stop) slice along `dim` (0: output rows, 1: input columns)."""
    shape = list(lin.weight.shape)
    shape[dim] = stop - start
    lin.weight = _meta_param(shape, lin.weight)
    if dim == 0:
        lin.out_features = stop - start
    else:
        lin.in_features = stop - start
    plan[name + ".weight"] = (dim, start, stop)


def _shard_mlp(mlp: nn.Module, prefix: str, comm: Comm, plan: Plan, reduce: bool) -> None:
    inner = mlp.gate_proj.weight.shape[0]
    a, b = _split(inner, comm.rank, comm.world)
    _shard_linear(mlp.gate_proj, 0, a, b, prefix + "gate_proj", plan)
    _shard_linear(mlp.up_proj, 0, a, b, prefix + "up_proj", plan)
    _shard_linear(mlp.down_proj, 1, a, b, prefix + "down_proj", plan)
    mlp.comm = comm if reduce else None


def _shard_attention(attn: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    heads = attn.n_heads
    h0, h1 = _split(heads, comm.rank, comm.world)
    qk = attn.nope + attn.rope
    kv = attn.nope + attn.v_dim
    _shard_linear(attn.q_b_proj, 0, h0 * qk, h1 * qk, prefix + "q_b_proj", plan)
    _shard_linear(attn.kv_b_proj, 0, h0 * kv, h1 * kv, prefix + "kv_b_proj", plan)
    _shard_linear(attn.o_proj, 1, h0 * attn.v_dim, h1 * attn.v_dim, prefix + "o_proj", plan)
    attn.n_heads = h1 - h0
    attn.comm = comm


def _shard_moe(moe: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    ex = moe.experts
    e0, e1 = _split(ex.n_experts, comm.rank, comm.world)
    for n in ("gate", "up", "down"):
        p = getattr(ex, n)
        setattr(ex, n, _meta_param((e1 - e0, *p.shape[1:]), p))
    ex.n_experts = e1 - e0
    ex.offset = e0  # state_dict names the global ids e0..e1-1: only those are read
    _shard_mlp(moe.shared_experts, prefix + "shared_experts.", comm, plan, reduce=False)
    moe.comm = comm


def _shard_layer(layer: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    from glm5mtp_cli.models.glm5.layers import MoE

    _shard_attention(layer.self_attn, prefix + "self_attn.", comm, plan)
    if isinstance(layer.mlp, MoE):
        _shard_moe(layer.mlp, prefix + "mlp.", comm, plan)
    else:
        _shard_mlp(layer.mlp, prefix + "mlp.", comm, plan, reduce=True)


def shard_target(model: nn.Module, comm: Comm) -> Plan:
    """Shard a Glm5ForCausalLM (parameters on meta) in place; returns the slicing plan."""
    plan: Plan = {}
    cfg = model.cfg
    for i, layer in enumerate(model.model.layers):
        _shard_layer(layer, f"model.layers.{i}.", comm, plan)
    emb = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm, device="meta",
                                 dtype=model.model.embed_tokens.weight.dtype)
    head = VocabParallelHead(cfg.vocab_size, cfg.hidden_size, comm, device="meta", dtype=model.lm_head.weight.dtype)
    model.model.embed_tokens = emb
    model.lm_head = head
    plan["model.embed_tokens.weight"] = (0, emb.start, emb.stop)
    plan["lm_head.weight"] = (0, head.start, head.stop)
    model.comm = comm
    return plan


def shard_mtp(layer: nn.Module, comm: Comm, mtp_prefix: str) -> Plan:
    """Shard a Glm5MtpLayer (parameters on meta) in place; eh_proj and the norms stay replicated.
    The drafter uses the target's (sharded) embed_tokens and lm_head."""
    plan: Plan = {}
    _shard_layer(layer.block, mtp_prefix, comm, plan)
    layer.comm = comm
    return plan


class _NoReduce(Comm):
    """A Comm whose all-reduce does nothing: each rank keeps its partial sum."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def strip_comm(module: nn.Module) -> int:
    """Skip the all-reduces of a sharded module's layers (test helper: what running the sharded head
    without its reductions computes: partial sums). Returns how many reductions were dropped."""
    from glm5mtp_cli.models.glm5.attention import MLAttention
    from glm5mtp_cli.models.glm5.layers import MLP, MoE

    n = 0
    for m in module.modules():
        c = m.__dict__.get("comm")
        if isinstance(m, (MLAttention, MoE, MLP)) and c is not None and not isinstance(c, _NoReduce):
            m.comm = _NoReduce(c.rank, c.world, c.group, c.local_rank)
            n += 1
    return n


# ---- memory per rank, predicted ---------------------------------------------------------------------

def _sharded_fraction(name: str) -> bool:
    """Whether a checkpoint tensor is split over ranks (else replicated on every rank)."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return True
    if ".indexer." in name:
        return False
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")):
        return True
    return ".mlp." in name and ".mlp.gate." not in name  # experts, shared experts, dense MLPs


def weight_bytes_per_rank(cfg: ModelConfig, tp: int, fmt: str, with_mtp: bool = True) -> dict[str, int]:
    """Bytes of weights on one rank for a checkpoint format: 'bf16' (2 bytes each) or 'fp8' (the
    FP8 checkpoint's quantized matrices at 1 byte plus one fp32 scale per 128x128 block, the rest
    bf16; fp32 for router/bias tensors in both). Returns {'sharded': .., 'replicated': .., 'total': ..}."""
    from glm5mtp_cli.models.glm5.layout import all_tensor_shapes, is_fp8_quantized, keeps_fp32

    out = {"sharded": 0, "replicated": 0}
    for name, shape in all_tensor_shapes(cfg, mtp=with_mtp):
        n = math.prod(shape)
        if keeps_fp32(name):
            b = 4 * n
        elif fmt == "fp8" and is_fp8_quantized(name, shape):
            b = n + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
        else:
            b = 2 * n
        if _sharded_fraction(name):
            out["sharded"] += -(-b // tp)
        else:
            out["replicated"] += b
    out["total"] = out["sharded"] + out["replicated"]
    return out
