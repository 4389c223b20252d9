"""Byte counts for people: read from flags (2GB, 64KiB) and written in the commands' output (no torch:
commands import it for --help); counts of things with their noun ("1 file", "3 files")."""

from __future__ import annotations

import re

from glm5mtp_cli.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def fmt_bytes(n: int | float | None, digits: int = 2) -> str:
    """1536 -> '1.50 KiB' (binary units up to TiB; whole bytes below 1 KiB); None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)


def plural(n: int, noun: str) -> str:
    """3, 'file' -> '3 files'; 1 -> '1 file'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def parse_size(text: str | int, flag: str = "size", zero_ok: bool = False) -> int:
    """'2GB' -> 2e9 (decimal units, as huggingface_hub uses), '512MiB' -> 512*2**20, '1000' -> 1000.
    flag: what a refusal names; zero_ok: 0 is a valid value (a budget that holds nothing)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise UserError(f"{flag} '{text}' not understood: use e.g. 2GB, 500MB, 64KiB or a byte count")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n == 0 and not zero_ok:  # never below: the pattern takes no sign
        raise UserError(f"{flag} '{text}' must be positive")
    return n
