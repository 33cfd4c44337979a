"""Every field of every config and every option of the estimators, swept with values no run can have
(None, negatives, zero, fractions, strings, NaN, infinities, bools, huge numbers, lists, dicts): each
either makes a valid object, with a value of the field's declared type, or raises a ValueError that
names the field. Never another exception (a TypeError deep inside, an unnamed unpacking error), never
a value of another type taken (a string read as true), and never minutes of work before the error.

The hand-picked cases beside each module (test_topology, test_model_options, test_schedules,
test_plan, test_trace_estimate) hold the exact messages; this sweep holds the rule for every field,
the ones added later included. It found: Hardware's calibration tables failing with "not iterable",
estimate_memory reading sequence_parallel="no" as true, estimate_comm estimating placement="V" as a
loop, and make_schedule building stages=10**9 for 37 s before a MemoryError."""

import dataclasses
import inspect
import math

import pytest

from mlmkit import Topology
from mlmkit.estimate import estimate_comm, estimate_memory
from mlmkit.model import GPTConfig
from mlmkit.model.presets import preset
from mlmkit.pipeline import Schedule, from_torch, make_schedule, schedule_from_table, simulate, to_torch_csv, validate
from mlmkit.pipeline.simulate import Costs
from mlmkit.plan import Hardware, Layout, hardware, plan, predict
from mlmkit.train import TrainConfig

BAD = [None, -1, 0, 1.5, -0.5, "x", float("nan"), float("inf"), True, 10**9, [], {}]
MODEL = dict(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2)


def _of_type(annotation: str, value) -> bool:
    """Whether ``value`` is of the declared type (as the annotation's text reads; True where no rule)."""
    optional = annotation.startswith("Optional[")
    kind = annotation[len("Optional["):-1] if optional else annotation
    if value is None:
        return optional or kind not in ("bool", "int", "float", "str", "tuple")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"bool": isinstance(value, bool), "int": number and isinstance(value, int),
            "float": number and math.isfinite(value), "str": isinstance(value, str),
            "tuple": isinstance(value, (tuple, list))}.get(kind, True)


def _annotations(target) -> dict:
    if dataclasses.is_dataclass(target):
        return {f.name: str(f.type) for f in dataclasses.fields(target)}
    return {k: str(p.annotation) for k, p in inspect.signature(target).parameters.items()}


def _outcomes(make, base: dict, fields, annotations: dict) -> list[str]:
    """What ``make(**{**base, field: value})`` does wrong for each field and bad value: an exception
    other than a ValueError naming the field, or a value not of the field's declared type taken
    (``sequence_parallel="no"`` read as true)."""
    wrong = []
    for field in fields:
        for value in BAD:
            try:
                made = make(**{**base, field: value})
                # a config's stored value (TrainConfig keeps recompute=True, the old flag, as "full")
                kept = getattr(made, field, value) if dataclasses.is_dataclass(made) else value
                if not _of_type(annotations.get(field, ""), kept):
                    wrong.append(f"{field}={value!r} taken as {kept!r}, but the field is {annotations[field]}")
            except ValueError as e:
                if field not in str(e).lower():                     # "1000 GPUs" names gpus
                    wrong.append(f"{field}={value!r}: ValueError without the field's name: {e}")
            except Exception as e:                                   # noqa: BLE001 (the sweep's point)
                wrong.append(f"{field}={value!r}: {type(e).__name__}: {e}")
    return wrong


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _predict(**layout):
    predict(preset("llama3-8b"), hardware("h100-sxm"), Layout(**layout), global_batch_size=64, seq_len=1024)


_1F1B = make_schedule("1f1b", stages=2, microbatches=4)
_TABLE = [dict(rank=r, kind=a.kind, microbatch=a.microbatch) for r in range(2) for a in _1F1B.compute_actions(r)]


def _from_torch(**options):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return validate(from_torch(to_torch_csv(_1F1B, f"{tmp}/s.csv"), **options))


# name: (make, a valid base, the fields swept, where their declared types are read)
CASES = {
    "GPTConfig": (GPTConfig, MODEL, _fields(GPTConfig), GPTConfig),
    "TrainConfig": (TrainConfig, dict(model=GPTConfig(**MODEL)), _fields(TrainConfig), TrainConfig),
    "Topology": (Topology, {}, ["tp", "pp", "dp", "cp", "ep", "expert_tp"], Topology),
    "Costs": (Costs, {}, _fields(Costs), Costs),
    "Hardware": (Hardware, {f: getattr(hardware("h100-sxm"), f) for f in _fields(Hardware)}, _fields(Hardware),
                 Hardware),
    "Layout (predict)": (_predict, dict(tp=2, cp=1, pp=2, dp=2, ep=1, chunks=1, schedule="1f1b", micro_batch_size=1,
                                        recompute="none", zero=1, sequence_parallel=True), _fields(Layout), Layout),
    "make_schedule": (lambda **k: make_schedule(k.pop("name"), **k), dict(name="1f1b", stages=2, microbatches=4),
                      ["stages", "microbatches", "chunks", "layers", "microbatch_group"], make_schedule),
    # a schedule written by hand, read from torch's CSV, or built field by field, and its simulation
    "schedule_from_table": (lambda **k: validate(schedule_from_table(_TABLE, **k)), dict(add_communication=True),
                            ["stages", "microbatches", "chunks", "name", "add_communication", "placement"],
                            schedule_from_table),
    "from_torch": (_from_torch, {}, ["microbatches", "name"], from_torch),
    "Schedule": (lambda **k: validate(Schedule(actions=_1F1B.actions, **k)),
                 dict(name="mine", stages=2, microbatches=4, chunks=1, placement="loop"),
                 ["name", "stages", "microbatches", "chunks", "placement"], Schedule),
    "simulate": (lambda **k: simulate(_1F1B, Costs(), **k), {}, ["cores"], simulate),
    "plan": (lambda **k: plan("llama3-8b", **k), dict(gpus=8, gpu="h100-sxm", global_batch_size=16, seq_len=512),
             ["gpus", "gpu", "global_batch_size", "seq_len", "flash_attention", "top"], plan),
    "estimate_memory": (lambda **k: estimate_memory(GPTConfig(**MODEL), Topology(pp=2, dp=2), **k),
                        dict(micro_batch_size=2, microbatches=4, precision="fp32"),
                        ["micro_batch_size", "microbatches", "schedule", "chunks", "sequence_parallel", "recompute",
                         "zero1", "precision", "implementation", "layers_per_stage", "microbatch_group", "zero",
                         "prefetch", "reshard_after_forward", "per_token_loss"], estimate_memory),
    "estimate_comm": (lambda **k: estimate_comm(GPTConfig(**MODEL), Topology(pp=2, dp=2), **k),
                      dict(micro_batch_size=2, microbatches=4, precision="fp32"),
                      ["micro_batch_size", "microbatches", "chunks", "sequence_parallel", "recompute", "zero1",
                       "precision", "bucket_bytes", "grad_reduce", "layers_per_stage", "placement", "zero",
                       "reshard_after_forward"], estimate_comm),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_field_refuses_bad_values_by_name(case):
    make, base, fields, declared = CASES[case]
    make(**base)                                                   # the base itself is valid
    wrong = _outcomes(make, base, fields, _annotations(declared))
    assert not wrong, "\n".join(wrong)
