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
from glm5mtp_cli.engine.runtime import Runtime, make_engine
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.engine.sequence import InjectedFailure, Request, budget_tokens, reserve_tokens

LIFECYCLES = ("length", "eos", "cancelled", "failed")
CUDA_TOLERANCE = 1 << 20  # allocator growth (bytes, whole run) tolerated on CUDA: workspaces, RNG state


@dataclass
class LeakCheckConfig:
    sequences: int = 24
    gamma: int = 3
    max_new_tokens: int = 16
    alloc: str = "budget"
    max_seq_len: int = 256
    inject_leak: str | None = None
    seed: int = 0
    graphs: str = "eager"  # engine forward mode (runtime.graph_mode): CUDA graphs are checked too
    compile: str = "off"  # --compile (engine/compiled.py)
    compile_mode: str = "default"
    batch_size: int = 1  # slots of the engine; > 1: rounds of 2 * batch_size lives (module docstring)


def check_flags(c: LeakCheckConfig, model_cfg=None) -> None:
    """Flag checks; with the model's config, --inject-leak must name one of its state components."""
    if c.sequences < 1:
        raise UserError(f"--sequences must be >= 1, got {c.sequences}")
    if c.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {c.batch_size}")
    if not 1 <= c.gamma <= 16:
        raise UserError(f"--gamma must be in 1..16 for leak-check (the drafter must run), got {c.gamma}")
    if c.max_new_tokens < 2:
        raise UserError(f"--max-new-tokens must be >= 2, got {c.max_new_tokens}")
    if c.alloc not in ("budget", "ceiling"):
        raise UserError(f"--alloc must be 'budget' or 'ceiling', got {c.alloc!r}")
    if c.inject_leak is not None and model_cfg is not None:
        names = [s.name for s in family_of(model_cfg).state_components(model_cfg, torch.bfloat16)]
        if c.inject_leak not in names:
            raise UserError(f"--inject-leak {c.inject_leak!r}: choose one of {', '.join(names)}")
    if c.max_seq_len < 1:
        raise UserError(f"--max-seq-len must be positive, got {c.max_seq_len}")
    need = budget_tokens(2, c.max_new_tokens, c.gamma)
    if need > c.max_seq_len:
        raise UserError(f"--max-seq-len {c.max_seq_len} is too small: a 2-token prompt + {c.max_new_tokens} new "
                        f"+ gamma {c.gamma} needs {need} rows")


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
    check_flags(c, rt.cfg)
    if rt.mtp is None:
        raise UserError(f"{rt.resolved.folder}: no MTP layer loaded; leak-check needs the drafter")
    rng = random.Random(c.seed)
    vocab = rt.cfg.vocab_size
    max_prompt = max(2, min(48, c.max_seq_len - c.max_new_tokens - c.gamma))

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(2, max_prompt))]

    # The pool holds every sequence of the run at once, so an injected (or real) leak shows in the
    # ledger instead of ending the run with an exhausted pool.
    per_seq = reserve_tokens(max_prompt, c.max_new_tokens, c.gamma, c.alloc, c.max_seq_len)
    lives = c.sequences + c.sequences // len(LIFECYCLES) + 3  # + EOS probes + warm-up
    pools = rt.make_pools(per_seq, lives)
    engine = make_engine(rt, pools, gamma=c.gamma, sampling=SamplingParams(seed=c.seed),
                        max_seq_len=c.max_seq_len, alloc=c.alloc, eos_ids=[], device=rt.device, graphs=c.graphs,
                        compile=c.compile, compile_mode=c.compile_mode,
                        check_invariants=True, inject_leak=c.inject_leak)

    def run_round(reqs: list[Request], eos: set[int]) -> list[tuple[str, int]]:
        engine.eos = eos
        try:
            return [(r.finish_reason, len(r.tokens)) for r in engine.generate(reqs, batch_size=c.batch_size)]
        except InjectedFailure as e:
            # the failing request, and the others it aborted (live in a slot or still waiting)
            return [("failed" if q.request_id == e.request_id else "aborted", -1) if r is None or not r.finish_reason
                    else (r.finish_reason, len(r.tokens)) for q, r in zip(reqs, e.results)]

    with torch.no_grad():
        # the warm-up fills every slot with the longest prompt: the engine's graphs are built for the
        # slots and the longest request they have met (graphs.table_blocks), so a later round
        # with more or longer ones would rebuild them after the baseline (allocator growth on CUDA)
        run_round([Request([rng.randrange(vocab) for _ in range(max_prompt)], c.max_new_tokens, request_id=-1 - j)
                   for j in range(c.batch_size)], set())
        base = _snapshot(pools, rt.device)
        lives = []
        for i in range(c.sequences):
            kind = LIFECYCLES[i % len(LIFECYCLES)]
            p = prompt()
            req = Request(p, c.max_new_tokens, request_id=i)
            eos: set[int] = set()
            if kind == "eos":
                # An honest EOS: learn what the model emits for this prompt, then declare the first
                # token that is new at position >= 1 an EOS token, so the sequence ends early.
                engine.eos = set()
                probe = engine.generate([Request(p, c.max_new_tokens, request_id=-2 - i)])[0].tokens
                k = next((j for j in range(1, len(probe)) if probe[j] not in probe[:j]), 0)
                eos = {probe[k]}
            elif kind == "cancelled":
                req.cancel_after_steps = 1 + (i // len(LIFECYCLES)) % 2
            elif kind == "failed":
                req.fail_at_step = 1 + (i // len(LIFECYCLES)) % 2
            lives.append((kind, req, eos))
        size = 1 if c.batch_size == 1 else 2 * c.batch_size
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
        "gamma": c.gamma, "alloc": c.alloc, "max_seq_len": c.max_seq_len, "max_new_tokens": c.max_new_tokens,
        "inject_leak": c.inject_leak, "graphs": c.graphs, "compile": c.compile, "batch_size": c.batch_size, "judged_on": "ledger+cuda_allocated" if rt.device.type == "cuda" else "ledger",
        "baseline": {"blocks_held": base["blocks_held"], "bytes_held": base["bytes_held"], "rss_bytes": base["rss"],
                     **({"cuda_allocated_bytes": base["cuda_allocated"]} if "cuda_allocated" in base else {})},
        "lifecycles_seen": sorted({r["finish_reason"] for r in rows}),
        "sequences": rows,
        "verdict": "leak" if leaked else "clean",
        "leaked_bytes_per_sequence": leaked,
    }
