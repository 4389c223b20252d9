"""Admission prefill: the prompts admitted together share forwards, for the target and the drafter.

A forward appends T rows to each of its m sequences ([m, T] ids). A sequence with fewer than T rows
left is padded; its padding rows land past its length, inside its own reservation, and the cache is
cut back to its real rows after the forward, so the next append overwrites them. That is exact
because every row the forward appends is dead once cut: paged rows are (attention is causal, so no
real row reads a padding row, and each row's logits/hidden are taken at its own last real row), and
a fixed-size state never sees them: the target is told each sequence's real rows (`real`) and keeps
the rest out of it (GLM-5-Next's KDA state: padding rows neither decay nor write it).

Planning (`plan_forwards`): while rows remain, T = min(chunk, the most rows any sequence has left);
sequences join the forward longest first while their headroom (reserved rows past their length)
holds T rows and the forward stays within `budget` rows (m * T, at least one sequence). The longest
sequence always fits (its reservation holds its whole prompt), so every forward makes progress;
sorting longest first groups prompts of similar lengths, which keeps the padding small, and a long
prompt is chunked as before.
"""

from __future__ import annotations

import torch

from glm5mtp_cli.engine.proposer import Feed, check_aligned


def plan_forwards(remaining: list[int], headroom: list[int], chunk: int,
                  budget: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """The forwards that append remaining[i] rows to sequence i: a list of (T, [(i, real rows)])."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    rem, room = list(remaining), list(headroom)
    for i, (r, h) in enumerate(zip(rem, room)):
        if h < r:
            raise RuntimeError(f"sequence {i}: {r} rows to prefill, {h} reserved")
    out = []
    while True:
        order = sorted((i for i, r in enumerate(rem) if r > 0), key=lambda i: -rem[i])
        if not order:
            return out
        t = min(chunk, rem[order[0]])
        members = []
        for i in order:
            if members and (len(members) + 1) * t > budget:
                break
            if room[i] >= t:
                k = min(rem[i], t)
                members.append((i, k))
                rem[i] -= k
                room[i] -= k
        out.append((t, members))


def prefill_targets(target, caches: list, prompts: list[list[int]], chunk: int, budget: int, device,
                    static=None):
    """Append prompts[i] (host ids) to caches[i] in shared forwards. Returns (the logits at each
    prompt's last row [N, V], each prompt's normed hiddens [len(prompts[i]), H]). `static`
    (engine/prefill_graphs.PrefillForwards, --prefill-graphs) runs the forwards it has a bucket for."""
    n = len(caches)
    done = [0] * n
    hiddens: list[list[torch.Tensor]] = [[] for _ in range(n)]
    logits: list[torch.Tensor | None] = [None] * n
    plan = plan_forwards([len(p) for p in prompts], [c.capacity - c.length for c in caches], chunk, budget)
    for t, members in plan:
        ids = torch.zeros(len(members), t, dtype=torch.long)
        for j, (i, k) in enumerate(members):
            ids[j, :k] = torch.tensor(prompts[i][done[i]:done[i] + k], dtype=torch.long)
        group = [caches[i] for i, _ in members]
        out = static.target(ids, group, [k for _, k in members]) if static is not None else None
        if out is None:
            starts = [c.length for c in group]
            real = torch.tensor([k for _, k in members], dtype=torch.long).to(device)
            padded = any(k < t for _, k in members)
            out = target(ids.to(device), group, rows=real - 1, real=real if padded else None)
            target.commit(out.pending, real)
            for j, (_, k) in enumerate(members):
                if k < t:
                    group[j].truncate(starts[j] + k)  # the padding rows are dead: the next append overwrites them
        for j, (i, k) in enumerate(members):
            hiddens[i].append(out.hidden_all[j, :k])
            logits[i] = out.logits[j, 0]
            done[i] += k
    return torch.stack(logits), [torch.cat(h) for h in hiddens]



def prefill_drafters(head, tokens: list[torch.Tensor], hiddens: list[torch.Tensor], states: list, chunk: int,
                     budget: int, static=None) -> None:
    """Append each drafter state's real rows tokens[i] (with hiddens[i], device) from its current
    length in shared forwards, planned as the targets' are (the drafters' caches are paged rows);
    `static` (PrefillForwards) runs the forwards it has a bucket for, the proposer's eager
    `append_rows` the rest."""
    for st in states:
        check_aligned(st.cache.length if st.cache is not None else -1, st)
    caches = [st.cache for st in states]
    done = [0] * len(states)
    plan = plan_forwards([t.shape[0] for t in tokens], [c.capacity - c.length for c in caches], chunk, budget)
    for t, members in plan:
        rows = [(tokens[i][done[i]:done[i] + k], hiddens[i][done[i]:done[i] + k]) for i, k in members]
        feed = Feed.of(rows, t)
        group = [caches[i] for i, _ in members]
        if static is None or not static.drafter(feed.tokens, feed.hiddens, group, feed.counts):
            head.append_rows(feed.tokens, feed.hiddens, group, feed.counts)
        for j, (i, k) in enumerate(members):
            states[i].add_real(feed.tokens, j, k)
            done[i] += k
