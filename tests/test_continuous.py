"""Continuous batching (engine/speculate.py generate): more requests than slots, of different
prompt lengths, budgets and early EOS, give every request exactly what it gets alone (greedy, and
sampled: each request draws from its own stream); the static schedule gives the same tokens; a
re-occupied slot never reads or writes the previous sequence's blocks. Both model families."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_oracle import hf_model, write_checkpoint  # noqa: E402

from glm5mtp_cli.engine.config import ModelSpec, EngineConfig
from glm5mtp_cli.engine.cache import BlockPool, CachePools  # noqa: E402
from glm5mtp_cli.engine.runtime import make_engine  # noqa: E402
from glm5mtp_cli.engine.sampling import SamplingParams  # noqa: E402
from glm5mtp_cli.engine.speculate import SpecEngine  # noqa: E402
from glm5mtp_cli.engine.sequence import Request  # noqa: E402
from glm5mtp_cli.engine.mtp_head import mtp_proposer  # noqa: E402
from glm5mtp_cli.models.glm5_next.load import load_next  # noqa: E402
from glm5mtp_cli.models.glm5_next.pooled import PooledMtp, PooledTarget  # noqa: E402
from kernels._triton import kernel_path  # noqa: E402

# prompt, max new tokens: different lengths (one over index_topk), budgets ending at different steps
WORK = [([3, 17, 99, 4, 250], 14), (list(range(10, 40)), 6), ([7] * 3 + list(range(60, 81)), 17),
        ([5, 9], 9), (list(range(100, 112)), 12), ([42, 43, 44, 45], 1)]


@pytest.fixture(scope="module")
def glm5(spec_runtime):
    return spec_runtime


def glm5next_models(folder: Path):
    """A random GLM-5-Next (the transformers oracle's) written to `folder`, loaded for the engine."""
    write_checkpoint(hf_model(seed=0), folder)
    cfg, target, mtp = load_next(folder, torch.float32)
    return cfg, PooledTarget(target), PooledMtp(mtp)


@pytest.fixture(scope="module")
def glm5next(tmp_path_factory):
    return glm5next_models(tmp_path_factory.mktemp("glm5next_continuous"))


def _glm5_engine(rt, gamma, slots, sampling=SamplingParams(), eos=(), mode="eager", schedule="continuous",
                 max_seq_len=64, **prefill):
    pools = rt.make_pools(max_seq_len, slots + 2, block_size=4)  # + 2: freed blocks can stay free a while
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, sampling=sampling, max_seq_len=max_seq_len, eos_ids=tuple(eos), check_invariants=True, graphs=mode, schedule=schedule, **prefill))
    return engine, pools


class Counting:
    """The engine's target, noting the sequences of each eager forward in `widths`."""

    def __init__(self, target, widths: list):
        self.target, self.widths = target, widths

    def __call__(self, ids, caches, rows="all", real=None, plan=None):
        self.widths.append(ids.shape[0])
        return self.target(ids, caches, rows, real, plan)

    def __getattr__(self, name):
        return getattr(self.target, name)


def _next_engine(models, gamma, slots, sampling=SamplingParams(), eos=(), schedule="continuous", max_seq_len=64,
                 **prefill):
    cfg, target, mtp = models
    pools = CachePools.create(cfg, num_blocks=max_seq_len // 4 * (slots + 2), block_size=4, dtype=torch.float32,
                              device="cpu")
    proposer = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=max_seq_len, sampling=sampling)) if gamma else None
    engine = SpecEngine(cfg, target, proposer, pools, EngineConfig(gamma=gamma, sampling=sampling, max_seq_len=max_seq_len, eos_ids=tuple(eos), check_invariants=True, schedule=schedule, graphs="eager", **prefill))
    return engine, pools


def _make(family, models, *args, **kw):
    return _glm5_engine(models, *args, **kw) if family == "glm5" else _next_engine(models, *args, **kw)


def _run(engine, pools, slots, work=WORK):
    res = engine.generate([Request(p, n, i) for i, (p, n) in enumerate(work)], batch_size=slots)
    engine.close()
    assert not any(pools.blocks_held().values()), "a block or slot stayed held"
    return res


def _alone(family, models, gamma, work=WORK, **kw):
    """Each request on its own engine of one slot."""
    out = []
    for i, (p, n) in enumerate(work):
        engine, pools = _make(family, models, gamma, 1, **kw)
        out.append(engine.generate([Request(p, n, i)])[0].tokens)
        engine.close()
    return out


