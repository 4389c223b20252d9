"""JSON-lines input files (prompts, conversations): one object per line, errors naming the line."""

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
