"""Tensor and expert parallelism over torch.distributed (NCCL on CUDA, gloo on the CPU): the parts
no model family owns.

`Comm` is this process's place in the group and the collectives a model uses; `VocabParallelEmbedding`
and `VocabParallelHead` split embed_tokens and lm_head by vocabulary (masked lookup + all-reduce;
local logits gathered into the full row, or a (max, index) exchange for greedy). How a family's
layers split (which projections are column or row parallel, which experts a rank holds) is the
family's sharding rule (models/glm5/sharding.py, models/glm5_next/sharding.py); it shards a
module built on the meta device and returns the slicing plan (checkpoint name -> (dim, start, stop))
that `checkpoint.load.load_module` reads with safetensors' lazy slices, so a rank never holds more
than its own part of a tensor. The pieces both families split the same way (a linear's rows or
columns, a SwiGLU MLP, the stacked-expert MoE, the vocabulary) are here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from glm5mtp_cli.errors import UserError

Plan = dict[str, tuple[int, int, int]]  # checkpoint name -> (dim, start, stop) of this rank's slice

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; the GPU image's
# 2.11 has only the old name
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Comm:
    """This process's place in the tensor-parallel group and the collectives the model uses.

    all_reduce_sum, all_gather and argmax run inside the engine's static forwards, so on NCCL they
    are captured into CUDA graphs (engine/graphs.py): fixed shapes, no host reads, no group created
    inside. NCCL (>= 2.9) captures a collective when the launch is captured on every rank of the
    communicator and each rank replays the graph from that same capture; torch's NCCL group
    creates its communicator lazily, at the first collective, which cannot happen inside a capture,
    so launch.py creates it eagerly (init_process_group's device_id). broadcast_int reads the host:
    it runs between graphs (the adaptive gamma's host step), never inside one."""

    rank: int
    world: int
    group: object = None  # None: the default process group
    local_rank: int = 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape on all ranks) along `dim`, in rank order. One
        collective into one flat buffer (no list of outputs, which NCCL fills by a staging copy), so
        it captures into a CUDA graph like all_reduce."""
        if self.world == 1:
            return t
        flat = t.contiguous().reshape(-1)
        out = torch.empty(self.world * flat.numel(), dtype=t.dtype, device=t.device)
        _gather_single(out, flat, group=self.group)
        return torch.cat(out.view(self.world, *t.shape).unbind(0), dim=dim)

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

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (a per-step decision that must match across ranks)."""
        if self.world == 1:
            return value
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.long, device=dev)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)


# ---- checks ---------------------------------------------------------------------------------------

def check_tp(cfg, tp: int) -> None:
    """One clear line when the model cannot be split `tp` ways (the family's divisibility rules)."""
    from glm5mtp_cli.core.families import family_of

    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp > 1:
        family_of(cfg).check_tp(cfg, tp)


def check_divides(tp: int, sizes: dict[str, int]) -> None:
    """The families' check_tp: one line when tp does not divide each of `sizes` (what its sharding
    splits in equal shares, by name; 0: absent), naming the first it does not and every --tp that
    divides them all (the divisors of their greatest common divisor)."""
    sizes = {what: n for what, n in sizes.items() if n}
    bad = next((what for what, n in sizes.items() if n % tp), None)
    if bad is None:
        return
    g = math.gcd(*sizes.values())
    ok = [str(d) for d in range(1, g + 1) if g % d == 0]
    choices = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
    raise UserError(f"--tp {tp} does not divide the model's {bad} ({sizes[bad]}): each rank takes an equal share "
                    f"of {', '.join(f'{what} {n}' for what, n in sizes.items())}, so --tp can be {choices}")


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


# ---- sharding a module built on the meta device (shared by the families' rules) ------------------

