"""Building blocks of the GLM-5 decoder: RMSNorm, interleaved rope, SwiGLU MLP and the noaux_tc MoE.

Numerics follow transformers' `modeling_glm_moe_dsa.py` (REFERENCE.md section 3): norms in fp32
then cast back before the weight, the router in fp32, expert weights chosen with the correction
bias but weighted without it.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from kernels._triton import as_op, use_kernels
from kernels.fp8_block import fp8_block_dequant_ref
from kernels.moe import moe_experts, moe_experts_fp8
from kernels.moe_grouped import moe_experts_grouped, moe_experts_grouped_fp8, pays
from kernels.rmsnorm import rmsnorm, rmsnorm_pair
from kernels.router import route
from kernels.swiglu import swiglu as swiglu_kernel, swiglu_ref

from glm5mtp_cli.core import sync_free
from glm5mtp_cli.models.fp8 import FP8, SCALE_SUFFIX, joined, scale_grid
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.models.overlap import side_by_side


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and not torch.is_grad_enabled():
            return rmsnorm(x, self.weight, self.eps)  # one Triton kernel instead of six (inference only)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of h, h) for h = x + residual: on the kernels' path (inference, not traced by
        torch.compile, whose inductor fuses the add itself) one launch for both."""
        if use_kernels(x) and not torch.is_grad_enabled() and not as_op():
            return rmsnorm(x, self.weight, self.eps, residual)
        h = x + residual
        return self(h), h


