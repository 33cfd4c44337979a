"""Schedules to and from PyTorch's pipelining runtime (``torch.distributed.pipelining``, used by
torchtitan), so a schedule prototyped here can leave the notebook, and torch's schedules can be
simulated, drawn, stepped and executed here.

PyTorch writes a schedule as one CSV row per rank of actions ``{stage}{kind}{microbatch}``, e.g.
``0F1,0I0,0W0`` (``_PipelineScheduleRuntime._load_csv`` / ``_dump_csv``). The vocabularies match:
mlmkit's virtual stage is torch's stage index; ``F`` forward, ``B`` full backward, ``I`` backward
for inputs, ``W`` backward for weights.

Written in the ``"compute_comms"`` format, the messages are spelled out too: ``{stage}SEND_F{mb}``
(mlmkit's SEND_ACT), ``RECV_F`` (RECV_ACT), ``SEND_B`` (SEND_GRAD), ``RECV_B`` (RECV_GRAD), in the
order of mlmkit's batch plan (torch pairs the messages between two ranks in posting order, without
tags; see :func:`torch_rows`), and each stage's ``{stage}REDUCE_GRAD`` after its last backward (B
or W), where torch's own lowering puts it: that action scales the gradients by 1/m, so a
``compute_comms`` file without it gives gradients m times too large in torch's runtime.

Read back (:func:`from_torch`, from an instance or from a CSV file, torch's ``_dump_csv`` included),
torch's overlapped ``OVERLAP_F_B`` actions (DualPipeV; ``(0F3;3B1)OVERLAP_F_B`` in a file) become their
forward and backward one after the other; its FSDP and gradient-reduction bookkeeping
(``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) is dropped, and the messages are inserted as mlmkit's
generators insert them.

Written out, a schedule must also suit torch's runtime where it is narrower than mlmkit's executor:
the last virtual stage must run its forwards in microbatch order (torch finds a microbatch's loss
by position; see :func:`_check_loss_order`). Found by running random valid schedules in both.

Pure planning code: actions are read from their text (``str(action)``), torch is not imported.
"""

from __future__ import annotations

import csv
import os
import re
from typing import Optional, Union

from mlmkit.pipeline.batching import plan_batches
from mlmkit.pipeline.schedule import Schedule, ScheduleError, _check_int, schedule_from_table
from mlmkit.pipeline.validate import validate

__all__ = ["from_torch", "to_torch_csv", "torch_rows"]

_COMM_TO_TORCH = {"SEND_ACT": "SEND_F", "RECV_ACT": "RECV_F", "SEND_GRAD": "SEND_B", "RECV_GRAD": "RECV_B"}
_ACTION = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")


def torch_rows(schedule: Schedule, *, format: str = "compute_only") -> list[list[str]]:
    """Per rank, the schedule's actions in torch's notation (``"0F1"``, ``"1SEND_F0"``, ...)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected an mlmkit Schedule, got {type(schedule).__name__} {schedule!r:.60}: build one with "
                        f"mlmkit.pipeline.make_schedule(name, stages=..., microbatches=...)")
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(f"format={format!r}: expected 'compute_only' or 'compute_comms'")
    # torch's runtime runs what it is given: a schedule that cannot run right is refused here, with
    # the rank, the action and the reason, rather than as a hang or wrong gradients there.
    validate(schedule)
    _check_loss_order(schedule)
    if format == "compute_comms":
        # torch's runtime posts each message without a tag: messages between two ranks pair in the
        # order they are posted. mlmkit's action order is only right with tags (a V placement sends a
        # rank's activations and gradients to one peer in another order than the peer receives them:
        # torch would swap equal-shaped messages silently), so the messages are written in the order
        # of mlmkit's batch plan, which pairs in order by construction (NCCL's semantics).
        plan = plan_batches(schedule)
        orders = [[schedule.actions[r][i] for step in plan.steps[r] for i in step.actions]
                  for r in range(schedule.stages)]
    else:
        orders = schedule.actions
    rows = []
    for r, acts in enumerate(orders):
        row, backwards = [], {}
        for a in acts:
            vs = schedule.virtual_stage(r, a.chunk)
            if a.kind in ("F", "B", "I", "W"):
                row.append(f"{vs}{a.kind}{a.microbatch}")
                if format == "compute_comms" and a.kind in ("B", "W"):
                    # torch's own lowering (_add_reduce_grad) puts REDUCE_GRAD after a stage's m-th
                    # B or W: it scales the gradients by 1/m (and reduces them over data parallelism)
                    backwards[vs] = backwards.get(vs, 0) + 1
                    if backwards[vs] == schedule.microbatches:
                        row.append(f"{vs}REDUCE_GRAD")
            elif format == "compute_comms":
                row.append(f"{vs}{_COMM_TO_TORCH[a.kind]}{a.microbatch}")
        rows.append(row)
    return rows


def _check_loss_order(schedule: Schedule) -> None:
    """torch's runtime keeps the last stage's losses in a list, in the order of its forwards, and
    gives the backward of microbatch ``i`` the ``i``-th (``_maybe_get_loss``): a last stage whose
    forwards run out of microbatch order runs each backward from another microbatch's loss. Its
    gradients are then silently wrong (a 2-stage schedule whose last stage runs F1 before F0: the
    same loss, gradients 0.38 off), or it stops with "Loss for microbatch 3 is not available" while
    its peers wait. mlmkit's executor keys each loss by its microbatch and runs any valid order."""
    rank, chunk = schedule.rank_of(schedule.virtual_stages - 1)
    order = [(i, a) for i, a in enumerate(schedule.actions[rank]) if a.kind == "F" and a.chunk == chunk]
    for k, (i, a) in enumerate(order):
        if a.microbatch != k:
            raise ScheduleError(
                f"torch's runtime takes microbatch k's loss from the last stage's k-th forward, and this last "
                f"stage runs its forwards in the order {[b.microbatch for _, b in order]}: it would run backwards "
                f"from other microbatches' losses (wrong gradients, or a stop half-way). Run the last virtual "
                f"stage's forwards in microbatch order (its backwards may come in any), or run the schedule in "
                f"mlmkit's executor", rank=rank, index=i, action=a)