def split_even(n: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's contiguous [start, stop) of n (n % world == 0: the family's check_tp says so)."""
    per = n // world
    return rank * per, (rank + 1) * per


def meta_param(shape, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=like.requires_grad)


def shard_param(owner: nn.Module, attr: str, dim: int, start: int, stop: int, name: str, plan: Plan) -> None:
    """Replace owner.<attr> (a parameter) by its [start, stop) slice along `dim`; `name` is its
    checkpoint name."""
    p = getattr(owner, attr)
    shape = list(p.shape)
    shape[dim] = stop - start
    setattr(owner, attr, meta_param(shape, p))
    plan[name] = (dim, start, stop)


def shard_linear(lin: nn.Linear, dim: int, start: int, stop: int, name: str, plan: Plan) -> None:
    """lin's weight sliced along `dim` (0: output rows, column parallel; 1: input columns, row
    parallel); `name` is the linear's checkpoint name without `.weight`."""
    shard_param(lin, "weight", dim, start, stop, name + ".weight", plan)
    if dim == 0:
        lin.out_features = stop - start
    else:
        lin.in_features = stop - start


def shard_mla_heads(attn: nn.Module, heads: int, qk: int, kv: int, v: int, prefix: str, comm: Comm,
                    plan: Plan) -> int:
    """MLA split by heads (both families): q_b (qk rows a head) and kv_b (kv rows a head) column
    parallel, o_proj row parallel (v columns a head) followed by the attention's all-reduce; the
    latent projections stay whole. Returns this rank's head count."""
    h0, h1 = split_even(heads, comm.rank, comm.world)
    shard_linear(attn.q_b_proj, 0, h0 * qk, h1 * qk, prefix + "q_b_proj", plan)
    shard_linear(attn.kv_b_proj, 0, h0 * kv, h1 * kv, prefix + "kv_b_proj", plan)
    shard_linear(attn.o_proj, 1, h0 * v, h1 * v, prefix + "o_proj", plan)
    attn.comm = comm
    return h1 - h0


def shard_mlp(mlp: nn.Module, prefix: str, comm: Comm, plan: Plan, reduce: bool) -> None:
    """SwiGLU: gate/up column parallel, down row parallel; `reduce`: the MLP sums over ranks itself
    (a shared expert leaves it to its MoE's one all-reduce)."""
    a, b = split_even(mlp.gate_proj.weight.shape[0], comm.rank, comm.world)
    shard_linear(mlp.gate_proj, 0, a, b, prefix + "gate_proj", plan)
    shard_linear(mlp.up_proj, 0, a, b, prefix + "up_proj", plan)
    shard_linear(mlp.down_proj, 1, a, b, prefix + "down_proj", plan)
    mlp.comm = comm if reduce else None


def shard_moe(moe: nn.Module, prefix: str, comm: Comm, plan: Plan) -> None:
    """The router replicated; routed experts expert parallel (E/N contiguous ids per rank: only
    those are named, so only those are read); the shared expert column/row parallel; routed and
    shared partials summed in ONE all-reduce (the MoE's comm)."""
    ex = moe.experts
    e0, e1 = split_even(ex.n_experts, comm.rank, comm.world)
    for n in ("gate", "up", "down"):
        p = getattr(ex, n)
        setattr(ex, n, meta_param((e1 - e0, *p.shape[1:]), p))
    ex.n_experts = e1 - e0
    ex.offset = e0
    shard_mlp(moe.shared_experts, prefix + "shared_experts.", comm, plan, reduce=False)
    moe.comm = comm


def vocab_parallel(embed: nn.Module, head: nn.Module, comm: Comm, embed_name: str, head_name: str,
                   plan: Plan) -> tuple[VocabParallelEmbedding, VocabParallelHead]:
    """Vocabulary-parallel replacements (on meta) of an embedding and an lm_head, planned by name."""
    vocab, hidden = embed.weight.shape
    emb = VocabParallelEmbedding(vocab, hidden, comm, device="meta", dtype=embed.weight.dtype)
    out = VocabParallelHead(vocab, hidden, comm, device="meta", dtype=head.weight.dtype)
    plan[embed_name] = (0, emb.start, emb.stop)
    plan[head_name] = (0, out.start, out.stop)
    return emb, out
