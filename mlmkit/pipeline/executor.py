"""Execute a :class:`~mlmkit.pipeline.schedule.Schedule` on real ranks, one action at a time.

Each rank builds its model chunks (:func:`build_model_chunks`) and a :class:`PipelineExecutor`, then
either runs a whole step (:meth:`PipelineExecutor.run_step`) or steps action by action
(:meth:`PipelineExecutor.step_action`, what the notebook's step button calls). The schedule is
validated first, so a broken one is rejected before any message is sent.

What an action does on this rank (``c`` = chunk, ``mb`` = microbatch, ``m`` microbatches):

- ``RECV_ACT`` / ``RECV_GRAD``: receive activations ``[s, b_mb, h]`` (``[s/t, b_mb, h]`` with sequence
  parallelism) or their gradient from the peer stage (``irecv``, then wait).
- ``F``: run chunk ``c`` on microbatch ``mb`` (token ids on the first virtual stage, the received
  activations otherwise); the last virtual stage computes the loss and scales it by ``1/m``.
  The input and output are kept until the backward.
- ``SEND_ACT`` / ``SEND_GRAD``: ``isend`` the output activations or the input gradient; sends are
  waited for once delivered, the last ones at the end of the step (:meth:`PipelineExecutor.wait_sends`).
- ``B``: backward through the chunk from the received output gradient (or from the loss); with a
  split schedule the linear layers' weight-gradient GEMMs are queued instead of run
  (:mod:`mlmkit.tensor_parallel.weight_grad`), so B computes the input gradient and the cheap
  gradients in one pass and frees the graph.
- ``W``: the queued weight-gradient GEMMs of that microbatch (``dA = dY^T X``): B + W cost one backward.

After the last action, :meth:`PipelineExecutor.finalize` (collective) sums the gradients of
sequence-parallel parameters over TP, of key/value heads replicated over TP ranks, and the tied
word embedding's gradient between the first and last stage (embedding group). It is separate from the actions so that a driver stepping ranks in
lockstep never calls a collective on one stage while another still has actions to run.

Two ways to communicate (``batch_p2p``):

- unbatched (default on gloo): each send is posted on its own (``isend``) and waited for once the
  schedule proves it delivered (a message the peer sent after receiving it has arrived; the rest
  at the end of the step), which frees the sent tensor: a step holds a bounded number of them
  whatever the number of microbatches. Receives are posted ahead (below) and waited for just
  before use. Messages carry a tag naming (activation or gradient, sending virtual stage,
  microbatch), so gloo cannot pair a message with the wrong receive even when a rank's previous
  and next stage are the same peer (pp=2 with interleaving).
- batched (default on NCCL, ``batch_p2p=True`` on gloo): communication runs as the batches of
  :func:`mlmkit.pipeline.batching.plan_batches` (``batch_isend_irecv``, the whole batch waited),
  without tags, so messages are matched by order exactly as NCCL matches them. The plan is built
  so that batches pair up under NCCL's rendezvous semantics; on gloo this path checks the pairing
  and the data on CPU.

Receives posted ahead (unbatched gloo). gloo's send is a rendezvous: the sender announces it, and
the data leaves only once the receiver has posted its receive, by the sender's background thread
when the receive came later. A receive posted only when reached therefore costs a round trip and
three thread wake-ups after the peer's send, each waiting for a core when ranks share them. So
before each compute action the executor posts the receives of the next :data:`RECV_LOOKAHEAD`
compute actions' stretch of the action list (in list order, each once): the data arrives while
this rank computes, and the wait at the receive finds it there. Each posted receive holds one
message buffer ``[s, b_mb, h]`` until used, so a rank holds at most a few more of them than
before, whatever the number of microbatches. Measured (pp=2 and 4, the pipeline benchmark's
stages, 16 paired steps): 1F1B 1-2% faster, zb-h1 6%, interleaved 1F1B and zb-v 8-13%. Not with
NCCL, where a posted receive holds the communicator's stream and a send queued behind it could
deadlock (and unbatched NCCL must keep the send order: posting in list order keeps it anyway).

Loss: with ``per_token_loss`` (Megatron-LM's ``calculate_per_token_loss``) each microbatch
contributes the *sum* of its token losses times ``loss_scale`` (by default ``1 / tokens`` of the
whole batch, ignored targets excluded), so the step's loss is the mean over every non-ignored
token whatever the microbatching; otherwise each microbatch's mean counts ``1/m``.

Context parallelism: every rank of a pipeline gets the whole sequences; each model chunk keeps
its cp rank's tokens (:mod:`mlmkit.context_parallel`), so messages between stages are
``[s/cp, b, h]`` and each cp rank's loss covers its own tokens, scaled by ``cp`` (default
``loss_scale = cp / tokens``): averaging losses and gradients over the cp group, as the
optimizer's dp-cp reduction does, gives the batch's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mlmkit.distributed import CommGroup, ProcessGroups
from mlmkit.model import GPT, GPTConfig, Stage, split_layers
from mlmkit.pipeline.batching import BatchPlan, Step, plan_batches
from mlmkit.pipeline.schedule import COMPUTE, Action, Schedule, ScheduleError
from mlmkit.pipeline.validate import validate
from mlmkit.model.gpt import moe_layers
from mlmkit.tensor_parallel import param_grad, sync_replicated_grads, sync_sequence_parallel_grads

__all__ = ["PipelineExecutor", "StepState", "build_model_chunks", "sync_embedding_grads"]

#: Unbatched gloo: before a compute action, the receives of the next this-many compute actions'
#: stretch of the action list are posted (module docstring, "Receives posted ahead").
RECV_LOOKAHEAD = 4


def build_model_chunks(config: GPTConfig, *, groups: ProcessGroups, chunks: int = 1,
                       layers_per_stage: Optional[Sequence[int]] = None,
                       sequence_parallel: bool = False, recompute=False, dtype=None,
                       split_backward: bool = False, placement: str = "loop",
                       cp_split: str = "balanced") -> list[GPT]:
    """This rank's model chunks: chunk ``c`` is virtual stage ``c * p + pp_rank`` of ``p * chunks``
    (``placement="v"``: chunk 0 is stage ``pp_rank``, chunk 1 stage ``2p - 1 - pp_rank``).

    ``layers_per_stage`` lists the layer count of each virtual stage (default: as even as possible);
    ``recompute``: "none", "selective" or "full"; ``dtype``: parameter and compute dtype;
    ``split_backward``: the chunks can defer weight gradients (zero-bubble schedules: B and W);
    ``cp_split``: how the sequence is divided over the cp group (:mod:`mlmkit.context_parallel`).
    """
    p, r = groups.topology.pp, groups.coords.pp
    config.check_parallel(tp=groups.tp.size, pp=p, chunks=chunks, sequence_parallel=sequence_parallel,
                          cp=groups.cp.size, cp_split=cp_split, ep=groups.ep.size, expert_tp=groups.expert_tp.size)
    layout = split_layers(config.layers, p * chunks, layers_per_stage)
    if placement == "v" and chunks != 2:
        raise ValueError(f"a V placement holds exactly 2 chunks per rank, not chunks={chunks}")
    out = []
    for c in range(chunks):
        vs = (r if c == 0 else 2 * p - 1 - r) if placement == "v" else c * p + r
        stage = Stage(layers=layout[vs], pre_process=vs == 0, post_process=vs == p * chunks - 1,
                      index=vs, pp_rank=r)
        out.append(GPT(config, tp=groups.tp, cp=groups.cp, cp_split=cp_split, stage=stage,
                       experts=groups.expert_groups() if config.moe else None,
                       sequence_parallel=sequence_parallel,
                       recompute=recompute, device=groups.device, dtype=dtype, split_backward=split_backward))
    return out


def sync_expert_tp_grads(model, expert_tp: CommGroup) -> None:
    """Sum over the expert-tp group the gradients of expert parameters every member holds whole
    (an expert's ``fc2`` bias: each member adds it to its own tokens)."""
    if expert_tp.size == 1:
        return
    for p in model.parameters():
        if getattr(p, "expert_tp_sum", False) and param_grad(p) is not None:
            expert_tp.all_reduce(param_grad(p), site="expert_tp_grads", phase="backward")


def sync_embedding_grads(chunks: Sequence[GPT], embedding: Optional[CommGroup]) -> None:
    """Sum the tied word embedding's gradient between the first and the last pipeline stage.

    The first stage uses it to embed tokens, the last as the output head; each holds a copy and
    gets part of the gradient. Megatron-LM all-reduces it over the embedding group so both copies
    take the same optimizer step and stay equal. When one rank holds both stages (the V placement
    of zb-v and dualpipev), the two copies are summed locally, without a message.

    The data-parallel reduction that follows gives each copy a bucket of its own (ZeRO-1: a shard of
    its own; ZeRO-2/3: a unit of its own), laid out alike on both stages (as Megatron-LM does), so
    the copies stay equal to the bit: inside a larger bucket its elements would sit at other places
    than the other copy's, and with more than two dp x cp replicas the ring would add their parts
    in another order (the copies parted by float rounding, 1e-8 after one step).
    """
    if not chunks or not chunks[0].config.tie_embeddings:
        return
    copies = [p for model in chunks for p in model.vocab_parameters()]
    for p in copies:
        if param_grad(p) is None:
            p.grad = torch.zeros_like(p)
    if len(copies) == 2:                      # both ends on this rank
        total = param_grad(copies[0]) + param_grad(copies[1])
        for p in copies:
            param_grad(p).copy_(total)
        return
    if embedding is None or embedding.size == 1:
        return
    for p in copies:
        embedding.all_reduce(param_grad(p), site="embedding_grads", phase="backward")


@dataclass
class _Held:
    """What one (microbatch, chunk) keeps between its forward and its last backward action."""

    input: Optional[torch.Tensor]                # received activations (leaf) or None on stage 0
    output: Optional[torch.Tensor]               # activations sent on, or the scaled loss (last stage)
    grad_output: Optional[torch.Tensor] = None   # received gradient of ``output``
    input_grad: Optional[torch.Tensor] = None    # to be sent to the previous stage
    weight_work: Optional[list] = None           # split backward: weight-gradient GEMMs waiting for W
    released: bool = False                       # graph freed (backward done)


@dataclass
class StepState:
    """A snapshot of one rank's executor for notebooks (see :meth:`PipelineExecutor.state`)."""

    rank: int
    pp_rank: int
    index: int
    total: int
    next_action: Optional[str]
    held: dict = field(default_factory=dict)
    loss: Optional[float] = None


class PipelineExecutor:
    """Runs this rank's actions of ``schedule`` with ``chunks`` (its model chunks, by chunk index).

    Args:
        schedule: the plan (validated here; must have ``stages == topology.pp``).
        chunks: this rank's model chunks, ``len(chunks) == schedule.chunks``.
        groups: this rank's process groups (p2p goes over ``groups.pp``).
        tracer: where actions and messages are recorded (default: the groups' tracer, if any).
        memory: a :class:`mlmkit.trace.memory.MemoryTracker`: counts saved activations during
            forwards and records a memory row after every compute action.
        batch_p2p: post communication as planned batches without tags (module docstring);
            ``None``: on with NCCL, off with gloo.
        per_token_loss: the loss is the mean over all non-ignored tokens of the batch (Megatron's
            per-token loss); ``False``: the mean of the microbatches' means.
        ignore_index: target id excluded from the loss.
    """

    def __init__(self, *, schedule: Schedule, chunks: Sequence[GPT], groups: ProcessGroups, tracer=None,
                 memory=None, batch_p2p: Optional[bool] = None, per_token_loss: bool = True,
                 ignore_index: int = -100):
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        batched = nccl if batch_p2p is None else bool(batch_p2p)
        # Unbatched messages carry tags on gloo; NCCL ignores tags, so unbatched NCCL needs send order.
        validate(schedule, batched=batched, ordered=nccl and not batched)
        if schedule.stages != groups.topology.pp:
            raise ScheduleError(f"schedule has stages={schedule.stages} but the topology has pp={groups.topology.pp}")
        if len(chunks) != schedule.chunks:
            raise ScheduleError(f"schedule has chunks={schedule.chunks} but this rank holds {len(chunks)} model chunks")
        self.schedule, self.chunks, self.groups = schedule, list(chunks), groups
        self.placement = schedule.placement
        self.dtype = next(self.chunks[0].parameters()).dtype     # of activations and their messages
        if schedule.split_backward and any(m.wgrad is None for m in self.chunks):
            raise ScheduleError(f"schedule {schedule.name!r} splits backward into I and W: build the model chunks "
                                f"with split_backward=True")
        self.pp_rank = groups.coords.pp
        self.actions: tuple[Action, ...] = schedule.actions[self.pp_rank]
        for c, model in enumerate(self.chunks):
            if model.stage.index != schedule.virtual_stage(self.pp_rank, c):
                raise ScheduleError(f"chunk {c} of pipeline rank {self.pp_rank} holds virtual stage {model.stage.index} "
                                    f"but the schedule ({schedule.placement} placement) puts stage "
                                    f"{schedule.virtual_stage(self.pp_rank, c)} there: build the chunks with "
                                    f"placement={schedule.placement!r}")
        self.tracer = tracer if tracer is not None else groups.pp.tracer
        self.memory = memory
        self._attach_memory()
        #: Called with the chunk index after each backward action (ZeRO-3 frees what it gathered).
        self.on_backward_done = None
        self.batch_p2p = batched
        #: Unbatched gloo: compute actions ahead whose receives are posted before each compute action
        #: (0: each receive posted when reached). Off with NCCL: a posted receive holds its
        #: communicator's stream, and a send queued behind it could deadlock.
        self.recv_lookahead = 0 if nccl or batched else RECV_LOOKAHEAD
        self.per_token_loss, self.ignore_index = per_token_loss, ignore_index
        self.plan: Optional[BatchPlan] = plan_batches(schedule) if self.batch_p2p else None
        self._steps: tuple[Step, ...] = self.plan.steps[self.pp_rank] if self.plan is not None else ()
        self._sends_done_by = self._plan_send_release() if not self.batch_p2p else {}
        self.index = len(self.actions)  # actions done in this step (all: no step in progress)
        self._step_pos = len(self._steps)
        self.last_step: Optional[str] = None
        self._reset()
        self._open = False              # a step started and neither finalized nor abandoned

    # ---------------------------------------------------------------------- step control
    def _reset(self) -> None:
        self._held: dict[tuple[int, int], _Held] = {}
        self._recv: dict[tuple[str, int, int], tuple[torch.Tensor, object, float]] = {}
        self._sends: dict[tuple, tuple[object, torch.Tensor]] = {}   # posted isends not yet waited for
        self._losses: list[torch.Tensor] = []
        self._inbox: dict[tuple, torch.Tensor] = {}   # received tensors not yet consumed
        self._pending: list = []                      # works of a batch being waited for
        self._finalized = False

    def start_step(self, tokens: torch.Tensor, targets: torch.Tensor, *,
                   loss_scale: Optional[float] = None) -> None:
        """Begin a step on the batch ``tokens``/``targets`` ``[m * b_mb, s]`` (split into m microbatches).

        Every rank of a pipeline passes the same batch; the first stage reads the tokens, the last
        the targets. ``loss_scale`` (per-token loss only) multiplies each microbatch's summed token
        loss; the default ``1 / (non-ignored targets in this batch)`` makes the loss the batch's
        per-token mean (a data-parallel trainer passes ``dp / tokens of the global batch``).

        Refused (RuntimeError) while the previous step is open: actions left (its messages would
        pair with the new step's, same tags) or :meth:`finalize` not yet run; :meth:`abandon` closes it.
        Refused (ValueError) before the step opens for a batch no step can run: ids that are not
        integers or lie outside the vocabulary (targets may be ``ignore_index``), tokens and targets
        of different shapes, sequences longer than the model's, a batch that ``m`` does not divide.
        """
        m = self.schedule.microbatches
        if self._open and not self.done:
            raise RuntimeError(
                f"start_step: a step is in progress on pipeline rank {self.pp_rank} (action {self.index} of "
                f"{len(self.actions)} done, {self.actions[self.index]} next); starting another would drop it with "
                f"its messages in flight, and on gloo the new step's receives could take the old step's messages "
                f"(same tags). Finish it (step_action() until done, then finalize()) or drop it with abandon() "
                f"and run the next step on fresh process groups")
        if self._open:
            raise RuntimeError(
                f"start_step: the step on pipeline rank {self.pp_rank} has run its actions but not finalize(), "
                f"which waits for its sends and sums the gradients that need every stage (sequence-parallel "
                f"parameters over tp, the tied embedding over the first and last stage): call finalize() on every "
                f"rank first, or drop the step with abandon()")
        self._check_batch(tokens, targets)
        if tokens.shape[0] % m:
            raise ValueError(f"batch of {tokens.shape[0]} samples does not split into microbatches={m}")
        dev = self.groups.device
        self._tokens = [t.to(dev) for t in tokens.chunk(m)]
        self._targets = [t.to(dev) for t in targets.chunk(m)]
        self._mb_size = tokens.shape[0] // m
        self._seq = tokens.shape[1]
        if loss_scale is None:
            loss_scale = self.groups.cp.size / max(1, int((targets != self.ignore_index).sum()))
        self._loss_scale = float(loss_scale)
        # Mixture of experts: each microbatch's auxiliary losses count 1/m, times cp since the dp-cp
        # gradient average divides by cp what the cp ranks' parts sum to (mlmkit.moe.layer).
        for model in self.chunks:
            for layer in moe_layers(model):
                layer.aux_scale = self.groups.cp.size / m
                layer.history.clear()
        self._reset()
        self.index = 0
        self._step_pos = 0
        self._open = True

    def _check_batch(self, tokens, targets) -> None:
        """ValueError for a batch no step can run, raised before the step opens. Every rank of a
        pipeline is given the same batch, so all of them refuse it together; found by the stage that
        reads it, a bad id stopped that stage mid-step while its peers waited for its messages (and
        a target outside the vocabulary was counted as a logit of 0 on the last stage)."""
        config = self.chunks[0].config
        for name, t in (("tokens", tokens), ("targets", targets)):
            if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype == torch.bool or t.is_floating_point()
                    or t.is_complex()):
                what = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"start_step: {name} must be an integer tensor [batch, seq] of token ids, got {what}")
        if tokens.shape != targets.shape:
            raise ValueError(f"start_step: tokens {list(tokens.shape)} and targets {list(targets.shape)} must have the "
                             f"same shape [batch, seq]")
        if tokens.shape[1] > config.seq_len:
            raise ValueError(f"start_step: sequence length {tokens.shape[1]} exceeds GPTConfig.seq_len={config.seq_len}")
        vocab = config.vocab_size
        bad = (tokens < 0) | (tokens >= vocab)
        if bool(bad.any()):
            raise ValueError(f"start_step: token id {int(tokens[bad][0])} is outside the vocabulary [0, {vocab}); check "
                             f"the tokenizer against GPTConfig.vocab_size")
        bad = (targets != self.ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(f"start_step: target id {int(targets[bad][0])} is outside the vocabulary [0, {vocab}) and "
                             f"is not ignore_index={self.ignore_index}; check the targets against GPTConfig.vocab_size")

    @property
    def done(self) -> bool:
        if self.batch_p2p:
            return self._step_pos >= len(self._steps)
        return self.index >= len(self.actions)

    def next_step_text(self) -> Optional[str]:
        """What :meth:`step_action` runs next: an action, or a batch ``[SEND_ACT(...) + RECV_GRAD(...)]``."""
        if self.done:
            return None
        if self.batch_p2p:
            return self.plan.describe(self.pp_rank)[self._step_pos]
        return str(self.actions[self.index])

    def step_action(self) -> Optional[Action]:
        """Execute this rank's next action (with ``batch_p2p``: its next step, a compute action or a
        whole batch); return the (first) action (``None`` when the step is over).

        A receive blocks until its message arrives. A driver stepping all ranks in lockstep steps a
        rank only when its next action can complete (see :class:`mlmkit.pipeline.ScheduleCursor`
        and :class:`mlmkit.pipeline.batching.BatchCursor`), so no rank ever blocks.
        """
        if self.done:
            return None
        if self.batch_p2p:
            step = self._steps[self._step_pos]
            self.last_step = self.plan.describe(self.pp_rank)[self._step_pos]
            if not step.is_compute(self.actions):
                self._run_batch(step)
                self._step_pos += 1
                self.index += len(step.actions)
                return self.actions[step.actions[0]]
            a = self.actions[step.actions[0]]
            self._compute(a)
            self._step_pos += 1
            self.index += 1
            return a
        a = self.actions[self.index]
        self.last_step = str(a)
        if a.kind in COMPUTE:
            self._post_recvs_ahead()
            self._compute(a)
        elif a.kind in ("RECV_ACT", "RECV_GRAD"):
            self._finish_recv(a)
        else:
            self._send(a)
        self.index += 1
        return a

    def _compute(self, a: Action) -> None:
        start = time.perf_counter()
        if a.kind == "F":
            self._forward(a)
        elif a.kind in ("B", "I"):
            self._backward(a)
        else:
            self._weight(a)
        if self.tracer is not None:
            self.tracer.record_event(action=a.kind, microbatch=a.microbatch, chunk=a.chunk,
                                     start=start, end=time.perf_counter())
        if self.memory is not None:
            self.memory.record(action=a.kind, microbatch=a.microbatch, chunk=a.chunk)

    def _attach_memory(self) -> None:
        for model in self.chunks:
            if model.wgrad is not None:
                model.wgrad.memory = self.memory

    def abandon(self) -> None:
        """Drop the step in progress: activations, received tensors, queued weight-gradient work and
        every pending send and receive. After a failure this releases the rank's hold on its process
        groups (a pending ``Work`` keeps gloo's connections open, so peers blocked on this rank
        would wait on). Messages of the dropped step may still be in flight (a send no receive
        matched, a receive posted ahead): a posted receive cannot be withdrawn from gloo, so run the
        next step on fresh process groups, as :class:`mlmkit.cluster.Cluster` does (it re-joins every
        rank to a new world after a failure or a reset half-way)."""
        for (_, c), h in getattr(self, "_held", {}).items():
            if h.weight_work:
                self.chunks[c].wgrad.drop(h.weight_work)
        for model in self.chunks:
            if model.wgrad is not None:
                model.wgrad.drop()
        self._reset()
        self.index = len(self.actions)
        self._step_pos = len(self._steps)
        self._open = False

    def run_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> Optional[float]:
        """A whole step: every action, then gradient finalisation. Returns the mean microbatch loss
        on the rank holding the last virtual stage, ``None`` elsewhere."""
        self.start_step(tokens, targets)
        while not self.done:
            self.step_action()
        self.finalize()
        return self.loss

    @property
    def loss(self) -> Optional[float]:
        if not self._losses:
            return None
        return float(torch.stack(self._losses).sum())  # each microbatch's share of the step's loss

    def state(self) -> StepState:
        """Where this rank is: next action, and the activations it holds with their shapes."""
        held = {}
        for (mb, c), h in sorted(self._held.items()):
            key = f"mb{mb}" + (f".chunk{c}" if self.schedule.chunks > 1 else "")
            if not h.released:
                held[key] = {"input": tuple(h.input.shape) if h.input is not None else None,
                             "output": tuple(h.output.shape)}
            elif h.weight_work:       # after I, until W: each linear's input and output gradient
                nbytes = sum(t.numel() * t.element_size() for *_, x, dy, _tok in h.weight_work for t in (x, dy))
                held[key] = {"waiting_for_W": f"{len(h.weight_work)} linear layers, {nbytes} bytes"}
        nxt = self.next_step_text()
        return StepState(rank=self.groups.rank, pp_rank=self.pp_rank, index=self.index, total=len(self.actions),
                         next_action=nxt, held=held, loss=self.loss if self.done else None)

    # ---------------------------------------------------------------------- communication
    def _key(self, a: Action, pp_rank: Optional[int] = None) -> tuple[str, int, int]:
        # (what, microbatch, sending virtual stage): the identity of the message.
        return self.schedule.message(self.pp_rank if pp_rank is None else pp_rank, a)

    def _tag(self, key: tuple[str, int, int]) -> int:
        what, mb, vs = key
        return ((0 if what == "act" else 1) * self.schedule.virtual_stages + vs) * self.schedule.microbatches + mb

    def _shape(self) -> tuple[int, int, int]:
        cfg, t = self.chunks[0].config, self.groups.tp.size
        s = self._seq // self.groups.cp.size                  # this cp rank's tokens
        s = s // t if self.chunks[0].sequence_parallel else s
        return (s, self._mb_size, cfg.hidden)

    def _peer(self, a: Action) -> int:
        return self.groups.pp.ranks[a.peer]

    def _post_recv(self, a: Action) -> None:
        key = self._key(a)
        if key in self._recv:
            return
        buf = torch.empty(self._shape(), dtype=self.dtype, device=self.groups.device)
        work = dist.irecv(buf, src=self._peer(a), group=self.groups.pp.pg, tag=self._tag(key))
        self._recv[key] = (buf, work, time.perf_counter())

    def _post_recvs_ahead(self) -> None:
        # Before a compute action (unbatched gloo only): post the receives of the next
        # recv_lookahead compute actions' stretch of the list, in list order, so each is posted
        # before the peer sends (module docstring, "Receives posted ahead").
        j, computes = self.index + 1, 0
        while j < len(self.actions) and computes < self.recv_lookahead:
            b = self.actions[j]
            if b.kind in COMPUTE:
                computes += 1
            elif b.kind in ("RECV_ACT", "RECV_GRAD"):
                self._post_recv(b)
            j += 1

    def _run_batch(self, step: Step) -> None:
        # One planned batch (NCCL semantics): post every operation together, without tags (messages
        # on a channel are matched by order, as NCCL does), then wait for the whole batch.
        ops, recvs = [], []
        for i in step.actions:
            a = self.actions[i]
            if a.kind.startswith("RECV"):
                buf = torch.empty(self._shape(), dtype=self.dtype, device=self.groups.device)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(a), self.groups.pp.pg))
                recvs.append((a, buf))
            else:
                tensor = self._take_send_tensor(a)
                ops.append(dist.P2POp(dist.isend, tensor, self._peer(a), self.groups.pp.pg))
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv(ops)
        self._pending = works
        if len(works) == len(ops):        # one work per operation (gloo): the receives first, since
            # a receive from a peer that failed fails at once, a send to it may not (see wait_sends)
            kinds = [self.actions[i].kind.startswith("RECV") for i in step.actions]
            works = [w for w, r in zip(works, kinds) if r] + [w for w, r in zip(works, kinds) if not r]
        for work in works:
            work.wait()
        self._pending = []
        for a, buf in recvs:
            self._trace_p2p("recv", a, buf, t0)
            self._inbox[("act" if a.kind == "RECV_ACT" else "grad", a.microbatch, a.chunk)] = buf

    def _finish_recv(self, a: Action) -> None:
        # gloo's irecv work never reports completion before wait(), so receives are waited here.
        self._post_recv(a)
        key = self._key(a)
        buf, work, t0 = self._recv.pop(key)
        work.wait()
        self._trace_p2p("recv", a, buf, t0)
        self._inbox[("act" if a.kind == "RECV_ACT" else "grad", a.microbatch, a.chunk)] = buf
        for sent in self._sends_done_by.get(key, ()):    # known delivered: free the sent tensors now
            work, _ = self._sends.pop(sent, (None, None))
            if work is not None:
                work.wait()                               # returns at once: the peer has received it

    def _plan_send_release(self) -> dict[tuple, list[tuple]]:
        """For each message this rank receives, the messages it sent that are surely delivered by then.

        A sent tensor must stay alive until its send completes; gloo's send works report completion
        only in ``wait()``, so without this every tensor sent in a step (a stage's output and input
        gradient per microbatch) would be held until :meth:`finalize`, and the memory of 1F1B would
        grow with the number of microbatches. The schedule says when a send has completed: if the
        peer, after its receive of our message, sends us a message, then by the time that message
        arrives ours was received, and waiting for our send returns at once. Sends with no such
        reply in the step (the first stage's last input gradients) are waited for in finalize."""
        me = self.pp_rank
        peers = {a.peer for a in self.actions if a.kind.startswith("SEND")}
        received_at, replies = {}, {}     # per peer: index of its receive of each message; its sends to us
        for q in peers:
            theirs = self.schedule.actions[q]
            received_at[q] = {self._key(b, q): i for i, b in enumerate(theirs) if b.kind.startswith("RECV")}
            replies[q] = [(i, self._key(b, q)) for i, b in enumerate(theirs)
                          if b.kind.startswith("SEND") and b.peer == me]
        done_by: dict[tuple, list[tuple]] = {}
        for a in self.actions:
            if not a.kind.startswith("SEND"):
                continue
            key = self._key(a)
            got = received_at[a.peer][key]
            reply = next((k for i, k in replies[a.peer] if i > got), None)
            if reply is not None:
                done_by.setdefault(reply, []).append(key)
        return done_by

    def _take_send_tensor(self, a: Action) -> torch.Tensor:
        h = self._held[(a.microbatch, a.chunk)]
        if a.kind == "SEND_ACT":
            tensor = h.output.detach().contiguous()
        else:
            tensor, h.input_grad = h.input_grad.contiguous(), None
            self._forget_if_done((a.microbatch, a.chunk))
        if self.tracer is not None:
            self._trace_p2p("send", a, tensor, time.perf_counter())
        return tensor

    def _send(self, a: Action) -> None:
        tensor = self._take_send_tensor(a)
        key = self._key(a)
        work = dist.isend(tensor, dst=self._peer(a), group=self.groups.pp.pg, tag=self._tag(key))
        self._sends[key] = (work, tensor)

    def _trace_p2p(self, op: str, a: Action, tensor: torch.Tensor, t0: float) -> None:
        tr = self.tracer
        if tr is not None and tr.enabled:
            nbytes = tensor.numel() * tensor.element_size()
            tr.record_comm(op=op, axis="pp", ranks=(self.groups.rank, self._peer(a)), nbytes=nbytes,
                           wire_bytes=nbytes if op == "send" else 0, start=t0, end=time.perf_counter(),
                           site=f"pipeline.{a.kind.lower()}", phase="forward" if "ACT" in a.kind else "backward")

    # ---------------------------------------------------------------------- compute
    def _forward(self, a: Action) -> None:
        model, mb = self.chunks[a.chunk], a.microbatch
        if model.stage.pre_process:
            x, inp = self._tokens[mb], None                                   # [b_mb, s] token ids
        else:
            inp = x = self._inbox.pop(("act", mb, a.chunk)).requires_grad_(True)  # [s, b_mb, h]
        with self.memory.saving() if self.memory is not None else contextlib.nullcontext():
            if model.stage.post_process:
                if self.per_token_loss:   # sum of token losses x (dp / tokens of the global batch)
                    out = model(x, self._targets[mb], ignore_index=self.ignore_index,
                                reduction="sum") * self._loss_scale
                elif self.groups.cp.size == 1:   # this microbatch's mean / m
                    out = model(x, self._targets[mb], ignore_index=self.ignore_index) / self.schedule.microbatches
                else:                     # this cp rank's part of the microbatch's mean, times cp, / m
                    tgt = self._targets[mb]
                    count = (tgt != self.ignore_index).sum().clamp(min=1)
                    out = (model(x, tgt, ignore_index=self.ignore_index, reduction="sum") / count
                           * self.groups.cp.size / self.schedule.microbatches)
                self._losses.append(out.detach())
            else:
                out = model(x)                                                  # [s, b_mb, h]
        self._held[(mb, a.chunk)] = _Held(input=inp, output=out)
        nxt = self._local_neighbour(a.chunk, +1)
        if nxt is not None:       # the tip of a V: the next stage is this rank's other chunk
            self._inbox[("act", mb, nxt)] = out.detach()

    def _local_neighbour(self, chunk: int, step: int) -> Optional[int]:
        """The chunk of this rank that holds the virtual stage next to ``chunk``'s (``step`` +1 or -1),
        if this rank holds it (the tip of a V), else None."""
        vs = self.schedule.virtual_stage(self.pp_rank, chunk) + step
        if not 0 <= vs < self.schedule.virtual_stages:
            return None
        rank, other = self.schedule.rank_of(vs)
        return other if rank == self.pp_rank else None

    def _backward(self, a: Action) -> None:
        # B: the full backward. I: a split backward's first part, one pass through the graph that
        # computes the input gradient (what the previous stage waits for) and the cheap gradients
        # (norms, embedding) while the linear layers queue their weight-gradient GEMMs for W
        # (mlmkit.tensor_parallel.weight_grad).
        key = (a.microbatch, a.chunk)
        h = self._held[key]
        model = self.chunks[a.chunk]
        if not model.stage.post_process:
            h.grad_output = self._inbox.pop(("grad", a.microbatch, a.chunk))
        if a.kind == "I":
            if model.wgrad is None:
                raise RuntimeError("a split schedule needs model chunks built with split_backward=True "
                                   "(build_model_chunks(..., split_backward=True))")
            with model.wgrad.defer():
                torch.autograd.backward(h.output, grad_tensors=h.grad_output)
            h.weight_work = model.wgrad.take()
        else:
            torch.autograd.backward(h.output, grad_tensors=h.grad_output)
        h.input_grad = h.input.grad if h.input is not None else None
        prev = self._local_neighbour(a.chunk, -1)
        if prev is not None:      # the tip of a V: hand the input gradient to this rank's other chunk
            self._inbox[("grad", a.microbatch, prev)] = h.input_grad
            h.input_grad = None
        self._release(key)
        if self.on_backward_done is not None:
            self.on_backward_done(a.chunk)

    def _weight(self, a: Action) -> None:
        # W: the weight-gradient GEMMs B queued, dA = dY^T X per linear layer, accumulated.
        key = (a.microbatch, a.chunk)
        h = self._held[key]
        work, h.weight_work = h.weight_work or [], None
        self.chunks[a.chunk].wgrad.run(work)
        self._forget_if_done(key)

    def _release(self, key: tuple[int, int]) -> None:
        # The graph and activations of this microbatch are no longer needed; an input gradient
        # that still has to be sent is kept until its SEND_GRAD, queued weight work until its W.
        h = self._held[key]
        h.input = h.output = h.grad_output = None
        h.released = True
        self._forget_if_done(key)

    def _forget_if_done(self, key: tuple[int, int]) -> None:
        h = self._held.get(key)
        if h is not None and h.released and h.input_grad is None and h.weight_work is None:
            del self._held[key]

    def finalize(self, *, wait_sends: bool = True) -> None:
        """After the last action: the gradient sums that need every stage (sequence-parallel
        parameters over TP, tied embedding over the embedding group), then (``wait_sends``) the
        wait for this step's sends still pending (see :meth:`wait_sends`). Collective: call it on
        every rank once the step's actions are done (idempotent)."""
        if not self.done:
            raise RuntimeError(f"finalize() before the step's actions are done ({self.state().next_action} is next)")
        if self._finalized:
            return
        self._finalized = True
        self._held.clear()
        for model in self.chunks:
            sync_sequence_parallel_grads(model, self.groups.tp)
            sync_replicated_grads(model, self.groups.tp)
            sync_expert_tp_grads(model, self.groups.expert_tp)
        sync_embedding_grads(self.chunks, self.groups.embedding)
        self._open = False
        if wait_sends:
            self.wait_sends()

    def wait_sends(self) -> None:
        """Wait for the step's sends still pending (unbatched path) and free their tensors.

        Called by the trainer after its loss all-reduce over the world, not in :meth:`finalize`:
        every rank has then done its actions, so every message was received and the wait returns
        at once. Waited for earlier, a send could block a healthy rank after a peer failed: when
        the receiver had posted its receive and then dropped its connections just before the data
        went out, gloo (torch 2.13) leaves the failed write queued, and closing the connection
        wakes the sends and receives still waiting for their peer but not that queued write; the
        sender waited until the collective timeout while its peers were released in milliseconds
        (about once in 100 failures injected at the last actions of a 1F1B step). A collective
        over the world fails on every rank once any rank has dropped its groups."""
        for work, _ in self._sends.values():
            work.wait()
        self._sends.clear()
