"""One prompt reader for every command (generate, bench, acceptance).

A prompt comes from --prompt TEXT, --prompt-ids 1,2,3, or a --prompts JSONL file whose lines are
one of:

    {"prompt": "text"}                  encoded with the checkpoint's tokenizer
    {"prompt": [1, 2, 3]}               token ids: works for checkpoints without a tokenizer
    {"messages": [{"role": ..., "content": ...}, ...]}   rendered with the chat template

Any line may add "response_format" (OpenAI's form, plus regex and grammar: constraint.py), the
grammar its output must match.

Reading is split in two so that bad input is refused before any weights load: `read_prompts`
parses and checks the flags and the file (no tokenizer needed), `encode_prompts` turns what was read
into token ids once the tokenizer is known. Nothing here imports torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from glm5mtp_cli.constraint import Constraint, from_response_format
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.jsonl import read_jsonl

SOURCES = "--prompt, --prompt-ids, --prompts"
# a checkpoint without a tokenizer: what it lacks, and how a random one gets it
NO_TOKENIZER = "no tokenizer.json (a random checkpoint gets one from init-random --tokenizer DIR)"


@dataclass
class Prompt:
    """One prompt as given: exactly one of text, ids, messages is set. name: its id in reports."""

    name: str
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict] | None = None
    where: str = ""  # "FILE: line N" for error messages
    constraint: Constraint | None = None  # its response_format


def parse_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError(f"{flag}: no token ids given")
    return ids


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def from_item(obj: dict, name: str, where: str) -> Prompt:
    """One JSONL object as a Prompt (the three forms of the module docstring, any with a response_format)."""
    p = _prompt_of(obj, name, where)
    if "response_format" in obj:
        p.constraint = from_response_format(obj["response_format"], where)
    return p


def _prompt_of(obj: dict, name: str, where: str) -> Prompt:
    if "messages" in obj:
        msgs = obj["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs)):
            raise UserError(f"{where}: 'messages' must be a list of {{\"role\", \"content\"}} objects")
        return Prompt(name, messages=msgs, where=where)
    value = obj.get("prompt")
    if isinstance(value, str):
        return Prompt(name, text=value, where=where)
    if _is_ids(value):
        return Prompt(name, ids=list(value), where=where)
    raise UserError(f'{where} needs {{"prompt": "text"}}, {{"prompt": [token ids]}} or {{"messages": [...]}}')


def read_file(path: Path) -> list[Prompt]:
    return [from_item(obj, str(obj.get("id", i)), f"{path}: line {i + 1}")
            for i, obj in enumerate(read_jsonl(path))]


def read_prompts(prompt: str | None, prompt_ids: str | None, prompts_file: Path | None,
                 others: str = "") -> list[Prompt]:
    """The prompts of exactly one of --prompt, --prompt-ids, --prompts (others: more mutually exclusive
    flags to name in the message, e.g. ", --conversation" when none of the three was given)."""
    given = [x is not None for x in (prompt, prompt_ids, prompts_file)]
    if sum(given) != 1:
        raise UserError(f"give exactly one of {SOURCES}{others}")
    if prompt_ids is not None:
        return [Prompt("0", ids=parse_ids(prompt_ids), where="--prompt-ids")]
    if prompt is not None:
        return [Prompt("0", text=prompt, where="--prompt")]
    return read_file(prompts_file)


def encode_prompts(prompts: list[Prompt], tokenizer, chat: bool = False, folder: Path | None = None) -> list[list[int]]:
    """Token ids of each prompt. tokenizer: runtime.Tokenizer or None (then only id prompts work).
    chat: wrap text prompts in the checkpoint's chat template (messages always are)."""
    out = []
    for p in prompts:
        if p.ids is not None:
            if chat:
                raise UserError(f"{p.where}: --chat wraps text prompts; this one is token ids")
            out.append(list(p.ids))
            continue
        if tokenizer is None:
            raise UserError(f"{folder or 'the checkpoint'}: {NO_TOKENIZER}; give token ids "
                            f"(--prompt-ids, or {{\"prompt\": [1, 2, 3]}} lines in --prompts)")
        if p.messages is not None or chat:
            messages = p.messages or [{"role": "user", "content": p.text}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        else:
            ids = tokenizer.encode(p.text)
        if not ids:
            raise UserError(f"{p.where}: the prompt encodes to no tokens")
        out.append(ids)
    return out


def random_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids of code-prompt length (24-63 tokens), for checkpoints without a tokenizer."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(24, 64))] for _ in range(count)]
