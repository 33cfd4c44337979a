"""`make demo`: the main job. Runs mlmkit on real CPU ranks and prints what each rank did."""

from __future__ import annotations

import argparse

import torch

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.trace import Tracer


def _rank_report(rank: int, world_size: int, tp: int, pp: int, dp: int):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(topo, tracer=tracer)
    x = torch.full((1024,), float(rank))
    for axis in ("tp", "dp", "pp"):
        getattr(groups, axis).all_reduce(x.clone(), site=f"demo.{axis}")
    return tracer.comm_frame()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args(argv)
    topo = Topology(tp=args.tp, pp=args.pp, dp=args.dp)
    print(topo.grid())
    print(topo.to_frame().to_string())
    import pandas as pd

    frames = run_ranks(_rank_report, world_size=topo.world_size, args=(args.tp, args.pp, args.dp))
    comm = pd.concat(frames, ignore_index=True)
    print("\nTraced collectives per rank and axis (bytes sent on the wire, ring algorithm):")
    print(comm.pivot_table(index="rank", columns="axis", values="wire_bytes", aggfunc="sum", fill_value=0))


if __name__ == "__main__":
    main()
