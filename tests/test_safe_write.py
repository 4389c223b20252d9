"""safe_write: output lands only when complete; errors and Ctrl-C leave the destination as it was."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from glm5mtp_cli.errors import Interrupted, UserError
from glm5mtp_cli.safe_write import refuse_overlap, staged_file, staged_folder


def _tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_new_folder_appears_only_when_complete(tmp_path):
    out = tmp_path / "deep" / "out"
    with staged_folder(out, "OUT_DIR") as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.glm5mtp-partial-")
        (tmp / "config.json").write_text("{}")
        assert not out.exists()
    assert _tree(tmp_path) == ["deep", "deep/out", "deep/out/config.json"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not tempfile's 0700


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("error, raised", [(RuntimeError("boom"), RuntimeError), (KeyboardInterrupt(), Interrupted)])
def test_an_error_removes_the_staging_folder_and_the_parents_it_made(tmp_path, error, raised, capsys):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(raised) as info:
        with staged_folder(out, "OUT_DIR") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise error
    assert _tree(tmp_path) == []
    assert capsys.readouterr().err == ""  # Ctrl-C's line is the CLI's, from Interrupted
    if raised is Interrupted:
        assert str(info.value) == f"the unfinished output was removed; {out} is as it was"


def test_replacing_keeps_other_files_until_the_new_checkpoint_is_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "RESULTS.md"):
        (out / name).write_text("old")
    with pytest.raises(UserError, match="already holds a checkpoint; pass --force"):
        with staged_folder(out, "OUT_DIR"):
            pass
    with pytest.raises(RuntimeError):
        with staged_folder(out, "OUT_DIR", force=True) as tmp:
            assert tmp.parent == out  # inside: the filesystem of the files it replaces
            (tmp / "model.safetensors").write_text("new")
            raise RuntimeError
    assert _tree(out) == sorted(["RESULTS.md", "config.json", "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"])
    with staged_folder(out, "OUT_DIR", force=True) as tmp:
        (tmp / "config.json").write_text("new")
        (tmp / "model.safetensors").write_text("new")
    assert _tree(out) == ["RESULTS.md", "config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "new" and (out / "RESULTS.md").read_text() == "old"


@pytest.mark.parametrize("where, needle", [("afile/out", "is a file, not a folder"),
                                           ("afile", "exists and is not a folder")])
def test_unwritable_destinations_are_one_line(tmp_path, where, needle):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=needle):
        with staged_folder(tmp_path / where, "--out"):
            pytest.fail("the block must not run")
    with pytest.raises(UserError, match="cannot write there"):
        with staged_folder(Path("/proc/no-such/out"), "--out"):
            pytest.fail("the block must not run")
    assert _tree(tmp_path) == ["afile"]


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "counts.json"
    with staged_file(path, "--out") as tmp:
        tmp.write_text("one")
        assert not path.exists()
    assert path.read_text() == "one" and _tree(tmp_path) == ["sub", "sub/counts.json"]
    with pytest.raises(ValueError):
        with staged_file(path, "--out") as tmp:
            tmp.write_text("tw")
            raise ValueError
    assert path.read_text() == "one" and _tree(tmp_path) == ["sub", "sub/counts.json"]
    with pytest.raises(UserError, match="is a folder"):
        with staged_file(tmp_path / "sub", "--out"):
            pass


def test_overlap_with_the_source_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for dest, relation in ((src, "is"), (tmp_path, "contains"), (src / "fp8", "is inside")):
        with pytest.raises(UserError, match=f"{relation} the source checkpoint's folder"):
            refuse_overlap(dest, src, "OUT_DIR")
    refuse_overlap(tmp_path / "other", src, "OUT_DIR")
    refuse_overlap(tmp_path / "src-fp8", src, "OUT_DIR")  # a sibling with a longer name is no overlap


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler, which a run started from a background shell (SIGINT ignored) lacks."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_waits_for_the_final_renames(tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("old")
    real_replace = os.replace

    def replace_then_interrupt(a, b):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of moving the files in
        real_replace(a, b)

    with pytest.raises(Interrupted, match="was complete and is in place"):
        with staged_folder(out, "OUT_DIR", force=True) as tmp:
            (tmp / "model.safetensors").write_text("new")
            (tmp / "config.json").write_text("new")
            monkeypatch.setattr(os, "replace", replace_then_interrupt)
    monkeypatch.undo()
    assert _tree(out) == ["config.json", "model.safetensors"]  # every rename ran, then the interrupt came
    assert (out / "config.json").read_text() == "new"


def test_a_staging_folder_that_cannot_be_removed_is_named_with_how_to_remove_it(tmp_path, monkeypatch, capsys):
    from glm5mtp_cli import safe_write

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safe_write.shutil, "rmtree", refuse)
    with pytest.raises(Interrupted) as info:
        with staged_folder(tmp_path / "out", "OUT_DIR") as tmp:
            raise KeyboardInterrupt
    assert str(info.value) == f"the unfinished output stays in {tmp} (Permission denied); remove it with: rm -r '{tmp}'"
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name] and tmp.name.startswith(".out.glm5mtp-partial-")
