"""Constrained speculation (engine/grammar.py): lossless under a grammar for every gamma, drafts
masked or not; EOS only where the grammar accepts; the `grammar` finish; --constrain-after landing
at every draft position and as a verify's own token; matchers freed with their sequences; the
packed bitmask's reference semantics. On glm5-nano (its shipped tokenizer), fp32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")

from glm5mtp_cli.constraint import Constraint  # noqa: E402
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec, SamplingParams  # noqa: E402
from glm5mtp_cli.engine.grammar import Grammars, StepMasks  # noqa: E402
from glm5mtp_cli.engine.run import run_generate  # noqa: E402
from glm5mtp_cli.prompts import encode_prompts, read_file  # noqa: E402
from kernels.bitmask import apply_bitmask_ref, unpack, words  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "profiles" / "constrained" / "prompts.jsonl"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def nano():
    from glm5mtp_cli.engine.runtime import load_runtime

    return load_runtime(ModelSpec("glm5-nano", "cpu", "fp32"), progress=False)


@pytest.fixture(scope="module")
def prompt_set(nano):
    items = read_file(PROMPTS)[::3]  # JSON schemas, json_object and regexes alike
    return encode_prompts(items, nano.tokenizer), [p.constraint for p in items]


def _run(rt, ids, rules, **kw):
    kw.setdefault("max_new_tokens", 24)
    return run_generate(rt, ids, EngineConfig(**kw), constraints=rules)[0]


def _grammars(rt) -> Grammars:
    return Grammars(rt.resolved.folder / "tokenizer.json", rt.cfg.vocab_size, rt.cfg.eos_token_id, None)


# ---- the mask's packing ------------------------------------------------------------------------------------

def test_bitmask_reference_bans_exactly_the_cleared_bits():
    v = 70
    allowed = torch.rand(2, v) < 0.5
    bits = torch.zeros(2, words(v) * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    packed = (bits.view(2, -1, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # bit 31: the sign
    assert torch.equal(unpack(packed, v), allowed)
    logits = torch.randn(2, v)
    out = apply_bitmask_ref(logits.clone(), packed)
    assert torch.equal(out[allowed], logits[allowed]) and torch.isneginf(out[~allowed]).all()


def test_llguidance_fills_the_same_packing(nano):
    """A regex's first mask, unpacked, allows exactly the tokens llguidance says start a match; the
    parallel fill writes the row it names and no other."""
    grammars = _grammars(nano)
    g = grammars.open(Constraint("regex", r"[0-9]{3}"), set())
    rows = torch.full((2, words(nano.cfg.vocab_size)), -1, dtype=torch.int32)
    grammars.fill_rows(rows, [(g.matcher, 1)])
    assert (rows[0] == -1).all()
    allowed = unpack(rows[1], nano.cfg.vocab_size).nonzero().flatten().tolist()
    texts = [nano.tokenizer.decode([t]) for t in allowed]
    assert allowed and all(t and t.isdigit() and len(t) <= 3 for t in texts), texts


def test_pools_give_each_thread_two_items_at_the_least(nano):
    """A call's llguidance pool: powers of two, at least two masks or walks a thread, at most
    `threads` (idle threads cost the call: tests/grammar_host_cost.py)."""
    g = _grammars(nano)
    g.threads = 12
    sizes = {items: g.executor(items) for items in (1, 3, 4, 8, 9, 24, 64)}
    assert sizes[1] is sizes[3] and sizes[8] is sizes[9]
    assert len({id(e) for e in sizes.values()}) == 5  # pools of 1, 2, 4, 8 and 12 threads
    assert g.executor(64) is g.executor(1000)  # capped at `threads`


@pytest.mark.parametrize("threads", [None, 1, 64])
def test_the_one_call_walk_fills_the_rows_the_row_by_row_walk_does(nano, monkeypatch, threads):
    """--no-draft-mask's verify walks every plain sequence at once: its rows, the drafts it counts
    as allowed and the matchers' states after it equal the row by row walk's, for drafts rejected
    at every position, a grammar completed mid-draft, fewer drafts than columns (one draft: its
    walk is two rows) and an end token among the drafts (that sequence walks row by row in both);
    on the calling thread (None: 7 sequences, under ON_CALLER), and on llguidance's pool in one
    call: whole walks (1 thread) and walks cut in pieces of two rows, a rejection at a piece's
    boundary among them (64). Each row is a fresh matcher's mask after the drafts before it."""
    import glm5mtp_cli.engine.grammar as grammar
    from types import SimpleNamespace

    tok = nano.tokenizer
    digit = [tok.encode(str(d))[0] for d in range(10)]
    letter = tok.encode("x")[0]
    eos = nano.cfg.eos_token_id[0] if isinstance(nano.cfg.eos_token_id, list) else nano.cfg.eos_token_id
    drafts = [[digit[1], digit[2], digit[3], digit[4]], [letter, digit[1], digit[2], digit[3]],
              [digit[5], letter, digit[1], digit[2]], [digit[7], digit[8], letter, digit[9]],
              [digit[1], digit[2], digit[3], digit[4]], [digit[1], eos, digit[2], digit[3]],
              [digit[1], digit[2], digit[3], digit[4]]]
    counts = [4, 4, 4, 4, 2, 4, 1]
    d = SimpleNamespace(tokens=torch.tensor(drafts), counts=counts)

    def walk(one_call: bool):
        grammars = _grammars(nano)
        if threads is not None:
            grammars.threads = threads
            monkeypatch.setattr(grammar, "ON_CALLER", 0)
        seqs = [grammars.open(Constraint("regex", r"[0-9]{3}"), {eos}) for _ in drafts]
        if not one_call:
            monkeypatch.setattr(StepMasks, "_walk_plain", lambda self, cols, counts: None)
        masks = StepMasks(grammars, seqs, 4, torch.device("cpu"))
        masks.read_drafts(d)
        rows = masks.verify(d).clone()
        monkeypatch.undo()
        for g in seqs:
            g.rollback()  # what commit does first
        after = [int(unpack(r, nano.cfg.vocab_size).sum()) for r in _first_rows(grammars, seqs)]
        return rows, masks.valid, after

    def _first_rows(grammars, seqs):
        out = torch.full((len(seqs), words(nano.cfg.vocab_size)), -1, dtype=torch.int32)
        grammars.fill_rows(out, [(g.matcher, b) for b, g in enumerate(seqs)])
        return out

    fast, slow = walk(True), walk(False)
    assert torch.equal(fast[0], slow[0])
    assert fast[1] == slow[1] == [3, 0, 1, 2, 2, 1, 1]
    assert fast[2] == slow[2]
    grammars = _grammars(nano)
    for b, toks in enumerate(drafts):
        for i in range(min(fast[1][b], counts[b] - 1) + 1):
            if eos in toks[:i]:
                break  # an end token is not fed to the matcher: the sequence ends there
            m = grammars._matcher(Constraint("regex", r"[0-9]{3}"))
            assert m.consume_tokens(toks[:i])
            assert torch.equal(fast[0][b, i], _first_rows(grammars, [SimpleNamespace(matcher=m)])[0]), (b, i)