@pytest.fixture(params=["glm5", "glm5next"])
def family(request):
    return request.param


@pytest.fixture
def models(family, glm5, request):
    return glm5 if family == "glm5" else request.getfixturevalue("glm5next")


@pytest.mark.parametrize("gamma", [0, 2])
def test_greedy_continuous_equals_each_request_alone(family, models, gamma):
    alone = _alone(family, models, gamma)
    eos = alone[2][4]  # request 2 ends early at its first emission of this token, others maybe too
    alone_eos = _alone(family, models, gamma, eos=[eos])
    engine, pools = _make(family, models, gamma, 2, eos=[eos])
    res = _run(engine, pools, 2)
    assert [r.tokens for r in res] == alone_eos
    assert res[2].finish_reason == "eos" and len(res[2].tokens) <= 5
    assert [len(r.tokens) for r in res] != [n for _, n in WORK]  # some ended early
    assert res[5].tokens == alone[5][:1]  # one-token budget: done at its prefill, never seated


def test_sampled_continuous_equals_each_request_alone(family, models):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = _alone(family, models, 2, sampling=params)
    engine, pools = _make(family, models, 2, 3, sampling=params)
    assert [r.tokens for r in _run(engine, pools, 3)] == alone
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=12)
    assert _alone(family, models, 2, sampling=other) != alone  # the seed matters


def test_static_schedule_gives_the_same_tokens(family, models):
    engine, pools = _make(family, models, 2, 2)
    cont = _run(engine, pools, 2)
    engine, pools = _make(family, models, 2, 2, schedule="static")
    static = _run(engine, pools, 2)
    assert [r.tokens for r in static] == [r.tokens for r in cont]
    assert [r.acceptance.accepted for r in static] == [r.acceptance.accepted for r in cont]


def test_trace_rows_carry_draft_and_emitted_ids(glm5):
    engine, pools = _glm5_engine(glm5, 3, 2)
    res = _run(engine, pools, 2)
    for r in res:
        emitted = [t for row in r.trace for t in row["emitted_ids"]]
        assert emitted == r.tokens[1:]  # the first token is the prefill's; nothing past the reply
        for row in r.trace:
            assert len(row["draft_ids"]) == row["drafts"] and len(row["emitted_ids"]) == row["emitted"]
            assert row["emitted_ids"][: row["accepted"]] == row["draft_ids"][: row["accepted"]]
        for row in r.trace[:-1]:  # the last step's drafts may be cut at the reply's end, not rejected
            if row["accepted"] < row["drafts"]:  # the target's token replaced the first rejected draft
                assert row["emitted_ids"][-1] != row["draft_ids"][row["accepted"]]


POISON = 1e30


@pytest.mark.parametrize("gamma", [0, 3])
def test_reoccupied_slot_never_touches_the_previous_blocks(glm5, gamma, monkeypatch):
    """Static mode (the CUDA graphs' code path): every freed block is filled with a huge value and
    kept free; after every step none of them was written, and every request's tokens equal its
    tokens alone, so no re-occupied slot read them either."""
    want = _alone("glm5", glm5, gamma)
    poisoned: dict[int, set[int]] = {}
    real_give = BlockPool.give

    def give(self, blocks):
        real_give(self, blocks)
        for b in blocks:
            self.data[:, b * self.block_size:(b + 1) * self.block_size] = POISON
            self._free.remove(b)
            self._free.insert(0, b)  # taken last: stays free (and poisoned) for the rest of the run
            poisoned.setdefault(id(self), set()).add(b)

    monkeypatch.setattr(BlockPool, "give", give)
    engine, pools = _glm5_engine(glm5, gamma, 2, mode="static")
    by_id = {id(p): p for p in pools.pools.values()}
    real_step = engine.step
    checked = []

    def step(run):
        real_step(run)
        for pid, blocks in poisoned.items():
            pool = by_id[pid]
            for b in blocks:
                if b in pool._held:
                    continue  # taken again by a new sequence (only once the pool ran out of clean ones)
                rows = pool.data[:, b * pool.block_size:(b + 1) * pool.block_size]
                assert bool((rows == POISON).all()), f"{pool.name}: freed block {b} was written"
                checked.append(b)

    engine.step = step
    res = _run(engine, pools, 2)
    assert [r.tokens for r in res] == want
    assert checked, "no freed block stayed free while others ran"


