"""The GPT model: config, stages, and shard inspection."""

from mlmkit.model.config import GPTConfig, tiny_config
from mlmkit.model.gpt import GPT, Stage, seeded_normal, split_layers
from mlmkit.model.shards import gather_full, shard_table

__all__ = ["GPT", "GPTConfig", "Stage", "gather_full", "seeded_normal", "shard_table", "split_layers", "tiny_config"]