def test_commit_in_one_call_equals_token_by_token(nano):
    """A step's emitted tokens without an end token go to the matcher in one call: the same stop
    index, state and count of emitted tokens as the token-by-token commit, for a grammar completed
    at a step's last token and mid-step (the tokens after the stop not fed), and a token the grammar
    rejects."""
    tok = nano.tokenizer
    digit = [tok.encode(str(d))[0] for d in range(10)]
    eos = nano.cfg.eos_token_id[0] if isinstance(nano.cfg.eos_token_id, list) else nano.cfg.eos_token_id
    grammars = _grammars(nano)

    def commits(steps, one_call: bool):
        g = grammars.open(Constraint("regex", r"[0-9]{3}"), {eos})
        if not one_call:
            g.enders = set(range(nano.cfg.vocab_size))  # every token takes the token-by-token path
        out = []
        for new in steps:
            try:
                out.append((g.commit(new), g.emitted, g.matcher.is_accepting()))
            except RuntimeError:
                out.append("rejected")
        g.free()
        return out

    for steps in ([[digit[1], digit[2]], [digit[3]]], [[digit[1]], [digit[2], digit[3]]],
                  [[digit[1], digit[2], digit[3], digit[4]]], [[digit[1], tok.encode("x")[0]]]):
        assert commits(steps, True) == commits(steps, False)
    assert commits([[digit[1]], [digit[2], digit[3]]], True) == [(None, 1, False), (1, 3, True)]
    assert commits([[digit[1], digit[2], digit[3], digit[4]]], True) == [(2, 3, True)]
    assert commits([[digit[1], tok.encode("x")[0]]], True) == ["rejected"]


