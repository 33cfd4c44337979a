"""The search: every layout of a job that divides it, predicted and ranked (pure Python).

:func:`plan` enumerates tensor (up to a node, dividing the heads), context, pipeline and data
parallel degrees whose product is the GPU count, for a mixture of experts the expert-parallel
degrees (dividing the experts and a stage's ``tp x cp x dp`` ranks), Megatron-LM's 1F1B and interleaved 1F1B
(2 or 4 chunks, when the microbatches allow them), micro-batch sizes, the three recomputation
choices and ZeRO stages 1 and 3; constraints fix any of these (a fixed chunk count is planned as
given; on mlmkit's own runtime, ``local-cpu``, a fixed schedule may be any that mlmkit runs). When
no layout is left, the error names the constraint that rules them out and the rule it breaks. Only layouts the model can be split
into are kept (:meth:`~mlmkit.model.GPTConfig.check_parallel`: the MLP width and the key/value heads
against tp, the sequence against cp x tp, as a training run checks them). Each layout is predicted by
:func:`mlmkit.plan.predict`; the table is ranked by tokens per second, layouts that do not fit
in memory last (``fits`` False), the smallest memory per GPU first among them: when nothing
fits, the top rows are the layouts closest to fitting, not the fastest of the impossible ones.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Sequence, Union

from mlmkit.model.config import GPTConfig
from mlmkit.pipeline.schedule import MAX_MICROBATCHES, V_SCHEDULES, make_schedule
from mlmkit.plan.hardware import Hardware, hardware
from mlmkit.plan.timing import (MEGATRON_SCHEDULES, Layout, check_ep, check_flash_attention, check_layout_fields,
                                check_seq_len, divisors, model_config, predict)

__all__ = ["COLUMNS", "check_job", "check_request", "plan", "search_space"]

#: Columns of :func:`plan`'s table, in order.
COLUMNS = ["tp", "cp", "pp", "dp", "ep", "chunks", "schedule", "micro_batch_size", "recompute", "zero",
           "microbatches", "memory_per_gpu_bytes", "fits", "step_time_s", "tokens_per_s", "model_tflops_per_gpu",
           "hardware_tflops_per_gpu", "mfu", "compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s",
           "bubble_s", "dp_comm_s", "optimizer_s", "state_bytes", "activation_bytes"]

_CONSTRAINTS = ("tp", "cp", "pp", "dp", "ep", "chunks", "schedule", "micro_batch_size", "recompute", "zero",
                "sequence_parallel")


def search_space(model: GPTConfig, hw: Hardware, *, gpus: int, global_batch_size: int, seq_len: int,
                 **fixed) -> list[Layout]:
    """The layouts :func:`plan` predicts (module docstring); ``fixed``: constraints."""
    _check_constraints(fixed)
    if fixed.get("schedule") is not None and hw.runtime == "megatron" and fixed["schedule"] not in MEGATRON_SCHEDULES:
        raise ValueError(f"plan: schedule={fixed['schedule']!r}: the time model of Megatron-LM's runtime ({hw.name}) "
                         f"covers {' and '.join(MEGATRON_SCHEDULES)}; plan with one of them, or on local-cpu")

    def options(name, default):
        value = fixed.get(name)
        return [value] if value is not None else default

    if fixed.get("ep") is not None:
        check_ep(model, fixed["ep"])
    # expert parallelism: whole experts over ep of a stage's tp x cp x dp ranks (mixtures of experts only)
    eps = options("ep", divisors(model.experts, at_most=gpus) if model.moe and hw.runtime != "mlmkit" else [1])
    out = []
    sp = fixed.get("sequence_parallel", True)
    checked, refused = {}, []

    def schedule_options(p: int) -> list[tuple[str, int]]:
        # Megatron-LM's 1F1B and interleaved 1F1B (2 or 4 chunks) unless a schedule is fixed; mlmkit's
        # own runtime simulates every schedule mlmkit runs, so a fixed one is planned there as well.
        names = [fixed["schedule"]] if fixed.get("schedule") is not None else list(MEGATRON_SCHEDULES)
        out = []
        for name in names:
            if name in V_SCHEDULES:
                chunks = [2]
            elif name == "interleaved-1f1b":
                chunks = [fixed["chunks"]] if (fixed.get("chunks") or 1) > 1 else [2, 4]
            else:
                chunks = [1]
            out += [(name, v) for v in chunks if fixed.get("chunks") in (None, v) and (p > 1 or v == 1 or
                                                                                        name in V_SCHEDULES)]
        return out

    def passes(key: tuple, check) -> bool:
        # each check once per key (the same split or pipeline recurs for every tp, cp and
        # recomputation choice); the reason of a refusal is kept for the error if nothing is left
        if key not in checked:
            try:
                check()
                checked[key] = True
            except ValueError as err:            # ScheduleError included
                checked[key] = False
                if str(err) not in refused:
                    refused.append(str(err))
        return checked[key]

    def schedulable(name: str, p: int, m: int, v: int) -> bool:
        return passes(("schedule", name, p, m, v),
                      lambda: make_schedule(name, stages=p, microbatches=m, chunks=v, layers=model.layers))

    def splittable(t: int, cp: int, p: int, v: int, ep: int) -> bool:
        # the model's own rules (a run of this layout would refuse it before starting)
        return passes(("split", t, cp, p, v, ep),
                      lambda: model.check_parallel(tp=t, pp=p, chunks=v, cp=cp, ep=ep, sequence_parallel=sp and t > 1))

    tps = [t for t in options("tp", divisors(hw.gpus_per_node)) if model.heads % t == 0 and gpus % t == 0]
    for t in tps:
        # mlmkit's own runtime (local-cpu) is modelled without context parallelism
        cps = [1] if hw.runtime == "mlmkit" else [c for c in (1, 2, 4, 8, 16) if seq_len % (2 * c) == 0 or c == 1]
        for cp in options("cp", cps):
            if gpus % (t * cp):
                continue
            for p in options("pp", divisors(gpus // (t * cp), at_most=model.layers)):
                if p > model.layers or gpus % (t * cp * p):
                    continue
                d = gpus // (t * cp * p)
                if fixed.get("dp") is not None and fixed["dp"] != d:
                    continue
                for b in options("micro_batch_size", [1, 2, 4, 8]):
                    if global_batch_size % (b * d):
                        continue
                    m = global_batch_size // (b * d)
                    if hw.runtime == "mlmkit" and m > MAX_MICROBATCHES:   # simulated action by action
                        reason = (f"{hw.name} simulates a step action by action, for at most {MAX_MICROBATCHES} "
                                  f"microbatches (micro_batch_size={b} x dp={d} makes {m}); use larger microbatches")
                        if reason not in refused:
                            refused.append(reason)
                        continue
                    for sched, v in schedule_options(p):
                        if sched == "interleaved-1f1b" and (m < p or m % p or model.layers < p * v):
                            continue
                        # mlmkit's own runtime runs (and simulates) the schedule itself: its rules decide
                        # (interleaved 1F1B there needs layers divisible by pp x chunks; Megatron-LM's
                        # uneven pipeline layouts are priced on the GPU presets)
                        if ((sched not in MEGATRON_SCHEDULES or hw.runtime == "mlmkit")
                                and not schedulable(sched, p, m, v)):
                            continue
                        for rc in options("recompute", ["none", "selective", "full"]):
                            for zero in options("zero", [1, 3] if d * cp > 1 else [1]):
                                for ep in eps:
                                    if (t * cp * d) % ep or not splittable(t, cp, p, v, ep):
                                        continue
                                    out.append(Layout(tp=t, cp=cp, pp=p, dp=d, ep=ep, chunks=v, schedule=sched,
                                                      micro_batch_size=b, recompute=rc, zero=zero,
                                                      sequence_parallel=sp))
    if not out and refused:
        raise ValueError(f"plan: no layout of {gpus} GPUs runs this job (constraints "
                         f"{ {k: v for k, v in fixed.items() if v is not None} or 'none'}): {refused[0]}"
                         + (f" (and {len(refused) - 1} other reason(s))" if len(refused) > 1 else ""))
    return out


def _why_no_layout(model: GPTConfig, hw: Hardware, *, gpus: int, global_batch_size: int, seq_len: int,
                   fixed: dict) -> str:
    """Which constraint leaves no layout, and what would: the divisibility rules first, then each
    constraint tried alone."""
    given = {k: v for k, v in fixed.items() if v is not None}
    g = given.get
    rules = []
    for name in ("tp", "cp", "pp", "dp"):
        if g(name) and gpus % g(name):
            rules.append(f"{name}={g(name)} does not divide the {gpus} GPUs")
    if g("tp") and model.heads % g("tp"):
        rules.append(f"tp={g('tp')} does not divide the {model.heads} attention heads")
    if g("pp") and g("pp") > model.layers:
        rules.append(f"pp={g('pp')} is more stages than the {model.layers} layers")
    if g("dp") and global_batch_size % g("dp"):
        rules.append(f"dp={g('dp')} does not divide global_batch_size={global_batch_size}")
    if g("micro_batch_size") and global_batch_size % (g("micro_batch_size") * (g("dp") or 1)):
        rules.append(f"micro_batch_size={g('micro_batch_size')}" + (f" x dp={g('dp')}" if g("dp") else "")
                     + f" does not divide global_batch_size={global_batch_size}")
    named = [n for n in ("tp", "cp", "pp", "dp") if g(n)]
    product = math.prod(g(n) for n in named)
    if len(named) > 1 and gpus % product and all(gpus % g(n) == 0 for n in named):
        rules.append(f"{' x '.join(named)} = {product} does not divide the {gpus} GPUs")
    elif len(named) == 4 and product != gpus:
        rules.append(f"tp x cp x pp x dp = {product}, not the {gpus} GPUs")
    chunks, sched = g("chunks"), g("schedule")
    if chunks and chunks > 1 and sched in ("1f1b", "gpipe", "zb-h1"):
        rules.append(f"schedule={sched!r} runs one model chunk per rank: chunks={chunks} needs schedule="
                     f"'interleaved-1f1b'" + (" (or a V schedule, chunks=2)" if hw.runtime == "mlmkit" else ""))
    if chunks == 1 and sched in ("interleaved-1f1b", "zb-v", "dualpipev"):
        rules.append(f"schedule={sched!r} runs several model chunks per rank: chunks=1 is '1f1b'")
    if chunks and chunks > 1 and sched in ("zb-v", "dualpipev") and chunks != 2:
        rules.append(f"schedule={sched!r} runs exactly 2 chunks per rank (the V), not chunks={chunks}")
    if chunks and chunks > 1 and (g("pp") or 1) * chunks > model.layers:
        rules.append(f"pp={g('pp') or 1} x chunks={chunks} virtual stages are more than the {model.layers} layers")
    if rules:
        return "; ".join(rules)
    if not given:
        return (f"no tp (dividing the {model.heads} heads) x cp x pp (at most the {model.layers} layers) x dp "
                f"(dividing the global batch of {global_batch_size}) makes {gpus} GPUs; change the GPU count or the "
                f"global batch")
    def leaves_none(key: str, value) -> bool:
        try:
            return not search_space(model, hw, gpus=gpus, global_batch_size=global_batch_size, seq_len=seq_len,
                                    **{key: value})
        except ValueError:           # refused for a reason of its own: no layout either
            return True

    alone = [f"{k}={v!r}" for k, v in given.items() if leaves_none(k, v)]
    if alone:
        return (f"no layout takes {' nor '.join(alone)} (the degrees must divide the GPUs and the model, the "
                f"microbatches the global batch, and interleaving needs a multiple of pp microbatches); relax "
                f"{'it' if len(alone) == 1 else 'them'} or change the GPU count")
    return ("each constraint alone leaves layouts, together they leave none (the degrees must multiply to the "
            "GPUs, the microbatches divide the global batch, and interleaving needs a multiple of pp "
            "microbatches); relax one of them or change the GPU count")


def check_job(*, gpus: object, global_batch_size: object) -> None:
    """ValueError unless the GPU count and the global batch are positive integers."""
    for name, value in (("gpus", gpus), ("global_batch_size", global_batch_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"plan: {name}={value!r} must be a positive integer")


def check_request(*, gpus: object, global_batch_size: object, seq_len: object = None, top: object = None,
                  **constraints) -> None:
    """ValueError naming the first value of a :func:`plan` request that no search can take (the
    command line calls it before it spends half a minute calibrating ``local-cpu``)."""
    check_job(gpus=gpus, global_batch_size=global_batch_size)
    check_seq_len(seq_len)
    if top is not None and (isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 0):
        raise ValueError(f"plan: top={top!r} must be a positive integer (0 or None: every layout)")
    _check_constraints(constraints)


def _check_constraints(constraints: dict) -> None:
    unknown = sorted(set(constraints) - set(_CONSTRAINTS))
    if unknown:
        raise ValueError(f"plan: unknown constraint(s) {unknown}; expected some of {', '.join(_CONSTRAINTS)}")
    check_layout_fields(**{k: v for k, v in constraints.items() if v is not None})


def plan(model: Union[GPTConfig, str], *, gpus: int, gpu="h100-sxm", global_batch_size: int,
         seq_len: Optional[int] = None, flash_attention: bool = True, top: Optional[int] = None, **constraints):
    """Ranked layouts for training ``model`` (a :class:`GPTConfig` or a preset's name, as
    ``"llama3-70b"``) on ``gpus`` GPUs of type ``gpu`` (a preset name of
    :data:`mlmkit.plan.GPUS` or a :class:`Hardware`), with ``global_batch_size`` sequences of
    ``seq_len`` tokens (default: the model's) per step. ``constraints`` fix any of tp, cp, pp, dp,
    ep, chunks, schedule, micro_batch_size, recompute, zero, sequence_parallel (default on).
    Returns a DataFrame (:data:`COLUMNS`): its ``top`` best rows when ``top`` is a positive integer
    (0 or None: every layout)."""
    import pandas as pd

    model = model_config(model)
    hw = hardware(gpu)
    check_request(gpus=gpus, global_batch_size=global_batch_size, seq_len=seq_len, top=top, **constraints)
    flash_attention = check_flash_attention(flash_attention, what="plan")
    s = seq_len or model.seq_len
    if s != model.seq_len:
        from dataclasses import replace

        model = replace(model, seq_len=s)
    layouts = search_space(model, hw, gpus=gpus, global_batch_size=global_batch_size, seq_len=s, **constraints)
    if not layouts:
        given = f"with constraints {constraints}" if constraints else "without constraints"
        raise ValueError(f"plan: no layout of {gpus} GPUs divides this job {given} "
                         f"(global_batch_size={global_batch_size}, heads={model.heads}, layers={model.layers}): "
                         + _why_no_layout(model, hw, gpus=gpus, global_batch_size=global_batch_size, seq_len=s,
                                          fixed=constraints))
    rows = [_predict(model, hw, lay, global_batch_size, s, flash_attention) for lay in layouts]
    df = pd.DataFrame(rows, columns=COLUMNS)
    fitting = df[df.fits].sort_values("tokens_per_s", ascending=False, kind="stable")
    too_big = df[~df.fits].sort_values(["memory_per_gpu_bytes", "tokens_per_s"], ascending=[True, False], kind="stable")
    df = pd.concat([fitting, too_big]).reset_index(drop=True)
    df.index.name = "rank"
    return df.head(top) if top else df


@functools.lru_cache(maxsize=None)
def _cached(model, hw, layout, global_batch_size, s, flash_attention):
    return predict(model, hw, layout, global_batch_size=global_batch_size, seq_len=s, flash_attention=flash_attention)


def _predict(model, hw, layout, global_batch_size, s, flash_attention) -> dict:
    return _cached(model, hw, layout, global_batch_size, s, flash_attention)
