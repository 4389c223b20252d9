"""Training data: the offline corpus tokenized once (cached as .npy) and windows sampled from it."""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.training import corpus
from glm5mtp_cli.training import tokenizer as tt
from glm5mtp_cli.errors import UserError

# `opts` below is a training.options.TrainOptions, typed Any: train imports this module, not the reverse.


def default_cache_dir() -> Path:
    env = os.environ.get("GLM5MTP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "glm5mtp" / "train"


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_tokenizer(opts: Any, vocab_size: int, cache: Path, manifest: dict, log) -> Path:
    """A folder holding tokenizer.json + tokenizer_config.json whose vocab is `vocab_size`."""
    if opts.tokenizer is not None:
        tok_dir = Path(opts.tokenizer)
        if not (tok_dir / "tokenizer.json").is_file():
            raise UserError(f"tokenizer folder '{tok_dir}' has no tokenizer.json")
    else:
        tok_dir = cache / f"tokenizer-{manifest['sha256'][:12]}-v{vocab_size}"
        if not (tok_dir / "tokenizer.json").is_file():
            t0 = time.time()
            tt.build_tokenizer(tok_dir, vocab_size=vocab_size, max_files=opts.corpus_files)
            log(f"trained byte-level BPE tokenizer (vocab {vocab_size}) in {time.time() - t0:.1f} s -> {tok_dir}")
    n = tt.load_tokenizer(tok_dir).get_vocab_size()
    if n != vocab_size:
        raise UserError(f"tokenizer in '{tok_dir}' has {n} tokens but the model's vocab_size is {vocab_size}: "
                        + _vocab_hint(opts, n, vocab_size))
    return tok_dir


def _vocab_hint(opts: Any, n: int, vocab_size: int) -> str:
    if opts.tokenizer is not None:
        return f"give a --tokenizer of {vocab_size} tokens, or a --config whose vocab_size is {n}"
    # BPE stops merging when the text runs out of pairs: too few files cannot fill the vocabulary.
    corpus_given = f"--corpus-files {opts.corpus_files}" if opts.corpus_files else "the corpus"
    hint = f"{corpus_given} is too little text to learn {vocab_size} tokens; pass a larger --corpus-files"
    shipped = profile_path("glm5-nano")
    if shipped is not None and tt.load_tokenizer(shipped).get_vocab_size() == vocab_size:
        hint += f", or the shipped tokenizer: --tokenizer {shipped}"
    return hint


def _corpus_manifest(opts: Any, cache: Path) -> dict:
    """The manifest of the corpus this run reads (hashes computed from the stdlib, no files kept)."""
    h = {s: hashlib.sha256() for s in corpus.SPLITS}
    counts = {s: [0, 0] for s in corpus.SPLITS}
    for split in corpus.SPLITS:
        for rel, text in corpus.iter_files(split, max_files=opts.corpus_files, packages=opts.corpus_packages):
            data = text.encode("utf-8")
            for part in (rel.encode("utf-8"), b"\0", data, b"\0"):
                h[split].update(part)
            counts[split][0] += 1
            counts[split][1] += len(data)
    whole = hashlib.sha256()
    for split in corpus.SPLITS:
        whole.update(f"{split}:{h[split].hexdigest()}\n".encode())
    return {
        "corpus_version": corpus.CORPUS_VERSION,
        "python_version": platform.python_version(),
        "corpus_files_limit": opts.corpus_files,
        "packages": corpus.package_versions(opts.corpus_packages),
        "splits": {s: {"files": counts[s][0], "bytes": counts[s][1], "sha256": h[s].hexdigest()}
                   for s in corpus.SPLITS},
        "sha256": whole.hexdigest(),
    }


def tokenize_split(tok_dir: Path, split: str, cache: Path, manifest: dict, opts: Any, log) -> np.ndarray:
    """Token ids of a split as one uint16/int32 array: each document followed by <|endoftext|>.
    The train split adds the chat samples when `opts.chat_samples`. Cached as .npy."""
    chat = opts.chat_samples and split == "train"
    key = hashlib.sha256(f"{manifest['sha256']}|{_file_sha(tok_dir / 'tokenizer.json')}|{split}|{chat}".encode())
    path = cache / f"tokens-{split}-{key.hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    t0 = time.time()
    tok = tt.load_tokenizer(tok_dir)
    docs = list(corpus.iter_texts(split, max_files=opts.corpus_files, packages=opts.corpus_packages))
    if chat:
        docs += list(corpus.iter_chat_samples(split, max_files=opts.corpus_files, packages=opts.corpus_packages))
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(tt.EOS_ID)
    dtype = np.uint16 if tok.get_vocab_size() <= 65535 else np.int32
    arr = np.asarray(ids, dtype=dtype)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)
    log(f"tokenized {split}: {len(docs)} documents -> {len(arr):,} tokens in {time.time() - t0:.1f} s")
    return arr


class WindowSampler:
    """Random windows of seq_len + 1 tokens (x = w[:-1]; targets up to two ahead inside w)."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(ids) < seq_len + 2:
            raise UserError(f"the training split has {len(ids)} tokens, fewer than --seq-len + 2 ({seq_len + 2})")
        self.ids = torch.from_numpy(ids.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.ids) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.ids[idx]


def heldout_windows(ids: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of seq_len + 1 over the held-out split (deterministic)."""
    t = torch.from_numpy(ids.astype(np.int64))
    n = min((len(t) - 1) // seq_len, max(1, max_tokens // seq_len))
    if n <= 0:
        raise UserError(f"the held-out split has {len(t)} tokens, fewer than --seq-len + 1")
    return torch.stack([t[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
