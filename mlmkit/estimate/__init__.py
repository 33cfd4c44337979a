"""Estimates in pure Python (no torch): memory and communication per rank, for any layout.

- :func:`estimate_memory`: parameters, gradients, optimizer state, peak activations per rank.
- :func:`estimate_comm`: wire bytes per rank and axis for one training step.
- :func:`bytes_per_parameter`, :func:`activation_bytes_per_layer`: the published formulas.
- :func:`moe_parameter_counts`: total and active parameters of a mixture of experts;
  :func:`forward_flops_per_token`, :func:`training_flops_per_token`: arithmetic per token.
"""

from mlmkit.estimate.comm import estimate_comm, estimate_train_comm
from mlmkit.estimate.flops import forward_flops_per_token, training_flops_per_token
from mlmkit.estimate.memory import (
    PRECISIONS,
    Precision,
    activation_bytes_per_layer,
    bytes_per_parameter,
    estimate_memory,
    estimate_train_memory,
    moe_activation_bytes,
)
from mlmkit.estimate.params import (
    LocalParam,
    local_parameters,
    moe_parameter_counts,
    stage_layout,
    total_parameters,
)

__all__ = [
    "PRECISIONS", "LocalParam", "Precision", "activation_bytes_per_layer", "bytes_per_parameter", "estimate_comm",
    "estimate_memory", "estimate_train_comm", "estimate_train_memory", "forward_flops_per_token", "local_parameters",
    "moe_activation_bytes", "moe_parameter_counts", "stage_layout", "total_parameters", "training_flops_per_token",
]
