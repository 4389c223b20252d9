"""Named model profiles: published configs (no weights) and the shipped small model."""

from pathlib import Path


def names() -> list[str]:
    """Every profile shipped here: each folder holding a config.json (no torch: --help lists them)."""
    return sorted(p.name for p in Path(__file__).resolve().parent.iterdir() if (p / "config.json").is_file())
