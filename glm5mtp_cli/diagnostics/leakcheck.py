"""leak-check: run many sequences through one engine and one pool, each through a whole life
(normal end, early EOS, cancellation, an error inside a verify step), and check that every cache
pool component goes back to its baseline (ARCHITECTURE invariant 2, REFERENCE section 8).

With --batch-size B > 1 the lives run in rounds of 2B requests through one continuously batched
generate call of B slots, so slots are re-occupied within a round; an injected failure then aborts
its whole round (every live sequence is released by the engine), and each round ends with one
snapshot shared by its rows.

The baseline is taken after a warm-up that fills every slot with the longest prompt, so the
engine's CUDA graphs (built for its slots and its longest request) exist before it and are never
rebuilt after it. The verdict rests on the pools' ledger (blocks held per component). On CUDA the allocator's
`memory_allocated` is checked as well; on the CPU the process RSS is reported but not judged
(it is noisy: the allocator keeps freed pages, the pools are committed lazily).
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass

import torch

from glm5mtp_cli.models import family_of
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.config import EngineConfig, SamplingParams
from glm5mtp_cli.engine.runtime import Runtime, make_engine, resolve
from glm5mtp_cli.engine.sequence import Request, budget_tokens, reserve_tokens

LIFECYCLES = ("length", "eos", "cancelled", "failed")
CUDA_TOLERANCE = 1 << 20  # allocator growth (bytes, whole run) tolerated on CUDA: workspaces, RNG state


@dataclass(frozen=True)
class LeakCheckConfig:
    engine: EngineConfig  # gamma, max_new_tokens, alloc, max_seq_len, batch_size, forward mode
    sequences: int = 24
    inject_leak: str | None = None  # a state component never given back (the verdict's self-test)
    seed: int = 0  # of the random prompts (and the engine's sampler)

    def __post_init__(self):
        e = self.engine
        if self.sequences < 1:
            raise UserError(f"--sequences must be >= 1, got {self.sequences}")
        if e.gamma < 1:
            raise UserError(f"--gamma must be in 1..16 for leak-check (the drafter must run), got {e.gamma}")
        if e.max_new_tokens < 2:
            raise UserError(f"--max-new-tokens must be >= 2, got {e.max_new_tokens}")
        need = budget_tokens(2, e.max_new_tokens, e.gamma)
        if e.max_seq_len is not None and need > e.max_seq_len:
            raise UserError(f"--max-seq-len {e.max_seq_len} is too small: a 2-token prompt + {e.max_new_tokens} new "
                            f"+ gamma {e.gamma} needs {need} rows")


def check_model(c: LeakCheckConfig, model_cfg) -> None:
    """With the model's config: --inject-leak must name one of its state components."""
    if c.inject_leak is not None:
        names = [s.name for s in family_of(model_cfg).state_components(model_cfg, torch.bfloat16)]
        if c.inject_leak not in names:
            raise UserError(f"--inject-leak {c.inject_leak!r}: choose one of {', '.join(names)}")


class InjectedFailure(RuntimeError):
    """Raised inside a verify step by Faults (the 'failed' lifecycle)."""

    def __init__(self, request_id: int, step: int):
        super().__init__(f"injected failure in verify step {step} of request {request_id}")
        self.request_id = request_id


