"""The MoE router's choice and weights from its logits (models/glm5/layers.Router, both families:
noaux_tc), as one kernel.

PyTorch's form is about eight launches per MoE layer and forward after the router's GEMM (sigmoid,
bias, top-k, gather, sum, the normalisation's add and divide, the scale), eight more with expert
groups (each group's top two, the groups' top-k, the mask). Here one program per token holds its
E scores in registers and picks the top k one argmax at a time: ids in descending order of the
biased score, ties to the lower expert id.
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, tracks_grad, use_triton


def choose_ref(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """The experts each token picks [N, k] from its sigmoid scores [N, E]: top-k of score + bias,
    among the experts of its topk_group best groups (a group's score: its two best) when n_group > 1."""
    choice = scores + bias
    n, e = choice.shape
    if n_group > 1:
        group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
        keep_groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep_groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    return choice.topk(top_k, dim=-1, sorted=False)[1]


def route_weights_ref(scores: torch.Tensor, ids: torch.Tensor, norm: bool, scale: float) -> torch.Tensor:
    """The chosen experts' weights [N, k] fp32: their raw sigmoid scores, normalised to sum 1
    (norm_topk_prob), times the routed scaling factor."""
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale


def route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 -> (weights [N, k] fp32, expert ids [N, k] int64)."""
    scores = logits.sigmoid()
    ids = choose_ref(scores, bias, top_k, n_group, topk_group)
    return route_weights_ref(scores, ids, norm, scale), ids


@jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, scale, K: tl.constexpr, G: tl.constexpr,
                  TG: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    scores = tl.sigmoid(tl.load(logits_ptr + n * E + e, mask=em, other=0.0))
    choice = tl.where(em, scores + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
    if G > 1:  # keep the experts of the TG groups whose two best sum highest
        group = e // (E // G)
        g_ids = tl.arange(0, BLOCK_G)
        g_scores = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        for g in tl.static_range(G):
            mine = tl.where(group == g, choice, float("-inf"))
            first = tl.argmax(mine, axis=0)
            second = tl.max(tl.where(e == first, float("-inf"), mine), axis=0)
            g_scores = tl.where(g_ids == g, tl.max(mine, axis=0) + second, g_scores)
        keep = e < 0
        for _ in tl.static_range(TG):
            best = tl.argmax(g_scores, axis=0)
            keep = keep | (group == best)
            g_scores = tl.where(g_ids == best, float("-inf"), g_scores)
        choice = tl.where(keep, choice, float("-inf"))
    k_ids = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.int64)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=0)
        picked = tl.where(k_ids == j, best, picked)
        weights = tl.where(k_ids == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), weights)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    km = k_ids < K
    tl.store(w_ptr + n * K + k_ids, weights * scale, mask=km)
    tl.store(ids_ptr + n * K + k_ids, picked, mask=km)


def route_triton(logits, bias, top_k, n_group, topk_group, norm, scale):
    n, e = logits.shape
    weights = alloc((n, top_k), torch.float32, logits.device)
    ids = alloc((n, top_k), torch.int64, logits.device)
    if n:
        _route_kernel[(n,)](logits.contiguous(), bias.contiguous(), weights, ids, e, float(scale), K=top_k,
                            G=n_group, TG=topk_group, NORM=bool(norm), BLOCK_E=next_pow2(e),
                            BLOCK_K=next_pow2(top_k, 2), BLOCK_G=next_pow2(n_group, 2))
    return weights, ids


def route(logits, bias, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float,
          force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's results (the ids' order within a row may differ: a set); the Triton kernel for
    CUDA tensors (or `force_triton` in the interpreter), the reference where autograd tracks the
    logits (training: the router's weight learns through the chosen scores)."""
    if tracks_grad(logits, bias):
        return route_ref(logits, bias, top_k, n_group, topk_group, norm, scale)
    if as_op():
        return route_op(logits, bias, top_k, n_group, topk_group, norm, scale)
    if use_triton(logits, bias, force=force_triton):
        return route_triton(logits, bias, top_k, n_group, topk_group, norm, scale)
    return route_ref(logits, bias, top_k, n_group, topk_group, norm, scale)


# As a custom op for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::route", mutates_args=())
def route_op(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(logits, bias):
        return route_triton(logits, bias, top_k, n_group, topk_group, norm, scale)
    return tuple(t.contiguous() for t in route_ref(logits, bias, top_k, n_group, topk_group, norm, scale))


@route_op.register_fake
def _(logits, bias, top_k, n_group, topk_group, norm, scale):
    n = logits.shape[0]
    return logits.new_empty((n, top_k)), logits.new_empty((n, top_k), dtype=torch.int64)
