"""Carry across turns: the same tokens as fresh turns, fewer rows prefilled, nothing left held."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.cli import app
from glm5mtp_cli.engine.conversation import run_conversations
from glm5mtp_cli.engine.sampling import SamplingParams

CONVS = [[[5, 9, 40, 41, 42, 43, 44, 45, 46], [7, 8, 9], [100, 101]], [list(range(20, 50)), [3, 3, 3, 4]]]


@pytest.fixture(scope="module")
def rt(spec_runtime):
    return spec_runtime


def _run(rt, carry, budget=None, gamma=3, sampling=SamplingParams()):
    config = EngineConfig(gamma=gamma, max_new_tokens=10, sampling=sampling, max_seq_len=512, alloc="budget",
                          eos_ids=(), graphs="eager")
    chats, info = run_conversations(rt, CONVS, config, carry, budget, use_template=False)
    return chats, info


def _turns(chats):
    return [[t.tokens for t in c.turns] for c in chats]


@pytest.mark.parametrize("gamma", [0, 3])
def test_carry_gives_the_same_tokens_and_prefills_less(rt, gamma):
    fresh, _ = _run(rt, "none", gamma=gamma)
    for mode in ("all",) + (("drafter",) if gamma else ()):
        carried, info = _run(rt, mode, gamma=gamma)
        assert _turns(carried) == _turns(fresh), mode
        later = [t for c in carried for t in c.turns[1:]]
        later_fresh = [t for c in fresh for t in c.turns[1:]]
        if mode == "all":
            assert all(t.carried_target_rows > 0 for t in later)
            assert sum(t.prefilled_target_rows for t in later) < sum(t.prefilled_target_rows for t in later_fresh)
        else:
            assert all(t.carried_target_rows == 0 for t in later)
        if gamma:
            assert all(t.carried_drafter_rows > 0 for t in later)
            assert sum(t.prefilled_drafter_rows for t in later) < sum(t.prefilled_drafter_rows for t in later_fresh)
            # a carried turn's drafter rows + new rows cover the prompt exactly as a fresh prefill does
            for t in later:
                assert t.carried_drafter_rows + t.prefilled_drafter_rows == len(t.prompt) - 1


def test_carry_budget_evicts_least_recently_used(rt):
    fresh, _ = _run(rt, "none")
    chats, info = _run(rt, "all", budget=1)
    assert info["evictions"] > 0
    assert _turns(chats) == _turns(fresh)
    assert all(t.carried_target_rows == 0 for c in chats for t in c.turns)


def test_carry_with_sampling_is_identical(rt):
    params = SamplingParams(temperature=0.9, seed=5)
    a, _ = _run(rt, "none", sampling=params)
    b, _ = _run(rt, "all", sampling=params)
    assert _turns(a) == _turns(b)


def test_cli_conversation_json(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    conv = tmp_path / "conv.jsonl"
    conv.write_text("\n".join(json.dumps({"turns": c}) for c in CONVS))
    r = CliRunner().invoke(app, ["generate", "--model", str(folder), "--conversation", str(conv), "--carry", "all",
                                 "--max-new-tokens", "6", "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["carry"]["same_tokens_as_no_carry"] is True
    turn = doc["conversations"][0]["turns"][1]
    assert set(turn) >= {"tokens", "text", "prefilled_target_rows", "prefilled_drafter_rows", "carried_rows", "ttft_ms"}
    assert turn["carried_rows"] > 0


@pytest.mark.parametrize("args, needle", [
    (["--carry", "all", "--prompt-ids", "1,2,3"], "--conversation"),
    (["--conversation", "/nonexistent.jsonl"], "nonexistent"),
    (["--conversation", "BAD", "--carry", "sometimes"], "--carry"),
])
def test_bad_carry_input(spec_ckpt, tmp_path, args, needle):
    folder, _ = spec_ckpt
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": [[1, 2, 3]]}\n')
    args = [str(bad) if a == "BAD" else a for a in args]
    r = CliRunner().invoke(app, ["generate", "--model", str(folder), "--device", "cpu", *args])
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


def test_drafting_turns_of_glm5next_nano_carry_the_whole_state():
    """At gamma 3 a turn's last verify may accept past its budget; what the turn hands on is cut at
    its reply (a KDA state cannot be cut back afterwards), so every later turn reuses all of it, at
    every budget, with the tokens of turns run without carry. The shipped model: its trained head's
    drafts are accepted, so last steps overshoot."""
    from glm5mtp_cli.engine.runtime import ModelSpec, load_runtime

    rt = load_runtime(ModelSpec("glm5next-nano", "cpu", "fp32"), progress=False)
    convs = [["def add(a, b):\n", "def mul(a, b):\n", "class Point:\n"]]
    for budget in range(9, 15):
        config = EngineConfig(gamma=3, max_new_tokens=budget, sampling=SamplingParams(), max_seq_len=512,
                              alloc="budget", eos_ids=(), graphs="eager")
        fresh, _ = run_conversations(rt, convs, config, "none", None, use_template=False)
        carried, _ = run_conversations(rt, convs, config, "all", None, use_template=False)
        assert _turns(carried) == _turns(fresh), budget
        for turn, before in zip(carried[0].turns[1:], carried[0].turns):
            assert turn.carried_target_rows == len(before.prompt) + len(before.tokens) - 1, budget
