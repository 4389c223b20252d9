"""A byte-level BPE tokenizer for the shipped small model, trained on the stdlib corpus.

Byte level (GPT-2 style pre-tokenizer, no prefix space), so every string round-trips exactly.
The four special tokens take ids 0..3, in GLM's spirit: `<|endoftext|>` ends a document,
`<|user|>` / `<|assistant|>` / `<|system|>` open chat turns. Like GLM-5, generation stops on
`<|endoftext|>` or on `<|user|>` (a model that starts the next user turn has finished its answer).

Writes `tokenizer.json` and a `tokenizer_config.json` that carries the Jinja chat template:
`<|system|>\\n{system}<|user|>\\n{prompt}<|assistant|>\\n` and the assistant's reply after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm5mtp_cli.training import corpus

DEFAULT_VOCAB = 4096
SPECIAL_TOKENS = [corpus.EOS, corpus.USER, corpus.ASSISTANT, corpus.SYSTEM]
EOS_ID = 0
USER_ID = 1
EOS_IDS = [EOS_ID, USER_ID]
BOS_ID = EOS_ID  # documents are separated (not prefixed) by <|endoftext|>; GPT-2's convention

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def apply_chat_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The same layout as CHAT_TEMPLATE, without Jinja (for callers that have no jinja2)."""
    out = []
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError("role must be system, user or assistant")
        out.append(f"<|{m['role']}|>\n{m['content']}")
    if add_generation_prompt:
        out.append(f"{corpus.ASSISTANT}\n")
    return "".join(out)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE on `texts`; vocab_size counts the 4 special tokens and the 256 bytes."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s} must have id {i}"
    return tok


def tokenizer_config(model_max_length: int = 4096) -> dict:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 4096) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def build_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB, root: Path | None = None,
                    max_files: int | None = None, model_max_length: int = 4096) -> Tokenizer:
    """Train on the corpus's train split (plain files and chat samples) and save under `out_dir`."""
    def texts():
        yield from corpus.iter_texts("train", root, max_files)
        yield from corpus.iter_chat_samples("train", root, max_files)

    tok = train_tokenizer(texts(), vocab_size)
    save_tokenizer(tok, out_dir, model_max_length)
    return tok


def load_tokenizer(folder: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
