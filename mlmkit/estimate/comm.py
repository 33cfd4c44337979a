"""Communication volume per rank and step, per axis, estimated in pure Python.

Counts every message mlmkit's training step sends, as bytes this rank puts on the wire with ring
algorithms (:func:`mlmkit.trace.ring_wire_bytes`: all-reduce ``2(n-1)/n N``, all-gather and
reduce-scatter ``(n-1)/n N``, a point-to-point send ``N``), computed message by message so that it
equals what the tracer measures:

- ``tp``: per layer and microbatch, 4 all-reduces of ``[s, b, h]`` (f and g, forward and backward;
  Shoeybi et al. 2019), or with sequence parallelism 4 all-gathers and 4 reduce-scatters of the same
  tensors (Korthikanti et al. 2022); with full recomputation each layer's 2 forward collectives run
  again in backward (selective recomputation reruns no collective); the embedding's reduction, the
  head's f, the vocab-parallel loss's three fp32 ``[s, b]`` all-reduces; once per step and model
  chunk, the sequence-parallel gradient sum and the sum of replicated key/value heads' gradients
  (tp > kv_heads);
- ``cp``: ring attention (context parallelism), per layer and microbatch: forward ``cp - 1``
  messages of the held keys and values ``[2, b, kv/t, s/cp, d]`` (training dtype), backward
  ``cp - 1`` such messages plus ``cp`` messages of their fp32 gradients; the forward ring runs
  again in backward under selective or full recomputation (the core is recomputed). With cp,
  every other activation message is ``s/cp`` tokens long;
- ``pp``: each microbatch's activations ``[s, b, h]`` (``[s/t, b, h]`` with SP) sent to the next
  stage and its gradient sent back to the previous one;
- ``dp``: the gradient all-reduce (bucketed), or ZeRO-1's reduce-scatter of gradients plus
  all-gather of parameters (flat vector padded to a multiple of dp), over the dp x cp ranks that
  hold the same parameters; ZeRO-2 the same unit by unit (each unit padded); ZeRO-3 per unit one
  reduce-scatter and an all-gather of the parameters before every forward and every backward of
  its chunk (``2m`` per step; once with ``reshard_after_forward=False``);

Activations and their messages travel in the training dtype (2 bytes in bf16), gradients in fp32
(``grad_reduce="bf16"``: the dp reduction in bf16), ZeRO-1's parameter all-gather in the
parameters' dtype.
- ``embedding``: the tied word embedding's gradient all-reduce between first and last stage;
- ``world``: the gradient-norm and loss all-reduces (8 bytes each).
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

from mlmkit.estimate.params import (check_estimate, local_parameters, moe_kept_by_expert, shard_unit_sizes,
                                    stage_layout)
from mlmkit.pipeline.schedule import PLACEMENTS, stage_rank
from mlmkit.model.config import GPTConfig
from mlmkit.topology import Topology
from mlmkit.trace.tracer import ring_wire_bytes

__all__ = ["estimate_comm", "estimate_train_comm", "gradient_messages"]


def _buckets(sizes: list[int], bucket_bytes: int, alone: list[bool]) -> list[int]:
    # Same rule as mlmkit.data_parallel.bucketize, on byte sizes (a tied embedding's copy alone).
    out, cur, single = [], 0, False
    for n, lone in zip(sizes, alone):
        if cur and (cur + n > bucket_bytes or lone or single):
            out.append(cur)
            cur = 0
        cur += n
        single = lone
    if cur:
        out.append(cur)
    return out


#: Columns of :func:`estimate_comm` (axes of the traced groups).
AXES = ("tp", "cp", "tp-cp", "ep", "expert-tp", "pp", "dp", "expert-dp", "embedding", "world")


def gradient_messages(params, d: int, *, zero1: bool, R: int, E: int, bucket_bytes: int) -> list[tuple[str, int]]:
    """The ``(op, bytes)`` of each collective that reduces ``params``' gradients over their ``d``
    replicas once per step (:mod:`mlmkit.data_parallel.optimizer`): one all-reduce per bucket
    (parameters in reverse order, each tied embedding copy a bucket of its own), or with ZeRO-1 a
    reduce-scatter of the gradients (``R`` bytes each) and an all-gather of the parameters (``E``
    bytes each) per flat vector, padded to a multiple of ``d`` (each tied embedding copy a vector of
    its own). Bytes as the tracer records them: the whole tensor."""
    if d == 1 or not params:
        return []
    if zero1:
        copies = [q.numel for q in params if q.tied_embedding]
        out = []
        for n in [sum(q.numel for q in params) - sum(copies)] + copies:
            if n:
                padded = -(-n // d) * d
                out += [("reduce_scatter", padded * R), ("all_gather", padded * E)]
        return out
    sizes = [q.numel * R for q in reversed(params)]
    alone = [q.tied_embedding for q in reversed(params)]
    return [("all_reduce", n) for n in _buckets(sizes, bucket_bytes, alone)]


def _grad_reduction(params, d: int, *, zero1: bool, R: int, E: int, bucket_bytes: int) -> int:
    # the optimizer part's reduction over its d replicas, as wire bytes
    return sum(ring_wire_bytes(op, n, d)
               for op, n in gradient_messages(params, d, zero1=zero1, R=R, E=E, bucket_bytes=bucket_bytes))


def _moe_comm(model: GPTConfig, topology: Topology, *, s: int, b: int, m: int, E: int, G: int, sp: bool,
              layers: int, full_recompute: bool, ep_rank: int) -> dict:
    """A mixture of experts' bytes for the rank at ``ep_rank`` per step: every rank routes its tokens
    alike (:func:`~mlmkit.estimate.params.moe_kept_by_expert`: exact for ``moe_force_uniform``, the
    mean of an even routing otherwise), less what a capacity drops."""
    t, ep, et = topology.tp, topology.ep, topology.expert_tp
    h, Ex = model.hidden, model.experts
    local = Ex // ep
    tokens = (s // t if sp else s) * b                  # this rank's tokens of a microbatch
    kept = moe_kept_by_expert(model, tokens)            # rows each expert takes from each rank
    mine = kept[ep_rank * local:(ep_rank + 1) * local]  # ... of this rank's experts
    runs = 2 if full_recompute else 1                   # forward passes per microbatch
    out = {}
    # ep: the dispatch sends the rows of the other ranks' experts and receives its own experts' rows
    # from the ep - 1 others; the combine sends those back, backward runs both the other way round;
    # the expert counts (int64) are exchanged in every forward
    leave = sum(kept) - sum(mine)
    arrive = (ep - 1) * sum(mine)
    a2a = (leave + arrive) * h * E
    out["ep"] = round(m * layers * ((runs + 1) * a2a + runs * (ep - 1) * local * 8)) if ep > 1 else 0
    # tp-cp: the routing statistics (2 E + 2 fp32) summed over the ranks that split the tokens
    n_tok = t * topology.cp
    out["tp-cp"] = m * layers * runs * ring_wire_bytes("all_reduce", (2 * Ex + 2) * 4, n_tok) if n_tok > 1 else 0
    # expert-tp: per local expert its rows (ep x kept on each member) gathered before fc1 and
    # reduce-scattered after fc2, and back in backward (an expert without rows runs nothing); the
    # padded row counts (int64) per forward
    if et > 1:
        per_mb = runs * ring_wire_bytes("all_reduce", local * 8, et)
        for rows in (ep * k for k in mine):
            full = round(et * rows * h * E)
            pair = ring_wire_bytes("all_gather", full, et) + ring_wire_bytes("reduce_scatter", full, et)
            per_mb += (runs + 1) * pair
        out["expert-tp"] = m * layers * per_mb
        if model.bias:   # each expert's fc2 bias gradient, once per step, where it has one (under bf16
            # every parameter has its fp32 gradient buffer; in fp32 an expert without rows has none)
            summed = local if E == 2 else sum(1 for k in mine if k > 0)
            out["expert-tp"] += layers * summed * ring_wire_bytes("all_reduce", h * G, et)
    else:
        out["expert-tp"] = 0
    return out


def estimate_comm(model: GPTConfig, topology: Topology, *, micro_batch_size: int, microbatches: int,
                  chunks: int = 1, sequence_parallel: bool = False, zero1: bool = False, recompute=False,
                  bucket_bytes: int = 25 * 2**20, precision: Optional[str] = None, grad_reduce: str = "fp32",
                  layers_per_stage: Optional[Sequence[int]] = None, placement: str = "loop",
                  zero: Optional[int] = None, reshard_after_forward: bool = True):
    """Wire bytes per rank (rows) and axis (columns: tp, cp, tp-cp, ep, expert-tp, pp, dp, expert-dp,
    embedding, world) for one step.
    For a training run, :func:`estimate_train_comm` takes every option from its TrainConfig."""
    import pandas as pd

    if precision is None:
        raise ValueError("estimate_comm: give precision='fp32' or 'bf16' (the run's; never assumed), or call "
                         "estimate_train_comm(config), which takes everything from the config")
    if precision not in ("fp32", "bf16") or grad_reduce not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r}, grad_reduce={grad_reduce!r}: expected 'fp32' or 'bf16'")
    check_estimate(model, topology, micro_batch_size=micro_batch_size, microbatches=microbatches, chunks=chunks,
                   sequence_parallel=sequence_parallel, zero=zero, recompute=recompute,
                   flags=dict(zero1=zero1, reshard_after_forward=reshard_after_forward), what="estimate_comm")
    if not isinstance(placement, str) or placement not in PLACEMENTS:    # "V" was estimated as a loop
        raise ValueError(f"estimate_comm: placement={placement!r}; expected one of {', '.join(PLACEMENTS)} "
                         f"('v' for zb-v and dualpipev)")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
        # as the run's (TrainConfig, bucketize): 0 or 1.5 estimated buckets no run makes
        raise ValueError(f"estimate_comm: bucket_bytes={bucket_bytes!r} must be an integer >= 1")
    full_recompute = recompute is True or recompute == "full"
    reruns_core = full_recompute or recompute == "selective"
    cp = topology.cp
    s, b, h, m = model.seq_len // cp, micro_batch_size, model.hidden, microbatches   # s: this rank's tokens
    E = 2 if precision == "bf16" else 4          # activations, parameters
    G = 4                                        # gradients (fp32 main gradients under bf16)
    R = 2 if grad_reduce == "bf16" else 4        # gradients on the dp wire
    t, d, p = topology.tp, topology.dp * cp, topology.pp       # d: ranks that reduce gradients together
    sp = sequence_parallel and t > 1
    act = s * b * h * E                   # one [s, b, h] tensor
    rows = []
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        vol = {axis: 0 for axis in AXES}
        stages = stage_layout(model, topology, pp_rank=c.pp, chunks=chunks, layers_per_stage=layers_per_stage,
                              placement=placement)
        ep_rank = topology.expert_coords(rank).ep
        params = local_parameters(model, topology, pp_rank=c.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                                  ep_rank=ep_rank,
                                  layers_per_stage=layers_per_stage, placement=placement)
        if t > 1:
            per_mb = 0
            # f/g pairs per layer: attention's and the MLP's (a mixture of experts has none, unless a
            # shared expert, a dense tensor-parallel MLP, runs beside it)
            pairs = 1 if (model.moe and not model.moe_shared_ffn_hidden) else 2
            for st in stages:
                if sp:
                    per_mb += len(st["layers"]) * 2 * pairs * (ring_wire_bytes("all_gather", act, t)
                                                              + ring_wire_bytes("reduce_scatter", act, t))
                else:
                    per_mb += len(st["layers"]) * 2 * pairs * ring_wire_bytes("all_reduce", act, t)
                if full_recompute:  # each layer's forward runs again in backward, collectives included
                    per_mb += len(st["layers"]) * pairs * (ring_wire_bytes("all_gather", act, t)
                                                          + ring_wire_bytes("reduce_scatter", act, t)
                                                          if sp else ring_wire_bytes("all_reduce", act, t))
                if st["pre_process"]:  # forward reduction; with SP its backward all-gathers the gradient
                    per_mb += (ring_wire_bytes("reduce_scatter", act, t) + ring_wire_bytes("all_gather", act, t)
                               if sp else ring_wire_bytes("all_reduce", act, t))
                if st["post_process"]:
                    per_mb += (ring_wire_bytes("all_gather", act, t) + ring_wire_bytes("reduce_scatter", act, t)
                               if sp else ring_wire_bytes("all_reduce", act, t))
                    per_mb += 3 * ring_wire_bytes("all_reduce", s * b * 4, t)
            vol["tp"] = m * per_mb
            for st in stages:   # once per step and model chunk
                mine = local_parameters(model, topology, pp_rank=c.pp, chunks=chunks, sequence_parallel=sequence_parallel,
                                        layers_per_stage=layers_per_stage, only_chunk=st["chunk"], placement=placement)
                if sp:
                    vol["tp"] += ring_wire_bytes("all_reduce", G * sum(q.numel for q in mine if q.sequence_parallel), t)
                replicated = sum(q.numel * (t // q.replicas) for q in mine if q.replicas > 1)
                if replicated:
                    vol["tp"] += ring_wire_bytes("all_reduce", G * replicated, t)
        if cp > 1:
            kv_l = model.num_kv_heads // t if model.num_kv_heads >= t else 1
            kv = 2 * b * kv_l * s * model.head_dim                 # [2, b, kv/t, s/cp, d] elements
            per_layer = (cp - 1) * kv * E * (3 if reruns_core else 2) + cp * kv * 4
            vol["cp"] = m * per_layer * sum(len(st["layers"]) for st in stages)
        if p > 1:
            msg = (s // t if sp else s) * b * h * E
            last = p * chunks - 1
            for st in stages:
                vs = st["virtual_stage"]
                # a neighbour on another rank gets a message (the tip of a V is handed over locally)
                for other in (vs + 1, vs - 1):
                    if 0 <= other <= last and stage_rank(other, stages=p, placement=placement)[0] != c.pp:
                        vol["pp"] += m * msg
        stage = (1 if zero1 else 0) if zero is None else zero
        if stage >= 2:
            if d > 1:
                gathers = 1 if stage == 2 else (2 * m if reshard_after_forward else 1)
                for u in shard_unit_sizes(model, topology, pp_rank=c.pp, chunks=chunks,
                                          sequence_parallel=sequence_parallel, layers_per_stage=layers_per_stage,
                                          placement=placement):
                    padded = -(-u["numel"] // d) * d
                    vol["dp"] += (ring_wire_bytes("reduce_scatter", padded * R, d)
                                  + gathers * ring_wire_bytes("all_gather", padded * E, d))
        else:
            vol["dp"] = _grad_reduction([q for q in params if not q.expert], d, zero1=stage == 1, R=R, E=E,
                                        bucket_bytes=bucket_bytes)
        if model.moe:
            layers = sum(len(st["layers"]) for st in stages)
            vol["expert-dp"] = _grad_reduction([q for q in params if q.expert], topology.expert_dp,
                                               zero1=stage == 1, R=R, E=E, bucket_bytes=bucket_bytes)
            vol.update(_moe_comm(model, topology, s=s, b=b, m=m, E=E, G=G, sp=sp, layers=layers,
                                 full_recompute=full_recompute, ep_rank=ep_rank))
        if p > 1 and model.tie_embeddings:
            vocab_bytes = model.padded_vocab(t) // t * h * G
            ends = sum(st["pre_process"] + st["post_process"] for st in stages)
            # one end here: summed with the other end's rank; both (a V): summed locally
            vol["embedding"] = ring_wire_bytes("all_reduce", vocab_bytes, 2) if ends == 1 else 0
        if topology.world_size > 1:   # gradient norm and loss (and, with experts, their metrics: 16 bytes)
            vol["world"] = (2 * ring_wire_bytes("all_reduce", 8, topology.world_size)
                            + (ring_wire_bytes("all_reduce", 16, topology.world_size) if model.moe else 0))
        rows.append({"rank": rank, **vol})
    return pd.DataFrame(rows).set_index("rank")


def estimate_train_comm(config):
    """:func:`estimate_comm` for a :class:`~mlmkit.train.TrainConfig` (every option from the config)."""
    return estimate_comm(config.model, config.topology, micro_batch_size=config.micro_batch_size,
                         microbatches=config.microbatches, chunks=config.chunks,
                         sequence_parallel=config.sequence_parallel, zero=config.zero, recompute=config.recompute,
                         reshard_after_forward=config.reshard_after_forward,
                         bucket_bytes=config.bucket_bytes, precision=config.precision, grad_reduce=config.grad_reduce,
                         placement=config.placement)
