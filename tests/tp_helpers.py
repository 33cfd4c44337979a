"""Shared pieces of the tensor-parallel tests (module-level so ranks can unpickle them)."""

import torch

from mlmkit.model import tiny_config


def batch(cfg, *, b=2, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    if ignore:
        targets[0, :3] = -100  # a few ignored positions
    return tokens, targets


CFG = tiny_config()
