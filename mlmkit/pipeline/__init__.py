"""Pipeline parallelism: schedules as data, validated, simulated and executed from one object.

Planning (pure Python, no torch): :func:`make_schedule`, :func:`schedule_from_table`,
:func:`validate`, :func:`simulate`; :func:`to_torch_csv` and :func:`from_torch` carry schedules to
and from PyTorch's pipelining runtime. Execution on real ranks: :mod:`mlmkit.pipeline.executor`
(imported on use, it needs torch).
"""

from mlmkit.pipeline.cursor import ScheduleCursor
from mlmkit.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    make_schedule,
    schedule_from_table,
)
from mlmkit.pipeline.simulate import ActionCosts, Costs, SimResult, replay, simulate
from mlmkit.pipeline.torch_bridge import from_torch, to_torch_csv
from mlmkit.pipeline.validate import validate

__all__ = [
    "SCHEDULES", "Action", "ActionCosts", "Costs", "Schedule", "ScheduleCursor", "ScheduleError", "SimResult", "from_torch",
    "make_schedule", "replay", "schedule_from_table", "simulate", "to_torch_csv", "validate",
]
