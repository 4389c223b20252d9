"""`glm5mtp draft-vocab`: count token frequencies on a corpus, store them where `generate` finds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli.commands.options import DEFAULT_MODEL, ModelOpt
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.input_file import read_text
from glm5mtp_cli.output_file import check_output
from glm5mtp_cli.prompts import NO_TOKENIZER
from glm5mtp_cli.safe_write import staged_file

COUNTS_FILE = "token_counts.json"  # engine.draft_vocab.COUNTS_FILE


def _texts(corpus: str):
    if corpus == "stdlib":
        from glm5mtp_cli.training.corpus import iter_texts

        return iter_texts("train"), "python stdlib, train split (glm5mtp_cli.training.corpus)"
    path = Path(corpus)
    raw = read_text(path, "--corpus")
    if path.suffix == ".jsonl":
        try:
            return [json.loads(line).get("prompt", "") for line in raw.splitlines() if line.strip()], str(path)
        except (json.JSONDecodeError, AttributeError):
            raise UserError(f"--corpus {corpus}: lines must be JSON objects with a 'prompt'") from None
    return [raw], str(path)


def draft_vocab_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    corpus: Annotated[str, typer.Option(help="'stdlib' (the training corpus's train split), a .txt or a .jsonl.")] = "stdlib",
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE", help=f"Where to write (default: {COUNTS_FILE} "
        "beside a checkpoint folder of yours; for a shipped profile or a Hub download, "
        "$XDG_CACHE_HOME or ~/.cache, then glm5mtp/draft-vocab/<profile or org/name>/).")] = None,
) -> None:
    """Count how often each token occurs on a corpus; `generate --draft-vocab K` drafts over the top K.

    By default the counts go where generate looks: beside a checkpoint folder of
    yours, or, for a shipped profile or a Hub download (never written into), the
    user cache; generate takes the newer of the two. It prints where it wrote.

    Examples:

      # glm5-nano, stdlib corpus: into ~/.cache/glm5mtp/draft-vocab/glm5-nano/
      glm5mtp draft-vocab

      glm5mtp draft-vocab --corpus prompts.jsonl --out counts.json

      glm5mtp generate --draft-vocab 1024 --draft-vocab-file counts.json \\
          --prompt 'import os'
    """
    check_output(out, "--out")  # the default path's cache folders are made as needed; --out's must exist
    from glm5mtp_cli.checkpoint.resolve import resolve_model
    from glm5mtp_cli.engine.draft_vocab import count_tokens, user_counts_path, write_counts
    from glm5mtp_cli.engine.runtime import Tokenizer

    resolved = resolve_model(model, need="target", progress=False)
    tok = Tokenizer.maybe(resolved.folder)
    if tok is None:
        raise UserError(f"{resolved.folder}: {NO_TOKENIZER}; draft-vocab counts its tokens")
    path = out or user_counts_path(resolved.folder) or resolved.folder / COUNTS_FILE
    with staged_file(path, "--out" if out is not None else "the counts file") as tmp:
        texts, source = _texts(corpus)
        counts = count_tokens(tok.encode, texts, resolved.config.vocab_size)
        if not any(counts):
            raise UserError(f"--corpus {corpus}: no tokens to count (the corpus is empty)")
        write_counts(tmp, counts, source)
    seen = sum(1 for c in counts if c)
    Console().print(f"counted {sum(counts):,} tokens ({seen} of {len(counts)} ids seen) -> {path}", soft_wrap=True)
