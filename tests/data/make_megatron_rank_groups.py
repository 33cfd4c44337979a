"""Record Megatron-Core's rank groups for the shapes tests/test_topology.py checks.

Run (needs Megatron-Core's source only, no GPU):

    python -m venv /tmp/mcore && /tmp/mcore/bin/pip install --no-deps megatron-core==0.16.1
    PYTHONPATH=/tmp/mcore/lib/python3.11/site-packages .venv/bin/python tests/data/make_megatron_rank_groups.py

It writes tests/data/megatron_rank_groups.json: for each shape, the groups Megatron-Core's
``RankGenerator`` returns for the dense grid (order "tp-cp-ep-dp-pp", ep=1, as
``initialize_model_parallel`` builds it) and for the expert grid (tp=expert_tp, cp=1, ep, dp=expert_dp).
"""

import json
import os

from megatron.core.parallel_state import RankGenerator

SHAPES = [  # tp, cp, dp, pp, ep, expert_tp
    (1, 1, 1, 1, 1, 1), (2, 1, 2, 2, 1, 1), (4, 1, 2, 1, 1, 1), (1, 1, 4, 2, 1, 1), (2, 1, 1, 4, 1, 1),
    (3, 1, 2, 2, 1, 1), (1, 2, 1, 1, 1, 1), (1, 4, 1, 1, 1, 1), (2, 2, 1, 1, 1, 1), (1, 2, 1, 2, 1, 1),
    (1, 2, 2, 1, 1, 1), (2, 2, 2, 2, 1, 1), (2, 4, 2, 1, 1, 1), (1, 2, 2, 2, 2, 1), (1, 1, 4, 1, 4, 1),
    (2, 1, 2, 1, 2, 1), (2, 1, 2, 2, 2, 2), (1, 1, 2, 2, 2, 1), (2, 2, 2, 1, 4, 2), (4, 1, 2, 1, 8, 1),
]
DENSE = ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp", "tp-pp"]
EXPERT = ["tp", "ep", "dp", "tp-ep", "tp-ep-pp"]


def main() -> None:
    out = []
    for tp, cp, dp, pp, ep, etp in SHAPES:
        world = tp * cp * dp * pp
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        out.append({"shape": {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "expert_tp": etp},
                    "dense": {k: dense.get_ranks(k) for k in DENSE},
                    "expert": {k: expert.get_ranks(k) for k in EXPERT}})
    path = os.path.join(os.path.dirname(__file__), "megatron_rank_groups.json")
    with open(path, "w") as f:
        json.dump({"source": "megatron-core 0.16.1, megatron.core.parallel_state.RankGenerator", "shapes": out}, f)
    print(f"wrote {len(out)} shapes to {path}")


if __name__ == "__main__":
    main()
