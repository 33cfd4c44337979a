"""The GPT model: config (pure Python), stages, and shard inspection (these import torch on use)."""

from mlmkit.model.config import GPTConfig, tiny_config

__all__ = ["GPT", "GPTConfig", "Stage", "gather_full", "seeded_normal", "shard_table", "split_layers", "tiny_config"]

_LAZY = {"GPT": "gpt", "Stage": "gpt", "seeded_normal": "gpt", "split_layers": "gpt",
         "gather_full": "shards", "shard_table": "shards"}


def __getattr__(name):
    # GPTConfig stays importable by the planning layer without pulling in torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mlmkit.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mlmkit.model' has no attribute {name!r}")
