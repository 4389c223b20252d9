"""Human-readable numbers for the commands' output (no torch: commands import it for --help)."""

from __future__ import annotations


def fmt_bytes(n: int | float | None, digits: int = 2) -> str:
    """1536 -> '1.50 KiB' (binary units up to TiB; whole bytes below 1 KiB); None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)