def norm_pair(na: RMSNorm, a: torch.Tensor, nb: RMSNorm, b: torch.Tensor) -> torch.Tensor:
    """[na(a) ; nb(b)] (an MTP layer's input to eh_proj): one launch on the kernels' path (inference)."""
    if use_kernels(a) and not torch.is_grad_enabled() and na.eps == nb.eps:
        return rmsnorm_pair(a, na.weight, b, nb.weight, na.eps)
    return torch.cat([na(a), nb(b)], dim=-1)


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of each position's per-pair angle: [..., rope_dim // 2] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32) / rope_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    return freqs.cos(), freqs.sin()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (GLM-5-Next) the clamp is asymmetric: gate only from above,
    up to [-limit, limit]. GLM-5 has no clamp (limit None)."""
    if use_kernels(gate) and not torch.is_grad_enabled():
        return swiglu_kernel(gate, up, limit)  # one launch instead of four (inference only)
    return swiglu_ref(gate, up, limit)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), optionally clamped (see swiglu)."""

    comm = None  # set by parallel.shard_model on a column/row-sharded dense MLP: sum over ranks

    def __init__(self, hidden: int, inner: int, swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def joined_groups(self) -> dict[str, list[nn.Module]]:
        """gate and up read x: one FP8 GEMM where the loader joined them (models/fp8.join_inputs)."""
        return {"x": [self.gate_proj, self.up_proj]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = joined(self, "x", x)
        gate, up = gate_up if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        out = self.down_proj(swiglu(gate, up, self.swiglu_limit))
        if self.comm is not None:
            out = self.comm.all_reduce_sum(out)
        return out


class Router(nn.Module):
    """noaux_tc: sigmoid scores; choice by score + bias, group-limited; weights from the raw scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] fp32, expert ids [N, k]; kernels/router.py)."""
        return route(F.linear(x.float(), self.weight.float()), self.e_score_correction_bias, self.top_k,
                     self.n_group, self.topk_group, self.norm_topk_prob, self.scale)


class Experts(nn.Module):
    """Routed experts stored stacked ([E, I, H]) so a decode step can gather just the chosen ones.

    state_dict() still speaks the checkpoint's per-expert names (`{e}.gate_proj.weight`, as views
    into the stacked tensors), so loaders copy straight into place and writers emit the Hub layout.
    """

    # Below this many (token, expert) pairs the chosen experts' weights are gathered (no host sync,
    # each chosen matrix read once per token); above it, loop over the experts that were hit.
    GATHER_MAX_PAIRS = 64

    def __init__(self, n_experts: int, hidden: int, inner: int, swiglu_limit: float | None = None):
        super().__init__()
        self.n_experts = n_experts
        self.swiglu_limit = swiglu_limit
        self.offset = 0  # global id of expert 0 here (expert parallel: this rank holds offset..offset+n-1)
        self.gate = nn.Parameter(torch.empty(n_experts, inner, hidden))
        self.up = nn.Parameter(torch.empty(n_experts, inner, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, inner))
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        if self._on_kernels(x):
            x = x.contiguous()
            return self._grouped(x, weights, ids) if pays(n * k, self.n_experts) else self._gemv(x, weights, ids)
        # a static forward (sync_free) never loops: the looped path reads per-expert counts on the host
        if n * k <= self.GATHER_MAX_PAIRS or sync_free.active():
            return self._gathered(x, weights, ids)
        return self._looped(x, weights, ids)

    def forward_local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel: the contribution of this rank's experts only; ids are global."""
        local = ids - self.offset
        mine = (local >= 0) & (local < self.n_experts)
        n, k = ids.shape
        kernels = self._on_kernels(x)
        if kernels and pays(n * k, self.n_experts):
            return self._grouped(x.contiguous(), weights, torch.where(mine, local, self.n_experts))  # E: skipped
        if kernels or n * k <= self.GATHER_MAX_PAIRS or sync_free.active():
            # Other ranks' pairs point at a clamped local expert with weight 0 (no host sync).
            weights, ids = weights * mine, local.clamp(0, self.n_experts - 1)
            return self._gemv(x.contiguous(), weights, ids) if kernels else self._gathered(x, weights, ids)
        return self._looped(x, weights, torch.where(mine, local, self.n_experts))

    def _on_kernels(self, x) -> bool:
        """CUDA reads the stacks in place (kernels/moe.py for few pairs, kernels/moe_grouped.py for
        many) when they share x's dtype."""
        return use_kernels(x) and self._kernel_reads(x)

    def _gathered(self, x, weights, ids):
        gate, up, down = self._weights(ids, x.dtype)  # [N, k, ...]
        h = swiglu(torch.einsum("nh,nkih->nki", x, gate), torch.einsum("nh,nkih->nki", x, up), self.swiglu_limit)
        out = torch.einsum("nki,nkhi->nkh", h, down)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(1)

    def _kernel_reads(self, x) -> bool:
        """Whether the kernels can read the stacks for activations x (they must share its dtype)."""
        return x.dtype == self.gate.dtype

    def _gemv(self, x, weights, ids):
        return moe_experts(x, self.gate, self.up, self.down, weights, ids, self.swiglu_limit)

    def _grouped(self, x, weights, ids):
        return moe_experts_grouped(x, self.gate, self.up, self.down, weights, ids, self.swiglu_limit)

    def _weights(self, index, dtype: torch.dtype):
        """(gate, up, down) of the experts `index` picks, as stored (dtype is for FP8 stacks, models/fp8.py)."""
        return self.gate[index], self.up[index], self.down[index]

    def as_fp8(self, block: int) -> "Fp8Experts":
        """The same experts (shape, offset, clamp) with FP8 stacks on the meta device, for the loader
        to fill from an FP8 checkpoint (models/fp8.convert)."""
        inner, hidden = self.gate.shape[1:]
        return Fp8Experts(self.n_experts, hidden, inner, self.swiglu_limit, block, self.offset, device="meta")

    def _looped(self, x, weights, ids):
        """Each hit expert once over its tokens; an id of n_experts marks a pair owned elsewhere."""
        k = ids.shape[1]
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.n_experts + 1)[: self.n_experts].tolist()  # prefill only
        token_of = order // k
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start:start + c]
            tok = token_of[start:start + c]
            start += c
            xe = x[tok]
            gate, up, down = self._weights(e, x.dtype)
            h = swiglu(xe @ gate.t(), xe @ up.t(), self.swiglu_limit)
            ye = (h @ down.t()) * weights.reshape(-1)[sel].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tok, ye)
        return out


