"""Estimates in pure Python (no torch): memory and communication per rank, for any layout.

- :func:`estimate_memory`: parameters, gradients, optimizer state, peak activations per rank.
- :func:`estimate_comm`: wire bytes per rank and axis for one training step.
- :func:`bytes_per_parameter`, :func:`activation_bytes_per_layer`: the published formulas.
"""

from mlmkit.estimate.comm import estimate_comm, estimate_train_comm
from mlmkit.estimate.memory import (
    PRECISIONS,
    Precision,
    activation_bytes_per_layer,
    bytes_per_parameter,
    estimate_memory,
    estimate_train_memory,
)
from mlmkit.estimate.params import LocalParam, local_parameters, stage_layout, total_parameters

__all__ = [
    "PRECISIONS", "LocalParam", "Precision", "activation_bytes_per_layer", "bytes_per_parameter", "estimate_comm",
    "estimate_memory", "estimate_train_comm", "estimate_train_memory", "local_parameters", "stage_layout",
    "total_parameters",
]