def to_torch_csv(schedule: Schedule, path: str, *, format: str = "compute_only") -> str:
    """Write ``schedule`` as torch's CSV (``_PipelineScheduleRuntime._load_csv(path, format)``);
    returns ``path``."""
    rows = torch_rows(schedule, format=format)     # first: a refused call leaves an existing file as it was
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def _parse(text: str) -> Optional[tuple[int, str, Optional[int]]]:
    m = _ACTION.match(text.strip())
    if m is None:
        raise ScheduleError(f"{text!r} is not an action of torch's pipeline notation (e.g. '0F1', '1W0')")
    return int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None


_OVERLAP = re.compile(r"^\((.*)\)\s*([A-Z_]+)$")


def _sub_actions(cell: str) -> list[str]:
    """A CSV cell's actions: ``(0F3;3B1)OVERLAP_F_B`` (torch's ``_dump_csv`` of DualPipeV, an overlapped
    forward and backward) is its sub-actions in their order; any other cell is itself."""
    m = _OVERLAP.match(cell.strip())
    if m is None:
        return [cell]
    subs = [sub for sub in m.group(1).split(";") if sub.strip()]
    if not subs:
        raise ScheduleError(f"{cell.strip()!r} holds no action between its parentheses (torch writes an "
                            f"overlapped pair as '(0F3;3B1)OVERLAP_F_B')")
    return subs


def _torch_order(source) -> list[list[str]]:
    """Per rank, the compute actions of a CSV file or of a torch schedule's ``pipeline_order``."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, newline="") as f:
            return [[sub for cell in row if cell.strip() for sub in _sub_actions(cell)] for row in csv.reader(f)]
    order = getattr(source, "pipeline_order", None)
    if order is None:
        raise ScheduleError(f"{type(source).__name__} has no pipeline_order: pass a CSV file or a torch "
                            f"PipelineScheduleMulti / _PipelineScheduleRuntime instance")
    rows = []
    for rank in sorted(order):
        row = []
        for action in order[rank]:
            if action is None:
                continue
            subs = getattr(action, "sub_actions", None)
            row += [str(a) for a in subs] if subs else [str(action)]   # OVERLAP_F_B: F then B
        rows.append(row)
    return rows


def from_torch(source: Union[str, os.PathLike, object], *, name: str = "torch",
               microbatches: Optional[int] = None) -> Schedule:
    """An mlmkit :class:`Schedule` from torch's CSV file (path) or a torch schedule instance.

    The stage-to-rank placement (torch's "loop" or "v") is read from where the stages' actions
    appear; sends and receives are inserted as mlmkit's generators do, so the result runs in
    mlmkit's executor (either communication path). Validate it with :func:`mlmkit.pipeline.validate`.
    """
    if microbatches is not None:
        _check_int("microbatches", microbatches)
    if not isinstance(name, str):
        raise ScheduleError(f"name={name!r} must be a string")
    rows = _torch_order(source)
    p = len(rows)
    stage_rank: dict[int, int] = {}
    compute = []
    for r, row in enumerate(rows):
        for cell in row:
            stage, kind, mb = _parse(cell)
            if kind not in ("F", "B", "I", "W"):
                continue
            if mb is None:
                raise ScheduleError(f"rank {r}'s {cell.strip()!r} names no microbatch: a compute action is "
                                    f"{{stage}}{kind}{{microbatch}}, e.g. '{stage}{kind}0'")
            if stage_rank.setdefault(stage, r) != r:
                raise ScheduleError(f"stage {stage} appears on ranks {stage_rank[stage]} and {r}")
            compute.append((r, kind, mb, stage))
    if not compute:
        raise ScheduleError("the torch schedule has no compute action")
    n_stages = 1 + max(stage_rank)
    if n_stages % p:
        raise ScheduleError(f"{n_stages} stages on {p} ranks: every rank must hold the same number of stages")
    v = n_stages // p
    placement = "loop"
    if all(stage_rank[s] == s % p for s in stage_rank):
        placement = "loop"
    elif v == 2 and all(stage_rank[s] == (s if s < p else 2 * p - 1 - s) for s in stage_rank):
        placement = "v"
    else:
        raise ScheduleError("the stages are placed neither in a loop (stage s on rank s % p) nor in a V "
                            "(2 stages per rank, stage s on rank s or 2p-1-s)")

    def chunk_of(stage: int) -> int:
        return stage // p if placement == "loop" else (0 if stage < p else 1)

    table = [{"rank": r, "kind": kind, "microbatch": mb, "chunk": chunk_of(stage)} for r, kind, mb, stage in compute]
    m = microbatches if microbatches is not None else 1 + max(row["microbatch"] for row in table)
    return schedule_from_table(table, stages=p, microbatches=m, chunks=v, name=name, add_communication=True,
                               placement=placement)