class Fp8Experts(Experts):
    """Experts whose stacks stay FP8: gate/up [E, I, H] and down [E, H, I] float8_e4m3fn buffers, each
    with its `{name}_scale_inv` grid [E, ceil(rows/block), ceil(cols/block)] fp32. state_dict() speaks
    the checkpoint's per-expert names (`{e}.gate_proj.weight` and `.weight_scale_inv`)."""

    def __init__(self, n_experts: int, hidden: int, inner: int, swiglu_limit: float | None = None,
                 block: int = 128, offset: int = 0, device=None):
        nn.Module.__init__(self)  # not Experts.__init__: its stacks would be full-precision parameters
        self.n_experts, self.swiglu_limit, self.offset, self.block = n_experts, swiglu_limit, offset, block
        for name, shape in (("gate", (inner, hidden)), ("up", (inner, hidden)), ("down", (hidden, inner))):
            self.register_buffer(name, torch.empty(n_experts, *shape, dtype=FP8, device=device))
            self.register_buffer(name + SCALE_SUFFIX, torch.empty(n_experts, *scale_grid(*shape, block),
                                                                  dtype=torch.float32, device=device))
        self.register_state_dict_post_hook(_split_experts)

    def _kernel_reads(self, x) -> bool:
        return True  # the FP8 kernel takes any activation dtype

    def _gemv(self, x, weights, ids):
        return moe_experts_fp8(x, self.gate, self.gate_scale_inv, self.up, self.up_scale_inv, self.down,
                               self.down_scale_inv, weights, ids, self.block, self.swiglu_limit)

    def _grouped(self, x, weights, ids):
        return moe_experts_grouped_fp8(x, self.gate, self.gate_scale_inv, self.up, self.up_scale_inv, self.down,
                                       self.down_scale_inv, weights, ids, self.block, self.swiglu_limit)

    def _weights(self, index, dtype: torch.dtype):
        """Only the chosen experts dequantized (fp32 products, then `dtype`): [N, k, ...] or one expert's."""
        return tuple(fp8_block_dequant_ref(getattr(self, n)[index], getattr(self, n + SCALE_SUFFIX)[index],
                                           self.block, torch.float32).to(dtype) for n in ("gate", "up", "down"))


def _split_experts(module: Experts, state_dict: dict, prefix: str, local_metadata) -> None:
    # FP8 stacks (models/fp8.py) carry a scale grid per expert too: `{e}.{name}.weight_scale_inv`
    for stacked, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        t = state_dict.pop(prefix + stacked)
        scale = state_dict.pop(prefix + stacked + "_scale_inv", None)
        for e in range(module.n_experts):
            state_dict[f"{prefix}{e + module.offset}.{name}.weight"] = t[e]
            if scale is not None:  # each weight next to its scales (a reader quantizing on the fly makes them together)
                state_dict[f"{prefix}{e + module.offset}.{name}.weight_scale_inv"] = scale[e]


def _stack_experts(module: Experts, state_dict: dict, prefix: str, *args) -> None:
    for stacked, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        keys = [f"{prefix}{e + module.offset}.{name}.weight" for e in range(module.n_experts)]
        if all(k in state_dict for k in keys):
            state_dict[prefix + stacked] = torch.stack([state_dict.pop(k) for k in keys])


class MoE(nn.Module):
    # Set by parallel.shard_model: experts hold this rank's E/N, the shared expert its column/row
    # slice; the routed and shared partials are added, then summed over ranks in ONE all-reduce.
    comm = None

    def __init__(self, cfg: ModelConfig, swiglu_limit: float | None = None):
        """cfg: any config with the router/expert fields of ModelConfig (GLM-5-Next's NextConfig
        has them under the same names); swiglu_limit clamps every expert (GLM-5-Next: 10)."""
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, swiglu_limit)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, swiglu_limit)
        self.last_expert_ids: torch.Tensor | None = None  # kept for load balancing in training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # the shared expert does not wait for the routing: on CUDA it runs beside it (models/overlap.py)
        routed, shared = side_by_side(lambda: self._routed(x), lambda: self.shared_experts(x), x)
        out = routed + shared
        return (out if self.comm is None else self.comm.all_reduce_sum(out)).view(shape)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.training:  # every call of a training step counts (the MTP's chained loss calls it twice)
            prev = self.last_expert_ids
            self.last_expert_ids = ids.detach() if prev is None else torch.cat([prev, ids.detach()])
        return self.experts(x, weights, ids) if self.comm is None else self.experts.forward_local(x, weights, ids)
