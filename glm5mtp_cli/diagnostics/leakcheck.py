"""leak-check: run many sequences through one engine and one pool, each through a whole life
(normal end, early EOS, cancellation, an error inside a verify step, and, where the checkpoint has
a tokenizer and llguidance is installed, a constrained request that its grammar ends), and check
that every cache pool component, every grammar matcher and the autograd nodes behind the pools
(none while the engine's state stays out of autograd) go back to their baseline (ARCHITECTURE
invariant 2, REFERENCE section 8).

With --batch-size B > 1 the lives run in rounds of up to 2B requests through one continuously
batched generate call of B slots, so slots are re-occupied within a round, and each round ends with
one snapshot shared by its rows. Every life ends as its lifecycle names it, by construction: the
engine's EOS set is the whole call's, so the EOS lives run in rounds of their own (any of their EOS
tokens ends an EOS life); an injected failure aborts its whole round, so a failure runs beside one
life of its own, 'aborted' (live in a slot when the failure hits: the engine releases it); a
cancellation or failure comes at a step the sequence cannot have reached its length by. The report
still compares each ending with its name and says where they differ.

The baseline is taken after a warm-up that fills every slot with the longest prompt, so the
engine's CUDA graphs (built for its slots and its longest request) exist before it and are never
rebuilt after it; the warm-up also runs one life of each lifecycle, and at least a round's worth of
lives, so that whatever a path builds once (a graph set for one slot, a first exception, host
buffers as wide as every slot busy) exists before the baseline too.

The verdict: the pools' ledger (bytes held per component) must be back at its baseline after the last
sequence (it is exact, so any growth is a leak). The run's device memory is judged by its slope, the
least-squares growth per sequence over every snapshot after the baseline, of their lower envelope (a
snapshot's minimum with every later one and with one taken after a last uncounted life: a leak never
gives memory back, while tensors a snapshot catches in passing do): CUDA's `memory_allocated`,
or on the CPU the bytes of every live tensor (a census of the garbage collector's objects, storages
counted once). A leak is a slope that, over the run's sequences, exceeds two allocation units of
512 B (CUDA's caching allocator rounds every block to 512 B; the CPU census, exact to the byte, uses
the same unit, as tensors a step replaces by one of another size, a pool selection as wide as the
pools its row sees, move it by a few hundred bytes without growing): a fixed tolerance per run
would hide a small leak in a long one. The process RSS is reported but not judged (the allocator
keeps freed pages; the pools are committed lazily).
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.constraint import Constraint
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.units import parse_size
from glm5mtp_cli.engine.config import EngineConfig, SamplingParams, check_seed
from glm5mtp_cli.engine.runtime import Runtime, make_engine, resolve
from glm5mtp_cli.engine.sequence import Request, budget_tokens, reserve_tokens

LIFECYCLES = ("length", "eos", "cancelled", "failed")
ABORTED = "aborted"  # above batch 1: the life a failure aborts (it follows "failed" in the cycle)
GRAMMAR = "grammar"
ROUND_OF = {"eos": "eos", "failed": "failure", ABORTED: "failure"}  # the others run in "plain" rounds
FILL_RULE = Constraint("regex", "[a-z]+")  # a warm-up fill's: past its first token, every step is constrained
ALLOCATION_UNIT = 512  # bytes: the CUDA caching allocator's rounding (the module doc says why the CPU's too)


@dataclass(frozen=True)
class LeakCheckConfig:
    engine: EngineConfig  # gamma, max_new_tokens, alloc, max_seq_len, batch_size, forward mode
    sequences: int = 24
    inject_leak: str | None = None  # a state component never given back, or tensor:BYTES (the verdict's self-test)
    seed: int = 0  # of the random prompts (and the engine's sampler)

    def __post_init__(self):
        e = self.engine
        planted_bytes(self.inject_leak)  # a malformed tensor:BYTES is refused before anything loads
        check_seed(self.seed)
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


def planted_bytes(inject_leak: str | None) -> int | None:
    """BYTES of --inject-leak tensor:BYTES (a live tensor planted per sequence), else None."""
    if inject_leak is None or not inject_leak.startswith("tensor:"):
        return None
    try:
        return parse_size(inject_leak[len("tensor:"):])
    except UserError:
        raise UserError(f"--inject-leak {inject_leak}: BYTES must be a positive size, e.g. tensor:1KiB or "
                        f"tensor:64") from None


def check_model(c: LeakCheckConfig, model_cfg) -> None:
    """With the model's config: --inject-leak must name one of its state components (or tensor:BYTES)."""
    if c.inject_leak is not None and planted_bytes(c.inject_leak) is None:
        names = [s.name for s in family_of(model_cfg).state_components(model_cfg, torch.bfloat16)]
        if c.inject_leak not in names:
            raise UserError(f"--inject-leak {c.inject_leak!r}: choose one of {', '.join(names)}, or tensor:BYTES")


