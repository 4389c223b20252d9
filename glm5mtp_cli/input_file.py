"""Text files the user names (prompts, conversations, constraints, a corpus, token counts, plan's JSON
inputs): read as UTF-8; a file that cannot be read or is not text (a .safetensors given as --prompts)
is one line naming it, not a traceback."""

from __future__ import annotations

from pathlib import Path

from glm5mtp_cli.errors import UserError


def read_text(path: Path, flag: str = "") -> str:
    """The text of `path`; an error line starts with `flag` when given, then the path."""
    where = f"{flag} {path}" if flag else str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{where}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "give a text file") from None