def test_template_copies_mask_as_freshly_compiled_matchers(nano, monkeypatch):
    """Matchers are copies of one compiled template per constraint, and a freed sequence's matcher,
    reset, becomes the next template: along each shipped prompt's constrained reply (its
    constrained gamma-0 output) a copy's mask at every position equals a freshly compiled
    matcher's, for a copy of the first template, one made while another copy is mid-walk, and one
    of the template a walked copy retired into; each constraint compiles once, and the engine keeps
    at most TEMPLATES of them."""
    import glm5mtp_cli.engine.grammar as grammar

    items = read_file(PROMPTS)
    ids = encode_prompts(items, nano.tokenizer)
    rules = [p.constraint for p in items]
    replies = _run(nano, ids, rules, gamma=0, max_new_tokens=32)
    compile_ = grammar.llguidance().LLMatcher
    texts = {rule: rule.grammar() for rule in rules}
    compiled = []
    monkeypatch.setattr(Constraint, "grammar", lambda self: compiled.append(self) or texts[self])
    grammars = _grammars(nano)
    n = words(nano.cfg.vocab_size)

    def masks_along(m, rule, tokens, done=()) -> int:
        """Walk m (already past `done`) along tokens, its mask against a fresh matcher's at every
        position; -> the positions compared."""
        fresh = compile_(grammars.tokenizer(), texts[rule], log_level=0)
        assert fresh.consume_tokens(list(done))
        for i, tok in enumerate(tokens + [None]):
            rows = torch.zeros((2, n), dtype=torch.int32)
            grammars.fill_rows(rows, [(m, 0), (fresh, 1)])
            assert torch.equal(rows[0], rows[1]), (rule.describe(), i)
            if tok is None or m.try_consume_tokens([tok]) != 1:
                return i + 1
            assert fresh.try_consume_tokens([tok]) == 1

    for rule, res in zip(rules, replies):
        tokens = [t for t in res.tokens if t not in nano.cfg.eos_token_id]
        first = grammars._matcher(rule)
        assert first.consume_tokens(tokens[:2])
        second = grammars._matcher(rule)  # a copy made while another is mid-walk
        assert masks_along(second, rule, tokens) > 2
        grammars.retire(rule, second)
        assert grammars._templates[rule] is second
        assert masks_along(grammars._matcher(rule), rule, tokens) > 2
        masks_along(first, rule, tokens[2:], tokens[:2])
    assert len(compiled) == len(set(rules))
    monkeypatch.undo()
    monkeypatch.setattr(grammar, "TEMPLATES", 2)
    grammars = _grammars(nano)
    for pattern in ("[0-9]{2}", "[a-z]{2}", "[0-9]{2}", "x+"):
        grammars._matcher(Constraint("regex", pattern))
    assert list(grammars._templates) == [Constraint("regex", "[0-9]{2}"), Constraint("regex", "x+")]
    seq = grammars.open(Constraint("regex", "[a-z]{2}"), set())  # compiled again: [0-9]{2}'s dropped
    matcher = seq.matcher
    seq.free()
    assert list(grammars._templates) == [Constraint("regex", "x+"), Constraint("regex", "[a-z]{2}")]
    assert grammars._templates[Constraint("regex", "[a-z]{2}")] is matcher and grammars.live == 0


# ---- lossless under a grammar ------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_mask", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_constrained_equals_constrained_gamma0_for_every_gamma(nano, prompt_set, draft_mask, batch):
    ids, rules = prompt_set
    base = _run(nano, ids, rules, gamma=0, batch_size=batch)
    assert any(r.complete for r in base)
    for gamma in (1, 2, 3, 4):
        got = _run(nano, ids, rules, gamma=gamma, batch_size=batch, draft_mask=draft_mask)
        assert [r.tokens for r in got] == [r.tokens for r in base], gamma
        assert [r.finish_reason for r in got] == [r.finish_reason for r in base]


