"""Data parallelism: bucketed gradient all-reduce, global norm clipping, replicated and ZeRO-1 AdamW."""

from mlmkit.data_parallel.grads import allreduce_gradients, bucketize, clip_grad_norm, counted_once
from mlmkit.data_parallel.optimizer import ReplicatedAdamW, ShardedAdamW, make_optimizer

__all__ = [
    "ReplicatedAdamW", "ShardedAdamW", "allreduce_gradients", "bucketize", "clip_grad_norm", "counted_once",
    "make_optimizer",
]
