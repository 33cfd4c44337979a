"""Predicted step time, throughput and memory of one layout on real GPUs (pure Python).

For a layout (tp, cp, pp with schedule and chunks, dp with a ZeRO stage, ep, micro-batch size,
recomputation) of ``model`` on ``gpus`` accelerators of one :class:`~mlmkit.plan.Hardware` type:

- **compute**: per layer and microbatch the forward FLOPs of :func:`mlmkit.estimate.forward_flops_per_token`
  (attention included; grouped-query attention, SwiGLU, top-k experts), split over ``tp x cp``,
  divided by the peak times the achievable efficiency :meth:`Hardware.compute_efficiency` of the
  per-GPU GEMM width ``hidden / tp``; backward is twice the forward; full recomputation reruns
  the forward, selective recomputation its attention core;
- **tensor / sequence parallelism**: per layer and microbatch two all-reduces forward and two
  backward (as all-gathers and reduce-scatters with sequence parallelism: the same bytes) of the
  ``[s, b, h]`` activations, ring algorithm, not overlapped (Megatron-LM's default); NVLink when
  the group fits in a node;
- **context parallelism**: the ring's key/value messages, overlapped with the attention compute
  (only what exceeds it is exposed); **expert parallelism**: four all-to-alls per MoE layer;
- **pipeline**: one activation message per microbatch and stage boundary each way; the bubble of
  1F1B ``(p - 1) (F + B)`` and of interleaved 1F1B ``(p - 1) (F + B) / v`` with the slowest stage's
  costs (``simulate`` gives the same for these costs: tests check it);
- **data parallelism**: ZeRO-0 all-reduces the fp32 gradients once per step, overlapped with the
  backward of the last microbatch, as Megatron-LM's bucketed overlap does (the experts' over their
  expert-dp replicas). ZeRO-1 (Megatron-LM's distributed optimizer) reduce-scatters them there
  instead, and all-gathers the updated parameters overlapped with the next step's first forward
  (a parameter is updated only once its gradient is reduced: no backward is left to hide it).
  ZeRO-2/3 hold only a shard of the gradients (as the memory count does), so every microbatch
  reduce-scatters its gradients layer by layer in its backward (DeepSpeed's ZeRO-2/3, FSDP);
  ZeRO-3's per-layer parameter all-gathers before each forward and backward share that link, each
  layer's overlapped with that layer's time (its compute and its tp/cp/ep communication); ZeRO-2
  all-gathers the updated parameters as ZeRO-1 does;
- **memory-bound work**: the element-wise operations between the GEMMs and, without a fused
  (flash) attention, the ``[b, a/t, s, s]`` attention scores, as HBM traffic
  (``ELEMENTWISE_PASSES``, ``MLP_PASSES``, ``SCORE_PASSES``);
- **optimizer**: AdamW streams ~32 bytes per local parameter through HBM.

Model FLOPs are Megatron-LM's (``3 x`` forward, no recomputation: :func:`~mlmkit.estimate.training_flops_per_token`),
MFU = model FLOP/s per GPU over the peak; hardware FLOPs add what recomputation reruns.

Memory per GPU (the largest pipeline stage): model state from :func:`~mlmkit.estimate.bytes_per_parameter`
(bf16 mixed precision, the ZeRO stage's sharding; ZeRO-3 also holds two units' parameters gathered,
the largest consecutive pair in the order of use; a mixture of experts' experts split over ``ep``,
their gradients and shards over their own ``tp x cp x dp / ep`` replicas) and activations from the
paper's per-layer formula (:func:`~mlmkit.estimate.activation_bytes_per_layer`,
``implementation="megatron"``, with the model's own dropout; experts: ``top_k`` rows per token),
times the microbatches in flight on the first stage (1F1B: ``p``; interleaved:
``p (1 + (p - 1) / (p v))``, Korthikanti et al. 2022; at most the step's ``m``), plus an allowance: 5% for
fragmentation and the hardware's ``framework_bytes`` (GPUs: 2 GiB for the CUDA context, NCCL and
workspaces; ``local-cpu``: a rank's measured resident set before any model). On mlmkit's own
runtime (``local-cpu``) the state and activations are instead :func:`mlmkit.estimate.estimate_memory`'s
for the layout (what mlmkit's blocks keep, the layout's own schedule replayed: GPipe holds every
microbatch, a split backward its weight-gradient inputs; equal to a traced run's bytes), of the rank
whose total is largest.

**mlmkit's own runtime** (``hw.runtime == "mlmkit"``: ``local-cpu``, measured by
:func:`mlmkit.distributed.calibrate_local_cpu`) replaces the time terms above with what a step of
:class:`mlmkit.train.Trainer` does on CPU ranks over gloo (:func:`_predict_mlmkit`): fp32; every
collective the step makes (:func:`mlmkit_collectives`, equal to a traced step's, collective by
collective: tests check it) waited for (nothing overlapped), each priced by the measured latency of
its group size after the work that precedes it; host time per dispatched operator (:data:`OPS`, counted in
mlmkit's code) and per recomputed region; ranks sharing the machine's cores (processor sharing:
the pipeline through :func:`mlmkit.pipeline.simulate` with ``cores`` and the measured message
latency of a pipeline of that depth); the optimizer's operators on every rank at once. A split
backward (zb-h1, zb-v, dualpipev) is priced as the full backward in its I and nothing in its W: the
model sees neither the bubble the W actions fill nor the split's host cost, which on this kind of
machine come out near even (ZB-H1 at 0.97-1.10x of 1F1B's step in ``make bench``, benchmarks/NOTES.md).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional, Union

from mlmkit.estimate.flops import forward_flops_per_token, training_flops_per_token
from mlmkit.estimate.memory import activation_bytes_per_layer, bytes_per_parameter, estimate_memory
from mlmkit.estimate.params import local_parameters, stage_layout
from mlmkit.model.config import GPTConfig
from mlmkit.model.presets import PRESETS, preset
from mlmkit.pipeline.schedule import SCHEDULES, V_SCHEDULES
from mlmkit.plan.hardware import GiB, Hardware
from mlmkit.scalars import plain_bool
from mlmkit.topology import Topology

__all__ = ["Collective", "Layout", "check_flash_attention", "check_layout_fields", "check_mlmkit_runtime", "check_seq_len",
           "mlmkit_collectives", "pipeline_time", "predict"]

FRAGMENTATION = 1.05
#: HBM passes (reads and writes, forward and backward together) over each layer's activations:
#: per token, of the hidden vector (2 norms, 2 dropouts, 2 residual adds) and of the MLP's inner
#: vector (activation function), and, without flash attention, of each attention score.
ELEMENTWISE_PASSES, MLP_PASSES, SCORE_PASSES = 24, 6, 12
ADAM_BYTES_PER_PARAM = 32


#: The fields of a :class:`Layout` (and the planner's constraints), and the schedules that run more
#: than one model chunk per pipeline rank.
LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "ep", "chunks", "schedule", "micro_batch_size", "recompute", "zero",
                 "sequence_parallel")
CHUNKED_SCHEDULES = ("interleaved-1f1b", "zb-v", "dualpipev")
#: Schedules whose backward is split into I and W (a weight gradient is whole only after the last W).
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zb-v", "dualpipev")
#: Schedules the time model of Megatron-LM's runtime (the GPU presets) covers: its 1F1B and interleaved
#: 1F1B; mlmkit's own runtime (``local-cpu``) simulates every schedule mlmkit runs.
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


def check_layout_fields(*, what: str = "plan", **fields) -> None:
    """ValueError naming the first of ``fields`` (any of :data:`LAYOUT_FIELDS`) that no layout can
    take: degrees, chunks and the micro-batch size are positive integers, the schedule one of
    mlmkit's, recompute none/selective/full, zero 0-3, sequence_parallel a bool."""
    for name, value in fields.items():
        value = plain_bool(value)
        if name in ("tp", "cp", "pp", "dp", "ep", "chunks", "micro_batch_size"):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{what}: {name}={value!r} must be a positive integer (1 switches that axis off)"
                                 if name not in ("chunks", "micro_batch_size") else
                                 f"{what}: {name}={value!r} must be a positive integer")
        elif name == "schedule" and value not in SCHEDULES:
            raise ValueError(f"{what}: schedule={value!r}; expected one of {', '.join(SCHEDULES)}")
        elif name == "recompute" and value not in ("none", "selective", "full"):
            raise ValueError(f"{what}: recompute={value!r}; expected 'none', 'selective' or 'full'")
        elif name == "zero" and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                 or value not in (0, 1, 2, 3)):
            raise ValueError(f"{what}: zero={value!r}; expected a ZeRO stage 0, 1, 2 or 3")
        elif name == "sequence_parallel" and not isinstance(value, bool):
            raise ValueError(f"{what}: sequence_parallel={value!r} must be True or False")
        elif name not in LAYOUT_FIELDS:
            raise ValueError(f"{what}: unknown field {name!r}; expected some of {', '.join(LAYOUT_FIELDS)}")