class Faults:
    """The engine's hooks (SpecEngine.hooks) that give leak-check its lifecycles: a request that
    fails inside a verify step, one cancelled after some steps as a client would, and a planted leak
    (a state component never given back) that the verdict must catch."""

    def __init__(self, leak: str | None = None):
        self.fail_at: dict[int, int] = {}  # request id -> the verify step that raises
        self.cancel_after: dict[int, int] = {}  # request id -> the steps after which it is cancelled
        self.leak = leak

    def before_verify(self, seqs) -> None:
        for s in seqs:
            if self.fail_at.get(s.req.request_id) == s.steps:
                raise InjectedFailure(s.req.request_id, s.steps)

    def cancels(self, seq) -> bool:
        after = self.cancel_after.get(seq.req.request_id)
        return after is not None and seq.steps >= after

    def kept_component(self, owner: str) -> str | None:
        """The component of `owner`'s caches not given back (its short name), if any."""
        if self.leak is not None and self.leak.startswith(owner + "_"):
            return self.leak[len(owner) + 1:]
        return None


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _snapshot(pools, device: torch.device) -> dict:
    gc.collect()
    snap = {"blocks_held": pools.blocks_held(), "bytes_held": pools.bytes_held()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        snap["cuda_allocated"] = torch.cuda.memory_allocated(device)
    snap["rss"] = rss_bytes()
    return snap


def _row(req: Request, kind: str, finish: str, ntok: int, snap: dict, base: dict) -> dict:
    growth = {k: snap["bytes_held"].get(k, 0) - base["bytes_held"].get(k, 0) for k in snap["bytes_held"]}
    row = {"sequence": req.request_id, "lifecycle": kind, "finish_reason": finish, "prompt_tokens": len(req.prompt),
           "tokens": ntok, "blocks_held": snap["blocks_held"], "bytes_held": snap["bytes_held"],
           "growth_bytes": growth, "rss_bytes": snap["rss"],
           "rss_growth_bytes": (snap["rss"] - base["rss"]) if snap["rss"] is not None and base["rss"] is not None else None}
    if "cuda_allocated" in snap:
        row["cuda_allocated_bytes"] = snap["cuda_allocated"]
        row["cuda_growth_bytes"] = snap["cuda_allocated"] - base["cuda_allocated"]
    return row


def run_leakcheck(rt: Runtime, c: LeakCheckConfig, on_sequence=None) -> dict:
    """Warm-up, baseline, then c.sequences lives cycling LIFECYCLES. Returns the JSON document."""
    check_model(c, rt.cfg)
    if rt.mtp is None:
        raise UserError(f"{rt.resolved.folder}: no MTP layer loaded; leak-check needs the drafter")
    e = resolve(rt, c.engine.replace(sampling=SamplingParams(seed=c.seed), eos_ids=(), check_invariants=True))
    rng = random.Random(c.seed)
    vocab = rt.cfg.vocab_size
    max_prompt = max(2, min(48, e.max_seq_len - e.max_new_tokens - e.gamma))

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(2, max_prompt))]

    # The pool holds every sequence of the run at once, so an injected (or real) leak shows in the
    # ledger instead of ending the run with an exhausted pool.
    per_seq = reserve_tokens(max_prompt, e.max_new_tokens, e.gamma, e.alloc, e.max_seq_len)
    lives = c.sequences + c.sequences // len(LIFECYCLES) + 3  # + EOS probes + warm-up
    pools = rt.make_pools(per_seq, lives)
    engine = make_engine(rt, pools, e)
    faults = engine.hooks = Faults(c.inject_leak)

    def run_round(reqs: list[Request], eos: set[int]) -> list[tuple[str, int]]:
        engine.eos = eos
        try:
            return [(r.finish_reason, len(r.tokens)) for r in engine.generate(reqs)]
        except InjectedFailure as failure:
            # the failing request, and the others it aborted (live in a slot or still waiting)
            return [("failed" if q.request_id == failure.request_id else "aborted", -1)
                    if r is None or not r.finish_reason else (r.finish_reason, len(r.tokens))
                    for q, r in zip(reqs, engine.results)]

    with torch.no_grad():
        # the warm-up fills every slot with the longest prompt: the engine's graphs are built for the
        # slots and the longest request they have met (graphs.table_blocks), so a later round
        # with more or longer ones would rebuild them after the baseline (allocator growth on CUDA)
        run_round([Request([rng.randrange(vocab) for _ in range(max_prompt)], e.max_new_tokens, request_id=-1 - j)
                   for j in range(e.batch_size)], set())
        base = _snapshot(pools, rt.device)
        lives = []
        for i in range(c.sequences):
            kind = LIFECYCLES[i % len(LIFECYCLES)]
            p = prompt()
            req = Request(p, e.max_new_tokens, request_id=i)
            eos: set[int] = set()
            if kind == "eos":
                # An honest EOS: learn what the model emits for this prompt, then declare the first
                # token that is new at position >= 1 an EOS token, so the sequence ends early.
                engine.eos = set()
                probe = engine.generate([Request(p, e.max_new_tokens, request_id=-2 - i)], batch_size=1)[0].tokens
                k = next((j for j in range(1, len(probe)) if probe[j] not in probe[:j]), 0)
                eos = {probe[k]}
            elif kind == "cancelled":
                faults.cancel_after[i] = 1 + (i // len(LIFECYCLES)) % 2
            elif kind == "failed":
                faults.fail_at[i] = 1 + (i // len(LIFECYCLES)) % 2
            lives.append((kind, req, eos))
        size = 1 if e.batch_size == 1 else 2 * e.batch_size
        if size > 1:
            lives.sort(key=lambda life: life[0] == "failed")  # a failure aborts its round: those go last
        rows = []
        for r0 in range(0, len(lives), size):
            group = lives[r0:r0 + size]
            outcomes = run_round([req for _, req, _ in group], set().union(*(eos for _, _, eos in group)))
            snap = _snapshot(pools, rt.device)
            for (kind, req, _), (finish, ntok) in zip(group, outcomes):
                rows.append(_row(req, kind, finish, ntok, snap, base))
                if on_sequence is not None:
                    on_sequence(rows[-1])
    engine.close()

    last = rows[-1]
    leaked = {k: v / c.sequences for k, v in last["growth_bytes"].items() if v > 0}
    if "cuda_growth_bytes" in last and last["cuda_growth_bytes"] > CUDA_TOLERANCE:
        leaked["cuda_allocator"] = last["cuda_growth_bytes"] / c.sequences
    return {
        "model": rt.resolved.spec, "device": str(rt.device), "dtype": str(rt.dtype).replace("torch.", ""),
        "gamma": e.gamma, "alloc": e.alloc, "max_seq_len": e.max_seq_len, "max_new_tokens": e.max_new_tokens,
        "inject_leak": c.inject_leak, "graphs": e.graphs, "compile": e.compile, "batch_size": e.batch_size, "judged_on": "ledger+cuda_allocated" if rt.device.type == "cuda" else "ledger",
        "baseline": {"blocks_held": base["blocks_held"], "bytes_held": base["bytes_held"], "rss_bytes": base["rss"],
                     **({"cuda_allocated_bytes": base["cuda_allocated"]} if "cuda_allocated" in base else {})},
        "lifecycles_seen": sorted({r["finish_reason"] for r in rows}),
        "sequences": rows,
        "verdict": "leak" if leaked else "clean",
        "leaked_bytes_per_sequence": leaked,
    }