@pytest.mark.parametrize("draft_mask", [True, False])
def test_static_forwards_mask_their_outputs_alike(nano, prompt_set, draft_mask):
    """The runner's static forwards (what CUDA graphs replay; unmasked drafting there is the fused
    chain): masks applied in place to their output buffers give eager's constrained tokens. Under
    --no-draft-mask most steps take the chain the step before launched ahead of its read (it needs
    no matcher state); masked drafting never does."""
    from glm5mtp_cli.engine.hooks import observing
    from observe import ahead_taken

    taken = []
    ids, rules = prompt_set
    base = _run(nano, ids, rules, gamma=0, batch_size=2)
    with observing(ahead_taken(taken)):
        got = _run(nano, ids, rules, gamma=3, batch_size=2, draft_mask=draft_mask, graphs="static")
    assert [r.tokens for r in got] == [r.tokens for r in base]
    assert bool(taken) != draft_mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["glm5-nano", "glm5next-nano"])
def test_cuda_graphs_verdicts_under_masks_equal_eager_constrained_gamma0(model, monkeypatch):
    """On CUDA (fp32) a greedy engine's constrained runs replay each verify's masked verdict
    (static.StaticVerdict: the host's masks copied in, applied to the verify's logits, matched);
    its tokens equal eager constrained gamma 0's, masked drafting or not."""
    from glm5mtp_cli.engine.runtime import load_runtime
    from glm5mtp_cli.engine.static import StaticVerdict

    rt = load_runtime(ModelSpec(model, "cuda", "fp32"), progress=False)
    items = read_file(PROMPTS)[::3]
    ids, rules = encode_prompts(items, rt.tokenizer), [p.constraint for p in items]
    replays = []
    run = StaticVerdict.run
    monkeypatch.setattr(StaticVerdict, "run", lambda self, rows: replays.append(1) or run(self, rows))
    base = _run(rt, ids, rules, gamma=0, batch_size=3, graphs="eager")
    for draft_mask in (True, False):
        got = _run(rt, ids, rules, gamma=3, batch_size=3, draft_mask=draft_mask, graphs="cuda")
        assert [r.tokens for r in got] == [r.tokens for r in base], draft_mask
    assert replays


@pytest.mark.parametrize("draft_mask", [True, False])
def test_constrained_and_free_requests_share_a_batch(nano, prompt_set, draft_mask):
    ids, rules = prompt_set
    mixed = [c if i % 2 else None for i, c in enumerate(rules)]
    got = _run(nano, ids, mixed, gamma=3, batch_size=4, draft_mask=draft_mask)
    alone = [_run(nano, [i], [c], gamma=0)[0] for i, c in zip(ids, mixed)]
    assert [r.tokens for r in got] == [r.tokens for r in alone]
    assert [r.constraint is not None for r in got] == [c is not None for c in mixed]


def test_every_complete_output_validates(nano, prompt_set):
    ids, rules = prompt_set
    results = _run(nano, ids, rules, gamma=3, max_new_tokens=64)
    assert sum(r.complete for r in results) >= len(results) // 2
    for r, c in zip(results, rules):
        assert r.complete == (r.finish_reason in ("grammar", "eos")), r
        assert r.valid is (True if r.complete else None)
        if r.complete and c.kind == "json_schema":
            json.loads(nano.tokenizer.decode(r.tokens))


def test_json_object_is_an_object_not_any_json_value(nano):
    """OpenAI's json_object: glm5-nano wrote `null` for the first prompt and a number for the second
    when it meant any JSON value; now each reply is an object, or one being written (cut), and the
    validity check refuses every other value."""
    rule = Constraint("json_object")
    ids = encode_prompts(read_file(PROMPTS)[13:14], nano.tokenizer) + [nano.tokenizer.encode("x = ")]
    results = _run(nano, ids, [rule] * 2, gamma=3)
    assert any(r.complete for r in results)
    for r in results:
        text = nano.tokenizer.decode(r.tokens)
        assert text.startswith("{"), text
        if r.complete:
            assert r.valid and isinstance(json.loads(text), dict), text
    g = _grammars(nano)
    assert not any(g.validates(rule, nano.tokenizer.encode(v)) for v in ("null", "false", "[0]", '"x"', "1"))
    assert all(g.validates(rule, nano.tokenizer.encode(v)) for v in ("{}", '{"a":{"b":[1,null]}}'))


def test_sampled_constrained_outputs_match_their_grammar(nano, prompt_set):
    ids, rules = prompt_set
    for draft_mask in (True, False):
        results = _run(nano, ids, rules, gamma=3, max_new_tokens=48, draft_mask=draft_mask,
                       sampling=SamplingParams(temperature=0.8, seed=3))
        assert all(r.valid for r in results if r.complete) and any(r.complete for r in results)
        g = _grammars(nano)  # every emitted token, complete or cut, is a prefix the grammar admits
        for r, c in zip(results, rules):
            m = g._matcher(c)
            assert m.validate_tokens([t for t in r.tokens if t not in nano.cfg.eos_token_id]) == \
                len([t for t in r.tokens if t not in nano.cfg.eos_token_id])


