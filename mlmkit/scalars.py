"""Scalars read from tables (pure, no torch): numpy's bool taken as the Python bool it equals.

A DataFrame's boolean cell (a sweep of layouts, a plan's rows) is ``numpy.bool``, which is neither a
``bool`` nor a ``numbers.Number``: the configs' "must be True or False" checks refused it, naming a
type that prints as ``bool``. Numpy's integers and floats are handled by ``numbers.Integral`` and
``numbers.Real``, which numpy registers.
"""

from __future__ import annotations

__all__ = ["plain_bool"]


def plain_bool(value: object) -> object:
    """``bool(value)`` for numpy's bool scalar (``numpy.bool``, ``numpy.bool_`` before numpy 2);
    any other value unchanged (its own check decides)."""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    return value
