"""JSON input files: JSON-lines (prompts, conversations: one object per line, errors naming the
line) and single documents (plan's acceptance, hardware and calibration inputs), each error one
line naming the flag and file."""

from __future__ import annotations

import json
from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.input_file import read_text


def read_jsonl(path: Path) -> list[dict]:
    lines = read_text(path).splitlines()
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
    text = read_text(path, flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} {path}: not JSON ({e.msg}, line {e.lineno}){hint}") from None
