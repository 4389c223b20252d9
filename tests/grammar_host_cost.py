"""Host cost of the grammar work in a constrained step, per call: a matcher compiled against one
opened from its constraint's template, and a walk from a fresh template against one from a template
a walked matcher retired into; one mask in each state of a function-call object's walk (one
thread); --no-draft-mask's verify walk (rows 0-3 at batch 8, 3 drafts each, JSON-schema matchers at
different depths of one object) on llguidance pools of 1 to 12 threads and as the engine computes
it (on the calling thread at this batch: `grammar.ON_CALLER`); and on CUDA the bitmask's
application (the Triton kernel's launch against the PyTorch reference's ops). Medians of 100 calls
(a mask) or 300 (the rest); prints one line per measurement (profiles/constrained/RESULTS.md).

    python3 tests/grammar_host_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm5mtp_cli.constraint import llguidance  # noqa: E402
from glm5mtp_cli.engine.config import ModelSpec  # noqa: E402
import glm5mtp_cli.engine.grammar as grammar  # noqa: E402
from glm5mtp_cli.engine.grammar import Grammars, StepMasks  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime  # noqa: E402
from glm5mtp_cli.prompts import read_file  # noqa: E402
from kernels.bitmask import apply_bitmask, apply_bitmask_ref, words  # noqa: E402

OBJECT = '{"name":"get_weather","arguments":{"city":"Paris is a lovely place","unit":"celsius"}}'
STARTS = [0, 2, 5, 9, 14, 18, 22, 28]  # each sequence's tokens of OBJECT consumed before the step


def _grammars(rt) -> Grammars:
    """A fresh engine's matchers over rt's tokenizer (no templates yet)."""
    return Grammars(rt.resolved.folder / "tokenizer.json", rt.cfg.vocab_size, rt.cfg.eos_token_id, None)


def walk_cost(rt, threads: int | None) -> float:
    """Median seconds of the verify's walk (rows 0-3, the drafts' copy read first); threads None:
    the engine's choice (8 sequences: on the calling thread), else every call on a pool of that
    many threads."""
    rule = read_file(ROOT / "profiles" / "constrained" / "prompts.jsonl")[0].constraint
    ids = rt.tokenizer.encode(OBJECT)
    g = _grammars(rt)
    on_caller = grammar.ON_CALLER
    if threads is not None:
        pool = llguidance().LLExecutor(num_threads=threads)
        g.executor = lambda items: pool
        grammar.ON_CALLER = 0
    seqs = [g.open(rule, set(rt.cfg.eos_token_id)) for _ in STARTS]
    for s, n in zip(seqs, STARTS):
        assert s.matcher.try_consume_tokens(ids[:n]) == n
    drafts = SimpleNamespace(tokens=torch.tensor([ids[n:n + 3] for n in STARTS]), counts=[3] * len(STARTS))

    def once() -> float:
        m = StepMasks(g, seqs, 3, torch.device("cpu"))
        m.read_drafts(drafts)
        t0 = time.perf_counter()
        m.verify(drafts)
        t1 = time.perf_counter()
        for s in seqs:
            s.rollback()
        return t1 - t0

    for _ in range(30):
        once()
    cost = statistics.median(once() for _ in range(300))
    grammar.ON_CALLER = on_caller
    return cost


def mask_costs(rt) -> list[tuple[str, float]]:
    """(the token consumed next, median seconds of one mask before it) for each state of OBJECT's
    walk, on one thread: where the schema forces the next bytes (keys, constants) a mask costs more
    than inside a free string."""
    rule = read_file(ROOT / "profiles" / "constrained" / "prompts.jsonl")[0].constraint
    g = _grammars(rt)
    m = g.open(rule, set(rt.cfg.eos_token_id)).matcher
    row = torch.empty(g.words, dtype=torch.int32)
    costs = []
    for tok in rt.tokenizer.encode(OBJECT):
        ts = []
        for _ in range(100):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            ts.append(time.perf_counter() - t0)
        costs.append((rt.tokenizer.decode([tok]), statistics.median(ts)))
        assert m.try_consume_tokens([tok]) == 1
    return costs


def open_costs(rt) -> tuple[float, float, float, float]:
    """Median seconds, over the shipped constraints, of compiling a matcher and of opening one as the
    engine does (a copy of its constraint's template); and OBJECT's walk (a mask before each token,
    one thread) by a copy of a fresh template and by a copy of the template a walked matcher
    retired into."""
    rules = list(dict.fromkeys(p.constraint for p in read_file(ROOT / "profiles" / "constrained" / "prompts.jsonl")))
    g = _grammars(rt)
    compile_, copy_ = [], []
    for rule in rules:
        text = rule.grammar()
        for _ in range(5):
            t0 = time.perf_counter()
            llguidance().LLMatcher(g.tokenizer(), text, log_level=0)
            compile_.append(time.perf_counter() - t0)
        g.open(rule, set()).free()  # its template compiled
        for _ in range(5):
            t0 = time.perf_counter()
            opened = g.open(rule, set())
            copy_.append(time.perf_counter() - t0)
            opened.free()
    ids = rt.tokenizer.encode(OBJECT)
    row = torch.empty(g.words, dtype=torch.int32)

    def walk(m) -> float:
        t0 = time.perf_counter()
        for tok in ids:
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            assert m.try_consume_tokens([tok]) == 1
        return time.perf_counter() - t0

    first, retired = [], []
    for _ in range(5):
        g = _grammars(rt)
        s = g.open(rules[0], set())
        first.append(walk(s.matcher))
        s.free()
        retired.append(walk(g.open(rules[0], set()).matcher))
    return (statistics.median(compile_), statistics.median(copy_), statistics.median(first),
            statistics.median(retired))


def apply_cost(fn, dtype) -> float:
    logits = torch.randn(8, 4, 4096, device="cuda", dtype=dtype)
    mask = torch.randint(-2**31, 2**31 - 1, (8, 4, words(4096)), dtype=torch.int32, device="cuda")
    for _ in range(20):
        fn(logits, mask)
    torch.cuda.synchronize()
    ts = []
    for _ in range(300):
        t0 = time.perf_counter()
        fn(logits, mask)
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts)


def main() -> None:
    rt = load_runtime(ModelSpec("glm5-nano", "cpu", "fp32"), progress=False)
    compiled, copied, first, retired = open_costs(rt)
    print(f"a matcher for a shipped constraint: compiled {1e6 * compiled:.0f} us, opened from its template "
          f"{1e6 * copied:.0f} us; the object's walk ({len(rt.tokenizer.encode(OBJECT))} masks) by a copy of a fresh "
          f"template {1e6 * first:.0f} us, of a retired one {1e6 * retired:.0f} us")
    costs = mask_costs(rt)
    print("one mask before each token of the object, us: " + " ".join(f"{t!r} {1e6 * c:.0f}" for t, c in costs))
    for threads in (1, 2, 4, 8, 12, None):
        name = f"{threads:2d} threads" if threads else "the engine's choice"
        print(f"walk, batch 8, gamma 3, {name}: rows 0-3 {1e6 * walk_cost(rt, threads):.0f} us")
    if torch.cuda.is_available():
        for dtype in (torch.bfloat16, torch.float32):
            for name, fn in (("Triton", apply_bitmask), ("PyTorch reference", apply_bitmask_ref)):
                print(f"apply [8, 4, 4096] {dtype}, {name}: {1e6 * apply_cost(fn, dtype):.1f} us host per call")


if __name__ == "__main__":
    main()
