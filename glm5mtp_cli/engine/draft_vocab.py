"""Reduced-vocabulary drafting: the drafter scores only the K most frequent tokens.

GLM-5's lm_head is 1.9 GB of the 3.09 GB a draft step reads at batch 1; drafting over the K most
frequent tokens reads K rows instead. Verification is untouched, so output stays the target's
(with sampling, the draft distribution is zero outside the K tokens, which rejection sampling
handles exactly). Token counts come from a corpus (`glm5mtp draft-vocab`), stored as
`token_counts.json`, so any K can be taken from one count.

Where counts live: beside a checkpoint in a folder of the user's own; for a model glm5mtp must
not write into (a shipped profile, a Hub download) in the user's cache, `user_counts_path`. A
run takes the newer of the two, so a shipped profile's own counts hold until the user writes
newer ones (and win again after an upgrade ships newer ones).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from glm5mtp_cli.checkpoint.resolve import profiles_dir
from glm5mtp_cli.core.parallel import vocab_range
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.input_file import read_text

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


def _model_key(folder: Path) -> str | None:
    """A shipped profile's name or a Hub download's org/name; None for any other folder."""
    folder = Path(folder).resolve()
    if folder.parent == profiles_dir():
        return folder.name
    repo = folder.parent.parent.name  # the Hub cache's layout: models--ORG--NAME/snapshots/REVISION
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/")
    return None


def user_counts_path(folder: Path) -> Path | None:
    """Where draft-vocab writes the counts of a shipped profile or a Hub download by default:
    $XDG_CACHE_HOME (else ~/.cache)/glm5mtp/draft-vocab/<profile or org/name>/token_counts.json.
    None for a folder of the user's own: its counts go beside the checkpoint."""
    key = _model_key(folder)
    if key is None:
        return None
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "glm5mtp" / "draft-vocab" / key / COUNTS_FILE


def _candidates(folder: Path) -> list[Path]:
    return [p for p in (Path(folder) / COUNTS_FILE, user_counts_path(folder)) if p is not None]


def counts_file(folder: Path) -> Path | None:
    """The counts a run over `folder` uses: the newer of its own token_counts.json and
    user_counts_path's (the checkpoint's own on a tie); None when neither exists."""
    found = [p for p in _candidates(folder) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def find_counts(folder: Path, k: int, vocab_size: int, path: Path | None = None) -> Path:
    """The counts file --draft-vocab K reads (path: --draft-vocab-file; default: counts_file(folder)),
    refusing a K outside the vocabulary or no file; from the config alone, before any weights load."""
    if not 1 <= k <= vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{vocab_size}, got {k}")
    if path is not None:  # EngineConfig (or bench) has checked that it exists
        return Path(path)
    found = counts_file(folder)
    if found is None:
        looked = " or ".join(str(p) for p in _candidates(folder))
        raise UserError(f"--draft-vocab: no token counts ({looked}); make them with `glm5mtp draft-vocab "
                        "--model MODEL`, or give --draft-vocab-file")
    return found


def load_draft_ids(folder: Path, k: int, vocab_size: int, device, path: Path | None = None) -> torch.Tensor:
    """Ids of the k most frequent tokens, ascending (so the sliced head keeps the vocabulary's order),
    from find_counts' file."""
    return _ranked_ids(find_counts(folder, k, vocab_size, path), k, vocab_size, device)


def _ranked_ids(path: Path, k: int, vocab_size: int, device) -> torch.Tensor:
    try:
        ranking = json.loads(read_text(path))["ranking"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{path}: not a token count file") from None
    if sorted(ranking) != list(range(vocab_size)):
        raise UserError(f"{path}: ranks {len(ranking)} tokens, the model has {vocab_size}")
    return torch.tensor(sorted(ranking[:k]), dtype=torch.long, device=device)


class SubsetHead(nn.Module):
    """lm_head restricted to `ids`: logits over K tokens; `ids[j]` is the token of logit j.

    Under --tp the head holds a slice of the vocabulary (parallel.VocabParallelHead): each rank
    keeps the rows of the ids it holds, padded to the most any rank holds, the ranks' logits are
    gathered, and `order` puts them back in the order of `ids`, so drafts (greedy or sampled from
    the same stream) are tp 1's."""

    def __init__(self, head: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.ids = ids
        self.comm = getattr(head, "comm", None)
        if self.comm is None:
            rows, self.order = ids, None
        else:
            ranges = [vocab_range(head.vocab_size, r, self.comm.world) for r in range(self.comm.world)]
            held = [ids[(ids >= a) & (ids < b)] for a, b in ranges]
            width = max(h.numel() for h in held)
            # where each id's logit lands in the gathered [world * width] row: rank r, column j
            at = torch.full((head.vocab_size,), -1, dtype=torch.long, device=ids.device)
            for r, h in enumerate(held):
                at[h] = r * width + torch.arange(h.numel(), device=ids.device)
            self.order = at[ids]
            mine = held[self.comm.rank] - head.start
            rows = torch.cat([mine, mine.new_zeros(width - mine.numel())])  # padding rows: never read back
        self.weight = nn.Parameter(head.weight.detach().index_select(0, rows).clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.t()
        if self.comm is None:
            return out
        return self.comm.all_gather(out, dim=-1).index_select(-1, self.order)

    def to_full(self, local: torch.Tensor) -> torch.Tensor:
        return self.ids[local]

    def probs_to_full(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        full = probs.new_zeros(probs.shape[:-1] + (vocab_size,))
        return full.index_copy_(-1, self.ids, probs)
