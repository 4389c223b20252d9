"""One rule for every single-file output (generate --trace, profile --plot, plan --plot and --out,
draft-vocab --out), applied before any work: the folder must exist (named when it does not; a file
output never creates folders, unlike a checkpoint's OUT_DIR) and the file must be writable, proved by
opening it. Permission bits are not proof: as root, /sys and /proc pass os.access yet refuse writes."""

from __future__ import annotations

import os
from pathlib import Path

from glm5mtp_cli.errors import UserError


def check_output(path: Path | None, flag: str) -> None:
    """Refuse `flag`'s file `path` in one line unless it can be written; an existing file is opened for
    appending (nothing truncated), a new one is created and removed."""
    if path is None:
        return
    folder = path.parent
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: {folder} is a file, not a folder" if folder.exists() else
                        f"{flag} {path}: folder {folder} does not exist")
    existed = path.exists()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND if existed else os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(fd)
        if not existed:
            path.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror})") from None
