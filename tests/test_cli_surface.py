"""The CLI surface a new user meets (issue 16, issue 11 items 4-5): fast --help, one line for bad input
before any weights load, one prompt reader, tables at 80 columns, nothing but JSON on --json stdout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from glm5mtp_cli.cli import COMMANDS, app, command_app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
NARROW = {"COLUMNS": "80"}


def _one_line(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output
    assert "Traceback" not in r.output


def _fits_80(text: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, line
    assert "…" not in text.replace("…[cut]", ""), text  # no header or cell cut to fit (…[cut]: the text's own mark)


# ---- issue 11 item 5: no torch for --help / --version ---------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["--version"], ["generate", "--help"], ["profile", "--help"],
                                  ["info", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    probe = ("import runpy, sys\nsys.argv = ['glm5mtp'] + sys.argv[1:]\ntry:\n"
             "    runpy.run_module('glm5mtp_cli.cli', run_name='__main__')\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env, timeout=60)
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH", r.stderr
    assert ("glm5mtp" in r.stdout) and ("Usage" in r.stdout or args == ["--version"])


def test_help_has_examples_and_no_bool_placeholders():
    for cmd in COMMANDS:
        r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "120"})
        assert r.exit_code == 0, r.output
        assert "Examples" in r.output and "<bool>" not in r.output, (cmd, r.output)  # --help's own line too
        assert "Usage: glm5mtp " + cmd in r.output
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "<bool>" not in r.output and "--version" in r.output, r.output
    r = runner.invoke(app, ["info", "--help"], env={"COLUMNS": "120"})
    assert "{model}" not in r.output and "MODEL" in r.output


def _params(cmd: str):
    """The command as Typer builds it (typer.main.get_command) and its parameters, --help included (ours)."""
    built = typer.main.get_command(command_app(cmd))
    return built, built.params


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_at_80_columns_shows_every_option_name_whole(cmd):
    """Each option's row starts with its full name(s), its negative beside it, and nothing is cut (…)."""
    r = runner.invoke(app, [cmd, "--help"], env=NARROW)
    assert r.exit_code == 0, r.output
    _fits_80(r.output)
    rows = [line.lstrip("│ *") for line in r.output.splitlines()]
    for p in _params(cmd)[1]:
        if p.param_type_name != "option":
            continue
        names = ",".join(o for o in p.opts if o.startswith("--"))
        negative = ",".join(p.secondary_opts)
        row = re.compile(re.escape(names) + r"\s" + (r".*\s" + re.escape(negative) + r"\s" if negative else ""))
        assert any(row.match(line) for line in rows), (cmd, names, r.output)


def test_help_markup_drops_no_bracketed_text():
    """Rich markup would swallow '[plot]' in "pip install 'glm5mtp[plot]'": every help text renders to
    itself, escapes aside."""
    from rich.text import Text

    for cmd in COMMANDS:
        built, params = _params(cmd)
        for text in [built.help] + [p.help for p in params if getattr(p, "help", None)]:
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (cmd, text)
    r = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    assert "pip install 'glm5mtp[plot]'" in r.output, r.output


def test_model_help_lists_every_profile_of_the_registry():
    import profiles

    names = profiles.names()
    assert {"glm5", "glm5-nano", "glm5-tiny", "glm5next", "glm5next-nano", "glm5next-tiny"} <= set(names)
    for cmd in ("generate", "bench", "profile"):
        model = next(p for p in _params(cmd)[1] if "--model" in p.opts)
        assert all(n in model.help for n in names), (cmd, model.help)


