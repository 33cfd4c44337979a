"""TrainConfig: one validated object for a training run, shared by notebooks and `torchrun -m mlmkit.train`."""

from __future__ import annotations

import csv
import json
import numbers
import os
from dataclasses import asdict, dataclass, replace
from typing import Optional

from mlmkit.model.config import GPTConfig, check_keys
from mlmkit.pipeline.schedule import MAX_MICROBATCHES, SCHEDULES, V_SCHEDULES, Schedule, ScheduleError, make_schedule
from mlmkit.scalars import plain_bool
from mlmkit.topology import Topology

__all__ = ["TOKENIZER_VOCAB", "TrainConfig", "check_corpus", "demo_config", "is_schedule_file"]

#: Vocabulary of the byte tokenizer the trainer uses (:class:`mlmkit.train.data.ByteTokenizer`).
TOKENIZER_VOCAB = 256


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"TrainConfig: {name}={value!r} must be an integer >= {minimum}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"TrainConfig: {name}={value!r} must be true or false (a bool, not "
                         f"{type(value).__name__}); in a JSON config write true/false without quotes")


_INT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "expert_tp", "chunks", "microbatch_group", "micro_batch_size",
               "global_batch_size", "zero", "prefetch", "bucket_bytes", "warmup_steps", "max_steps", "seed")
