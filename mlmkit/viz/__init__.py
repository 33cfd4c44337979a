"""Pictures per rank (plotly, from DataFrames only; no torch) and widgets to explore schedules.

Figures: :func:`topology_figure`, :func:`timeline_figure`, :func:`timeline_comparison`,
:func:`memory_figure`, :func:`activation_peaks_figure`, :func:`comm_heatmap`, :func:`comm_by_axis_figure`,
:func:`comm_timeline_figure`, :func:`shard_figure`, :func:`shard_matrix_figure`; context parallelism: :func:`cp_split_figure`,
:func:`ring_timeline_figure`, :func:`cp_memory_figure`; mixture of experts: :func:`expert_load_figure`,
:func:`all_to_all_figure`, :func:`moe_training_figure`; ZeRO: :func:`parameter_memory_figure`,
:func:`zero_bytes_figure`; plans: :func:`plan_breakdown_figure`, :func:`plan_memory_figure`, :func:`plan_vs_measured_figure`;
:func:`save_html` writes any of them as a
standalone HTML file. Widgets: :func:`schedule_explorer`, :class:`SessionControls`.
"""

from mlmkit.viz.context_parallel import cp_memory_figure, cp_split_figure, cp_work_frame, ring_timeline_figure
from mlmkit.viz.figures import (
    activation_peaks_figure,
    bubble_table,
    comm_by_axis_figure,
    comm_heatmap,
    comm_matrix,
    comm_timeline_figure,
    memory_figure,
    save_html,
    shard_figure,
    shard_matrix_figure,
    timeline_comparison,
    timeline_figure,
    topology_figure,
)
from mlmkit.viz.moe import all_to_all_figure, expert_load, expert_load_figure, moe_training_figure
from mlmkit.viz.plan import plan_breakdown_figure, plan_memory_figure, plan_vs_measured_figure
from mlmkit.viz.sharding import parameter_memory_figure, zero_bytes_figure, zero_bytes_frame
from mlmkit.viz.widgets import ScheduleExplorer, SessionControls, schedule_explorer

__all__ = [
    "activation_peaks_figure",
    "ScheduleExplorer", "SessionControls", "bubble_table", "comm_by_axis_figure", "comm_heatmap", "comm_matrix",
    "cp_memory_figure", "cp_split_figure", "cp_work_frame", "ring_timeline_figure", "all_to_all_figure",
    "expert_load", "expert_load_figure", "moe_training_figure", "parameter_memory_figure", "zero_bytes_figure",
    "zero_bytes_frame", "plan_breakdown_figure", "plan_memory_figure", "plan_vs_measured_figure",
    "comm_timeline_figure", "memory_figure", "save_html", "schedule_explorer", "shard_figure", "shard_matrix_figure", "timeline_comparison",
    "timeline_figure", "topology_figure",
]
