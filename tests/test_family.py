"""The engine needs nothing GLM-5-specific: a fake model family whose target keeps a fixed-size
recurrent state per sequence (a `slot` component, like GLM-5-Next's KDA state) beside paged rows
runs through the same engine, losslessly, with its state rolled back after every rejection and
every slot and block given back.

The fake target: s_p = tanh(W s_{p-1} + E[x_p]) is the recurrent state after token p; each token
also stores s_p as a paged row; m_p is the mean of the stored rows so far, the logits are
(s_p + m_p) @ E^T and the hidden handed to the drafter is [s_p, m_p]. Its slot holds the state
after the committed rows; a forward leaves the states of its rows pending, and the target's
commit after a verify keeps the accepted one (engine/target.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.cache import CachePools, SequenceCache
from glm5mtp_cli.core.cached import cached_rows
from glm5mtp_cli.engine.proposer import DraftProposer, Drafts, ProposerState, TreeDrafter
from glm5mtp_cli.engine.speculate import SpecEngine
from glm5mtp_cli.engine.verify import VerifyPlan
from glm5mtp_cli.engine.sequence import Request
from glm5mtp_cli.core.families import register_family
from glm5mtp_cli.core.dtypes import dtype_name
from glm5mtp_cli.core.family import ROWS, SLOT, StateComponent



@dataclass
class FakeConfig:
    model_type = "fake_recurrent"
    vocab_size: int = 7
    hidden_size: int = 8
    eos_token_id: list = field(default_factory=list)
    source: str = "<fake>"


@dataclass
class FakePending:
    data: torch.Tensor  # the slot pool's [1, slots, H]
    index: torch.Tensor  # each batch row's slot [B]
    states: torch.Tensor  # the state after each row of the forward [B, T, H]


@dataclass
class FakeOut:
    logits: torch.Tensor
    hidden: torch.Tensor
    hidden_all: torch.Tensor
    pending: FakePending


class FakeTarget(nn.Module):
    reads_slots = False  # eager only: its state is read through the caches, never slot indices

    def __init__(self, cfg: FakeConfig):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
        self.w = nn.Parameter(torch.randn(cfg.hidden_size, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, caches: list, rows="all", real=None, plan=None) -> FakeOut:
        """Token by token on purpose: the reference recurrence, nothing clever to get wrong. real
        (padding rows of a shared prefill forward): nothing to do, the pending commit keeps the
        state after exactly the rows the engine keeps, and the recurrence is causal. plan: a
        verify's; row j's state follows its parent's (row 0's: the cached state) and its mean is
        over the cached rows and its ancestors' (engine/verify.py)."""
        t = ids.shape[1]
        parents = plan.parents if plan is not None else tuple(range(-1, t - 1))
        depths = []
        for p in parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        starts, paged = cached_rows(caches, t, ids.device)
        store = paged["row"]
        hiddens, states = [], []
        for b, c in enumerate(caches):
            n, slot = int(starts[b]), c.slots["rec"]
            before = slot.pool.data[0, slot.slot]
            cached = store.data[0].index_select(0, store.all[b, :n]).sum(0)
            seq, sums, means = [], [], []
            for j, p in enumerate(parents):
                s = torch.tanh(self.w @ (seq[p] if p >= 0 else before) + self.embed[ids[b, j]])
                sums.append((sums[p] if p >= 0 else cached) + s)
                seq.append(s)
                means.append(sums[-1] / (n + depths[j] + 1))
            store.data[0].index_copy_(0, store.new[b * t:(b + 1) * t], torch.stack(seq))
            hiddens.append(torch.cat([torch.stack(seq), torch.stack(means)], -1))
            states.append(torch.stack(seq))
        rec = caches[0].slots["rec"].pool.data
        pending = FakePending(rec, torch.tensor([c.slots["rec"].slot for c in caches]), torch.stack(states))
        h = torch.stack(hiddens)
        for c in caches:
            c.length += ids.shape[1]
        if isinstance(rows, torch.Tensor):  # a row per sequence: each prompt's last real row
            out = h.gather(1, rows.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))
        else:
            out = h if rows == "all" else h[:, -1:]
        return FakeOut(self.logits(out), out, h, pending)

    def commit(self, pending: FakePending, kept: torch.Tensor) -> None:
        """Each row's slot takes the state after its first kept[b] rows (none kept: unchanged)."""
        after = pending.states[torch.arange(kept.shape[0]), (kept - 1).clamp(min=0)]
        before = pending.data[0].index_select(0, pending.index)
        pending.data[0].index_copy_(0, pending.index, torch.where((kept > 0)[:, None], after, before))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        s, m = hidden.split(self.cfg.hidden_size, -1)
        return (s + m) @ self.embed.T

    def advance(self, hidden: torch.Tensor, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The hiddens [B, 2H] after `token` [B] at `position` [B], from the hiddens before them (what
        a drafter can know without the caches)."""
        s, m = hidden.split(self.cfg.hidden_size, -1)
        s = torch.tanh(s @ self.w.T + self.embed[token])
        return torch.cat([s, (m * position[:, None] + s) / (position[:, None] + 1)], -1)


class SpoilingProposer:
    """Drafts the target's own greedy continuation, computed from the last hidden, but spoils
    every draft at a position divisible by 3, so verifies accept some drafts and reject the rest
    and the rollback behind each partial acceptance is exercised. Its forward (drafter_forward,
    run by the engine's runner like any family's) needs no cache rows: its drafter cache has no
    components and holds only its row count."""

    draft_head = None  # no --draft-vocab subset

    def __init__(self, target: FakeTarget):
        self.target = target

    def alloc_state_for(self, budget_tokens: int) -> ProposerState:
        return ProposerState(SequenceCache({}), budget_tokens)

    def free_state(self, state: ProposerState) -> None:
        state.cache = None

    def drafter_rows(self, state: ProposerState) -> int:
        return state.cache.length

    def catchup_drafter(self, tokens, hiddens, row_base, state) -> None:
        state.cache.length += tokens.shape[0]
        state.add_real(tokens[None], 0, tokens.shape[0])

    def append_rows(self, ids, hiddens, caches, real) -> None:
        for c, k in zip(caches, real):
            c.length += k

    def start_propose(self) -> None:
        pass

    def choose(self, logits, states):
        return logits.argmax(-1), None

    def chained(self):
        return nullcontext()

    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        state.cache.truncate(state.real_rows)

    def context(self, starts, t, rows):
        return starts

    def drafter_forward(self, ids, hidden, ctx, rows):
        """Row r = starts + T - 1 (the last) pairs token t[r+1] with the hidden after position r
        and drafts t[r+2]: spoiled when r + 2 is divisible by 3."""
        t = ids.shape[1]
        h = self.target.advance(hidden[:, -1], ids[:, -1], ctx + t)
        logits = self.target.logits(h)
        spoil = (ctx + t + 1) % 3 == 0
        return torch.where(spoil[:, None], logits.roll(1, -1), logits), h

    def greedy_chain(self, ids, hidden, starts, last_real, context_at, gamma):
        raise NotImplementedError("eager only")

    def propose_tree(self, feed, states, plan) -> Drafts:
        """A tree plan's rows: a row's c-th child guesses the c-th candidate at it: its top-1, spoiled
        where q + d is divisible by 5 (a step of 3 or 4 accepted rows, these trees' whole paths, moves
        the spoiled depth: 3's would not), then the unspoiled top-1 where that was spoiled (else the top-2), so each branch is
        right where the other is wrong. Row d deep drafts at position q + d, q the feed's last, as a
        chain's d-th draft does."""
        rows = []
        for j, st in enumerate(states):
            k = feed.counts[j]
            q = st.cache.length + k
            st.cache.length += k
            hidden = self.target.advance(feed.hiddens[j, k - 1][None], feed.tokens[j, k - 1][None], torch.tensor([q]))
            tokens, hiddens = [], [hidden]
            for i, (p, d) in enumerate(zip(plan.parents[1:], plan.depths[1:]), 1):
                logits = self.target.logits(hiddens[p])[0]
                spoiled = (q + d) % 5 == 0
                top = logits.topk(2).indices.tolist()
                candidates = [(top[0] + 1) % logits.shape[0] if spoiled else top[0], top[0] if spoiled else top[1]]
                token = candidates[plan.parents[1:i].count(p)]
                tokens.append(token)
                hiddens.append(self.target.advance(hiddens[p], torch.tensor([token]), torch.tensor([q + d])))
            rows.append(tokens)
        return Drafts(torch.tensor(rows), [plan.drafts] * len(states))

    def take_drafter_kv(self, state):
        raise NotImplementedError

    def install_drafter_kv(self, kv, state):
        raise NotImplementedError

    def free_drafter_kv(self, kv):
        raise NotImplementedError


class FakeFamily:
    name = "fake"
    model_types = ("fake_recurrent",)

    def parse_config(self, raw, source):
        return FakeConfig(**{k: v for k, v in raw.items() if k != "model_type"})

    def state_components(self, cfg, dtype, with_drafter=True, tp=1):
        return [StateComponent("target_row", "target", ROWS, 1, (cfg.hidden_size,), dtype_name(dtype)),
                StateComponent("target_rec", "target", SLOT, 1, (cfg.hidden_size,), dtype_name(dtype))]


register_family("fake_recurrent", FakeFamily())
CFG = FakeConfig()
PROMPTS = [[1, 2, 3], [4, 0, 6, 5, 2, 1, 3], [2]]


def _generate(gamma: int, batch: int, tree: tuple[int, ...] | None = None) -> tuple[list[list[int]], CachePools, list]:
    target = FakeTarget(CFG)
    pools = CachePools.create(CFG, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    proposer = SpoilingProposer(target) if gamma else None
    engine = SpecEngine(CFG, target, proposer, pools, EngineConfig(gamma=gamma, max_seq_len=64, eos_ids=(), check_invariants=True,
                                                                   graphs="eager", tree=tree))
    res = engine.generate([Request(p, 30, i) for i, p in enumerate(PROMPTS)], batch_size=batch)
    return [r.tokens for r in res], pools, res


def _reference(prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recompute of the whole sequence at every token, no cache reuse."""
    target = FakeTarget(CFG)
    seq = list(prompt)
    for _ in range(n):
        pools = CachePools.create(CFG, num_blocks=32, block_size=4, dtype=torch.float32, device="cpu")
        cache = pools.target_cache()
        out = target(torch.tensor([seq]), [cache], rows="last")
        seq.append(int(out.logits[0, -1].argmax()))
        cache.release()
    return seq[len(prompt):]


def test_fake_proposer_meets_the_protocol():
    assert isinstance(SpoilingProposer(FakeTarget(CFG)), DraftProposer)
    assert isinstance(SpoilingProposer(FakeTarget(CFG)), TreeDrafter)


def test_pools_follow_the_family_components():
    pools = CachePools.create(CFG, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert set(pools.pools) == {"target_row", "target_rec"}
    cache = pools.target_cache()
    cache.reserve(3)
    short = cache.bytes_held()
    cache.reserve(17)
    grown = cache.bytes_held()
    assert grown["rec"] == short["rec"] == CFG.hidden_size * 4  # fixed, whatever the length
    assert grown["row"] == 5 * short["row"]  # rows grow with tokens (whole blocks of 4)
    cache.release()
    assert not any(pools.blocks_held().values())


@pytest.mark.parametrize("gamma", [0, 1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_speculation_over_a_recurrent_state_is_lossless(gamma, batch):
    tokens, pools, res = _generate(gamma, batch)
    assert tokens == [_reference(p, 30) for p in PROMPTS]
    assert not any(pools.blocks_held().values()), "a slot or block stayed held"
    if gamma:
        acc = [r.acceptance for r in res]
        proposed = sum(a.proposed for a in acc)
        accepted = sum(a.accepted for a in acc)
        assert 0 < accepted < proposed, "the test needs both accepted and rejected drafts"


@pytest.mark.parametrize("tree", [(2, 1), (2, 2), (1, 2, 1)])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_tree_plan_is_verified_exactly(tree, batch, monkeypatch):
    """A tree of drafts through the same engine: each row sees its ancestors only, the accepted path's
    paged rows are gathered into place and the recurrent state committed at its last row, so greedy
    output equals full recompute; paths through second branches are taken, and everything goes back."""
    paths, keep = [], SequenceCache.keep_path
    monkeypatch.setattr(SequenceCache, "keep_path", lambda c, start, rows: paths.append(rows) or keep(c, start, rows))
    tokens, pools, res = _generate(len(tree), batch, tree)
    assert tokens == [_reference(p, 30) for p in PROMPTS]
    assert not any(pools.blocks_held().values()), "a slot or block stayed held"
    plan = VerifyPlan.tree(tree)
    later_child = [r and plan.parents.index(plan.parents[r]) != r for r in range(plan.rows)]  # not its parent's first
    taken = {"first children only": any(p and not any(later_child[r] for r in p) for p in paths),
             "a later child": any(later_child[r] for p in paths for r in p)}
    assert all(taken.values()), taken
    assert sum(x.acceptance.accepted for x in res) < sum(x.acceptance.steps for x in res) * plan.depth


def test_a_tree_takes_its_second_branches():
    """The verdict of a tree: the deepest accepted row, its path's tokens and rows (first branch
    wrong, second right; and the reverse)."""
    from glm5mtp_cli.engine.accept import greedy_verdict, unread

    plan = VerifyPlan.tree((2, 1))  # rows: 0; 1, 2 (children of 0); 3 (of 1), 4 (of 2)
    target = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])  # the target's token after each row
    logits = torch.nn.functional.one_hot(target, 10).float()
    drafts = torch.tensor([[4, 5, 6, 7], [5, 4, 1, 7]])  # row 1..4's tokens
    v = unread([4, 4], greedy_verdict(logits, drafts, plan=plan), plan)
    v.read()
    assert (v.accepted, v.next, v.path) == ([2, 1], [9, 6], [[2, 4], [1, 0]])
    assert v.draft_ids[0] == [5, 7] and v.draft_ids[1][:1] == [5]


def test_a_fixed_size_state_refuses_to_roll_back_past_its_last_forward():
    target = FakeTarget(CFG)
    pools = CachePools.create(CFG, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    cache = pools.target_cache()
    target.commit(target(torch.tensor([[1, 2, 3]]), [cache]).pending, torch.tensor([3]))
    out = target(torch.tensor([[4, 5]]), [cache])
    with pytest.raises(ValueError, match="before the last forward"):
        cache.truncate(2)
    target.commit(out.pending, torch.tensor([1]))  # inside the last forward: the state after token 4
    cache.truncate(4)
    fresh = pools.target_cache()
    target.commit(target(torch.tensor([[1, 2, 3, 4]]), [fresh]).pending, torch.tensor([4]))  # a prefill, whole
    rec = pools.pools["target_rec"].data[0]
    assert torch.equal(rec[cache.slots["rec"].slot], rec[fresh.slots["rec"].slot])
    fresh.release()
    with pytest.raises(ValueError, match="only into its last forward"):
        cache.truncate(3)
    cache.release()


def test_graph_modes_refuse_slot_components_the_forwards_cannot_read():
    """The fake target has slot state but no context taking slot indices: static forwards refuse
    it (nothing left held) and graph_mode keeps it eager even on CUDA."""
    from types import SimpleNamespace

    from glm5mtp_cli.engine.runtime import graph_mode
    from glm5mtp_cli.errors import UserError

    target = FakeTarget(CFG)
    pools = CachePools.create(CFG, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    engine = SpecEngine(CFG, target, None, pools, EngineConfig(gamma=0, max_seq_len=32, eos_ids=(), graphs="static"))
    with pytest.raises(UserError, match="fixed-size state"):
        engine.generate([Request([1, 2], 4)])
    assert not any(pools.blocks_held().values())
    on_cuda = SimpleNamespace(cfg=CFG, dtype=torch.float32, target=target, comm=None, device=torch.device("cuda"))
    assert graph_mode(on_cuda, True) == "eager"