_FLOAT_FIELDS = ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs; invalid combinations raise ValueError on construction.

    ``global_batch_size = micro_batch_size * microbatches * dp``: each step every dp replica takes
    ``global_batch_size / dp`` samples, cut into ``microbatches`` microbatches of
    ``micro_batch_size`` samples that flow through the pipeline schedule. The cp ranks of a
    replica share its samples, each holding ``seq_len / cp`` tokens of every sequence.
    """

    model: GPTConfig
    """The model (its vocab_size must cover the tokenizer's: 256 for the byte tokenizer)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over ``cp`` ranks and attention runs as ring
    attention (:mod:`mlmkit.context_parallel`). Needs ``dropout=0`` and ``seq_len`` divisible by
    ``2 cp`` (times tp with sequence parallelism)."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): each ep rank holds experts/ep experts;
    the expert ranks fold the dense layers' tp x cp x dp ranks of a stage (Megatron-Core's grid)."""
    expert_tp: int = 1
    """Tensor-parallel degree inside each expert."""
    cp_split: str = "balanced"
    """How the sequence is divided over cp ranks: ``"balanced"`` (2 cp chunks, rank i holds chunks
    i and 2cp-1-i, as Megatron-LM does) or ``"naive"`` (cp contiguous pieces; unequal work, for
    comparison)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v or dualpipev (with pp=1 it is
    gradient accumulation), or a schedule of one's own: the path of a CSV file in PyTorch's pipeline
    format (``0F0,0F1,0I0,0W0,...``, one line per rank; either of torch's formats), such as
    :func:`mlmkit.pipeline.to_torch_csv` writes. The file is read and checked when the config is made
    (it must run ``pp`` ranks, ``chunks`` chunks per rank in a loop or a V, and this config's
    microbatches) and its path kept absolute; the config carries the schedule read, so engines
    and resumed sessions run the order that was checked. See :meth:`pipeline_schedule`."""
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved-1f1b: 2 or more; zb-v and dualpipev: 2, in a V)."""
    microbatch_group: Optional[int] = None
    """interleaved-1f1b: microbatches per group (Megatron-LM's microbatch_group_size_per_vp_stage;
    default pp). A group larger than pp allows microbatch counts that pp does not divide."""
    micro_batch_size: int = 4
    """Samples per microbatch."""
    global_batch_size: int = 8
    """Samples per optimizer step over all replicas."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout regions along the sequence (needs tp > 1 to matter)."""
    recompute: str = "none"
    """Activation recomputation: ``"none"``, ``"selective"`` (the attention core, Korthikanti et al.
    2022) or ``"full"`` (each Transformer layer). ``True``/``False`` are read as full/none."""
    zero1: bool = False
    """Shard optimizer state over dp (ZeRO-1 / distributed optimizer); an alias of ``zero=1``."""
    zero: int = 0
    """ZeRO stage over the dp (x cp) replicas: 0 replicated, 1 optimizer state sharded, 2 also the
    gradients, 3 also the parameters (gathered per layer when used; FSDP). See
    :mod:`mlmkit.data_parallel.zero`."""
    prefetch: int = 0
    """ZeRO-3: layers gathered ahead of use (0 or 1)."""
    reshard_after_forward: bool = True
    """ZeRO-3: free a layer's gathered parameters after its forward (and gather it again for its
    backward); ``False`` keeps them whole until the optimizer step."""
    bucket_bytes: int = 25 * 2**20
    """Size of the dp gradient all-reduce buckets."""
    lr: float = 3e-3
    """Peak learning rate, reached after ``warmup_steps``."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 5
    """Linear warm-up steps (from lr/warmup_steps at step 0 to lr)."""
    max_steps: int = 50
    """Steps of the cosine schedule (training may stop earlier)."""
    weight_decay: float = 0.0
    """AdamW weight decay, on the matrices and embeddings, not on biases and norm gains (Megatron-LM's
    default: :func:`mlmkit.data_parallel.optimizer.decayed`)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping, as in Megatron-LM)."""
    seed: int = 0
    """Seed of the data order."""
    corpus: Optional[str] = None
    """Text file to train on (default: the small corpus shipped in mlmkit/data)."""
    tracing: bool = True
    """Record per-rank traces (compute, communication)."""
    per_token_loss: bool = True
    """Loss = sum of token losses / non-ignored tokens of the whole global batch (Megatron-LM's
    per-token loss), so ignored targets weigh the same in every layout. ``False``: the mean of the
    microbatches' means (differs from the serial model when microbatches hold different numbers
    of non-ignored targets)."""
    batch_p2p: Optional[bool] = None
    """Pipeline communication as planned batches without tags (NCCL's way); ``None``: on with
    NCCL, off with gloo. See :mod:`mlmkit.pipeline.batching`."""
    precision: str = "fp32"
    """``"fp32"``, or ``"bf16"``: Megatron-LM's mixed precision (bf16 parameters and compute, fp32
    gradients accumulated across microbatches, fp32 master weights and Adam state; loss and
    softmax in fp32). See :mod:`mlmkit.data_parallel.mixed_precision`."""
    grad_reduce: str = "fp32"
    """Dtype of the data-parallel gradient reduction: ``"fp32"`` (Megatron-LM's default) or
    ``"bf16"`` (half the bytes, bf16 only)."""

    def __post_init__(self) -> None:
        # Whole numbers from a DataFrame or numpy (a plan's rows) are numpy integers: taken as the
        # Python ints they equal (the checks below, the JSON of to_dict and every repr want ints).
        for name in _INT_FIELDS + _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
                object.__setattr__(self, name, float(value))
        for name in ("sequence_parallel", "zero1", "tracing", "per_token_loss", "reshard_after_forward", "batch_p2p",
                     "recompute"):           # numpy's bools (a DataFrame's boolean column) as bools
            object.__setattr__(self, name, plain_bool(getattr(self, name)))
        if not isinstance(self.model, GPTConfig):
            raise ValueError(f"TrainConfig.model must be a GPTConfig, got {type(self.model).__name__}")
        if all(type(d) is int for d in (self.ep, self.expert_tp)) and not self.model.moe:
            self.model.check_parallel(ep=self.ep, expert_tp=self.expert_tp)   # before the expert grid's arithmetic
        topo = self.topology  # validates degrees
        for name in ("chunks", "micro_batch_size", "global_batch_size", "max_steps", "bucket_bytes"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        for name in ("sequence_parallel", "zero1", "tracing", "per_token_loss", "reshard_after_forward"):
            _check_bool(name, getattr(self, name))
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in (0, 1, 2, 3):   # not 2.0
            raise ValueError(f"TrainConfig: zero={self.zero!r} must be a ZeRO stage 0, 1, 2 or 3")
        if self.zero1 and self.zero not in (0, 1):
            raise ValueError(f"TrainConfig: zero1=True asks for stage 1 but zero={self.zero}: give only zero={self.zero}")
        object.__setattr__(self, "zero", 1 if self.zero1 else self.zero)
        object.__setattr__(self, "zero1", self.zero == 1)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch not in (0, 1):
            raise ValueError(f"TrainConfig: prefetch={self.prefetch!r} must be 0 or 1 (layers gathered ahead)")
        if self.zero < 3 and (self.prefetch or not self.reshard_after_forward):
            raise ValueError(f"TrainConfig: prefetch and reshard_after_forward apply to zero=3 only (zero={self.zero}); "
                             f"set zero=3 or leave them at their defaults")
        if self.zero >= 2 and self.model.moe:
            raise ValueError(f"TrainConfig: zero={self.zero} shards dense models only (experts={self.model.experts}); "
                             f"use zero=1 with a mixture of experts")
        if isinstance(self.recompute, bool):       # the old flag: full or none
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"TrainConfig: recompute={self.recompute!r} must be 'none', 'selective' (the attention "
                             f"core) or 'full' (each layer)")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig: precision={self.precision!r} must be 'fp32' or 'bf16'")
        if self.grad_reduce not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig: grad_reduce={self.grad_reduce!r} must be 'fp32' or 'bf16'")
        if self.grad_reduce == "bf16" and self.precision != "bf16":
            raise ValueError("TrainConfig: grad_reduce='bf16' needs precision='bf16' (fp32 training reduces fp32 "
                             "gradients)")
        if self.batch_p2p is not None:
            _check_bool("batch_p2p", self.batch_p2p)
        for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ValueError(f"TrainConfig: {name}={v!r} must be a number")
            if v in (float("inf"), float("-inf")):
                raise ValueError(f"TrainConfig: {name}={v!r} must be a finite number")
        if self.grad_clip < 0:
            raise ValueError(f"TrainConfig: grad_clip={self.grad_clip} must be >= 0 (a negative clip turns the "
                             f"update into gradient ascent); use 0 to switch clipping off")
        if self.eps <= 0:
            raise ValueError(f"TrainConfig: eps={self.eps} must be > 0 (it keeps Adam's division finite); "
                             f"the usual value is 1e-8")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TrainConfig: {name}={getattr(self, name)} must be in [0, 1) "
                                 f"(Adam's moving-average coefficient; typical: beta1=0.9, beta2=0.95)")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig: weight_decay={self.weight_decay} must be >= 0")
        if isinstance(self.corpus, os.PathLike):      # a pathlib.Path: the str it names (the JSON of to_dict)
            object.__setattr__(self, "corpus", os.fspath(self.corpus))
        if self.corpus is not None and not isinstance(self.corpus, str):
            raise ValueError(f"TrainConfig: corpus={self.corpus!r} must be a file path (str) or None")
        if self.model.vocab_size < TOKENIZER_VOCAB:
            raise ValueError(
                f"TrainConfig: model.vocab_size={self.model.vocab_size} is smaller than the byte tokenizer's "
                f"vocabulary ({TOKENIZER_VOCAB}): token ids up to {TOKENIZER_VOCAB - 1} would be out of range. "
                f"Use vocab_size >= {TOKENIZER_VOCAB}.")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size x dp = "
                f"{self.micro_batch_size} x {self.dp} = {per_step}; use a multiple of {per_step} "
                f"(e.g. {max(per_step, self.global_batch_size // per_step * per_step)})."
            )
        if self.microbatches > MAX_MICROBATCHES:
            raise ValueError(
                f"TrainConfig: global_batch_size={self.global_batch_size} makes {self.microbatches} microbatches per "
                f"step (micro_batch_size={self.micro_batch_size} x dp={self.dp} samples each), more than the "
                f"{MAX_MICROBATCHES} a step's schedule is planned for (action by action: about 2.5 kB per "
                f"microbatch and stage, built before the first step); raise micro_batch_size or dp, or lower "
                f"global_batch_size")
        if isinstance(self.schedule, os.PathLike):       # a pathlib.Path: the str it names (the JSON of to_dict)
            object.__setattr__(self, "schedule", os.fspath(self.schedule))
        if not isinstance(self.schedule, str) or (self.schedule not in SCHEDULES and not is_schedule_file(self.schedule)):
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}, or give "
                             f"the path of a CSV file in torch's pipeline format (ending in .csv; "
                             f"mlmkit.pipeline.to_torch_csv writes one)")
        if self.cp_split not in ("balanced", "naive"):
            raise ValueError(f"TrainConfig: cp_split={self.cp_split!r} must be 'balanced' or 'naive'")
        self.model.check_parallel(tp=self.tp, pp=self.pp, chunks=self.chunks, cp=self.cp, cp_split=self.cp_split,
                                  sequence_parallel=self.sequence_parallel, ep=self.ep, expert_tp=self.expert_tp)
        if is_schedule_file(self.schedule):
            object.__setattr__(self, "schedule", os.path.abspath(self.schedule))   # the engines' folder may differ
            object.__setattr__(self, "_schedule_read", self._read_schedule_file())
        else:
            make_schedule(self.schedule, stages=topo.pp, microbatches=self.microbatches, chunks=self.chunks,
                          layers=self.model.layers, microbatch_group=self.microbatch_group)
        if not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig: need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")

    def _read_schedule_file(self) -> Schedule:
        """The schedule of the CSV file ``self.schedule``, checked to be this run's (pp, chunks,
        microbatches) and to run, batched too unless ``batch_p2p=False``; ValueError naming the file and
        the fix otherwise."""
        from mlmkit.pipeline import from_torch, validate

        path = self.schedule
        where = f"TrainConfig: schedule file {path}"
        if self.microbatch_group is not None:
            raise ValueError(f"TrainConfig: microbatch_group={self.microbatch_group} groups the microbatches of the "
                             f"interleaved-1f1b generator; a schedule file already has its order: drop microbatch_group")
        try:
            sched = from_torch(path, name=os.path.basename(path))
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{where} cannot be read: {err.strerror if isinstance(err, OSError) else err}") from None
        except (ScheduleError, csv.Error) as err:
            raise ValueError(f"{where}: {err}") from None
        got = dict(pp=sched.stages, chunks=sched.chunks, microbatches=sched.microbatches)
        want = dict(pp=self.pp, chunks=self.chunks, microbatches=self.microbatches)
        if got != want:
            fixes = []
            if got["pp"] != want["pp"]:
                fixes.append(f"pp={got['pp']}")
            if got["chunks"] != want["chunks"]:
                fixes.append(f"chunks={got['chunks']}")
            if got["microbatches"] != want["microbatches"]:
                per = self.micro_batch_size * self.dp
                fixes.append(f"global_batch_size={got['microbatches'] * per} (microbatches = global_batch_size / "
                             f"(micro_batch_size x dp) = global_batch_size / {per})")
            raise ValueError(f"{where} runs {got['pp']} pipeline ranks with {got['chunks']} chunk(s) each and "
                             f"{got['microbatches']} microbatches; this config has pp={self.pp}, chunks={self.chunks} "
                             f"and {self.microbatches} microbatches: set {', '.join(fixes)}, or write the schedule "
                             f"for this layout")
        try:
            # batched: what batch_p2p=True (NCCL's default) posts, checked unless the config turns it off.
            # NCCL's unbatched path (batch_p2p=False on NCCL: messages matched in send order, no tags) is
            # checked by the executor, which knows the backend; gloo's tags match any order.
            validate(sched, batched=self.batch_p2p is not False)
        except ScheduleError as err:
            raise ValueError(f"{where} cannot run: {err}") from None
        return sched

    def pipeline_schedule(self) -> Schedule:
        """The schedule a step runs: the named generator's for these stages, microbatches and chunks,
        or the file's, as read and checked when the config was made."""
        read = self.__dict__.get("_schedule_read")
        if read is not None:
            return read
        return make_schedule(self.schedule, stages=self.pp, microbatches=self.microbatches, chunks=self.chunks,
                             layers=self.model.layers, microbatch_group=self.microbatch_group)

    @property
    def schedule_file(self) -> bool:
        """True when the schedule is read from a CSV file (:attr:`schedule` is its path)."""
        return is_schedule_file(self.schedule)

    @property
    def placement(self) -> str:
        """How the model chunks sit on the pipeline ranks: ``"loop"`` or ``"v"`` (zb-v, dualpipev, a V file)."""
        if self.schedule_file:
            return self.pipeline_schedule().placement
        return "v" if self.schedule in V_SCHEDULES else "loop"

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep, expert_tp=self.expert_tp,
                        experts=self.model.experts > 0)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def replace(self, **changes) -> "TrainConfig":
        """A copy with some fields changed (``model`` may be given as a dict of GPTConfig changes)."""
        if isinstance(changes.get("model"), dict):
            changes["model"] = replace(self.model, **changes["model"])
        if "zero" in changes and "zero1" not in changes:       # the stage wins over the old alias
            changes["zero1"] = False
        elif "zero1" in changes and "zero" not in changes:
            changes["zero"] = 1 if changes["zero1"] else 0
        return replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        check_keys(cls, data)
        data = dict(data)
        data["model"] = GPTConfig.from_dict(data["model"]) if isinstance(data["model"], dict) else data["model"]
        return cls(**data)

    @classmethod
    def from_file(cls, path: str) -> "TrainConfig":
        """Read a JSON file (same keys as the dataclass; ``model`` is a nested object)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {path}: not valid JSON ({err})") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {path} cannot be read: {err.strerror if isinstance(err, OSError) else err}"
                             ) from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"config file {path}: {err}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def is_schedule_file(schedule: str) -> bool:
    """Whether a config's ``schedule`` names a CSV file of torch's pipeline format, not a generator."""
    return isinstance(schedule, str) and schedule not in SCHEDULES and schedule.lower().endswith(".csv")


def check_corpus(path: Optional[str], *, seq_len: int) -> None:
    """ValueError naming a corpus that no rank could train on: missing, not a file, or shorter than
    one window (``seq_len + 1`` bytes; a byte is a token). Drivers call it before any process group
    exists (``python -m mlmkit.train``, :meth:`mlmkit.cluster.Cluster.session`)."""
    if path is None:
        return
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"corpus={path!r} {what}: give a text file (or no corpus: the shipped one)")
    size = os.path.getsize(path)
    if size < seq_len + 1:
        raise ValueError(f"corpus={path!r} has {size} bytes (tokens), too few for one window of seq_len+1="
                         f"{seq_len + 1}: give a longer text or a shorter seq_len")


def demo_config(**overrides) -> TrainConfig:
    """The quickstart run: a 4-layer byte-level GPT (hidden 64) on the shipped corpus, tp=2 x pp=2."""
    from mlmkit.model.presets import preset

    base = dict(model=preset("quickstart"), tp=2, pp=2, dp=1, micro_batch_size=4, global_batch_size=16, max_steps=40,
                warmup_steps=4, lr=3e-3, min_lr=3e-4)
    base.update(overrides)
    return TrainConfig(**base)

