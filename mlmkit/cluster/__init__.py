"""ipyparallel engines as ranks: the notebook cluster, interactive sessions, failure recovery."""

from mlmkit.cluster.cluster import Cluster, EngineDied, RankError, RankTimeout
from mlmkit.cluster.session import Session, StateLost

__all__ = ["Cluster", "EngineDied", "RankError", "RankTimeout", "Session", "StateLost"]