def test_leakcheck_over_slot_reuse_in_static_mode(glm5):
    """leak-check's lives through 2 slots with the static forwards (the CUDA graphs' path): clean."""
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig, run_leakcheck

    doc = run_leakcheck(glm5, LeakCheckConfig(EngineConfig(gamma=2, max_new_tokens=6, max_seq_len=64, graphs="static",
                                                           batch_size=2), sequences=8))
    assert doc["verdict"] == "clean"
    assert {"length", "eos", "cancelled", "failed"} <= set(doc["lifecycles_seen"])


# very different prompt lengths admitted in one batch: 2 to 44 rows, chunked by 8 rows, 24 rows a forward
MIXED = [(list(range(200, 244)), 7), ([11, 12], 9), (list(range(30, 47)), 5), ([8, 1, 6], 11),
         (list(range(120, 151)), 8)]


@pytest.mark.parametrize("gamma", [0, 2])
def test_prompts_of_different_lengths_prefilled_together_equal_alone(family, models, gamma):
    alone = _alone(family, models, gamma, work=MIXED)
    engine, pools = _make(family, models, gamma, len(MIXED), prefill_chunk=8, prefill_tokens=24)
    widths = []  # sequences per target forward during the admission
    engine.admission.target = Counting(engine.admission.target, widths)
    first = {}  # request -> target forwards run when its first token came
    engine.lifecycle.on_tokens = lambda rid, toks: first.setdefault(rid, len(widths))
    res = _run(engine, pools, len(MIXED), work=MIXED)
    assert [r.tokens for r in res] == alone
    admission = widths[: max(first.values())]  # every request admitted in one batch: its forwards
    # prompts share forwards within the 24-row budget (GLM-5-Next: padding kept out of the KDA state)
    assert max(admission) > 1 and len(admission) < sum(-(-len(p) // 8) for p, _ in MIXED)


# GLM-5-Next prompts across the KDA chunk (64 rows) and pool (4) boundaries, ending mid-pool
LONG = [(list(range(2, 99)), 9), ([21, 22, 23], 7), (list(range(110, 176)), 12), (list(range(40, 71)), 5),
        (list(range(7, 70)), 8), ([9] * 6 + list(range(80, 99)), 10), (list(range(30, 100)), 6)]


def _per_request(res):
    return [(r.tokens, r.finish_reason, r.acceptance.accepted, r.acceptance.proposed) for r in res]


@pytest.mark.parametrize("path", ["cuda", "all"])
def test_glm5next_varlen_prefill_equals_each_prompt_alone(glm5next, path):
    """One forward of 4 prompts padded to 70 rows ('final' KDA: across its 64-row chunk; pools of 4
    ended mid-pool) gives each prompt's last logits and hiddens as its own forward does, and leaves
    its KDA states and conv windows such that the next decode step's logits agree too. Path "all":
    the shared forward takes the kernels' branch (KDA's one-launch recurrence over every prompt's
    real rows, kernels/kda.kda_slots with `final`), each prompt alone the chunked form."""
    cfg, target, _ = glm5next
    lengths = [70, 5, 66, 33]
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    pools = CachePools.create(cfg, num_blocks=200, block_size=4, dtype=torch.float32, device="cpu", with_drafter=False)

    def caches():
        out = [pools.target_cache() for _ in lengths]
        for c in out:
            c.reserve(80)
        return out

    alone, shared = caches(), caches()
    ref = [target(p[None], [c], rows="last") for p, c in zip(prompts, alone)]
    for r, p in zip(ref, prompts):
        target.commit(r.pending, torch.tensor([len(p)]))  # each prompt's own prefill, whole
    ids = torch.zeros(len(lengths), 70, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, : len(p)] = p
    real = torch.tensor(lengths)
    with kernel_path(path):
        out = target(ids, shared, rows=real - 1, real=real)
        target.commit(out.pending, real)  # as prefill_targets does: each KDA state at its real rows
    for j, c in enumerate(shared):
        c.truncate(lengths[j])
        torch.testing.assert_close(out.logits[j, 0], ref[j].logits[0, 0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden_all[j, : lengths[j]], ref[j].hidden_all[0], atol=1e-4, rtol=1e-4)
    nxt = torch.tensor([[7], [8], [9], [10]])
    step_alone = torch.cat([target(nxt[j:j + 1], [c]).logits for j, c in enumerate(alone)])
    step_shared = target(nxt, shared).logits
    torch.testing.assert_close(step_shared, step_alone, atol=1e-4, rtol=1e-4)
    for c in alone + shared:
        c.release()


# a 97-row prompt in pieces ending mid-pool: 66 + 31 ('final' KDA forwards, the first across its
# 64-row chunk) or ten of 10 (verify-sized forwards, whose commits replay the kept rows)
@pytest.mark.parametrize("chunk", [66, 10])
@pytest.mark.parametrize("sampled", [False, True])
def test_glm5next_prompts_admitted_together_equal_one_prompt_per_forward(glm5next, chunk, sampled):
    """Several prompts per forward, padding kept out of the KDA state, give every request exactly
    what one prompt per forward gives (prefill_tokens 1): tokens, finish reason, acceptance counts;
    3 slots for 7 requests, so slots are re-occupied; one EOS id ends some early."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=5) if sampled else SamplingParams()
    kw = dict(sampling=sampling, max_seq_len=112, prefill_chunk=chunk)
    engine, pools = _next_engine(glm5next, 2, 3, prefill_tokens=1, **kw)
    single = _run(engine, pools, 3, work=LONG)
    eos = single[0].tokens[3]
    engine, pools = _next_engine(glm5next, 2, 3, prefill_tokens=1, eos=[eos], **kw)
    single = _per_request(_run(engine, pools, 3, work=LONG))
    engine, pools = _next_engine(glm5next, 2, 3, prefill_tokens=4096, eos=[eos], **kw)
    widths = []
    engine.admission.target = Counting(engine.admission.target, widths)
    shared = _per_request(_run(engine, pools, 3, work=LONG))
    assert max(widths) > 1  # prompts did share forwards
    assert shared == single
    assert "eos" in {r[1] for r in shared}


def test_continuous_admits_once_idle_slots_cost_what_an_admission_does():
    from glm5mtp_cli.engine.scheduler import Run, Scheduler

    def due(rule, free, slots=64, waiting=100):
        run = Run([None] * waiting, [object()] * (slots - free) + [None] * free, [], None, 1)
        return rule.due(run, run.free())

    rule = Scheduler(EngineConfig(), runner=None)
    rule.admitted(0.010)  # the last admission stalled the batch for 10 ms
    assert not due(rule, 8)
    rule.idle_s = 0.010 * 56 - 1e-6  # just under 56 running sequences x 10 ms
    assert not due(rule, 8)
    rule.idle_s = 0.010 * 56
    assert due(rule, 8)
    rule.idle_s = 0.0
    assert due(rule, 3, waiting=3)  # the last requests
    assert due(rule, 1, slots=1)  # nothing would run
    static = Scheduler(EngineConfig(schedule="static"), runner=None)
    static.idle_s = 1.0
    assert not due(static, 63) and due(static, 64)


def test_idle_slot_seconds_accrue_per_step_and_reset_at_admission(glm5):
    engine, pools = _glm5_engine(glm5, 0, 4)
    seen = []  # (idle, last admission) each time the rule is asked while sequences run
    rule = engine.scheduler
    due = rule.due
    rule.due = lambda run, free: (len(free) < len(run.slots) and seen.append((rule.idle_s, rule.admission_s))
                                  ) or due(run, free)
    work = [(p, n) for p, n in zip([[5, 17, 99], [7, 7], [3, 4, 5, 6], [9], [11, 12]] * 2, [2, 9, 4, 6, 3] * 2)]
    _run(engine, pools, 4, work=work)
    assert seen and all(a > 0 for _, a in seen)
    assert any(i > 0 for i, _ in seen)  # free slots accrue idle time between admissions


def test_admissions_that_wait_for_idle_slots_still_equal_alone(glm5):
    engine, pools = _glm5_engine(glm5, 2, 9)
    work = WORK * 2
    assert [r.tokens for r in _run(engine, pools, 9, work=work)] == _alone("glm5", glm5, 2, work=work)


def test_loading_freezes_the_startup_heap_and_what_comes_after_stays_collectable():
    """runtime.freeze_startup_heap: a full collection no longer walks the loaded model and the
    imports (it paused a decode step for 130 ms on the H200); a cycle made later is still freed."""
    import gc
    import weakref

    from glm5mtp_cli.engine.runtime import load_runtime

    rt = load_runtime(ModelSpec("glm5-tiny", "cpu", "fp32", random_weights=True), progress=False)
    frozen = gc.get_freeze_count()
    assert frozen > sum(1 for _ in rt.target.modules())  # the models' objects, and more, are frozen

    class Node:
        pass

    node = Node()
    node.me = node
    alive = weakref.ref(node)
    del node
    gc.collect()
    assert alive() is None
