"""A byte-level tokenizer and a deterministic batch sampler over a small shipped corpus.

Nothing is downloaded: ``mlmkit/data/corpus.txt`` ships with the package. A corpus is read as
bytes, each byte one token, whatever its encoding and line endings (a CRLF file trains on its
``\r``), so a file of N bytes holds N tokens and N - s windows of ``s + 1``. Batches depend only
on (seed, step), so every layout (tp, pp, dp) sees exactly the same global batch at each step; a
dp rank takes its contiguous slice of it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mlmkit.train.config import TOKENIZER_VOCAB, check_corpus

__all__ = ["ByteTokenizer", "TextData", "default_corpus"]


def default_corpus() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "corpus.txt")


class ByteTokenizer:
    """Bytes as token ids (text as UTF-8): vocabulary 256, no unknown tokens."""

    vocab_size = TOKENIZER_VOCAB

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TextData:
    """Random windows of a corpus: ``batch(step)`` -> (tokens, targets), each ``[B, s]``."""

    def __init__(self, *, seq_len: int, path: Optional[str] = None, seed: int = 0):
        self.path = path or default_corpus()
        check_corpus(self.path, seq_len=seq_len)          # a byte is a token: its size is the token count
        with open(self.path, "rb") as f:                  # bytes: no decoding, no newline translation
            self.tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()   # [N]
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: the same for every layout."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        # A window is s + 1 tokens (inputs and their next tokens): starts 0 .. N - s - 1, all of them.
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.tokens[idx]                                 # [B, s + 1]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def replica_batch(self, step: int, *, global_batch: int, dp_rank: int, dp: int):
        """This dp replica's contiguous slice of the global batch."""
        tokens, targets = self.batch(step, global_batch)
        n = global_batch // dp
        return tokens[dp_rank * n:(dp_rank + 1) * n], targets[dp_rank * n:(dp_rank + 1) * n]