class InjectedFailure(RuntimeError):
    """Raised inside a verify step by Faults (the 'failed' lifecycle)."""

    def __init__(self, request_id: int, step: int):
        super().__init__(f"injected failure in verify step {step} of request {request_id}")
        self.request_id = request_id


class Faults:
    """The engine's hooks (Lifecycle.hooks) that give leak-check its lifecycles: a request that
    fails inside a verify step, one cancelled after some steps as a client would, and a planted leak
    (a state component never given back) that the verdict must catch."""

    def __init__(self, leak: str | None = None):
        self.fail_at: dict[int, int] = {}  # request id -> the verify step that raises
        self.cancel_after: dict[int, int] = {}  # request id -> the steps after which it is cancelled
        self.leak = leak
        self.planted: list[torch.Tensor] = []  # --inject-leak tensor:BYTES, one per finished sequence

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


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of every live tensor's storage on `device` that Python can reach, each storage once."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device.type and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def autograd_nodes(pools) -> int:
    """Autograd nodes behind the pools' tensors. None while the engine's state stays out of
    autograd; if it came to require grad, every in-place write (a KDA commit) chains one more, and
    what those nodes keep alive is out of the census's reach (not Python objects)."""
    seen: set[int] = set()
    stack = [pool.data.grad_fn for pool in pools.pools.values()]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(nxt for nxt, _ in node.next_functions)
    return len(seen)


GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives a gloo process group's worker threads


def gloo_workers_asleep(timeout_s: float = 10.0) -> bool:
    """Waits until every gloo worker thread of this process sleeps (Linux's /proc; elsewhere there
    is nothing to read). A worker wakes the rank waiting on its collective before it lets go of the
    collective's tensors, and on a loaded CPU it may not run again for a while; meanwhile those
    tensors, their Python objects kept alive for it, are in the census. Asleep, it holds none."""
    tasks = "/proc/self/task"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            states = [open(f"{tasks}/{t}/stat").read().rpartition(")")[2].split()[0]
                      for t in os.listdir(tasks) if open(f"{tasks}/{t}/comm").read().strip() == GLOO_WORKER]
        except OSError:  # no /proc, or a thread that ended while read
            return not os.path.isdir(tasks)
        if all(state == "S" for state in states):
            return True
        time.sleep(0.001)
    return False


