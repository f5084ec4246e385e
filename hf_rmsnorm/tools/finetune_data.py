"""Training data for ``scripts/finetune.py``: read a plain-text corpus, tokenise it, pack it into sequences.

Packing concatenates every document (separated by the tokenizer's end-of-sequence token when it has one) into
one token stream and cuts it into rows of exactly ``seq_len`` tokens, dropping the ragged tail. Every row is
then full length, so no padding or attention mask is needed and each process's mean loss weighs the same
number of tokens, which keeps the loss averaged over processes exact.

Checkpoints without a tokenizer (the random presets) get a byte-level tokenisation: each UTF-8 byte is one
token, folded into the vocabulary when it has fewer than 256 entries.

Every problem with the input raises :class:`FinetuneInputError` with a one-line message, before anything is
trained or written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .cli import InputError

# What the project itself holds, used when no --data is given (relative to the checkout root).
_PROJECT_TEXT_GLOBS = ("README.md", "CHANGELOG.md", "docs/**/*.md", "hf_rmsnorm/**/*.py", "scripts/**/*.py")
_N_BYTES = 256


class FinetuneInputError(InputError):
    """A bad command-line input (data, sizes, output paths); the message is one line meant for the user."""


def corpus_files(data: Path | None) -> list[Path]:
    """The files to train on, in a fixed order so every process and every run reads the same stream.

    Args:
        data: a text file, or a directory searched recursively for ``*.txt``; ``None`` for the project's own
            README, docs and sources.
    """
    if data is None:
        return project_text_files()
    if not data.exists():
        raise FinetuneInputError(f"--data {data}: no such file or directory")
    if data.is_file():
        return [data]
    files = sorted(p for p in data.rglob("*.txt") if p.is_file())
    if not files:
        raise FinetuneInputError(f"--data {data}: the directory holds no .txt files")
    return files


def project_text_files() -> list[Path]:
    """The project's README, changelog, docs and Python sources (what exists of them in this install)."""
    root = Path(__file__).resolve().parents[2]  # the checkout: hf_rmsnorm/tools/ is two levels down
    files = {p for pattern in _PROJECT_TEXT_GLOBS for p in root.glob(pattern) if p.is_file()}
    return sorted(files)


def read_documents(files: Iterable[Path]) -> list[str]:
    """The non-blank files' texts; raises when there is no text at all."""
    files = list(files)
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as err:
            raise FinetuneInputError(f"cannot read {path}: {err.strerror}") from err
        if text.strip():
            texts.append(text)
    if not texts:
        where = files[0] if len(files) == 1 else f"{len(files)} files"
        raise FinetuneInputError(f"empty corpus: {where} contains no text")
    return texts


class ByteTokenizer:
    """One token per UTF-8 byte, for checkpoints that ship no tokenizer.

    With 256 or more embeddings, token ``b`` is byte ``b``; a smaller vocabulary gets ``b % vocab_size`` so
    every id stays a valid embedding index (the model then cannot tell some bytes apart, which is harmless for
    the random presets this exists for).
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise FinetuneInputError(f"the model's vocabulary has {vocab_size} entries: too few to train on")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, one per UTF-8 byte."""
        ids = text.encode("utf-8")
        if self.vocab_size >= _N_BYTES:
            return list(ids)
        return [b % self.vocab_size for b in ids]

    def describe(self) -> str:
        """What the ids are, for the log."""
        if self.vocab_size >= _N_BYTES:
            return "byte-level tokens (ids 0-255)"
        return f"byte-level tokens folded into the vocabulary's {self.vocab_size} ids"


def tokenize(documents: Sequence[str], tokenizer, vocab_size: int) -> list[int]:
    """One token stream for all documents.

    Args:
        documents: the texts, in training order.
        tokenizer: a Hugging Face tokenizer (its end-of-sequence token separates documents), or ``None`` for
            byte-level tokens.
        vocab_size: the model's number of input embeddings; the byte-level fallback fits into it.
    """
    if tokenizer is None:
        byte_tokenizer = ByteTokenizer(vocab_size)
        return [t for doc in documents for t in byte_tokenizer.encode(doc)]
    # verbose=False: whole documents are longer than the model's context on purpose (they are packed later).
    encoded = tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"]
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return [t for ids in encoded for t in (*ids, *separator)]


def pack(tokens: Sequence[int], seq_len: int, min_sequences: int = 1) -> torch.Tensor:
    """Cuts the stream into ``[n, seq_len]`` int64 rows, dropping the incomplete last row.

    Args:
        tokens: the token stream.
        seq_len: tokens per row.
        min_sequences: rows one optimizer step consumes (batch size x processes); fewer is an error.
    """
    if seq_len < 2:
        raise FinetuneInputError(f"--seq-len {seq_len}: a causal LM needs at least 2 tokens per sequence")
    n_rows = len(tokens) // seq_len
    if n_rows == 0:
        raise FinetuneInputError(
            f"the corpus has {len(tokens)} tokens, shorter than one sequence of --seq-len {seq_len}"
        )
    if n_rows < min_sequences:
        raise FinetuneInputError(
            f"the corpus gives {n_rows} sequence(s) of {seq_len} tokens but one step needs {min_sequences} "
            "(batch size x processes): use a smaller --seq-len or --batch-size, or more text"
        )
    return torch.tensor(tokens[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def label_documents(
    documents: Sequence[str], tokenizer, vocab_size: int, seq_len: int, num_labels: int, min_sequences: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences and labels for sequence classification: each document tokenized alone and cut into rows of
    ``seq_len`` (its incomplete last row dropped), every row of document ``i`` labelled ``i % num_labels``.

    The labels are synthetic (which of the interleaved parts of the corpus a sequence comes from): they give a
    classification head a deterministic target on any corpus, which is what comparing a patched run with an
    unpatched one needs. Returns ``([n, seq_len]`` int64 rows, ``[n]`` int64 labels).
    """
    rows, labels = [], []
    for index, document in enumerate(documents):
        tokens = tokenize([document], tokenizer, vocab_size)
        for start in range(0, len(tokens) - seq_len + 1, seq_len):
            rows.append(tokens[start:start + seq_len])
            labels.append(index % num_labels)
    if len(rows) < min_sequences:
        raise FinetuneInputError(
            f"the corpus gives {len(rows)} sequence(s) of {seq_len} tokens (each document cut alone) but one step "
            f"needs {min_sequences} (batch size x processes): use a smaller --seq-len or --batch-size, or more text"
        )
    return torch.tensor(rows, dtype=torch.long), torch.tensor(labels, dtype=torch.long)