# ---- flags and paths refused before any weights load --------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    ([], "--conversation"),  # no prompt source: the message names every alternative
    (["--prompt", "x", "--trace", "/nonexistent/dir/t.jsonl"], "--trace"),
    (["--prompt", "x", "--threads", "0"], "--threads"),
    (["--prompt", "x", "--draft-vocab-file", "/nonexistent/c.json", "--draft-vocab", "8"], "--draft-vocab-file"),
    (["--prompt", "x", "--draft-vocab-file", "/nonexistent/c.json"], "--draft-vocab"),
    (["--prompt", "x", "--carry", "all"], "--carry needs --conversation"),
    (["--prompt", "x", "--carry-budget", "1KB"], "--carry-budget needs --conversation"),  # units parsed first
    (["--prompt", "x", "--carry-budget", "2x"], "--carry-budget '2x' not understood"),
])
def test_generate_refuses_before_loading(args, needle, monkeypatch):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    _one_line(runner.invoke(app, ["generate", "--model", "no-such-model", *args]), needle)


@pytest.mark.parametrize("args, needle", [
    (["--prompt-ids", "1,99999"], "--prompt-ids: token id 99999 outside the vocabulary (0..4095)"),
    (["--prompt", "x", "--max-seq-len", "99999"], "over the model's limit (max_position_embeddings 2048)"),
    (["--prompt", "x", "--draft-vocab", "5000"], "--draft-vocab must be in 1..4096"),
    (["--prompt", "x", "--model", "glm5next-tiny", "--draft-vocab", "64"], "--draft-vocab: no token counts"),
    (["--prompt", "x", "--compare", "--gamma", "0"], "--compare runs gamma 0 beside --gamma"),
    (["--prompt", "x", "--gamma-policy", "adaptive", "--gamma", "0"], "--gamma-policy adaptive"),
    (["--prompt", "x", "--threads", "100000"], "--threads must be in 1.."),
    (["--prompt", "x", "--trace", "/etc/hostname/t.jsonl"], "/etc/hostname is a file, not a folder"),
])
def test_generate_refuses_what_the_config_refutes_before_loading(args, needle, monkeypatch, tmp_path):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no draft-vocab counts of the user's
    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    _one_line(runner.invoke(app, ["generate", *args]), needle)


@pytest.mark.parametrize("extra, needle", [(["--batch-size", "2"], "--batch-size"), (["--compare"], "--compare")])
def test_conversation_refuses_what_it_cannot_honour(tmp_path, extra, needle):
    conv = tmp_path / "c.jsonl"
    conv.write_text('{"turns": [[1, 2, 3], [4, 5]]}\n')
    _one_line(runner.invoke(app, ["generate", "--model", "no-such-model", "--conversation", str(conv), *extra]), needle)


def test_byte_flags_take_units():
    from glm5mtp_cli.errors import UserError
    from glm5mtp_cli.units import parse_size

    assert parse_size("1KB", "--carry-budget", zero_ok=True) == 1000 and parse_size("64KiB") == 65536
    assert parse_size("0", "--carry-budget", zero_ok=True) == 0  # a budget may hold nothing
    with pytest.raises(UserError, match="--max-shard-size '0' must be positive"):
        parse_size("0", "--max-shard-size")


