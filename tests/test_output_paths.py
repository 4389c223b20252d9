"""Files the user names (issue 70 items 2-3): every single-file output is proved writable before any work,
its folder never created; a plot's format and an input that is not text are one line before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from glm5mtp_cli.cli import app
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.output_file import check_output

runner = CliRunner()
BINARY = Path(__file__).resolve().parent.parent / "profiles" / "glm5-nano" / "model.safetensors"
# /sys and /proc refuse new files even to root, who passes os.access there: only opening proves it
UNWRITABLE = [p for p in ("/sys", "/proc") if os.path.isdir(p)]


def _one_line(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output
    assert "Traceback" not in r.output


def _fail(*args, **kwargs):
    pytest.fail("work started before the refusal")


@pytest.fixture
def no_weights(monkeypatch):
    import glm5mtp_cli.engine.runtime as runtime

    monkeypatch.setattr(runtime, "load_runtime", _fail)


@pytest.fixture
def no_work(monkeypatch, no_weights):
    """Not even the model's config is read: output paths are checked first."""
    import glm5mtp_cli.checkpoint.resolve as resolve

    monkeypatch.setattr(resolve, "resolve_config", _fail)
    monkeypatch.setattr(resolve, "resolve_model", _fail)


# ---- the rule, on its own -----------------------------------------------------------------------------------

@pytest.mark.parametrize("root", UNWRITABLE)
def test_a_folder_that_refuses_new_files_is_refused(root):
    with pytest.raises(UserError, match=f"--trace {root}/t.jsonl: cannot write there"):
        check_output(Path(root) / "t.jsonl", "--trace")


def test_an_existing_file_is_proved_writable_without_being_touched(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("keep\n")
    check_output(f, "--trace")
    assert f.read_text() == "keep\n"
    new = tmp_path / "new.jsonl"
    check_output(new, "--trace")
    assert not new.exists()  # created to prove it, then removed


def test_a_missing_folder_or_a_folder_given_as_the_file_is_refused(tmp_path):
    with pytest.raises(UserError, match=f"folder {tmp_path / 'no'} does not exist"):
        check_output(tmp_path / "no" / "t.jsonl", "--trace")
    with pytest.raises(UserError, match="is a folder; give a file name"):
        check_output(tmp_path, "--trace")


# ---- every output flag, before any work ---------------------------------------------------------------------

OUTPUTS = [
    (["generate", "--prompt", "x", "--trace"], "--trace", "t.jsonl"),
    (["profile", "--plot"], "--plot", "p.png"),
    (["plan", "--acceptance", "0.8", "--plot"], "--plot", "p.png"),
    (["plan", "--calibrate", "profiles/glm5/PLAN_RESULTS.md", "--out"], "--out", "cal.json"),
    (["draft-vocab", "--out"], "--out", "c.json"),
]


@pytest.mark.parametrize("args, flag, name", OUTPUTS)
@pytest.mark.parametrize("root", UNWRITABLE)
def test_every_output_flag_proves_writability_before_any_work(args, flag, name, root, no_work):
    _one_line(runner.invoke(app, [*args, f"{root}/{name}"]), f"{flag} {root}/{name}: cannot write there")


@pytest.mark.parametrize("args, flag, name", OUTPUTS)
def test_every_output_flag_refuses_a_missing_folder_and_makes_none(args, flag, name, tmp_path, no_work):
    missing = tmp_path / "no" / "such"
    _one_line(runner.invoke(app, [*args, str(missing / name)]), f"folder {missing} does not exist")
    assert not (tmp_path / "no").exists()


# ---- a plot's format, an input that is not text -------------------------------------------------------------

@pytest.mark.parametrize("cmd", [["profile"], ["plan", "--acceptance", "0.8"]])
@pytest.mark.parametrize("name", ["p.txt", "p"])
def test_a_plot_name_matplotlib_cannot_write_is_refused_before_any_work(cmd, name, tmp_path, no_work):
    pytest.importorskip("matplotlib")
    _one_line(runner.invoke(app, [*cmd, "--plot", str(tmp_path / name)]), "end the name with one (e.g. .png)")


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompts", str(BINARY)], f"{BINARY}: not UTF-8 text"),
    (["bench", "--prompts", str(BINARY)], f"{BINARY}: not UTF-8 text"),
    (["acceptance", "--prompts", str(BINARY)], f"{BINARY}: not UTF-8 text"),
    (["generate", "--conversation", str(BINARY)], f"{BINARY}: not UTF-8 text"),
    (["generate", "--prompt", "x", "--json-schema", str(BINARY)], f"--json-schema {BINARY}: not UTF-8 text"),
    (["generate", "--prompt", "x", "--grammar", str(BINARY)], f"--grammar {BINARY}: not UTF-8 text"),
    (["plan", "--acceptance-file", str(BINARY)], f"--acceptance-file {BINARY}: not UTF-8 text"),
])
def test_an_input_that_is_not_text_is_one_line_before_any_weights_load(args, needle, no_weights):
    _one_line(runner.invoke(app, args), needle)