def _snapshot(pools, device: torch.device, grammars, comm) -> dict:
    # Under --tp on the CPU the census read a forward's collective buffers now and then (1.5 KB,
    # a verify's local logits at glm5next-tiny --tp 2; 4.6 KB with the gathered ones): held by a
    # gloo worker that had not yet run again since the collective returned (gloo_workers_asleep).
    if comm is not None:
        gloo_workers_asleep()
    gc.collect()
    snap = {"blocks_held": pools.blocks_held(), "bytes_held": pools.bytes_held(),
            "matchers": grammars.live if grammars is not None else 0, "autograd_nodes": autograd_nodes(pools)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        snap["cuda_allocated"] = torch.cuda.memory_allocated(device)
    else:
        snap["live_tensors"] = live_tensor_bytes(device)
    snap["rss"] = rss_bytes()
    return snap


def grammar_rule(max_new_tokens: int) -> Constraint:
    """The grammar life's constraint: at most as many letters as tokens in its budget, so that the
    grammar, not the length, ends it (every token adds a letter)."""
    return Constraint("regex", f"[a-z]{{1,{min(4, max_new_tokens)}}}")


def last_safe_step(max_new_tokens: int, gamma: int) -> int:
    """The most verify steps after which a sequence is surely short of its length (a step adds at
    most gamma + 1 tokens to the prefill's one): where a cancellation or failure may come."""
    return (max_new_tokens - 2) // (gamma + 1)


def ended_otherwise(rows: list[dict]) -> list[dict]:
    """The sequences whose ending differs from the lifecycle they were run for."""
    return [{"sequence": r["sequence"], "lifecycle": r["lifecycle"], "finish_reason": r["finish_reason"]}
            for r in rows if r["finish_reason"] != r["lifecycle"]]


def _constrainable(rt: Runtime, e: EngineConfig) -> bool:
    """Whether the constrained lifecycle runs: a tokenizer to match over, llguidance, no synthetic draws."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return rt.tokenizer is not None and rt.tp == 1 and e.synthetic_acceptance is None


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares growth of y per unit of x over (x, y) points (0 for fewer than two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def lower_envelope(values: list[int]) -> list[int]:
    """Each value's minimum with every later one: what stayed held, without what a snapshot caught in
    passing (a leak never gives memory back, so its growth is all kept)."""
    out, low = [], None
    for v in reversed(values):
        low = v if low is None else min(low, v)
        out.append(low)
    return out[::-1]


def device_verdict(snaps: list[tuple[int, dict]], settled: dict, base: dict, device: torch.device) -> dict:
    """The slope verdict on the run's device memory, from (sequences done, snapshot) after the
    baseline and the snapshot after one more uncounted life (`settled`): the slope of the lower
    envelope, so tensors a snapshot catches in passing (under --tp, a collective's buffers) are not
    growth."""
    key = "cuda_allocated" if device.type == "cuda" else "live_tensors"
    kept = lower_envelope([snap[key] - base[key] for _, snap in snaps] + [settled[key] - base[key]])[:-1]
    points = [(0, 0)] + [(done, y) for (done, _), y in zip(snaps, kept)]
    per_sequence = slope(points)
    over_run = per_sequence * snaps[-1][0]
    return {"measure": key, "bytes_per_sequence": per_sequence, "over_run_bytes": over_run,
            "limit_bytes": 2 * ALLOCATION_UNIT, "allocation_unit_bytes": ALLOCATION_UNIT,
            "leak": over_run > 2 * ALLOCATION_UNIT}


def _row(req: Request, kind: str, finish: str, ntok: int, snap: dict, base: dict) -> dict:
    growth = {k: snap["bytes_held"].get(k, 0) - base["bytes_held"].get(k, 0) for k in snap["bytes_held"]}
    row = {"sequence": req.request_id, "lifecycle": kind, "finish_reason": finish, "prompt_tokens": len(req.prompt),
           "tokens": ntok, "blocks_held": snap["blocks_held"], "bytes_held": snap["bytes_held"],
           "growth_bytes": growth, "rss_bytes": snap["rss"],
           "rss_growth_bytes": (snap["rss"] - base["rss"]) if snap["rss"] is not None and base["rss"] is not None else None}
    if "cuda_allocated" in snap:
        row["cuda_allocated_bytes"] = snap["cuda_allocated"]
        row["cuda_growth_bytes"] = snap["cuda_allocated"] - base["cuda_allocated"]
    if "live_tensors" in snap:
        row["live_tensor_bytes"] = snap["live_tensors"]
        row["live_tensor_growth_bytes"] = snap["live_tensors"] - base["live_tensors"]
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
    size = 1 if e.batch_size == 1 else 2 * e.batch_size  # a round's lives: above batch 1, twice the slots
    constrained = _constrainable(rt, e)
    lifecycles = LIFECYCLES + ((ABORTED,) if size > 1 else ()) + ((GRAMMAR,) if constrained else ())
    latest = last_safe_step(e.max_new_tokens, e.gamma)

    # The pool holds every sequence of the run at once, so an injected (or real) leak shows in the
    # ledger instead of ending the run with an exhausted pool: the lives, the warm-up's one of each
    # lifecycle, their EOS probes, the fills (below) and the settling life.
    per_seq = reserve_tokens(max_prompt, e.max_new_tokens, e.gamma, e.alloc, e.max_seq_len)
    lives_held = c.sequences + len(lifecycles) + c.sequences // len(lifecycles) + 2 + 2 * e.batch_size + 1
    pools = rt.make_pools(per_seq, lives_held)
    engine = make_engine(rt, pools, e)
    plant = planted_bytes(c.inject_leak)
    faults = engine.lifecycle.hooks = Faults(c.inject_leak if plant is None else None)

    def run_round(reqs: list[Request], eos: set[int]) -> list[tuple[str, int]]:
        engine.lifecycle.eos = eos
        try:
            return [(r.finish_reason, len(r.tokens)) for r in engine.generate(reqs)]
        except InjectedFailure as failure:
            # the failing request, and the others it aborted (live in a slot or still waiting)
            return [("failed" if q.request_id == failure.request_id else "aborted", -1)
                    if r is None or not r.finish_reason else (r.finish_reason, len(r.tokens))
                    for q, r in zip(reqs, engine.results)]

    def life(i: int, request_id: int) -> tuple[str, Request, set[int]]:
        kind = lifecycles[i % len(lifecycles)]
        p = [rng.randrange(vocab) for _ in range(rng.randint(2, max_prompt))]
        eos: set[int] = set()
        if kind == "eos":
            # An honest EOS: learn what the model emits for this prompt, then declare the first
            # token that is new at position >= 1 an EOS token, so the sequence ends early.
            engine.lifecycle.eos = set()
            probe = engine.generate([Request(p, e.max_new_tokens, request_id=-10_000 - request_id)],
                                    batch_size=1)[0].tokens
            k = next((j for j in range(1, len(probe)) if probe[j] not in probe[:j]), 0)
            eos = {probe[k]}
        elif kind == "cancelled":
            faults.cancel_after[request_id] = min(1 + (i // len(lifecycles)) % 2, latest)
        elif kind == "failed":
            faults.fail_at[request_id] = min(1 + (i // len(lifecycles)) % 2, latest)
        rule = grammar_rule(e.max_new_tokens) if kind == GRAMMAR else None
        return kind, Request(p, e.max_new_tokens, request_id=request_id, constraint=rule), eos

    def rounds(lives):
        """(lives, outcomes) per round, in the order the rounds fill: each of a kind of round (ROUND_OF),
        a failure's of two (the failure, and the life it aborts)."""
        def play(group):
            return group, run_round([req for _, req, _ in group], set().union(*(eos for _, _, eos in group)))

        pending: dict[str, list] = {}
        for lv in lives:
            kind = ROUND_OF.get(lv[0], "plain")
            group = pending.setdefault(kind, [])
            group.append(lv)
            if len(group) == (min(2, size) if kind == "failure" else size):
                yield play(pending.pop(kind))
        for group in pending.values():
            yield play(group)

    def fill(rule: Constraint | None) -> None:
        run_round([Request([rng.randrange(vocab) for _ in range(max_prompt)], e.max_new_tokens,
                           request_id=-1 - j, constraint=rule) for j in range(e.batch_size)], set())

    # Run as generate and bench run, outside no_grad, so that engine state that joins autograd shows.
    # The warm-up fills every slot with the longest prompt (the engine's graphs are built for the
    # slots and the longest request they have met, graphs.table_blocks, so a later round with
    # more or longer ones would rebuild them after the baseline), and again under a grammar, so
    # that what a constrained step sizes to its sequences is as wide as every slot before the
    # baseline (engine/grammar.host_buffer: as many rows as the most sequences a step met; batch
    # 8's grew from 5 to 8 rows in a counted round, 9.7 KB the slope read as 434 B a sequence);
    # then it runs one life of each lifecycle (what a path builds once, it builds before the
    # baseline).
    fill(None)
    if constrained:
        fill(FILL_RULE)
    for _ in rounds([life(i, -1_000 - i) for i in range(len(lifecycles))]):
        pass
    base = _snapshot(pools, rt.device, engine.grammars, rt.comm)
    rows, snaps = [], []
    for group, outcomes in rounds([life(i, i) for i in range(c.sequences)]):
        if plant is not None:
            faults.planted += [torch.empty(plant, dtype=torch.uint8, device=rt.device) for _ in group]
        snap = _snapshot(pools, rt.device, engine.grammars, rt.comm)
        snaps.append((len(rows) + len(group), snap))
        for (kind, req, _), (finish, ntok) in zip(group, outcomes):
            rows.append(_row(req, kind, finish, ntok, snap, base))
            if on_sequence is not None:
                on_sequence(rows[-1])
    run_round([Request([rng.randrange(vocab) for _ in range(2)], e.max_new_tokens, request_id=-20_000)], set())
    settled = _snapshot(pools, rt.device, engine.grammars, rt.comm)
    engine.close()

    last = rows[-1]
    leaked = {k: v / c.sequences for k, v in last["growth_bytes"].items() if v > 0}
    for key, name in (("matchers", "grammar_matchers"), ("autograd_nodes", "autograd_nodes")):
        if settled[key] > base[key]:  # counted exactly, like the ledger: any growth is a leak
            leaked[name] = (settled[key] - base[key]) / c.sequences
    memory = device_verdict(snaps, settled, base, rt.device)
    if memory["leak"]:
        leaked["cuda_allocator" if rt.device.type == "cuda" else "live_tensors"] = memory["bytes_per_sequence"]
    baseline = {"blocks_held": base["blocks_held"], "bytes_held": base["bytes_held"], "rss_bytes": base["rss"]}
    if "cuda_allocated" in base:
        baseline["cuda_allocated_bytes"] = base["cuda_allocated"]
    if "live_tensors" in base:
        baseline["live_tensor_bytes"] = base["live_tensors"]
    return {
        "model": rt.resolved.spec, "device": str(rt.device), "dtype": str(rt.dtype).replace("torch.", ""),
        "gamma": e.gamma, "alloc": e.alloc, "max_seq_len": e.max_seq_len, "max_new_tokens": e.max_new_tokens,
        "inject_leak": c.inject_leak, "synthetic_acceptance": e.synthetic_acceptance, "graphs": e.graphs, "compile": e.compile, "batch_size": e.batch_size,
        "judged_on": f"ledger+{memory['measure']} slope",
        "baseline": baseline,
        "lifecycles_seen": sorted({r["finish_reason"] for r in rows}),
        "ended_otherwise": ended_otherwise(rows),
        "matchers_live_after": settled["matchers"],
        "autograd_nodes_after": settled["autograd_nodes"],
        "sequences": rows,
        "memory_slope": memory,
        "verdict": "leak" if leaked else "clean",
        "leaked_bytes_per_sequence": leaked,
    }
