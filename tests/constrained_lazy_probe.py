"""Would greedy verification under a grammar need fewer masks if only row 0 were masked? A probe, not
a test: it runs `--no-draft-mask` constrained speculation (as tests/constrained_measure.py does) and,
at every verify, compares the target's unmasked argmax with the walk's masks.

The scheme it weighs: mask row 0 (needed before the drafts are read), and at each later verified
position take the target's unmasked argmax where the grammar allows it (then it is also the first
maximum among the allowed tokens, so the greedy verdict is unchanged), falling back to that
position's own mask, in a second device round, only where the unmasked argmax is banned. It pays
only where the fallback is rare. Counts, per sequence-step:

- row0_banned: the unmasked argmax at row 0 is banned (a masked row 0 is needed at all);
- fallback: a position 1..k (k: the drafts the masked verify accepted) whose unmasked argmax is banned;
- steps_with_fallback: steps where any sequence needs a fallback (each costs a round trip).

Its wider form reads the target's top K candidates per position instead of its argmax: the first
the grammar allows (in argmax's order: value, then lower id) is the masked argmax wherever the
masked argmax is among them, checked by consuming a token, no mask. `within_top_k` gives, over every
position the masked verdict reaches (0..k), the share whose masked argmax ranks below K in the
unmasked order; `steps_with_fallback_top_k` the steps where some sequence's does not.

    OMP_NUM_THREADS=1 python3 tests/constrained_lazy_probe.py --model glm5-nano --batch-size 8
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm5mtp_cli.engine.config import EngineConfig, ModelSpec  # noqa: E402
from glm5mtp_cli.engine.run import run_generate  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime, set_threads  # noqa: E402
import glm5mtp_cli.engine.speculate as speculate  # noqa: E402
from glm5mtp_cli.prompts import encode_prompts, read_file  # noqa: E402
from kernels.bitmask import unpack  # noqa: E402

COUNTS: collections.Counter = collections.Counter()
SEEN: dict[str, torch.Tensor] = {}  # the current verify's unmasked logits [A, g + 1, V] and allowed [A, g + 1, V]
RANKS: list[int] = []  # per position the masked verdict reaches: the masked argmax's rank unmasked
TOP_K = (1, 4, 16, 64, 256, 1024)


def _recording(apply):
    def recorded(logits, mask):
        SEEN["raw"], SEEN["allowed"] = logits.clone(), unpack(mask, logits.shape[-1])
        return apply(logits, mask)
    return recorded


def _counting(accept):
    def counted(self, drafts, logits, active, masked):
        if masked and drafts is not None and "raw" in SEEN:
            logits_raw, allowed = SEEN.pop("raw"), SEEN.pop("allowed")
            raw = logits_raw.argmax(-1)
            d = drafts.tokens
            chosen = logits.argmax(-1)  # the masked verdict's tokens [A, g + 1]
            k = (chosen[:, :-1] == d).long().cumprod(1).sum(1).tolist()
            rank = _ranks(logits_raw, chosen)
            worst = [max(rank[b, : k[b] + 1].tolist()) for b in range(d.shape[0])]
            RANKS.extend(r for b in range(d.shape[0]) for r in rank[b, : k[b] + 1].tolist())
            COUNTS.update({f"steps_with_fallback_top_{n}": int(max(worst) >= n) for n in TOP_K})
            banned = ~allowed.gather(-1, raw[..., None])[..., 0]  # [A, g + 1]
            fallbacks = [bool(banned[b, 1:k[b] + 1].any()) for b in range(d.shape[0])]
            COUNTS.update(sequence_steps=d.shape[0], row0_banned=int(banned[:, 0].sum()),
                          accepted_a_draft=sum(n > 0 for n in k), fallback=sum(fallbacks), steps=1,
                          steps_with_fallback=int(any(fallbacks)))
        SEEN.clear()
        return accept(self, drafts, logits, active, masked)
    return counted


def _ranks(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[A, g + 1]: how many tokens precede `chosen` in argmax's order (value, then lower id)."""
    v = logits.gather(-1, chosen[..., None])
    ids = torch.arange(logits.shape[-1])
    return (logits > v).sum(-1) + ((logits == v) & (ids < chosen[..., None])).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm5-nano")
    ap.add_argument("--prompts", default=str(ROOT / "profiles" / "constrained" / "prompts.jsonl"))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    set_threads(1)
    speculate.apply_bitmask = _recording(speculate.apply_bitmask)
    speculate.SpecEngine._accept = _counting(speculate.SpecEngine._accept)
    rt = load_runtime(ModelSpec(a.model, "cpu"), progress=False)
    items = read_file(Path(a.prompts))
    ids = encode_prompts(items, rt.tokenizer, folder=rt.resolved.folder)
    config = EngineConfig(gamma=a.gamma, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, draft_mask=False)
    with torch.no_grad():
        run_generate(rt, ids, config, constraints=[p.constraint for p in items])
    print(json.dumps({"command": " ".join(["python3", "tests/constrained_lazy_probe.py"] + sys.argv[1:]),
                      "model": a.model, **COUNTS, "positions_reached": len(RANKS),
                      "within_top_k": {n: round(sum(r < n for r in RANKS) / len(RANKS), 4) for n in TOP_K}}))


if __name__ == "__main__":
    main()