def test_conversation_carry_budget_in_units(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    conv = tmp_path / "c.jsonl"
    conv.write_text('{"turns": [[1, 2, 3, 4], [5, 6]]}\n')
    r = runner.invoke(app, ["generate", "--model", str(folder), "--conversation", str(conv), "--max-new-tokens", "3",
                            "--carry", "all", "--carry-budget", "1KB", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["carry"]["carry_budget"] == 1000


def test_profile_checks_flags_against_the_model_before_loading(monkeypatch):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    _one_line(runner.invoke(app, ["profile", "--max-seq-len", "4096"]), "the model's limit")
    _one_line(runner.invoke(app, ["leak-check", "--max-seq-len", "4096"]), "the model's limit")


def test_prompt_over_the_limit_names_the_models_limit(spec_ckpt):
    folder, _ = spec_ckpt
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "100000",
                            "--device", "cpu"])
    _one_line(r, "the model's limit")
    assert "--max-seq-len" not in r.stderr


# ---- one prompt reader -------------------------------------------------------------------------------------

def test_prompt_reader_forms(tmp_path):
    from glm5mtp_cli.errors import UserError
    from glm5mtp_cli.prompts import encode_prompts, read_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ab"}\n{"prompt": [5, 6, 7]}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = read_prompts(None, None, f)
    assert [(p.text, p.ids, bool(p.messages)) for p in items] == [("ab", None, False), (None, [5, 6, 7], False),
                                                                  (None, None, True)]
    assert encode_prompts(items[1:2], None) == [[5, 6, 7]]  # token ids need no tokenizer
    with pytest.raises(UserError, match="no tokenizer"):
        encode_prompts(items[:1], None)
    f.write_text('{"prompt": 3}\n')
    with pytest.raises(UserError, match="line 1"):
        read_prompts(None, None, f)
    with pytest.raises(UserError, match="--conversation"):
        read_prompts(None, None, None, others=", --conversation")


def test_token_id_prompts_file_without_tokenizer(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    f = tmp_path / "ids.jsonl"
    f.write_text('{"prompt": [3, 17, 99, 4]}\n{"prompt": [5, 6, 7, 8, 9]}\n')
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompts", str(f), "--max-new-tokens", "4",
                            "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [q["prompt_tokens"] for q in doc["requests"]] == [4, 5]
    assert "graph_capture_ms" not in doc["latency"]  # eager on the CPU: nothing captured


def test_acceptance_takes_the_same_prompt_forms(spec_ckpt, tmp_path):
    folder, _ = spec_ckpt
    f = tmp_path / "ids.jsonl"
    f.write_text('{"prompt": [3, 17, 99, 4]}\n')
    r = runner.invoke(app, ["acceptance", "--model", str(folder), "--prompts", str(f), "--gammas", "2",
                            "--temperatures", "0", "--max-new-tokens", "4", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompts"]["count"] == 1  # stdout is the JSON document alone (no progress)


# ---- --conversation honours generate's flags ----------------------------------------------------------------

def test_conversation_honours_draft_vocab_tau_and_trace(spec_ckpt, tmp_path):
    from glm5mtp_cli.engine.draft_vocab import write_counts

    folder, model = spec_ckpt
    counts = tmp_path / "counts.json"
    write_counts(counts, list(range(model.config.vocab_size)), "test")
    conv, trace = tmp_path / "c.jsonl", tmp_path / "t.jsonl"
    conv.write_text('{"turns": [[1, 2, 3, 4], [5, 6]]}\n')
    r = runner.invoke(app, ["generate", "--model", str(folder), "--conversation", str(conv), "--max-new-tokens", "5",
                            "--draft-vocab", "64", "--draft-vocab-file", str(counts), "--draft-conf-tau", "0.1",
                            "--trace", str(trace), "--device", "cpu"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "chat 0, turn 2" in r.stdout and "finish:" in r.stdout  # the replies are shown, not only the table
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {row["turn"] for row in rows} == {1, 2} and all(row["conversation"] == 0 for row in rows)
    _fits_80(r.stdout)


def test_conversation_static_graphs_equal_eager(spec_runtime):
    from glm5mtp_cli.engine.conversation import run_conversations
    from glm5mtp_cli.engine.sampling import SamplingParams

    convs = [[[1, 2, 3, 4, 5], [6, 7]], [[9, 8, 7], [1, 2, 3]]]
    from glm5mtp_cli.engine.config import EngineConfig

    config = EngineConfig(gamma=2, max_new_tokens=6, sampling=SamplingParams(), max_seq_len=256, alloc="budget",
                          eos_ids=(), graphs="eager")
    eager, _ = run_conversations(spec_runtime, convs, config, "all", None, use_template=False)
    static, _ = run_conversations(spec_runtime, convs, config.replace(graphs="static"), "all", None,
                                  use_template=False)
    assert [[t.tokens for t in c.turns] for c in static] == [[t.tokens for t in c.turns] for c in eager]


# ---- output: --json stdout, 80 columns, the single-prompt layout ---------------------------------------------

def test_generate_tables_fit_80_columns_and_compare_says_same_tokens(spec_ckpt):
    folder, _ = spec_ckpt
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt-ids", "1,2,3,4", "--gamma", "2",
                            "--max-new-tokens", "6", "--compare", "--device", "cpu"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "same tokens" in r.stdout and "finish: length" in r.stdout
    _fits_80(r.stdout)


def test_single_prompt_shows_header_finish_and_cut_mark():
    r = runner.invoke(app, ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--ignore-eos",
                            "--device", "cpu"], env=NARROW)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.splitlines()[0].startswith("glm5-nano, cpu, gamma 3, greedy")
    assert "def add(a, b):" in out and "finish: length" in out
    assert "─" * 20 in out.split("finish:")[1]  # a rule between the text and the tables
    _fits_80(out)


def test_info_fits_80_columns_with_one_unit_and_the_models_limit():
    r = runner.invoke(app, ["info", "glm5-nano"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "parameters in M" in r.stdout and "2,048 tokens" in r.stdout
    _fits_80(r.stdout)
    doc = json.loads(runner.invoke(app, ["info", "glm5-nano", "--json"]).stdout)
    assert doc["cache"]["tokens"] == 2048


def test_profile_defaults_work_on_the_default_model_and_fit_80_columns():
    r = runner.invoke(app, ["profile", "--repeats", "1"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "clipped to the model's limit" in " ".join(r.stderr.split())
    _fits_80(r.stdout)
    r = runner.invoke(app, ["profile", "--model", "glm5", "--predict-only", "--max-seq-len", "4096,32k,128k",
                            "--tp", "8"], env=NARROW)
    assert r.exit_code == 0, r.output
    assert "8 *" in r.stdout and "* the --tp of this run" in r.stdout
    _fits_80(r.stdout)


def test_leak_check_fits_80_columns_and_json_stdout_is_json_only(tiny):
    args = ["leak-check", "--model", tiny, "--sequences", "4", "--max-new-tokens", "4", "--device", "cpu"]
    r = runner.invoke(app, args, env=NARROW)
    assert r.exit_code == 0, r.output
    _fits_80(r.stdout)
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip().splitlines()) == 1 and json.loads(r.stdout)["verdict"] == "clean"


def test_bench_prints_json_only_with_json():
    args = ["bench", "--model", "glm5-tiny", "--random-weights", "--draft-context", "16", "--device", "cpu"]
    r = runner.invoke(app, args, env=NARROW)
    assert r.exit_code == 0, r.output
    assert '"draft_step"' not in r.stdout and "one draft step" in r.stdout
    r = runner.invoke(app, [*args, "--json"])
    assert json.loads(r.stdout)["draft_step"]["step_ms"] > 0


# ---- files, threads, the Hub ---------------------------------------------------------------------------------

def test_init_random_writes_shards_with_normal_modes(tmp_path):
    r = runner.invoke(app, ["init-random", "glm5-tiny", str(tmp_path / "m"), "--max-shard-size", "64KiB"])
    assert r.exit_code == 0, r.output
    umask = os.umask(0)
    os.umask(umask)
    shards = list((tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 1
    assert {s.stat().st_mode & 0o777 for s in shards} == {0o666 & ~umask}


def test_default_threads_leave_room_on_a_shared_machine(monkeypatch):
    from glm5mtp_cli.engine import runtime

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert runtime.default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert runtime.default_threads() == 4


def test_hub_miss_without_offline_suggests_hf_hub_offline(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from glm5mtp_cli.errors import UserError
    from glm5mtp_cli.checkpoint.resolve import resolve_config

    def miss(*a, **k):
        raise hub_errors.LocalEntryNotFoundError("no network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", miss)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1"):
        resolve_config("someorg/somemodel")


def test_shared_option_constants_match_the_engine():
    from glm5mtp_cli.commands import draft_vocab, options
    from glm5mtp_cli.engine import draft_vocab as engine_dv, runtime

    assert options.DEFAULT_MODEL == runtime.DEFAULT_MODEL
    assert draft_vocab.COUNTS_FILE == engine_dv.COUNTS_FILE


def test_no_module_outside_commands_imports_commands():
    pkg = ROOT / "glm5mtp_cli"
    for path in pkg.rglob("*.py"):
        if "commands" in path.parts or path.name == "cli.py":
            continue
        assert "glm5mtp_cli.commands" not in path.read_text(), path


def test_every_option_declares_its_flag():
    """Older Typer (0.27, the GPU image's) takes a lone metavar for the flag's name (`--DEVICE`), so
    every typer.Option that sets a metavar must name its flag explicitly."""
    import ast

    missing = []
    for path in (ROOT / "glm5mtp_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Option"
                    and not node.args and any(k.arg == "metavar" for k in node.keywords)):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, missing


@pytest.mark.parametrize("args, needle", [(["--compile", "fast"], "--compile must be one of off, kernels, torch"),
                                          (["--compile-mode", "max"], "--compile-mode must be one of")])
@pytest.mark.parametrize("cmd", ["generate", "bench", "acceptance", "leak-check"])
def test_bad_compile_value_is_one_line(cmd, args, needle):
    extra = ["--humaneval"] if cmd == "acceptance" else []
    r = runner.invoke(app, [cmd, "--model", "glm5-tiny", "--device", "cpu", *extra, *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output


@pytest.mark.parametrize("cmd", ["generate", "acceptance", "leak-check", "profile"])
def test_a_seed_past_the_generators_range_is_one_line_before_loading(cmd, monkeypatch):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setattr(runtime, "load_runtime", lambda *a, **k: pytest.fail("weights loaded"))
    extra = ["--prompt", "x"] if cmd == "generate" else []
    _one_line(runner.invoke(app, [cmd, *extra, "--seed", str(1 << 70)]), "--seed must be in")


@pytest.mark.parametrize("cmd", [["init-random", "glm5-tiny", "/tmp/never-written"],
                                 ["quantize", "glm5-tiny", "/tmp/never-written"], ["train", "--out", "/tmp/never-written"]])
def test_a_bad_shard_size_names_its_flag_before_any_work(cmd):
    _one_line(runner.invoke(app, [*cmd, "--max-shard-size", "5XB"]), "--max-shard-size '5XB' not understood")


def test_a_single_file_is_one_file(tmp_path):
    r = runner.invoke(app, ["quantize", "glm5-nano", str(tmp_path / "fp8")])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert " 1 file, " in out and "1 files" not in out, out


@pytest.mark.parametrize("source", [["--prompt", "x"], ["--conversation", "{d}/c.jsonl"]])
def test_a_checkpoint_without_a_tokenizer_says_how_a_random_one_gets_one(tiny, source, tmp_path):
    (tmp_path / "c.jsonl").write_text('{"turns": ["hi"]}\n')
    args = [a.format(d=tmp_path) for a in source]
    _one_line(runner.invoke(app, ["generate", "--model", tiny, *args, "--device", "cpu"]),
              "no tokenizer.json (a random checkpoint gets one from init-random --tokenizer DIR)")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_text_is_not_ragged_at_80_columns(cmd):
    """Rich keeps the docstring's line breaks, so a line too long for 80 columns leaves a fragment alone on
    the next (an example's '(a smoke run: ~1 GB, ~80 s)'): below the summary, every line renders whole."""
    import inspect

    doc = inspect.cleandoc(typer.main.get_command(command_app(cmd)).help).split("\n\n", 1)[1]
    r = runner.invoke(app, [cmd, "--help"], env=NARROW)
    assert r.exit_code == 0, r.output
    rendered = [line.strip() for line in r.output.splitlines()]
    cut = [line for line in doc.splitlines() if line.strip() and line.strip().replace("\\[", "[") not in rendered]
    assert not cut, (cmd, cut)
