"""GLM-5-Next through the engine (fp32 CPU): the family's state in the engine's pools, its MTP
layer drafting through MtpHead, every state rolled back after rejections. Greedy speculative output
equals transformers' greedy generate for gamma 0..4 at batch 1 and 3; nothing stays allocated."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_oracle import hf_model, write_checkpoint  # noqa: E402
from glm5next_reference import Mtp  # noqa: E402
from proposer_calls import prefill_drafter, propose_one  # noqa: E402

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.cache import CachePools  # noqa: E402
from glm5mtp_cli.engine import drafting  # noqa: E402
from glm5mtp_cli.engine.graphs import ForwardRunner  # noqa: E402
from glm5mtp_cli.engine.proposer import Feed  # noqa: E402
from glm5mtp_cli.engine.speculate import SpecEngine  # noqa: E402
from glm5mtp_cli.engine.sequence import Request  # noqa: E402
from glm5mtp_cli.engine.mtp_head import mtp_proposer  # noqa: E402
from glm5mtp_cli.models.glm5_next import paged  # noqa: E402
from glm5mtp_cli.models.glm5_next.load import load_next  # noqa: E402
from glm5mtp_cli.models.glm5_next.paged import mla_paged  # noqa: E402
from glm5mtp_cli.models.glm5_next.pooled import PooledMtp, PooledTarget  # noqa: E402

PROMPTS = [[5, 17, 99, 4, 250, 31, 8], list(range(40, 70)), [7, 7, 7, 200, 13]]
NEW = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = hf_model(seed=0)
    folder = write_checkpoint(hf, tmp_path_factory.mktemp("glm5next_engine"))
    cfg, target, mtp = load_next(folder, torch.float32)
    refs = []
    for p in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                              eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    drafter = PooledMtp(mtp)
    drafter.share_topk = False  # each test picks the behaviour
    return cfg, PooledTarget(target), drafter, refs


def _run(models, gamma, batch, rollback_check=True, share=False):
    cfg, target, mtp, _ = models
    pools = CachePools.create(cfg, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    proposer = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=128)) if gamma else None
    engine = SpecEngine(cfg, target, proposer, pools, EngineConfig(gamma=gamma, max_seq_len=128, eos_ids=(), check_invariants=rollback_check, graphs="eager"))
    mtp.share_topk = share
    try:
        res = engine.generate([Request(p, NEW, i) for i, p in enumerate(PROMPTS)], batch_size=batch)
    finally:
        mtp.share_topk = False
    assert not any(pools.blocks_held().values()), "a block or slot stayed held"
    return res


@pytest.mark.parametrize("gamma", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_equals_transformers(models, gamma, batch):
    res = _run(models, gamma, batch)
    assert [r.tokens for r in res] == models[3]
    if gamma:
        proposed = sum(r.acceptance.proposed for r in res)
        accepted = sum(r.acceptance.accepted for r in res)
        assert proposed > accepted, "rejections (and so rollbacks) must happen"


def test_state_components_are_budget_sized_and_flat(models):
    """KDA state and conv windows are one slot per sequence whatever its length; the rest are rows."""
    cfg = models[0]
    pools = CachePools.create(cfg, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu")
    cache = pools.target_cache()
    cache.reserve(8)
    short = cache.bytes_held()
    cache.reserve(64)
    long = cache.bytes_held()
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    assert short["kda"] == long["kda"] == len(cfg.kda_layers) * h * d * d * 4
    assert long["mla"] == 8 * short["mla"]
    cache.release()
    assert not any(pools.blocks_held().values())


def test_carry_reuses_the_recurrent_state_only_at_the_exact_end(models):
    """A second turn extending the first turn's tokens reuses the whole target state; a prompt
    diverging earlier prefills the target afresh (a KDA state cannot be cut back) and still keeps
    the drafter's rows up to the divergence. Both give the tokens of a run without carry."""
    cfg, target, mtp, _ = models
    pools = CachePools.create(cfg, num_blocks=96, block_size=4, dtype=torch.float32, device="cpu")
    proposer = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=128))
    engine = SpecEngine(cfg, target, proposer, pools, EngineConfig(gamma=3, max_seq_len=128, eos_ids=(), check_invariants=True, graphs="eager"))
    first = engine.generate([Request(PROMPTS[0], 12, 0, carry_mode="all")])[0]
    history = PROMPTS[0] + first.tokens
    for prompt, carried in ((history + [9, 10], len(history) - 1), (PROMPTS[0][:5] + [3, 3, 3], 0)):
        carry = first.carry_out
        first = engine.generate([Request(PROMPTS[0], 12, 0, carry_mode="all")])[0]  # a fresh carry for the next case
        res = engine.generate([Request(prompt, 10, 1, carry=carry)])[0]
        fresh = engine.generate([Request(prompt, 10, 2)])[0]
        assert res.tokens == fresh.tokens
        assert res.carried_target_rows == carried
        assert res.carried_drafter_rows > 0
    first.carry_out.release(proposer)
    assert not any(pools.blocks_held().values())


