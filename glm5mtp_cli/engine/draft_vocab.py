"""Reduced-vocabulary drafting: the drafter scores only the K most frequent tokens.

GLM-5's lm_head is 1.9 GB of the 3.09 GB a draft step reads at batch 1; drafting over the K most
frequent tokens reads K rows instead. Verification is untouched, so output stays the target's
(with sampling, the draft distribution is zero outside the K tokens, which rejection sampling
handles exactly). Token counts come from a corpus and are stored beside the checkpoint as
`token_counts.json`, so any K can be taken from one count.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from glm5mtp_cli.errors import UserError

COUNTS_FILE = "token_counts.json"


def count_tokens(encode, texts: Iterable[str], vocab_size: int) -> list[int]:
    counts: Counter = Counter()
    for text in texts:
        counts.update(encode(text))
    return [counts.get(i, 0) for i in range(vocab_size)]


def write_counts(path: Path, counts: list[int], source: str) -> Path:
    ranking = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    path.write_text(json.dumps({"source": source, "tokens_counted": sum(counts), "ranking": ranking,
                                "counts": counts}))
    return path


def load_draft_ids(folder: Path, k: int, vocab_size: int, device, path: Path | None = None) -> torch.Tensor:
    """Ids of the k most frequent tokens, ascending (so the sliced head keeps the vocabulary's order).
    path: a counts file written by `draft-vocab --out` (default: token_counts.json in folder)."""
    if not 1 <= k <= vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{vocab_size}, got {k}")
    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"--draft-vocab-file {path}: no such file")
        return _ranked_ids(Path(path), k, vocab_size, device)
    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise UserError(f"--draft-vocab: no {COUNTS_FILE} beside the checkpoint in {folder}; "
                        "make one with `glm5mtp draft-vocab`, or give --draft-vocab-file")
    return _ranked_ids(path, k, vocab_size, device)


def _ranked_ids(path: Path, k: int, vocab_size: int, device) -> torch.Tensor:
    try:
        ranking = json.loads(path.read_text())["ranking"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{path}: not a token count file") from None
    if sorted(ranking) != list(range(vocab_size)):
        raise UserError(f"{path}: ranks {len(ranking)} tokens, the model has {vocab_size}")
    return torch.tensor(sorted(ranking[:k]), dtype=torch.long, device=device)


class SubsetHead(nn.Module):
    """lm_head restricted to `ids`: logits over K tokens; `ids[j]` is the token of logit j."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.ids = ids
        self.weight = nn.Parameter(head.weight.detach().index_select(0, ids).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    def to_full(self, local: torch.Tensor) -> torch.Tensor:
        return self.ids[local]

    def probs_to_full(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        full = probs.new_zeros(probs.shape[:-1] + (vocab_size,))
        return full.index_copy_(-1, self.ids, probs)
