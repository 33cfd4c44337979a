"""Tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

- :mod:`~mlmkit.tensor_parallel.comm`: the f/g operators and their sequence-parallel twins;
- :mod:`~mlmkit.tensor_parallel.layers`: column/row-parallel linears, vocab-parallel embedding;
- :mod:`~mlmkit.tensor_parallel.cross_entropy`: loss over a split vocabulary;
- :mod:`~mlmkit.tensor_parallel.random`: dropout streams that agree or differ across TP ranks;
- :mod:`~mlmkit.tensor_parallel.weight_grad`: split backward (input gradients now, weight gradients later).
The attention and MLP blocks built from them live in :mod:`mlmkit.model.gpt`.
"""

from mlmkit.tensor_parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from mlmkit.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mlmkit.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    param_grad,
    shard_full,
    sync_replicated_grads,
    sync_sequence_parallel_grads,
    unshard,
)
from mlmkit.tensor_parallel.random import TPRandomState, dropout
from mlmkit.tensor_parallel.weight_grad import WeightGradStore, accumulate_grad

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "TPRandomState", "WeightGradStore",
    "accumulate_grad",
    "copy_to_tp", "dropout", "gather_from_sequence", "gather_from_tp", "param_grad", "reduce_from_tp",
    "reduce_scatter_to_sequence", "scatter_to_sequence", "scatter_to_tp", "shard_full",
    "sync_replicated_grads", "sync_sequence_parallel_grads", "unshard", "vocab_parallel_cross_entropy",
]
