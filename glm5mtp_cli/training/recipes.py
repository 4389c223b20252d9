"""What each model family contributes to `glm5mtp train`: its differentiable training forward
(target logits, MTP logits, indexer loss, and where the family has one the chained second draft's
logits), its evaluation forward, and any training-only init."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models.glm5_next.training import mtp_forward, target_forward, training_init


@dataclass(frozen=True)
class _Recipe:
    """forward(target, mtp, x, mtp_only, want_indexer, chain) -> (logits, MTP logits, indexer loss,
    chained logits or None), differentiable; eval_forward(target, mtp, x) -> (logits, MTP logits,
    chained logits or None) under no_grad; init(target, seed): training-only initialisation of a fresh
    target after the generic random fill (None: none); chain: whether forward can return the chained
    second draft (row i: the MTP's own output for row i with token x[i+2], predicting x[i+3])."""

    forward: Callable
    eval_forward: Callable
    init: Callable | None = None
    chain: bool = False


def _glm5_forward(target, mtp, x: torch.Tensor, mtp_only: bool, want_indexer: bool, chain: bool):
    if mtp_only:
        with torch.no_grad():
            out = target(x, [None] * x.shape[0])
        logits, hidden = out.logits, out.hidden
        aux = logits.new_zeros((), dtype=torch.float32)
    else:
        o = target.forward_train(x)
        logits, hidden, aux = o.logits, o.hidden, o.aux_loss
    m = mtp.forward_train(hidden[:, :-1], x[:, 1:], target.model.embed_tokens, target.lm_head)
    return logits, m.logits, aux + m.aux_loss, None


def _glm5_eval(target, mtp, x: torch.Tensor):
    out = target(x, [None] * x.shape[0])
    m = mtp(x[:, 1:], out.hidden[:, :-1], [None] * x.shape[0], target.model.embed_tokens, target.lm_head)
    return out.logits, m.logits, None


def _next_forward(target, mtp, x: torch.Tensor, mtp_only: bool, want_indexer: bool, chain: bool):
    """GLM-5-Next: target/mtp are the family's PooledTarget/PooledMtp; train their inner modules."""
    model = target.model
    with torch.no_grad() if mtp_only else contextlib.nullcontext():
        logits, hidden, aux = target_forward(model, x, want_indexer and not mtp_only)
    ml, _, maux, chained = mtp_forward(mtp.layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head,
                                       want_indexer, chain)
    return logits, ml, aux + maux, chained


def _next_eval(target, mtp, x: torch.Tensor):
    model = target.model
    logits, hidden, _ = target_forward(model, x)
    ml, _, _, chained = mtp_forward(mtp.layer, hidden[:, :-1], x[:, 1:], model.embed_tokens, model.lm_head,
                                    chain=True)
    return logits, ml, chained


def _next_init(target, seed: int) -> None:
    training_init(target, seed)


RECIPES = {"glm5": _Recipe(_glm5_forward, _glm5_eval),
           "glm5_next": _Recipe(_next_forward, _next_eval, _next_init, chain=True)}


def recipe_of(cfg) -> _Recipe:
    family = family_of(cfg)
    if family.name not in RECIPES:
        raise UserError(f"glm5mtp train does not support the {family.name} family yet (it trains "
                        f"{', '.join(RECIPES)})")
    return RECIPES[family.name]