def model_config(model: object, *, what: str = "plan") -> GPTConfig:
    """``model`` as a :class:`GPTConfig`: one given, or a preset's by name (``"llama3-70b"``, as
    ``python -m mlmkit.plan --model`` takes it); anything else is a ValueError naming it."""
    if isinstance(model, GPTConfig):
        return model
    if isinstance(model, str):
        return preset(model)
    raise ValueError(f"{what}: model={model!r} ({type(model).__name__}): expected a GPTConfig or the name of a preset "
                     f"({', '.join(sorted(PRESETS))})")


def check_seq_len(seq_len: object, *, what: str = "plan") -> None:
    """ValueError unless ``seq_len`` is None (the model's) or a positive integer."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1):
        raise ValueError(f"{what}: seq_len={seq_len!r} must be a positive integer (or None: the model's)")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a job: the degrees, the schedule, the micro-batch size, recomputation, ZeRO."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    chunks: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    recompute: str = "none"
    zero: int = 1
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        check_layout_fields(**{f: getattr(self, f) for f in LAYOUT_FIELDS}, what="Layout")
        for name in ("tp", "cp", "pp", "dp", "ep", "chunks", "micro_batch_size", "zero"):   # numpy integers too
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "sequence_parallel", plain_bool(self.sequence_parallel))
        if self.chunks > 1 and self.schedule not in CHUNKED_SCHEDULES:
            raise ValueError(f"Layout: chunks={self.chunks} needs a schedule with model chunks "
                             f"({', '.join(CHUNKED_SCHEDULES)}), not schedule={self.schedule!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @classmethod
    def of(cls, config) -> "Layout":
        """The layout of a :class:`~mlmkit.train.TrainConfig` (read by attribute)."""
        if getattr(config, "schedule_file", False):
            raise ValueError(f"Layout.of: the config's schedule is a file ({config.schedule}); the planner times the "
                             f"named schedules ({', '.join(SCHEDULES)}). Simulate the file's order with "
                             f"mlmkit.pipeline.simulate(config.pipeline_schedule(), costs), or plan with the named "
                             f"schedule nearest to it")
        return cls(tp=config.tp, cp=config.cp, pp=config.pp, dp=config.dp, ep=config.ep, chunks=config.chunks,
                   schedule=config.schedule, micro_batch_size=config.micro_batch_size,
                   recompute=config.recompute, zero=config.zero, sequence_parallel=config.sequence_parallel)


@functools.lru_cache(maxsize=4096)
def _chunk_sums(model: GPTConfig, t: int, p: int, v: int, sp: bool, r: int) -> tuple:
    """Per chunk of pipeline rank ``r`` (tp ``t``, ``v`` chunks in a loop, whole experts on the rank):
    ``(pre_process, layers, root, layer)``, ``root`` and ``layer`` being ``(dense numel, expert
    numel, tensors)`` of the chunk's parameters outside its layers (embedding, head, final norm)
    and of one of its layers.

    Counted on a model of one layer per virtual stage (every layer of a GPTConfig has the same
    parameters), and with two expert counts, since a layer's parameters grow linearly with the
    experts (the router's rows, the experts' weights): listing every tensor of the whole model took
    31 s for a 61-layer, 256-expert plan on 1024 GPUs, and minutes to forever as the layers or the
    experts grew (``--experts 10**6`` filled 14 GB)."""
    topo = Topology(tp=t, pp=p)
    E = model.experts

    def sums(m: GPTConfig) -> list[tuple]:
        out = []
        for st in stage_layout(m, topo, pp_rank=r, chunks=v):
            root, layer = [0, 0, 0], [0, 0, 0]
            for q in local_parameters(m, topo, pp_rank=r, chunks=v, sequence_parallel=sp, only_chunk=st["chunk"]):
                into = layer if q.name.startswith("layers.") else root
                into[1 if q.expert else 0] += q.numel
                into[2] += 1
            out.append((st["pre_process"], tuple(root), tuple(layer)))
        return out

    one = replace(model, layers=p * v)
    if E:
        k = model.top_k            # two expert counts; the count at E follows the line through them
        a, b = sums(replace(one, experts=k)), sums(replace(one, experts=k + 1))
        at = [(pre, root, tuple(x + (y - x) * (E - k) for x, y in zip(la, lb)))
              for (pre, root, la), (_, _, lb) in zip(a, b)]
    else:
        at = sums(one)
    counts = [len(st["layers"]) for st in stage_layout(model, topo, pp_rank=r, chunks=v)]
    return tuple((pre, n, root, layer) for n, (pre, root, layer) in zip(counts, at))


@functools.lru_cache(maxsize=4096)
def _stage_split(model: GPTConfig, t: int, p: int, v: int, sp: bool, ep: int) -> tuple:
    """``(dense, expert)`` parameters per GPU of the largest pipeline stage (first or last), the
    experts split over ``ep`` ranks (whole experts, ``expert_tp = 1``)."""
    best = (0, 0)
    for r in {0, p - 1}:
        chunks = _chunk_sums(model, t, p, v, sp, r)
        dense = sum(root[0] + n * layer[0] for _, n, root, layer in chunks)
        expert = sum(root[1] + n * layer[1] for _, n, root, layer in chunks) // ep
        best = max(best, (dense, expert), key=sum)
    return best


@functools.lru_cache(maxsize=4096)
def _gathered_pair(model: GPTConfig, t: int, p: int, v: int, sp: bool, ep: int) -> float:
    """Parameters per GPU that ZeRO-3 holds gathered at once on the busier end stage: the largest
    two consecutive units in the order of use (each unit gathered while the one before it computes;
    a unit: a layer, or a chunk's embedding, final norm and head together), experts split over ``ep``.
    A stage of one layer and no embedding holds that layer alone."""
    best = 0.0
    for r in {0, p - 1}:
        units = []
        for pre, n, root, layer in _chunk_sums(model, t, p, v, sp, r):
            rest, each = root[0] + root[1] / ep, layer[0] + layer[1] / ep
            # a chunk's units: its root (before its layers on the first stage, after them elsewhere)
            # and its layers; the largest pairs need at most two of its layers
            units += ([rest] if pre and rest else []) + [each] * min(n, 2) + ([rest] if rest and not pre else [])
        pairs = [a + b for a, b in zip(units, units[1:])] or units
        best = max(best, max(pairs, default=0.0))
    return best


@functools.lru_cache(maxsize=4096)
def _check_split(model: GPTConfig, t: int, p: int, v: int, cp: int, ep: int, sp: bool) -> None:
    """The model's own rules for a layout (:meth:`GPTConfig.check_parallel`), checked once per split."""
    model.check_parallel(tp=t, pp=p, chunks=v, cp=cp, ep=ep, sequence_parallel=sp)


def divisors(n: int, *, at_most: Optional[int] = None) -> list[int]:
    """The divisors of ``n`` (those ``<= at_most`` when given), ascending, in O(min(sqrt(n), at_most))
    steps: a scan up to ``n`` took 2 minutes for ``--gpus 1000000000`` before the search could say
    that no layout divides the job, and one up to sqrt(n) still does not end for ``--gpus 10**20``,
    where only pipelines up to the model's layers are asked for."""
    if at_most is not None and at_most <= math.isqrt(n):
        return [k for k in range(1, at_most + 1) if n % k == 0]
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    out = small + [n // k for k in reversed(small) if k * k != n]
    return out if at_most is None else [k for k in out if k <= at_most]


def check_ep(model: GPTConfig, ep: int) -> None:
    """Raise ValueError, naming the fix, if ``model``'s experts cannot be split over ``ep`` ranks."""
    if ep == 1:
        return
    if not model.moe:
        raise ValueError(f"ep={ep} but the model has no experts (experts=0); drop --ep (ep=1) or use a "
                         f"mixture-of-experts model")
    if model.experts % ep:
        raise ValueError(f"ep={ep} does not divide experts={model.experts}; choose ep among {divisors(model.experts)}")


def _check_experts(model: GPTConfig, L: "Layout") -> int:
    """Validate ``L.ep`` for ``model``; return the experts' data-parallel replicas (expert-dp)."""
    check_ep(model, L.ep)
    if (L.tp * L.cp * L.dp) % L.ep:
        raise ValueError(f"ep={L.ep} does not divide tp x cp x dp = {L.tp * L.cp * L.dp}, the ranks of a stage that "
                         f"share the experts (Megatron-Core's expert grid); change ep or dp")
    return L.tp * L.cp * L.dp // L.ep


@functools.lru_cache(maxsize=4096)
def _stage_tensors(model: GPTConfig, t: int, p: int, v: int, sp: bool) -> int:
    """Parameter tensors of the end stage with the most (first or last)."""
    return max(sum(root[2] + n * layer[2] for _, n, root, layer in _chunk_sums(model, t, p, v, sp, r))
               for r in {0, p - 1})


@functools.lru_cache(maxsize=256)
def _flops(model: GPTConfig, s: int, t: int) -> tuple:
    # t: the head's vocabulary is padded for tp ranks (its padded columns are computed too)
    return forward_flops_per_token(model, seq_len=s, tp=t), training_flops_per_token(model, seq_len=s, tp=t), \
        {rc: training_flops_per_token(model, recompute=rc, seq_len=s, tp=t) for rc in ("none", "selective", "full")}


def _ring(op: str, nbytes: float, n: int, bw: float, latency: float) -> float:
    # nothing to move (a dense model's expert part): no collective, no latency
    if n <= 1 or nbytes == 0:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    share = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return share * nbytes / bw + steps * latency


def pipeline_time(forward: float, backward: float, *, microbatches: int, stages: int, chunks: int = 1) -> tuple:
    """(busy, bubble) seconds of a step of 1F1B (``chunks=1``) or interleaved 1F1B when every rank's
    forward and backward of one microbatch (all its chunks) take ``forward`` and ``backward``:
    ``m (F + B)`` and ``(p - 1) (F + B) / v`` (Narayanan et al. 2021); equals what
    :func:`mlmkit.pipeline.simulate` gives for these costs (tests check it)."""
    busy = microbatches * (forward + backward)
    return busy, ((stages - 1) * (forward + backward) / chunks if stages > 1 else 0.0)


#: Operators mlmkit's own step dispatches (aten operators, forward and backward together; fp32 GPT
#: blocks), counted with a dispatch mode (tests/test_plan.py re-counts them): per layer and
#: microbatch, its extra with tensor parallelism (the collectives' wrappers) and sequence
#: parallelism, what full recomputation adds, the embedding (first stage) and the head with its
#: loss (last stage) per microbatch, the optimizer per parameter tensor, and, with data
#: parallelism, the flattening of gradients around their reduction, per parameter tensor.
OPS = {"layer": 104, "layer_tp": 6, "layer_sp": 20, "layer_full_recompute": 70, "layer_selective_recompute": 20,
       "embedding": 30, "head": 51, "step": 75, "optimizer_per_tensor": 10, "dp_per_tensor": 5}


def check_mlmkit_runtime(model: GPTConfig, *, cp: Optional[int] = 1, ep: Optional[int] = 1,
                         name: str = "local-cpu") -> None:
    """ValueError naming what the time model of mlmkit's own runtime (``local-cpu``) does not cover:
    context or expert parallelism, and mixtures of experts (their operator counts would be a dense
    layer's: the router, permutation and expert loop are not counted). The command line calls it
    before it spends half a minute calibrating."""
    cp, ep = cp or 1, ep or 1
    if cp > 1 or ep > 1:
        raise ValueError(f"{name}: the time model of mlmkit's own runtime does not cover context or expert "
                         f"parallelism yet (cp={cp}, ep={ep}); plan with cp=1 and ep=1 here")
    if model.moe:
        raise ValueError(f"{name}: the time model of mlmkit's own runtime does not cover mixtures of experts "
                         f"yet (experts={model.experts}); plan a dense model here, or a GPU preset")


@dataclass(frozen=True)
class Collective:
    """One kind of collective that a step of mlmkit's own trainer issues on one rank, as its tracer
    records it (:mod:`mlmkit.trace`): ``count`` of them per ``per`` ("layer": each layer of the rank,
    each microbatch; "microbatch"; "step")."""

    axis: str        # the tracer's axis: "tp", "dp", "embedding" (tied, first and last stage), "world"
    op: str          # "all_reduce", "all_gather" or "reduce_scatter"
    nbytes: int      # the tracer's bytes: the whole tensor (gathered, or before its scatter)
    ranks: int       # the group's size
    per: str
    phase: str       # the tracer's phase: "forward", "backward", or "optimizer" (after the backward)
    count: int = 1
    rerun: bool = False   # a forward collective that full recomputation runs again inside the backward


def mlmkit_collectives(model: GPTConfig, layout: "Layout", *, seq_len: Optional[int] = None, pp_rank: int = 0,
                       precision: str = "fp32", bucket_bytes: int = 25 * 2**20) -> list[Collective]:
    """Every collective a training step of :class:`mlmkit.train.Trainer` issues on pipeline rank
    ``pp_rank`` of ``layout`` (any of its tp ranks), gradients reduced in fp32 (the trainer's
    default) in buckets of ``bucket_bytes``. What :func:`_predict_mlmkit` prices; tests compare it
    with traced steps, collective by collective.

    Per layer and microbatch, with tensor parallelism (Shoeybi et al. 2019): the all-reduces of
    attention's and the MLP's output in forward and of their inputs' gradients in backward; with
    sequence parallelism (Korthikanti et al. 2022) each all-reduce is an all-gather before and a
    reduce-scatter after its block, forward and backward (4 + 4); full recomputation runs the
    forward's collectives again in backward. Per microbatch: the embedding's reduction (first
    stage), the head's and the vocab-parallel loss's three fp32 ``[s, b]`` all-reduces (last
    stage); ZeRO-3's all-gather of each unit before its forward and its backward. Per step: the
    sequence-parallel parameters' and replicated key/value heads' gradient sums (per model chunk;
    with ZeRO-2/3 per layer, in its backward, unless the backward is split, and the rest per chunk),
    the data-parallel gradient reduction (:func:`mlmkit.estimate.comm.gradient_messages`; ZeRO-2/3
    per unit), the tied embedding's sum between first and last stage, the loss and gradient norm
    over the world. Context and expert parallelism are not covered (:func:`check_mlmkit_runtime`)."""
    from mlmkit.estimate.comm import gradient_messages
    from mlmkit.estimate.params import shard_unit_sizes, stage_layout

    check_mlmkit_runtime(model, cp=layout.cp, ep=layout.ep)
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.chunks, layout.micro_batch_size
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, numbers.Integral) or not 0 <= pp_rank < p:
        raise ValueError(f"mlmkit_collectives: pp_rank={pp_rank!r} must be an integer in 0..{p - 1} (pp={p})")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"mlmkit_collectives: precision={precision!r}: expected 'fp32' or 'bf16'")
    s = seq_len or model.seq_len
    E = 4 if precision == "fp32" else 2
    sp = layout.sequence_parallel and t > 1
    placement = "v" if layout.schedule in V_SCHEDULES else "loop"
    topo = Topology(tp=t, pp=p, dp=d)
    act = s * b * model.hidden * E                                   # one [s, b, h] activation
    stages = stage_layout(model, topo, pp_rank=pp_rank, chunks=v, placement=placement)
    out: list[Collective] = []

    def add(axis, op, nbytes, ranks, per, phase, count=1, rerun=False):
        if ranks > 1 and count:
            out.append(Collective(axis, op, int(nbytes), ranks, per, phase, count, rerun))

    if t > 1:
        for phase in ("forward", "backward"):
            if sp:
                add("tp", "all_gather", act, t, "layer", phase, 2)
                add("tp", "reduce_scatter", act, t, "layer", phase, 2)
            else:
                add("tp", "all_reduce", act, t, "layer", phase, 2)
        if layout.recompute == "full":
            if sp:
                add("tp", "all_gather", act, t, "layer", "forward", 2, rerun=True)
                add("tp", "reduce_scatter", act, t, "layer", "forward", 2, rerun=True)
            else:
                add("tp", "all_reduce", act, t, "layer", "forward", 2, rerun=True)
        ends = [st for st in stages if st["pre_process"] or st["post_process"]]
        for st in ends:
            if st["pre_process"]:            # the vocab-parallel embedding's sum (with SP: scattered)
                if sp:
                    add("tp", "reduce_scatter", act, t, "microbatch", "forward")
                    add("tp", "all_gather", act, t, "microbatch", "backward")
                else:
                    add("tp", "all_reduce", act, t, "microbatch", "forward")
            if st["post_process"]:           # the head's f (with SP: gathered) and the loss's three sums
                if sp:
                    add("tp", "all_gather", act, t, "microbatch", "forward")
                    add("tp", "reduce_scatter", act, t, "microbatch", "backward")
                else:
                    add("tp", "all_reduce", act, t, "microbatch", "backward")
                add("tp", "all_reduce", s * b * 4, t, "microbatch", "forward", 3)
        # once per step and model chunk; ZeRO-2/3 sum each layer's in its backward, once its gradient
        # is whole (not under a split backward: its W actions come later), and the rest at the end
        by_layer = layout.zero >= 2 and layout.schedule not in SPLIT_BACKWARD_SCHEDULES
        for st in stages:
            mine = local_parameters(model, topo, pp_rank=pp_rank, chunks=v, sequence_parallel=sp,
                                    only_chunk=st["chunk"], placement=placement)
            parts = [mine]
            if by_layer:
                parts = [[q for q in mine if q.name.startswith(f"layers.{i}.")] for i in st["layers"]] \
                    + [[q for q in mine if not q.name.startswith("layers.")]]
            for part in parts:
                if sp and any(q.sequence_parallel for q in part):
                    add("tp", "all_reduce", 4 * sum(q.numel for q in part if q.sequence_parallel), t, "step",
                        "backward")
                replicated = sum(q.numel * (t // q.replicas) for q in part if q.replicas > 1)
                if replicated:
                    add("tp", "all_reduce", 4 * replicated, t, "step", "backward")
    if d > 1:
        if layout.zero >= 2:
            for u in shard_unit_sizes(model, topo, pp_rank=pp_rank, chunks=v, sequence_parallel=sp,
                                      placement=placement):
                padded = -(-u["numel"] // d) * d
                add("dp", "reduce_scatter", padded * 4, d, "step", "backward")
                if layout.zero == 2:
                    add("dp", "all_gather", padded * E, d, "step", "optimizer")
                else:                        # before each forward and each backward of the unit
                    add("dp", "all_gather", padded * E, d, "microbatch", "forward")
                    add("dp", "all_gather", padded * E, d, "microbatch", "backward")
        else:
            params = local_parameters(model, topo, pp_rank=pp_rank, chunks=v, sequence_parallel=sp, placement=placement)
            for op, nbytes in gradient_messages(params, d, zero1=layout.zero == 1, R=4, E=E, bucket_bytes=bucket_bytes):
                add("dp", op, nbytes, d, "step", "backward" if op != "all_gather" else "optimizer")
    if p > 1 and model.tie_embeddings:
        ends = sum(st["pre_process"] + st["post_process"] for st in stages)
        if ends == 1:                        # one end here, the other on another rank (a V holds both)
            add("embedding", "all_reduce", model.padded_vocab(t) // t * model.hidden * 4, 2, "step", "backward")
    add("world", "all_reduce", 8, t * p * d, "step", "optimizer", 2)       # loss, gradient norm
    return out


def _predict_mlmkit(model: GPTConfig, hw: Hardware, L: Layout, *, m: int, s: int) -> dict:
    """Time of a step of mlmkit's own trainer (``hw.runtime == "mlmkit"``, e.g. ``local-cpu``):
    every collective waited for (gloo: nothing overlapped), operators' host time counted
    (:data:`OPS` times ``hw.op_overhead_s``), ranks sharing ``hw.cores`` processors (processor
    sharing; the pipeline through :func:`mlmkit.pipeline.simulate` with ``cores``)."""
    from mlmkit.pipeline.schedule import make_schedule
    from mlmkit.pipeline.simulate import Costs, simulate

    t, cp, p, d, v, b = L.tp, L.cp, L.pp, L.dp, L.chunks, L.micro_batch_size
    check_mlmkit_runtime(model, cp=cp, ep=L.ep, name=hw.name)
    E = 4 if hw.precision == "fp32" else 2
    sp = L.sequence_parallel and t > 1
    h, layers = model.hidden, model.layers
    peak = hw.peak_tflops * 1e12 * hw.compute_efficiency(h / t)
    fl = _flops(model, s, t)[0]
    tokens = b * s
    per_layer = (fl["linear"] + fl["attention"]) / layers * tokens / (t * cp)       # forward FLOPs
    attn_share = fl["attention"] / (fl["linear"] + fl["attention"])
    rerun = {"none": 0.0, "selective": attn_share, "full": 1.0}[L.recompute]
    ops_layer = (OPS["layer"] + (OPS["layer_tp"] if t > 1 else 0) + (OPS["layer_sp"] if sp else 0)
                 + {"none": 0, "selective": OPS["layer_selective_recompute"], "full": OPS["layer_full_recompute"]}[L.recompute])
    c = hw.op_overhead_s
    f_work = per_layer / peak + ops_layer * c / 3                 # host work: a third of the operators forward
    b_work = (2 + rerun) * per_layer / peak + 2 * ops_layer * c / 3 \
        + (hw.recompute_overhead_s if L.recompute != "none" else 0.0)     # one recomputed region per layer
    act = tokens / cp * h * E
    coll = hw.collective_time
    bw = hw.intra_node_bandwidth
    # the collectives of the two end stages (every rank has the same per layer): mlmkit_collectives
    ends = {r: mlmkit_collectives(model, L, seq_len=s, pp_rank=r, precision=hw.precision) for r in {0, p - 1}}
    layer = [x for x in ends[0] if x.per == "layer"]
    own_f = [x for x in layer if x.phase == "forward" and not x.rerun]
    own_b = [x for x in layer if x.phase == "backward"]
    # each of a layer's collectives after the work since the previous one (its gap); the reruns of
    # full recomputation after the recomputed forward's
    gf = f_work / max(1, sum(x.count for x in own_f))
    gb = b_work / max(1, sum(x.count for x in own_b))

    def priced(collectives, gap) -> float:
        return sum(x.count * coll(x.op, x.nbytes, x.ranks, bw, gap) for x in collectives)

    tp_f = priced(own_f, gf)
    tp_b = priced([x for x in layer if x.rerun], gf) + priced(own_b, gb)
    head = fl["head"] * tokens / (t * cp) / peak
    # the embedding's and the head's (with the loss's) collectives per microbatch, both ends
    per_mb = priced([x for r in ends for x in ends[r] if x.per == "microbatch" and x.axis == "tp"], gf)
    lp = layers / (p * v)                                          # layers per virtual stage
    F = [lp * f_work] * (p * v)
    B = [lp * b_work] * (p * v)
    F[0] += OPS["embedding"] * c / 3
    B[0] += 2 * OPS["embedding"] * c / 3
    F[-1] += head + OPS["head"] * c / 3
    B[-1] += 2 * head + 2 * OPS["head"] * c / 3
    wait_f = lp * tp_f
    wait_b = lp * tp_b
    # ranks computing at once: a pipeline stage's t x cp ranks, times d pipelines, share the cores
    cores = hw.cores
    share = None if cores is None else cores / (t * cp * d)
    if p == 1 and v == 1:
        work = m * (F[0] + B[0])
        busy = work * (max(1.0, 1.0 / share) if share is not None else 1.0)
        pipe = busy
        bubble = 0.0
    else:
        sched = make_schedule(L.schedule, stages=p, microbatches=m, chunks=v, layers=layers)
        costs = Costs(forward=F, backward=B, p2p_latency=hw.message_latency(p),
                      p2p_bandwidth=bw, message_bytes=act / (t if sp else 1))
        sim = simulate(sched, costs, cores=share)
        pipe = sim.step_time
        busy = sum(sim.busy_per_rank.values()) / p
        bubble = pipe - busy
    # collectives waited for on the critical path: every forward and backward of one stage of each
    # microbatch, plus the pipeline's fill and drain
    path = m * v + (p - 1)
    tp_wait = path * (wait_f + wait_b) + m * per_mb
    # once per step, on the end stage whose collectives take longest: the sequence-parallel gradient
    # sums, the gradient reduction over dp (ZeRO-3: per unit, its reduce-scatter after the unit's
    # backward, its gathers before each forward and backward), the tied embedding between first and
    # last stage, the loss and gradient-norm all-reduces over the world; the optimizer on every rank
    tensors = _stage_tensors(model, t, p, v, sp)
    replicas = d * cp

    def once_per_step(r: int) -> tuple[float, float]:
        per_step = [x for x in ends[r] if x.per == "step"]
        unit_rs = [x for x in per_step if L.zero == 3 and x.op == "reduce_scatter"]   # in the backward
        chain = [x for x in per_step if not (L.zero == 3 and x.op == "reduce_scatter")]
        gathers = [x for x in ends[r] if x.per == "microbatch" and x.axis == "dp"]
        # one after the other: the first after the last backward (its gap), each next right after the
        # one before (no work between: the shortest measured gap)
        cost = [priced([x], 0.0) for x in chain]
        if chain:
            x = chain[0]
            cost[0] += coll(x.op, x.nbytes, x.ranks, bw, B[0]) - coll(x.op, x.nbytes, x.ranks, bw, 0.0)
        tp_part = sum(k for x, k in zip(chain, cost) if x.axis == "tp")
        dp_part = (sum(k for x, k in zip(chain, cost) if x.axis != "tp")
                   + priced(unit_rs, b_work) + m * priced([x for x in gathers if x.phase == "forward"], f_work)
                   + m * priced([x for x in gathers if x.phase == "backward"], b_work))
        return tp_part, dp_part

    tp_step, dp = max((once_per_step(r) for r in sorted(ends)), key=sum)
    tp_wait += tp_step
    world = t * cp * p * d
    opt_ops = OPS["step"] + tensors * (OPS["optimizer_per_tensor"] + (OPS["dp_per_tensor"] if replicas > 1 else 0))
    optimizer = opt_ops * c * (max(1.0, world / cores) if cores is not None else 1.0)
    step = pipe + tp_wait + dp + optimizer
    return {"step_time_s": step, "compute_s": busy, "tp_comm_s": tp_wait, "cp_comm_s": 0.0, "ep_comm_s": 0.0,
            "pp_comm_s": 0.0, "bubble_s": bubble, "dp_comm_s": dp, "optimizer_s": optimizer}


def check_flash_attention(value: object, *, what: str) -> bool:
    """``flash_attention`` as a bool (numpy's too); ValueError for anything else (a string such as
    "no" would read as true)."""
    value = plain_bool(value)
    if not isinstance(value, bool):
        raise ValueError(f"{what}: flash_attention={value!r} must be true or false (a bool, not "
                         f"{type(value).__name__})")
    return value


def _mlmkit_memory(model: GPTConfig, layout: Layout, *, microbatches: int, precision: str) -> tuple[float, float]:
    """Memory of ``layout`` on mlmkit's own runtime: :func:`mlmkit.estimate.estimate_memory` (what
    mlmkit's blocks keep, the layout's schedule replayed; equal to a traced run's bytes, tests check
    it) for every rank, of the rank whose total is largest: ``(model state, activation peak)``."""
    L = layout
    topology = Topology(tp=L.tp, cp=L.cp, pp=L.pp, dp=L.dp, ep=L.ep, experts=model.moe)
    est = estimate_memory(model, topology, micro_batch_size=L.micro_batch_size, microbatches=microbatches,
                          schedule=L.schedule, chunks=L.chunks, sequence_parallel=L.sequence_parallel and L.tp > 1,
                          recompute=L.recompute, zero=L.zero, precision=precision)
    row = est.loc[est["total"].idxmax()]
    return float(row["parameters"] + row["gradients"] + row["optimizer"]), float(row["activations"])


def predict(model: Union[GPTConfig, str], hw: Hardware, layout: Layout, *, global_batch_size: int,
            seq_len: Optional[int] = None, flash_attention: bool = True) -> dict:
    """Step time, throughput, FLOP/s, MFU, memory per GPU and the time breakdown of ``layout``
    (module docstring). Raises ``ValueError`` when the layout does not divide the job."""
    L = layout
    model = model_config(model, what="predict")
    check_seq_len(seq_len, what="predict")
    flash_attention = check_flash_attention(flash_attention, what="predict")
    if hw.runtime == "megatron" and L.schedule not in MEGATRON_SCHEDULES:
        raise ValueError(f"predict: schedule={L.schedule!r}: the time model of Megatron-LM's runtime ({hw.name}) "
                         f"covers {' and '.join(MEGATRON_SCHEDULES)}; simulate other schedules with "
                         f"mlmkit.pipeline.simulate, or plan them on local-cpu")
    s = seq_len or model.seq_len
    t, cp, p, d, v, b = L.tp, L.cp, L.pp, L.dp, L.chunks, L.micro_batch_size
    if global_batch_size % (b * d):
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size x dp = {b * d}")
    m = global_batch_size // (b * d)
    h, layers = model.hidden, model.layers
    if layers < p * v:
        raise ValueError(f"layers={layers} are fewer than pp x chunks = {p * v} stages")
    if hw.runtime == "megatron" and L.schedule == "interleaved-1f1b" and (p == 1 or m % p):
        # what plan() searches, and what Megatron-LM runs: a layout it refuses gets no time
        raise ValueError(
            f"predict: schedule='interleaved-1f1b' with pp={p} " + (
                "interleaves nothing (one pipeline stage); use schedule='1f1b' (chunks=1) or pp > 1" if p == 1 else
                f"needs microbatches divisible by pp, as Megatron-LM's interleaved schedule does: global_batch_size="
                f"{global_batch_size} / (micro_batch_size={b} x dp={d}) = {m}; choose a global batch size that makes "
                f"it a multiple of {p}, or schedule='1f1b'"))
    if s % cp:
        raise ValueError(f"seq_len={s} is not a multiple of cp={cp}")
    sp = L.sequence_parallel and t > 1
    expert_dp = _check_experts(model, L)
    # what a run of this layout would refuse (tp dividing the heads, the key/value heads and the MLP,
    # the sequence over cp x tp, ...), as plan() does before it predicts
    _check_split(model if s == model.seq_len else replace(model, seq_len=s), t, p, v, cp, L.ep, sp)
    E = 2 if hw.precision == "bf16" else 4                    # bytes of activations and parameters
    peak = hw.peak_tflops * 1e12
    eff = hw.compute_efficiency(h / t)
    fl, _, train_flops = _flops(model, s, t)
    tokens = b * s                                             # tokens of a microbatch
    per_layer = (fl["linear"] + fl["attention"]) / layers * tokens / (t * cp)
    attn_share = fl["attention"] / (fl["linear"] + fl["attention"])
    # memory-bound work per layer and microbatch (HBM traffic): the element-wise operations on the
    # activations (norms, activation function, dropout, residuals: replicated over tp without
    # sequence parallelism, except inside the tp-split MLP), and without a fused (flash) attention
    # the [b, a/t, s, s] scores written and read by scale, mask, softmax and dropout
    elem = tokens / cp * (ELEMENTWISE_PASSES * h / (t if sp else 1) + MLP_PASSES * model.ffn / t) * E
    if not flash_attention:
        elem += b * (model.heads / t) * s * (s / cp) * SCORE_PASSES * E
    f_mem = elem / 3 / hw.hbm_bandwidth                       # a third of it in forward
    f_layer = per_layer / (peak * eff) + f_mem
    b_layer = 2 * f_layer + {"none": 0.0, "selective": attn_share * f_layer, "full": f_layer}[L.recompute]
    head = fl["head"] * tokens / (t * cp) / (peak * eff)
    # communication per layer and microbatch
    act = tokens / cp * h * E                                  # one [s/cp, b, h] activation
    tp_bw = hw.link(t, 1)
    ar = _ring("all_reduce", act, t, tp_bw, hw.latency_s)
    reruns = 1 if L.recompute == "full" else 0
    tp_f, tp_b = 2 * ar, (2 + 2 * reruns) * ar
    cp_exposed = 0.0
    if cp > 1:
        kv_heads = model.num_kv_heads
        kv = 2 * b * max(1, kv_heads // t) * (s // cp) * model.head_dim * E
        ring = (cp - 1) * (kv / hw.link(cp, t) + hw.latency_s)
        attn = attn_share * f_layer
        cp_exposed = max(0.0, ring - attn) * 3                 # forward, backward (twice the messages)
    ep_time = 0.0
    if model.moe and L.ep > 1:
        a2a = tokens / (t * cp) * model.top_k * h * E * (L.ep - 1) / L.ep
        ep_time = 4 * (a2a / hw.link(L.ep, t * cp) + hw.latency_s)
    lp = -(-layers // p)                 # layers of the busiest pipeline rank (uneven splits round up)
    p2p = (act / (t if sp else 1)) / hw.link(p, t * cp * d) + hw.latency_s if p > 1 else 0.0
    F = lp * (f_layer + tp_f + cp_exposed / 3 + ep_time / 2) + p2p * v
    B = lp * (b_layer + tp_b + 2 * cp_exposed / 3 + ep_time / 2) + p2p * v
    F_last, B_last = F + head, B + 2 * head
    Fs, Bs = max(F, F_last), max(B, B_last)
    busy, bubble = pipeline_time(Fs, Bs, microbatches=m, stages=p, chunks=v)
    # data parallelism and the optimizer
    # experts: split over ep, their gradients reduced over their own replicas (expert-dp, strided by ep)
    dense, expert = _stage_split(model, t, p, v, sp, L.ep)
    replicas = d * cp
    dp_bw, edp_bw = hw.link(replicas, t), hw.link(expert_dp, L.ep)

    def over_dp(op: str, dense_bytes: float, expert_bytes: float) -> float:
        return (_ring(op, dense_bytes, replicas, dp_bw, hw.latency_s)
                + _ring(op, expert_bytes, expert_dp, edp_bw, hw.latency_s))

    # a layer's time per microbatch, forward and backward: what its data-parallel traffic hides behind
    f_tot = f_layer + tp_f + cp_exposed / 3 + ep_time / 2
    b_tot = b_layer + tp_b + 2 * cp_exposed / 3 + ep_time / 2
    if L.zero == 0:
        # whole fp32 gradients accumulate over the microbatches and are all-reduced once, behind the
        # last microbatch's backward
        dp_exposed = max(0.0, over_dp("all_reduce", dense * 4, expert * 4) - Bs)
    else:
        # ZeRO-1/2: the updated parameters all-gathered (in the training dtype) behind the next step's
        # first forward; no backward window is left for them, since each waits for its reduced gradient
        # and the update (Megatron-LM's overlapped parameter gather)
        regather = max(0.0, over_dp("all_gather", dense * E, expert * E) - Fs) if L.zero <= 2 else 0.0
        if L.zero == 1:
            # whole fp32 gradients accumulate and are reduce-scattered once, behind the last backward
            dp_exposed = max(0.0, over_dp("reduce_scatter", dense * 4, expert * 4) - Bs) + regather
        else:
            # ZeRO-2/3 keep only their shard of the gradients (the memory count below): every
            # microbatch's are reduce-scattered in its backward, layer by layer (DeepSpeed's ZeRO-2/3,
            # FSDP), on the dp link that ZeRO-3's gathers of the next layer's parameters also use
            rs = over_dp("reduce_scatter", dense / lp * 4, expert / lp * 4)
            gather = over_dp("all_gather", dense / lp * E, expert / lp * E) if L.zero == 3 else 0.0
            dp_exposed = m * lp * (max(0.0, gather - f_tot) + max(0.0, gather + rs - b_tot)) + regather
    local = dense / (replicas if L.zero >= 1 else 1) + expert / (expert_dp if L.zero >= 1 else 1)
    optimizer = local * ADAM_BYTES_PER_PARAM / hw.hbm_bandwidth
    step = busy + bubble + dp_exposed + optimizer
    breakdown = {"compute_s": m * (lp * (f_layer + b_layer) + 3 * head), "tp_comm_s": m * lp * (tp_f + tp_b),
                 "cp_comm_s": m * lp * cp_exposed, "ep_comm_s": m * lp * ep_time, "pp_comm_s": m * 2 * p2p * v,
                 "bubble_s": bubble, "dp_comm_s": dp_exposed, "optimizer_s": optimizer}
    if hw.runtime == "mlmkit":
        breakdown = _predict_mlmkit(model, hw, L, m=m, s=s)
        step = breakdown["step_time_s"]
    # throughput and utilisation
    tr = train_flops[L.recompute]
    total_tokens = global_batch_size * s
    n = L.gpus
    model_tflops = tr["model"] * total_tokens / step / n / 1e12
    hw_tflops = tr["hardware"] * total_tokens / step / n / 1e12
    if hw.runtime == "mlmkit":
        # mlmkit's own runs: what its blocks keep, the schedule replayed (any schedule), every rank
        state, activations = _mlmkit_memory(model if s == model.seq_len else replace(model, seq_len=s), L,
                                            microbatches=m, precision=hw.precision)
    else:
        # memory of the largest stage
        state = (dense * bytes_per_parameter(precision=hw.precision, zero=L.zero, dp=replicas)
                 + expert * bytes_per_parameter(precision=hw.precision, zero=L.zero, dp=expert_dp))
        if L.zero == 3 and replicas > 1:                           # two units gathered at a time
            state += _gathered_pair(model, t, p, v, sp, L.ep) * E
        # a fused (flash) attention keeps no [s, s] scores: the paper's selective-recomputation count
        kept = "selective" if (flash_attention and L.recompute == "none") else L.recompute
        per_layer_act = activation_bytes_per_layer(
            s=s // cp, b=b, h=h, a=model.heads, ffn=model.ffn, t=t, sequence_parallel=sp, recompute=kept,
            dropout=model.dropout > 0, precision=hw.precision, implementation="megatron", kv_heads=model.num_kv_heads,
            mlp=model.mlp, norm=model.norm, rope=model.position == "rope", moe=model if model.moe else None)
        # the first stage's microbatches in flight, never more than the step has (with m = p an
        # interleaved schedule's warm-up already runs every chunk of every microbatch)
        inflight = min(m, p if v == 1 else p * (1 + (p - 1) / (p * v)))
        activations = per_layer_act * lp * inflight
    memory = (state + activations) * FRAGMENTATION + hw.framework_bytes
    return {
        "tp": t, "cp": cp, "pp": p, "dp": d, "ep": L.ep, "chunks": v, "schedule": L.schedule,
        "micro_batch_size": b, "recompute": L.recompute, "zero": L.zero, "microbatches": m,
        "memory_per_gpu_bytes": memory, "fits": memory <= hw.memory_bytes,
        "step_time_s": step, "tokens_per_s": total_tokens / step,
        "model_tflops_per_gpu": model_tflops, "hardware_tflops_per_gpu": hw_tflops, "mfu": model_tflops * 1e12 / peak,
        **{key: value for key, value in breakdown.items() if key != "step_time_s"},
        "state_bytes": state, "activation_bytes": activations,
    }
