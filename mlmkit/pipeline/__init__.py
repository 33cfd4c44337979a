"""Pipeline parallelism: schedules as data, validated, simulated and executed from one object.

Planning (pure Python, no torch): :func:`make_schedule`, :func:`schedule_from_table`,
:func:`validate`, :func:`simulate`. Execution on real ranks: :mod:`mlmkit.pipeline.executor`
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
from mlmkit.pipeline.simulate import Costs, SimResult, simulate
from mlmkit.pipeline.validate import validate

__all__ = [
    "SCHEDULES", "Action", "Costs", "Schedule", "ScheduleCursor", "ScheduleError", "SimResult", "make_schedule",
    "schedule_from_table", "simulate", "validate",
]
