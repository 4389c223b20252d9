"""JSON input files: JSON-lines (prompts, conversations: one object per line, errors naming the
line) and single documents (plan's acceptance, hardware and calibration inputs), each error one
line naming the flag and file."""

from __future__ import annotations

import json
from pathlib import Path

from glm5mtp_cli.errors import UserError


def read_jsonl(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}: line {n} is not a JSON object")
        items.append(obj)
    if not items:
        raise UserError(f"{path}: no entries")
    return items


def read_json(path: Path, flag: str, hint: str = ""):
    """The JSON document in `path`, given by `flag`; `hint` follows a parse error (what was expected)."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} {path}: not JSON ({e.msg}, line {e.lineno}){hint}") from None
