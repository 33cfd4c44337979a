"""Mixture of experts with expert parallelism (Shazeer et al. 2017; GShard 2020; Switch 2021).

- :mod:`mlmkit.moe.routing` (torch, no communication): the router's top-k choice and weights,
  capacities and the load-balancing / z losses;
- :mod:`mlmkit.moe.layer`: the layer itself (router, experts split over the ``ep`` group and
  each expert over ``expert_tp``, all-to-all dispatch and combine with uneven splits).

``GPTConfig.experts``, ``TrainConfig.ep`` / ``expert_tp`` and ``--experts --ep`` switch it on; the
topology's expert grid (:meth:`mlmkit.Topology.expert_coords`) says which ranks share experts.
"""

from mlmkit.moe.layer import ExpertGroups, ExpertMLP, MoELayer, Router, all_to_all
from mlmkit.moe.routing import Routing, balance_terms, capacity, capacity_keep, route, uniform_indices

__all__ = ["ExpertGroups", "ExpertMLP", "MoELayer", "Router", "Routing", "all_to_all", "balance_terms",
           "capacity", "capacity_keep", "route", "uniform_indices"]