# ---- ends: EOS where the grammar accepts, the grammar's own finish -------------------------------------------

def test_eos_is_masked_until_the_grammar_accepts(nano):
    eos = nano.cfg.eos_token_id
    g = _grammars(nano)
    seq = g.open(Constraint("regex", r"ab?"), set(eos))
    masks = StepMasks(g, [seq], 2, torch.device("cpu"))
    a, b = (nano.tokenizer.encode(x)[0] for x in ("a", "b"))
    drafts = type("D", (), {"tokens": torch.tensor([[a, b]]), "counts": [2]})()
    masks.read_drafts(drafts)
    allowed = unpack(masks.verify(drafts)[0], nano.cfg.vocab_size)
    assert not allowed[0, eos].any()  # nothing matched yet
    assert allowed[1, eos].all() and allowed[1, b]  # "a" matches; "b" may follow
    assert masks.valid == [2]
    assert seq.commit([a, eos[0]]) is None and seq.ended  # an EOS the engine ends on: not fed to the matcher


@pytest.mark.parametrize("draft_mask", [True, False])
def test_an_end_token_the_grammar_could_write_is_allowed_only_where_it_accepts(nano, draft_mask):
    """An end token of the engine's own that the grammar also takes as content (leak-check declares
    one per round) is banned until the grammar accepts, as the model's EOS is: it was allowed as
    a letter, and the engine, ending on it before any match, failed."""
    ids = [nano.tokenizer.encode("# a short name\nname = '")]
    rule = Constraint("regex", r"[a-z]{1,4}")
    first = _run(nano, ids, [rule], gamma=0, eos_ids=())[0].tokens[0]  # what it writes first, unhindered
    r = _run(nano, ids, [rule], gamma=3, eos_ids=(first,), draft_mask=draft_mask)[0]
    assert r.tokens[0] != first and r.complete and r.valid, (r.tokens, r.finish_reason)


def test_a_completed_grammar_finishes_the_sequence_also_under_ignore_eos(nano):
    ids = [nano.tokenizer.encode("# the release date\nd = '")]
    for eos_ids in (None, ()):
        r = _run(nano, ids, [Constraint("regex", r"\d{4}-\d{2}-\d{2}")], gamma=3, eos_ids=eos_ids)[0]
        text = nano.tokenizer.decode(r.tokens)
        assert r.finish_reason == "grammar" and r.complete and r.valid, (r.finish_reason, text)
        assert len(text) == 10 and text[4] == text[7] == "-"


def test_a_cut_output_is_incomplete(nano):
    ids = [nano.tokenizer.encode("# a person\nperson = ")]
    r = _run(nano, ids, [Constraint("json_schema", json.dumps(SCHEMA))], gamma=3, max_new_tokens=4)[0]
    assert r.finish_reason == "length" and r.complete is False and r.valid is None


# ---- --constrain-after: the trigger at every draft position and as the bonus token ----------------------------

def test_constrain_after_lands_at_every_draft_position_and_the_bonus(nano):
    gamma = 3
    prompt = nano.tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n")
    free = _run(nano, [prompt], None, gamma=gamma, max_new_tokens=40, eos_ids=())[0]
    rule = Constraint("regex", r"[a-z]{1,6}")
    landed = set()
    firsts = [k for k in range(1, 30) if free.tokens[k] not in free.tokens[:k]]
    for k in firsts:
        trig = free.tokens[k]
        runs = {g: run_generate(nano, [prompt], EngineConfig(gamma=g, max_new_tokens=40, eos_ids=(), constraint=rule,
                                                              constrain_after=trig))[0][0] for g in (0, gamma)}
        assert runs[gamma].tokens == runs[0].tokens, k
        out = runs[gamma].tokens
        assert out[:k + 1] == free.tokens[:k + 1]  # unconstrained up to and including the trigger
        assert runs[gamma].finish_reason == "grammar" and runs[gamma].valid  # constrained right after it
        at = 1  # output index of each step's first token (the prefill made token 0)
        for step in runs[gamma].trace:
            if at <= k < at + step["emitted"]:
                j = k - at
                landed.add("bonus" if j == step["accepted"] else j)
            at += step["emitted"]
    assert landed >= {0, 1, 2, "bonus"}, landed


