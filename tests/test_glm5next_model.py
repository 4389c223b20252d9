"""GLM-5-Next target against transformers (fp32 CPU): whole prompt, chunked prefill, verify + rollback.

The oracle is transformers' Glm5NextForConditionalGeneration on its torch fallbacks; our model is
loaded from the checkpoint it wrote (real layout) through the project's reader. Pool selection is
active (prompts longer than index_topk) and every test input is checked for exact ties at the pool
top-k boundary, where full and cached forwards may legitimately pick different pools.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_oracle import hf_logits, hf_model, write_checkpoint  # noqa: E402
from glm5next_reference import Target, boundary_ties  # noqa: E402

from glm5mtp_cli.models.glm5_next.load import load_next  # noqa: E402

REL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = hf_model(seed=0)
    folder = write_checkpoint(hf, tmp_path_factory.mktemp("glm5next"))
    cfg, target, mtp = load_next(folder, torch.float32)
    return hf, folder, cfg, Target(target), mtp  # the one-sequence reference path


def prompt(n, seed=3):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_no_boundary_ties(target, cfg, toks):
    _, _, pend = target.forward_rows(toks, target.new_state(toks.shape[0]))
    visible = (torch.arange(toks.shape[0]) + 1) // cfg.index_kpool
    n_sel = cfg.index_topk // cfg.index_kpool
    for i in cfg.indexed_layers:
        s = pend.layers[i].scores
        assert not boundary_ties(s, visible, n_sel, tol=1e-6 * s.abs().max()).any(), f"tie at layer {i}"
    assert (visible > n_sel).any(), "pool selection must be exercised"


@pytest.mark.parametrize("n", [40, 70])
def test_whole_prompt_logits_match_transformers(ckpt, n):
    hf, _, cfg, target, _ = ckpt
    toks = prompt(n)
    assert_no_boundary_ties(target, cfg, toks)
    logits, hidden = target(toks)
    assert hidden.shape == (n, cfg.hidden_size)
    assert rel(logits, hf_logits(hf, toks)) < REL


@pytest.mark.parametrize("kda_chunk", [64, 8])
def test_prefill_in_pieces_equals_whole_prompt(ckpt, kda_chunk):
    """Pieces of 13, 1, 1, 30, 25 tokens: cross pool boundaries (P=4) mid-pool, single-token decodes,
    and KDA chunk boundaries (64, and 8 to cross many)."""
    hf, _, cfg, target, _ = ckpt
    toks = prompt(70)
    ref = hf_logits(hf, toks)
    state = target.new_state(70)
    outs, s = [], 0
    for piece in (13, 1, 1, 30, 25):
        lg, _ = target.prefill(toks[s:s + piece], state, kda_chunk=kda_chunk)
        outs.append(lg)
        s += piece
    assert state.length == 70
    assert rel(torch.cat(outs), ref) < REL


def assert_states_equal(a, b, atol=2e-5):
    # fp32 through different summation orders (the verify's recurrence against a fresh chunked
    # prefill): one indexer tail element of ~7e-3 differs by 1.07e-5 on an AMD EPYC host's BLAS
    assert a.length == b.length
    for i in a.kda:
        torch.testing.assert_close(a.kda[i].state, b.kda[i].state, atol=atol, rtol=1e-4)
        torch.testing.assert_close(a.kda[i].window, b.kda[i].window, atol=atol, rtol=1e-4)
    for i in a.indexed:
        x, y = a.indexed[i], b.indexed[i]
        n, P = x.length, x.pool
        assert n == y.length
        torch.testing.assert_close(x.latent[:n], y.latent[:n], atol=atol, rtol=1e-4)
        torch.testing.assert_close(x.pooled[: n // P], y.pooled[: n // P], atol=atol, rtol=1e-4)
        torch.testing.assert_close(x.tail[: n % P], y.tail[: n % P], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("rollback", ["states", "replay"])
@pytest.mark.parametrize("start", [22, 24])
def test_verify_rollback_to_every_prefix(ckpt, rollback, start):
    """gamma = 3: verify 4 rows after a prompt of `start` tokens (22: the window completes a pool at
    its 2nd row; 24: it starts a pool), keep 0..4 rows, compare with a fresh prefill of the kept
    prefix; then decode one more token on the rolled-back state."""
    hf, _, cfg, target, _ = ckpt
    toks = prompt(start + 5, seed=5)
    assert_no_boundary_ties(target, cfg, toks)
    full = hf_logits(hf, toks)
    for keep in range(0, 5):
        state = target.new_state(start + 5)
        target.prefill(toks[:start], state, chunk_tokens=9)
        logits, hidden, pending = target.verify(toks[start:start + 4], state, rollback=rollback)
        assert rel(logits, full[start:start + 4]) < REL   # verify rows are exact whatever is kept later
        target.commit(state, pending, keep)
        fresh = target.new_state(start + 5)
        target.prefill(toks[:start + keep], fresh)
        assert_states_equal(state, fresh)
        nxt, _ = target.decode(toks[start + keep], state)
        assert rel(nxt, full[start + keep:start + keep + 1]) < REL


def test_verify_leaves_state_untouched(ckpt):
    _, _, _, target, _ = ckpt
    toks = prompt(30)
    state = target.new_state(30)
    target.prefill(toks[:21], state)
    before = {i: s.state.clone() for i, s in state.kda.items()}
    tails = {i: s.tail.clone() for i, s in state.indexed.items()}
    for mode in ("states", "replay"):
        target.verify(toks[21:25], state, rollback=mode)
    assert state.length == 21
    assert all(torch.equal(before[i], s.state) for i, s in state.kda.items())
    assert all(torch.equal(tails[i], s.tail) for i, s in state.indexed.items())