# ---- a checkpoint's size, said before it is written ---------------------------------------------------------

@pytest.mark.parametrize("profile, fp8", [("glm5-tiny", False), ("glm5-tiny", True), ("glm5next-tiny", True)])
def test_init_random_says_the_bytes_it_writes_before_writing(profile, fp8, tmp_path):
    from glm5mtp_cli.checkpoint.write import init_random, random_config, weight_bytes
    from glm5mtp_cli.units import fmt_bytes

    cfg, dtype = random_config(profile)
    assert weight_bytes(cfg, dtype, fp8) == init_random(cfg, tmp_path / "direct", fp8=fp8).total_bytes
    out = tmp_path / "ckpt"
    r = runner.invoke(app, ["init-random", profile, str(out), *(["--fp8"] if fp8 else [])])
    assert r.exit_code == 0, r.output
    assert f"init-random: writing {fmt_bytes(weight_bytes(cfg, dtype, fp8))} of weights into {out}" in r.stderr


def test_init_random_refuses_a_filesystem_without_room_before_writing(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import glm5mtp_cli.checkpoint.write as write

    monkeypatch.setattr(write, "init_random", _fail)  # were the check gone, no 22 GiB written here
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=2**30))
    out = tmp_path / "glm5-1l"
    r = runner.invoke(app, ["init-random", "glm5", str(out), "--layers", "1"])  # 22.83 GiB in bf16
    _one_line(r, f"OUT_DIR {out}: needs 22.83 GiB, its filesystem has 1.00 GiB free")
    assert list(tmp_path.iterdir()) == []  # nothing staged, nothing written


@pytest.mark.parametrize("profile", ["glm5-nano", "glm5next-nano"])
def test_quantize_says_the_bytes_it_writes_before_writing(profile, tmp_path):
    """Exactly the bytes its tensors take, from the source's headers: the FP8 copy, then its fp32 twin."""
    from safetensors import safe_open

    from glm5mtp_cli.checkpoint.write import rewrite_bytes, rewrite_source
    from glm5mtp_cli.units import fmt_bytes

    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    for src, out, verb in ((profile, fp8, "quantize"), (str(fp8), twin, "dequantize")):
        size = rewrite_bytes(rewrite_source(src, fp8=verb == "quantize"), fp8=verb == "quantize")
        r = runner.invoke(app, ["quantize", src, str(out), *(["--dequantize"] if verb == "dequantize" else [])])
        assert r.exit_code == 0, r.output
        assert f"{verb}: writing {fmt_bytes(size)} of weights into {out}" in r.stderr
        written = 0
        for shard in out.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                written += sum(f.get_tensor(k).nbytes for k in f.keys())
        assert size == written


def test_quantize_refuses_a_filesystem_without_room_before_writing(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import glm5mtp_cli.checkpoint.write as write

    monkeypatch.setattr(write, "rewrite_checkpoint", _fail)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=2**20))
    out = tmp_path / "nano-fp8"
    r = runner.invoke(app, ["quantize", "glm5-nano", str(out)])  # 18.54 MiB in FP8
    _one_line(r, f"OUT_DIR {out}: needs 18.54 MiB, its filesystem has 1.00 MiB free")
    assert list(tmp_path.iterdir()) == []  # nothing staged, nothing written