def test_confidence_stop_and_draft_vocab_stay_lossless(models):
    """--draft-conf-tau and --draft-vocab change only what is drafted, never the output."""
    cfg, target, mtp, refs = models
    for options in ({"draft_conf_tau": 0.5}, {"draft_ids": torch.arange(0, cfg.vocab_size, 2)}):
        pools = CachePools.create(cfg, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
        proposer = mtp_proposer(cfg, target, mtp, pools,
                                                EngineConfig(max_seq_len=128, draft_conf_tau=options.get("draft_conf_tau")),
                                                options.get("draft_ids"))
        engine = SpecEngine(cfg, target, proposer, pools, EngineConfig(gamma=3, max_seq_len=128, eos_ids=(), check_invariants=True, graphs="eager"))
        res = engine.generate([Request(p, NEW, i) for i, p in enumerate(PROMPTS)], batch_size=3)
        assert [r.tokens for r in res] == refs, options
        assert not any(pools.blocks_held().values())


def test_sampled_runs_repeat_with_the_seed(models):
    from glm5mtp_cli.engine.sampling import SamplingParams

    cfg, target, mtp, _ = models
    runs = []
    for _ in range(2):
        pools = CachePools.create(cfg, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
        proposer = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=128, sampling=params))
        # each request samples from its own stream, seeded from params.seed and its id
        engine = SpecEngine(cfg, target, proposer, pools, EngineConfig(gamma=2, sampling=params, max_seq_len=128, eos_ids=(), graphs="eager"))
        runs.append([r.tokens for r in engine.generate([Request(p, 12, i) for i, p in enumerate(PROMPTS)])])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("batch", [1, 3])
def test_index_share_stays_lossless(models, batch):
    """Reusing step 0's top-k moves only the drafts: greedy gamma 3 still gives gamma 0's tokens."""
    assert [r.tokens for r in _run(models, 3, batch, share=True)] == models[3]


def test_index_share_keeps_each_sequences_own_step0(models):
    """Batched, each sequence's chained steps reuse its OWN step 0, also when the catch-up groups
    sequences by row count (1, 2, 1 rows here): the drafts equal those of each sequence alone."""
    cfg, target, mtp, _ = models
    g = torch.Generator().manual_seed(4)
    seqs = [(torch.randint(2, cfg.vocab_size, (n,), generator=g), torch.randn(n, cfg.hidden_size, generator=g), f)
            for n, f in ((27, 1), (31, 2), (22, 1))]

    def drafts(members):
        pools = CachePools.create(cfg, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
        head = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=128))
        states = [head.alloc_state_for(64) for _ in members]
        for st, (prompt, hid, f) in zip(states, members):
            prefill_drafter(head, prompt[:-f], hid[:-f], st)
        feed = Feed.of([(p[-f:], h[-f - 1:-1]) for p, h, f in members])
        chains = drafting.propose(head, ForwardRunner("eager", torch.device("cpu")), feed, states, 4, None)
        for st in states:
            head.free_state(st)
        return [c.tokens for c in chains]

    mtp.share_topk = True
    try:
        together = drafts(seqs)
        alone = [drafts([s])[0] for s in seqs]
    finally:
        mtp.share_topk = False
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def _chain_with_selections(models, share: bool, prompt: torch.Tensor, hiddens: torch.Tensor, gamma: int):
    """MtpHead's propose after a prefill, and the pool selection [Np] of the drafting row of each
    forward: step 0 (the catch-up's last row), then each chained step."""
    cfg, target, mtp, _ = models
    pools = CachePools.create(cfg, num_blocks=64, block_size=4, dtype=torch.float32, device="cpu")
    head = mtp_proposer(cfg, target, mtp, pools, EngineConfig(max_seq_len=128))
    state = head.alloc_state_for(64)
    mtp.share_topk = share
    sels = []

    def spy(attn, a, ctx, layer, reuse=None):
        y, sel, visible = mla_paged(attn, a, ctx, layer, reuse)
        seen = (ctx.positions()[0, -1] + 1) // attn.pool  # the pools the drafting row sees
        sels.append(sel[0, -1, : int(seen)].clone())
        return y, sel, visible

    try:
        prefill_drafter(head, prompt[:-1], hiddens[:-1], state)
        paged.mla_paged = spy
        chain = propose_one(head, prompt[-1], hiddens[-2], state.cache.length, gamma, state)
    finally:
        paged.mla_paged = mla_paged
        mtp.share_topk = False
        head.free_state(state)
    assert not any(pools.blocks_held().values())
    return chain.tokens, sels


def test_index_share_reuses_step0_selection_in_chained_steps(models):
    """With more complete pools than the top-k budget, chained steps that share use step 0's pools
    (plus every pool completed after it) while recomputing picks others; step 0 is the same both ways,
    and the engine's drafts equal the one-sequence reference chain's (glm5next_reference.Mtp.propose)."""
    cfg, target, mtp, _ = models
    budget = cfg.index_topk // cfg.index_kpool
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, cfg.vocab_size, (27,), generator=g)
    hiddens = torch.randn(27, cfg.hidden_size, generator=g)
    gamma = 4
    shared_tokens, shared = _chain_with_selections(models, True, prompt, hiddens, gamma)
    own_tokens, own = _chain_with_selections(models, False, prompt, hiddens, gamma)
    n0 = shared[0].shape[0]
    assert n0 > budget, "the context must hold more complete pools than the budget"
    assert torch.equal(shared[0], own[0]) and int(shared[0].sum()) == budget
    assert len(shared) == len(own) == gamma
    assert shared[-1].shape[0] > n0, "a chain row must complete a pool"
    for sel in shared[1:]:
        assert torch.equal(sel[:n0], shared[0]) and sel[n0:].all()
    assert any(not torch.equal(sel[:n0], own[0]) for sel in own[1:]), "recomputing must pick other pools here"
    for share, tokens in ((True, shared_tokens), (False, own_tokens)):
        ref_mtp = Mtp(mtp.layer)
        slot = ref_mtp.new_state(64)
        embed, lm_head = target.model.embed_tokens, target.model.lm_head
        ref_mtp.prefill(prompt[:-1], hiddens[:-1], slot, embed, lm_head)
        ref = ref_mtp.propose(prompt[-1], hiddens[-2], slot, gamma, embed, lm_head, share_topk=share)
        assert torch.equal(tokens, ref.tokens), share
