"""Data parallelism: bucketed gradient all-reduce, global norm clipping (in the optimizers),
replicated and ZeRO-1 AdamW, ZeRO-2/3 (fully sharded, unit by unit: :mod:`mlmkit.data_parallel.zero`),
mixed precision (fp32 main gradients and master weights)."""

from mlmkit.data_parallel.grads import allreduce_gradients, bucketize, counted_once
from mlmkit.data_parallel.mixed_precision import PRECISIONS, attach_main_grads, dtype_of
from mlmkit.data_parallel.optimizer import ReplicatedAdamW, ShardedAdamW, make_optimizer
from mlmkit.data_parallel.zero import FullyShardedAdamW, Zero3Hooks, shard_units

__all__ = [
    "FullyShardedAdamW", "PRECISIONS", "ReplicatedAdamW", "Zero3Hooks", "shard_units", "ShardedAdamW", "allreduce_gradients", "attach_main_grads", "bucketize",
    "counted_once", "dtype_of", "make_optimizer",
]
