"""Per-rank trace rows: communication, schedule actions and memory, gathered as DataFrames.

A :class:`Tracer` lives on one rank and is passed explicitly to whatever reports to it (the
process groups for collectives, the pipeline executor for actions). Rows are plain tuples while a
step runs (cheap enough to leave on) and become pandas DataFrames only when asked.

- :mod:`mlmkit.trace.memory`: :class:`~mlmkit.trace.memory.MemoryTracker` (bytes per category over time);
- :mod:`mlmkit.trace.export`: merge per-rank traces, write a Chrome trace for Perfetto.
"""

from mlmkit.trace.tracer import COMM_COLUMNS, EVENT_COLUMNS, MOE_COLUMNS, RING_COLUMNS, Tracer, ring_wire_bytes

__all__ = ["COMM_COLUMNS", "EVENT_COLUMNS", "MOE_COLUMNS", "RING_COLUMNS", "Tracer", "ring_wire_bytes"]
