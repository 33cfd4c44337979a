"""Data parallelism: bucketed gradient all-reduce, global norm clipping, replicated and ZeRO-1 AdamW,
mixed precision (fp32 main gradients and master weights)."""

from mlmkit.data_parallel.grads import allreduce_gradients, bucketize, clip_grad_norm, counted_once
from mlmkit.data_parallel.mixed_precision import PRECISIONS, attach_main_grads, dtype_of
from mlmkit.data_parallel.optimizer import ReplicatedAdamW, ShardedAdamW, make_optimizer

__all__ = [
    "PRECISIONS", "ReplicatedAdamW", "ShardedAdamW", "allreduce_gradients", "attach_main_grads", "bucketize",
    "clip_grad_norm", "counted_once", "dtype_of", "make_optimizer",
]
