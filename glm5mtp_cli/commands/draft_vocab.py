"""`glm5mtp draft-vocab`: count token frequencies on a corpus, store them beside the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli.commands.options import DEFAULT_MODEL, ModelOpt
from glm5mtp_cli.errors import UserError

COUNTS_FILE = "token_counts.json"  # engine.draft_vocab.COUNTS_FILE


def _texts(corpus: str):
    if corpus == "stdlib":
        from glm5mtp_cli.training.corpus import iter_texts

        return iter_texts("train"), "python stdlib, train split (glm5mtp_cli.training.corpus)"
    path = Path(corpus)
    try:
        raw = path.read_text()
    except OSError as e:
        raise UserError(f"--corpus {corpus}: {e.strerror}") from None
    if path.suffix == ".jsonl":
        try:
            return [json.loads(line).get("prompt", "") for line in raw.splitlines() if line.strip()], str(path)
        except (json.JSONDecodeError, AttributeError):
            raise UserError(f"--corpus {corpus}: lines must be JSON objects with a 'prompt'") from None
    return [raw], str(path)


def draft_vocab_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    corpus: Annotated[str, typer.Option(help="'stdlib' (the training corpus's train split), a .txt or a .jsonl.")] = "stdlib",
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE", help=f"Where to write (default: {COUNTS_FILE} in the model folder).")] = None,
) -> None:
    """Count how often each token occurs on a corpus; `generate --draft-vocab K` drafts over the top K.

    Examples:

      glm5mtp draft-vocab    (the stdlib corpus, written beside the shipped model)

      glm5mtp draft-vocab --corpus prompts.jsonl --out counts.json

      glm5mtp generate --draft-vocab 1024 --draft-vocab-file counts.json --prompt 'import os'
    """
    from glm5mtp_cli.checkpoint.resolve import resolve_model
    from glm5mtp_cli.engine.draft_vocab import count_tokens, write_counts
    from glm5mtp_cli.engine.runtime import Tokenizer

    if out is not None:
        from glm5mtp_cli.commands.generate import check_output

        check_output(out, "--out")
    resolved = resolve_model(model, need="target", progress=False)
    tok = Tokenizer.maybe(resolved.folder)
    if tok is None:
        raise UserError(f"{resolved.folder}: no tokenizer.json to count tokens with")
    texts, source = _texts(corpus)
    counts = count_tokens(tok.encode, texts, resolved.config.vocab_size)
    path = write_counts(out or resolved.folder / COUNTS_FILE, counts, source)
    seen = sum(1 for c in counts if c)
    Console().print(f"counted {sum(counts):,} tokens ({seen} of {len(counts)} ids seen) -> {path}")
