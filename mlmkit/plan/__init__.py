"""Planning a real run (pure Python): hardware descriptions (:mod:`mlmkit.plan.hardware`), a time
and memory model per layout (:mod:`mlmkit.plan.timing`) and the search over layouts
(:func:`plan`; ``python -m mlmkit.plan``)."""

from mlmkit.plan.hardware import GPUS, Hardware, hardware
from mlmkit.plan.search import COLUMNS, plan, search_space
from mlmkit.plan.timing import Collective, Layout, mlmkit_collectives, predict

__all__ = ["COLUMNS", "GPUS", "Collective", "Hardware", "Layout", "hardware", "mlmkit_collectives", "plan", "predict",
           "search_space"]