# ---- lifetimes -------------------------------------------------------------------------------------------

def test_matchers_are_freed_with_their_sequences(nano, prompt_set):
    from glm5mtp_cli.engine.runtime import make_engine

    ids, rules = prompt_set
    config = EngineConfig(gamma=3, max_new_tokens=16, batch_size=2)
    pools = nano.make_pools(200, 2)
    engine = make_engine(nano, pools, config)
    from glm5mtp_cli.engine.sequence import Request

    engine.generate([Request(p, 16, i, constraint=c) for i, (p, c) in enumerate(zip(ids, rules))])
    assert engine.grammars.live == 0

    class Cancel:  # leak-check's hooks, reduced: cancel every sequence after its first step
        def before_verify(self, seqs):
            pass

        def cancels(self, seq):
            return seq.steps >= 1

        def kept_component(self, owner):
            return None

    engine.lifecycle.hooks = Cancel()
    results = engine.generate([Request(p, 16, i, constraint=c) for i, (p, c) in enumerate(zip(ids, rules))])
    assert {r.finish_reason for r in results} <= {"cancelled", "grammar", "eos"} and engine.grammars.live == 0
    engine.close()


# ---- the commands ----------------------------------------------------------------------------------------

def _one_line(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output
    assert "Traceback" not in r.output


@pytest.fixture
def bad_inputs(tmp_path):
    (tmp_path / "bad.json").write_text('{"type": ')
    (tmp_path / "list.json").write_text('[1]')
    (tmp_path / "unknown.json").write_text('{"type": "frobnicate"}')
    (tmp_path / "g.lark").write_text("start: undefined_rule\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y", "response_format": {"type": "regex", "pattern": "[a-"}}\n')
    (tmp_path / "ok.jsonl").write_text('{"prompt": "y", "response_format": {"type": "json_object"}}\n')
    (tmp_path / "c.jsonl").write_text('{"turns": ["hi"]}\n')
    return tmp_path


@pytest.mark.parametrize("cmd", ["generate", "bench", "acceptance"])
@pytest.mark.parametrize("args, needle", [
    (["--json-schema", "{d}/bad.json"], "--json-schema {d}/bad.json: not JSON"),
    (["--json-schema", "{d}/missing.json"], "--json-schema {d}/missing.json: No such file"),
    (["--json-schema", "{d}/list.json"], "a JSON schema must be a JSON object"),
    (["--json-schema", "{d}/unknown.json"], "invalid json schema"),
    (["--regex", "[a-"], "--regex: invalid regex"),
    (["--grammar", "{d}/g.lark"], "invalid grammar"),
    (["--regex", "a", "--json-object"], "give at most one constraint"),
    (["--prompts", "{d}/p.jsonl"], "p.jsonl: line 2: invalid regex"),
    (["--regex", "a", "--constrain-after", "<|no-such-token|>"], "is not one token of the vocabulary"),
    (["--regex", "a", "--constrain-after", "id:99999"], "outside the vocabulary"),
    (["--constrain-after", "<|assistant|>"], "--constrain-after needs a constraint"),
    (["--regex", "a", "--synthetic-acceptance", "0.5"], "cannot honour a constraint"),
])
def test_bad_constraints_are_one_line_before_any_weights_load(cmd, args, needle, bad_inputs, monkeypatch):
    from typer.testing import CliRunner

    import glm5mtp_cli.engine.runtime as runtime
    from glm5mtp_cli.cli import app

    if cmd == "acceptance" and "--synthetic-acceptance" in args:
        pytest.skip("acceptance has no --synthetic-acceptance")
    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    d = str(bad_inputs)
    args = [a.format(d=d) for a in args]
    if cmd == "generate" and "--prompts" not in args:
        args = ["--prompt", "x", *args]
    _one_line(CliRunner().invoke(app, [cmd, "--device", "cpu", *args]), needle.format(d=d))


def test_conversation_and_tp_refuse_constraints(bad_inputs, monkeypatch):
    from typer.testing import CliRunner

    import glm5mtp_cli.engine.runtime as runtime
    from glm5mtp_cli.cli import app

    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    run = CliRunner().invoke
    _one_line(run(app, ["generate", "--conversation", f"{bad_inputs}/c.jsonl", "--json-object"]), "--conversation")
    _one_line(run(app, ["generate", "--prompts", f"{bad_inputs}/ok.jsonl", "--tp", "2"]), "constraints run on one rank")


def test_generate_json_carries_the_verdicts_and_constrain_after_takes_a_special_token(tmp_path):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    r = CliRunner().invoke(app, ["generate", "--device", "cpu", "--prompt", "# a person\nperson = ", "--json",
                                 "--json-schema", str(tmp_path / "s.json"), "--compare", "--max-new-tokens", "40",
                                 "--trace", str(tmp_path / "t.jsonl")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    req = doc["requests"][0]
    assert req["constraint"] == "json_schema" and req["complete"] and req["valid"]
    assert req["finish_reason"] == "grammar" and set(json.loads(req["text"])) == {"name", "age"}
    assert doc["compare"]["same_tokens"] is True
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert all(0 <= row["grammar_rejected"] <= row["drafts"] for row in rows)
    assert doc["config"]["engine"]["constraint"]["kind"] == "json_schema"
    r = CliRunner().invoke(app, ["generate", "--device", "cpu", "--prompt", "x = ", "--json", "--regex", "[a-z]{1,4}",
                                 "--constrain-after", "<|assistant|>", "--max-new-tokens", "3"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["config"]["engine"]["constrain_after"] == 2  # <|assistant|>'s id in glm5-nano's tokenizer
    assert doc["requests"][0]["complete"] is False  # the trigger never came: nothing was constrained


def test_leak_check_frees_matchers_and_catches_one_kept(monkeypatch):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app
    from glm5mtp_cli.engine.grammar import SeqGrammar

    args = ["leak-check", "--device", "cpu", "--sequences", "5", "--max-new-tokens", "6", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "grammar" in doc["lifecycles_seen"] and doc["matchers_live_after"] == 0 and doc["verdict"] == "clean"
    monkeypatch.setattr(SeqGrammar, "free", lambda self: None)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "grammar_matchers" in json.loads(r.stdout)["leaked_bytes_per_sequence"]


def test_bench_and_acceptance_run_prompt_lines_constrained(tmp_path):
    from typer.testing import CliRunner

    from glm5mtp_cli.cli import app

    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:4]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = CliRunner().invoke(app, ["bench", "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl"), "--no-transformers",
                                 "--batch-sizes", "2", "--gammas", "0,3", "--repeats", "1", "--max-new-tokens", "8",
                                 "--target-layers", "0", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {(row["constrained"], row["valid"] == row["complete"]) for row in doc["rows"]} == {(2, True)}
    from rich.console import Console

    from glm5mtp_cli.commands.bench import print_rows
    out = Console(record=True, width=100)
    print_rows(out, doc)
    assert "constrained requests" in out.export_text()
    r = CliRunner().invoke(app, ["acceptance", "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl"), "--gammas", "3",
                                 "--temperatures", "0", "--max-new-tokens", "32", "--no-draft-mask", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["lossless"] is True and "--no-draft-mask" in doc["command"]
    c = next(run for run in doc["runs"] if run["gamma"] == 3)["constrained"]
    assert c["requests"] == 4 and c["valid"] == c["complete"]


def test_step_phases_times_the_grammar_work_and_takes_its_wrappers_off(tmp_path, capsys):
    """diagnostics/step_phases around a constrained bench (--no-draft-mask): the drafts' copy, the
    walk, the commit and the outputs' check are timed, and the engine's grammar classes are as they
    were after."""
    from glm5mtp_cli.diagnostics import step_phases
    from glm5mtp_cli.engine.grammar import SeqGrammar

    lines = PROMPTS.read_text().splitlines()[:2]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    before = StepMasks.verify, StepMasks.read_drafts, SeqGrammar.commit
    assert step_phases.main(["bench", "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl"), "--no-transformers",
                             "--batch-sizes", "2", "--gammas", "3", "--repeats", "1", "--max-new-tokens", "8",
                             "--target-layers", "0", "--no-draft-mask", "--json"]) == 0
    row = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    for phase in ("masks.read_drafts", "masks.verify", "grammar.commit", "judge", "runner.mask"):
        assert row[f"{phase}_us"] > 0, phase
    assert (StepMasks.verify, StepMasks.read_drafts, SeqGrammar.commit) == before
