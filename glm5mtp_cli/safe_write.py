"""Safe writes: output goes into a hidden staging folder (or file) and moves into place only when
complete, so nothing half-written ever looks like a checkpoint, a counts file or a report.

    with staged_folder(out_dir, "OUT_DIR", force) as tmp:   # checks out_dir, creates tmp
        ...write the checkpoint into tmp...                 # on success: moved into out_dir

Entering checks the destination and creates the staging path at once, so an unwritable output
fails before any work. The staging path is `.NAME.glm5mtp-partial-XXXX` beside a new destination,
or `.glm5mtp-partial-XXXX` inside a folder that exists already (the same filesystem as the files
it replaces: a mount point's parent is another filesystem). On any exception, Ctrl-C included, it
is removed (with any parent folders it had to create); when that fails, one line on stderr names
it and how to remove it.

An existing folder (--force, or one holding other files) keeps its other files: at the end its old
checkpoint's files are deleted, config.json first, and the new files renamed in, config.json last,
with Ctrl-C held back for those few renames, so at no moment does the folder read as a
checkpoint whose files disagree.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape

from glm5mtp_cli.errors import Interrupted, UserError
from glm5mtp_cli.units import fmt_bytes

PARTIAL = "glm5mtp-partial"
# What a new checkpoint replaces in an existing folder; the earlier writer's hidden temp shards too.
_OLD_CHECKPOINT = re.compile(r"^(config\.json|model.*\.safetensors(\.index\.json)?|\.partial-\d+\.safetensors)$")


def holds_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and ((folder / "config.json").exists() or any(folder.glob("*.safetensors")))


def check_folder(dest: Path, flag: str, force: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{flag} {dest}: exists and is not a folder")
    if holds_checkpoint(dest) and not force:
        raise UserError(f"{flag} {dest}: already holds a checkpoint; pass --force to replace it")


def check_room(dest: Path, nbytes: int, flag: str) -> None:
    """Refuse before writing when `dest`'s filesystem has less than `nbytes` free (the staging path lies
    on it: beside a new destination, inside an existing one)."""
    existing = next(p for p in (dest, *dest.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < nbytes:
        raise UserError(f"{flag} {dest}: needs {fmt_bytes(nbytes)}, its filesystem has {fmt_bytes(free)} free")


def refuse_overlap(dest: Path, src: Path, flag: str) -> None:
    """Writing where the source is read from would destroy it before it is read."""
    d, s = dest.resolve(), Path(src).resolve()
    relation = "is" if d == s else "contains" if d in s.parents else "is inside" if s in d.parents else None
    if relation:
        raise UserError(f"{flag} {dest} {relation} the source checkpoint's folder {s}; choose another folder")


def default_mode(folder: bool) -> int:
    """The mode an ordinary mkdir/open would give (0777/0666 less the umask): tempfile makes 0700/0600."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


@contextlib.contextmanager
def staged_folder(dest: Path, flag: str, force: bool = False) -> Iterator[Path]:
    """A fresh staging folder for a checkpoint that lands in `dest` when the block ends without error."""
    dest = Path(dest)
    check_folder(dest, flag, force)
    existed = dest.is_dir()
    parent, prefix = (dest, f".{PARTIAL}-") if existed else (dest.parent, f".{dest.name}.{PARTIAL}-")
    made = _make_parents(parent, dest, flag)
    tmp = _create(lambda: Path(tempfile.mkdtemp(prefix=prefix, dir=parent)), dest, flag)
    yield from _staged(tmp, made or tmp, dest, lambda: _move_in(tmp, dest, existed, flag))


@contextlib.contextmanager
def staged_file(dest: Path, flag: str) -> Iterator[Path]:
    """A staging file beside `dest` that replaces it when the block ends without error."""
    dest = Path(dest)
    if dest.is_dir():
        raise UserError(f"{flag} {dest}: is a folder; give a file name")
    made = _make_parents(dest.parent, dest, flag)

    def create() -> Path:
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.{PARTIAL}-", dir=dest.parent)
        os.close(fd)
        return Path(name)

    def commit() -> None:
        os.chmod(tmp, default_mode(folder=False))
        os.replace(tmp, dest)

    tmp = _create(create, dest, flag)
    yield from _staged(tmp, made or tmp, dest, commit)


def _make_parents(parent: Path, dest: Path, flag: str) -> Path | None:
    """Create `parent` and its missing ancestors; returns the topmost one created (None: it existed)."""
    chain = [parent, *parent.parents]
    missing = [p for p in chain if not p.exists()]  # the lowest ones: above an existing folder all exist
    if not chain[len(missing)].is_dir():
        raise UserError(f"{flag} {dest}: {chain[len(missing)]} is a file, not a folder")
    if missing:
        _create(lambda: parent.mkdir(parents=True), dest, flag)
    return missing[-1] if missing else None


def _create(make: Callable, dest: Path, flag: str):
    try:
        return make()
    except OSError as e:
        raise UserError(f"{flag} {dest}: cannot write there ({e.strerror})") from None


def _move_in(tmp: Path, dest: Path, existed: bool, flag: str) -> None:
    try:
        if not existed:
            os.chmod(tmp, default_mode(folder=True))
            os.rename(tmp, dest)
            return
        for p in sorted(dest.iterdir(), key=lambda p: p.name != "config.json"):
            if p.is_file() and _OLD_CHECKPOINT.match(p.name):
                p.unlink()
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(p, dest / p.name)
        tmp.rmdir()
    except OSError as e:
        raise UserError(f"{flag} {dest}: could not move the finished output into place ({e.strerror})") from None


def _staged(tmp: Path, made: Path, dest: Path, commit: Callable[[], None]) -> Iterator[Path]:
    """Yield `tmp` to the caller's block, then commit; on any error before the commit ends, remove
    `made` (tmp, or the topmost parent folder created for it)."""
    committed = False
    try:
        yield tmp
        with _ctrl_c_held():  # a Ctrl-C during the renames comes after the last one
            commit()
            committed = True
    except BaseException as e:
        left = None if committed else _discard(made)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"{dest} was complete and is in place" if committed else
                              left or f"the unfinished output was removed; {dest} is as it was") from None
        if left:
            _say(left)
        raise


def _discard(path: Path) -> str | None:
    """Remove the staging path; None when it went, else the line that says how to remove it."""
    with _ctrl_c_held():  # a second Ctrl-C must not stop the clean-up halfway
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        except OSError as e:
            return f"the unfinished output stays in {path} ({e.strerror}); remove it with: rm -r '{path}'"
    return None


def _say(line: str) -> None:
    Console(stderr=True).print(escape(line), highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold SIGINT back while a few renames or deletions run, then deliver it to the previous handler."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)
