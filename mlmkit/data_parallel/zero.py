"""ZeRO stages 2 and 3 (Rajbhandari et al. 2020; PyTorch FSDP, Zhao et al. 2023): gradients, and
with stage 3 the parameters too, sharded over the data-parallel replicas, unit by unit.

A **unit** is one Transformer layer, or the rest of a model chunk (embedding, final norm, head: the
*root*), as in FSDP2's ``fully_shard`` per layer; a chunk's copy of a tied word embedding is a root
unit of its own (:func:`shard_units`). Each unit's parameters are viewed as one flat vector
``[N_u]``, zero-padded to ``d * ceil(N_u / d)`` and cut in ``d`` contiguous shards (``d`` = the
replicas: the dp-cp group). Rank ``r`` owns shard ``r``: its fp32 master copy and Adam moments.

Stage 2 (:class:`FullyShardedAdamW` with ``stage=2``): parameters stay whole. Once a layer's last
backward of the step has passed, its gradient ``[N_u]`` is reduce-scattered (rank ``r`` receives
the sum of shard ``r``) and the whole gradient is freed, while the backward goes on through the
layers before it (FSDP's post-backward reduce-scatter); each rank updates its shard, and the
updated shards are all-gathered back into the parameters, unit by unit.

Stage 3 (``stage=3``): between uses a parameter holds no memory (its storage is resized to one
element, a NaN that every position reads; its shape stays); rank ``r`` keeps the unit's shard in
the parameters' dtype. :class:`Zero3Hooks` gathers a unit right before it is used and frees it after:

- forward: a layer's forward pre-hook all-gathers its parameters, its forward hook frees them
  (``reshard_after_forward=True``, the default); the root is gathered around the chunk's forward;
- backward: a hook on the layer's output gradient gathers the layer again before its backward
  runs (and, with full recomputation, before its forward is recomputed); a hook on its input
  gradient frees it once its backward has passed; the executor frees what is left (the root) at
  the end of each backward action;
- ``prefetch=1``: gathering a layer also gathers the next one to run (forward: the next layer;
  backward: the previous one), so two layers are whole at a time. On gloo the gathers are
  synchronous: the prefetch shows its memory cost, not the overlap a GPU stream gives;
- ``reshard_after_forward=False``: a unit gathered at its first forward of the step stays whole
  until the optimizer step (ZeRO-2-like memory, one gather per unit and step; torchtitan's
  choice for pipeline stages).

Per step and unit, with ``m`` microbatches (forward and backward actions per chunk): stage 3 all-
gathers ``2m`` times (``reshard_after_forward``) or once, and reduce-scatters once; stages 1 and 2
reduce-scatter once and all-gather once. With ``m = 1`` stage 3 moves ``3 (d-1)/d`` of the unit
against plain data parallelism's ``2 (d-1)/d``: 1.5x (the ZeRO paper's figure).

Gradients are reduced **once per step**, in the last backward of each layer (as torch's pipelining
runtime does with FSDP: no gradient sync before the last microbatch), so with several microbatches
they are whole until then; each layer's is freed as soon as its shard is reduced. Just before, the
layer's sequence-parallel and replicated key/value gradients are summed over tp (what the
executor's finalisation does for whole chunks). The root's gradient is reduced at the optimizer
step, after the finalisation (the tied embedding is summed between the first and last stage
first), and so is every unit's under a split backward (zero-bubble schedules: the weight
gradients come later, in W).

Forward: every number is the unsharded model's (a gathered parameter is bit-identical to the
replicated one). Backward: the reduce-scatter sums exactly what the all-reduce of plain data
parallelism sums, so gradients, the global norm and the AdamW update (element-wise) are equal.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from mlmkit.data_parallel.optimizer import (_STATE_KEYS, _Base, apply_decay, copy_flat_into, counted_spans,
                                            flatten_padded, shard_sumsq, take_written)
from mlmkit.distributed import CommGroup
from mlmkit.tensor_parallel.layers import param_grad

__all__ = ["FullyShardedAdamW", "ShardedUnit", "Zero3Hooks", "shard_units"]


def shard_units(chunks: Sequence[nn.Module]) -> list[tuple[str, int, list[tuple[str, nn.Parameter]], Optional[nn.Module]]]:
    """The units of ``chunks`` (model chunks, :class:`mlmkit.model.GPT`): ``(name, chunk, named
    parameters, layer module or None for the root)``: per chunk its root, then its copy of a tied
    word embedding as a unit of its own (``chunk<c>.tied_embedding``), then each layer.

    The tied copy is alone so that the first and the last stage shard it alike: its reduce-scatter
    then adds every element's parts in the same order on both, and the copies stay equal to the bit
    (as its own bucket does without ZeRO; :func:`mlmkit.pipeline.executor.sync_embedding_grads`)."""
    units = []
    for c, chunk in enumerate(chunks):
        layer_params = {id(p) for layer in chunk.layers.values() for p in layer.parameters()}
        rest = [(n, p) for n, p in chunk.named_parameters() if id(p) not in layer_params and p.requires_grad]
        root = [(n, p) for n, p in rest if not getattr(p, "tied_embedding", False)]
        tied = [(n, p) for n, p in rest if getattr(p, "tied_embedding", False)]
        if root:
            units.append((f"chunk{c}.root", c, root, None))
        if tied:
            units.append((f"chunk{c}.tied_embedding", c, tied, None))
        for key, layer in chunk.layers.items():
            named = [(f"layers.{key}.{n}", p) for n, p in layer.named_parameters() if p.requires_grad]
            if named:
                units.append((f"chunk{c}.layers.{key}", c, named, layer))
    return units


class ShardedUnit:
    """One unit's parameters, flat and sharded over ``group`` (see the module docstring).

    Args:
        name: for traces (``zero3.params.<name>``).
        named_params: the unit's parameters.
        group: the replicas (dp-cp group).
        stage: 2 or 3.
        counted: whether a parameter's elements count towards the global gradient norm.
    """

    def __init__(self, name: str, named_params, group: CommGroup, *, stage: int, counted: Callable,
                 module: Optional[nn.Module] = None):
        self.name, self.group, self.stage, self.module = name, group, stage, module
        self.passes = 0                      # backward passes through this unit in the current step
        self.named = list(named_params)
        self.params = [p for _, p in self.named]
        for p in self.params:       # readers such as gather_full check these (freed weights, sharded gradients)
            p.zero_stage, p.grad_reduced = stage, False
        self.dtype = self.params[0].dtype
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = -(-self.numel // group.size)            # ceil(N_u / d)
        self.start = group.rank * self.shard_size
        self.nbytes = [p.numel() * p.element_size() for p in self.params]
        flat = self.flat([p.detach().float() for p in self.params])
        self.master = nn.Parameter(flat[self.start:self.start + self.shard_size].clone())   # fp32 [shard]
        # Stage 3 keeps this rank's shard in the parameters' dtype (the fp32 master itself in fp32).
        self.param_shard = None
        self.shared = stage == 3 and self.dtype == torch.float32      # the master shard is the parameter shard
        if stage == 3:
            self.param_shard = self.master.detach() if self.shared else self.master.detach().to(self.dtype)
        self.counted_spans = counted_spans(self.params, counted, self.start, self.shard_size)
        self.gathered = True
        self.in_backward = False
        self.shard_grad: Optional[torch.Tensor] = None

    def flat(self, tensors) -> torch.Tensor:
        """``[N_u]`` -> ``[d * shard_size]``, zero-padded at the end."""
        return flatten_padded(tensors, self.shard_size * self.group.size)

    # ---------------------------------------------------------------- stage 3: gather and free
    def gather(self, *, phase: str = "forward", memory=None) -> bool:
        """Make the unit's parameters whole (all-gather of the shards). Returns whether it gathered."""
        if self.gathered:
            return False
        g = self.group
        full = g.all_gather(self.param_shard, dim=0, site=f"zero3.params.{self.name}", phase=phase) \
            if g.size > 1 else self.param_shard
        offset = 0
        for p, nbytes in zip(self.params, self.nbytes):
            storage = p.untyped_storage()
            storage.resize_(nbytes)
            # .data: the same storage object (the memory tracker knows it), made whole and contiguous
            # again, without bumping the version counter autograd checks.
            p.data = torch.empty(0, dtype=p.dtype, device=p.device).set_(storage, 0, p.shape)
            p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.gathered = True
        if memory is not None:
            memory.record(action=f"gather {self.name}", microbatch=-1)
        return True

    def free(self) -> None:
        """Drop the whole parameters' memory (shapes stay; the shard is kept). Each parameter keeps
        one NaN element that every position reads (stride 0): code reading a freed parameter gets
        NaN, code writing it a RuntimeError, never the freed memory (a segfault)."""
        if self.stage != 3 or not self.gathered:
            return
        for p in self.params:
            storage = p.untyped_storage()
            storage.resize_(p.element_size())
            placeholder = torch.empty(0, dtype=p.dtype, device=p.device).set_(storage, 0, (1,), (1,))
            placeholder.fill_(float("nan"))
            p.data = placeholder.as_strided(p.shape, (0,) * p.dim())
        self.gathered = False
        self.in_backward = False

    # ---------------------------------------------------------------- gradients and update
    def reduce_grads(self, *, divisor: int, reduce_dtype, label: str) -> None:
        grads = self.flat([param_grad(p) if param_grad(p) is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                           for p in self.params])
        for p in self.params:          # the whole gradient is no longer needed
            p.grad, p.grad_reduced = None, True
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None
        g = self.group
        if g.size > 1:
            wire = grads.to(reduce_dtype) if reduce_dtype is not None else grads
            shard = g.reduce_scatter(wire, dim=0, site=f"zero{self.stage}.grads.{label}.{self.name}",
                                     phase="backward").float()
        else:
            shard = grads.float()
        self.shard_grad = shard / divisor                               # [shard_size], averaged

    def write_back(self, *, label: str) -> None:
        """After the update: stage 2 all-gathers the new weights into the parameters; stage 3
        refreshes its shard and frees the (now stale) whole parameters."""
        if self.stage == 3:
            if not self.shared:
                self.param_shard.copy_(self.master.detach())
            self.gathered = True          # force the free below
            self.free()
            return
        g = self.group
        mine = self.master.detach().to(self.dtype)
        full = g.all_gather(mine, dim=0, site=f"zero2.params.{label}.{self.name}") if g.size > 1 else mine
        copy_flat_into(self.params, full)

    def _own_slice(self) -> torch.Tensor:
        """This rank's slice of the whole parameters, flat fp32 ``[shard_size]`` (they must be whole)."""
        return self.flat([p.detach().float() for p in self.params])[self.start:self.start + self.shard_size]

    def take_written(self) -> None:
        """The shard takes what code wrote into the whole parameters (see
        :meth:`mlmkit.data_parallel.optimizer._Base.params_written`)."""
        if take_written(self.master, self._own_slice(), self.dtype) and self.param_shard is not None \
                and not self.shared:
            with torch.no_grad():
                self.param_shard.copy_(self.master.detach())

    def refresh_from_params(self) -> None:
        """The shard (master, and stage 3's parameter shard) from the whole parameters (after a load)."""
        with torch.no_grad():
            self.master.copy_(self._own_slice())
            if self.param_shard is not None and not self.shared:
                self.param_shard.copy_(self.master.detach())


class FullyShardedAdamW(_Base):
    """AdamW over :class:`ShardedUnit` s: ZeRO stage 2 or 3 (module docstring).

    Args:
        units: ``(name, chunk, named parameters, module)`` from :func:`shard_units`.
        stage: 2 or 3.
    """

    def __init__(self, units, groups, *, stage: int, **kw):
        named = [(n, p) for _, _, ps, _ in units for n, p in ps]
        super().__init__(named, groups, **kw)
        if stage not in (2, 3):
            raise ValueError(f"FullyShardedAdamW: stage={stage!r} must be 2 or 3")
        self.stage = stage
        self.units = [ShardedUnit(name, ps, self.reduce, stage=stage, counted=self.counted, module=module)
                      for name, _, ps, module in units]
        self.opt = torch.optim.AdamW([u.master for u in self.units], lr=0.0, **self.hyper)
        # the stretches of each unit's shard that weight decay applies to (optimizer.decayed)
        self.decay_spans = [counted_spans(u.params, lambda p: id(p) in self.decayed_ids, u.start, u.shard_size)
                            for u in self.units]
        if stage == 3:
            for u in self.units:
                u.free()

    # ------------------------------------------------------------------ one step
    def reduce_grads(self) -> None:
        """At the optimizer step: every unit not reduced during the backward."""
        for u in self.units:
            if u.shard_grad is None:
                u.reduce_grads(divisor=self.divisor, reduce_dtype=self.grad_reduce_dtype, label=self.label)

    def reduce_in_backward(self, unit: ShardedUnit, tp: CommGroup) -> None:
        """A layer's last backward of the step has passed: sum its tp-partial gradients over tp
        (sequence parallelism, replicated key/value heads), then reduce-scatter it and free it."""
        from mlmkit.tensor_parallel import sync_replicated_grads, sync_sequence_parallel_grads

        sync_sequence_parallel_grads(unit.module, tp)
        sync_replicated_grads(unit.module, tp)
        unit.reduce_grads(divisor=self.divisor, reduce_dtype=self.grad_reduce_dtype, label=self.label)

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The reduced gradient shards held until the update (memory accounting)."""
        return [u.shard_grad for u in self.units if u.shard_grad is not None]

    def local_sumsq(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.groups.device)
        for u in self.units:
            total = total + shard_sumsq(u.shard_grad, u.counted_spans)
        return total

    def apply(self, *, lr: float, coef: float) -> None:
        for u in self.units:
            u.master.grad = u.shard_grad * coef if coef < 1.0 else u.shard_grad
            u.shard_grad = None
        for g in self.opt.param_groups:
            g["lr"] = lr
        for u, spans in zip(self.units, self.decay_spans):
            apply_decay(u.master, spans, lr, self.weight_decay)
        self.opt.step()
        for u in self.units:
            u.master.grad = None
            u.write_back(label=self.label)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad, p.grad_reduced = None, False
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None                 # allocated again by the first accumulation
        for u in self.units:
            u.shard_grad = None
            u.passes = 0

    # ------------------------------------------------------------------ whole parameters on demand
    @contextlib.contextmanager
    def materialized(self):
        """Stage 3: every parameter whole inside the block (checkpoints, inspection); freed after.
        Collective over the replicas."""
        if self.stage != 3:
            yield
            return
        before = [u.gathered for u in self.units]
        for u in self.units:
            u.gather(phase="")
        try:
            yield
        finally:
            for u, was in zip(self.units, before):
                if not was:
                    u.free()

    def params_loaded(self) -> None:
        for u in self.units:
            u.refresh_from_params()

    def params_written(self) -> None:
        for u in self.units:
            if u.gathered:          # stage 3: a unit freed now was not written (only whole ones can be)
                u.take_written()

    # ------------------------------------------------------------------ memory accounting
    def state_tensors(self) -> list[torch.Tensor]:
        """Adam's moments and the fp32 master shards (under stage 3 in fp32 the master shard is the
        parameter shard, counted with the parameters)."""
        out = [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        for u in self.units:
            if not u.shared:
                out.append(u.master)
        return out

    def parameter_tensors(self) -> list[torch.Tensor]:
        """Stage 3: the parameter shards this rank keeps."""
        return [u.param_shard for u in self.units if u.param_shard is not None]

    # ------------------------------------------------------------------ checkpoints
    def _gather(self, u: ShardedUnit, local: torch.Tensor) -> torch.Tensor:
        g = u.group
        return g.all_gather(local.detach(), dim=0, site="zero.checkpoint") if g.size > 1 else local.detach()

    def state_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
        states, step = {}, 0
        for u in self.units:
            full = {}
            if u.master in self.opt.state:
                full = {k: self._gather(u, self.opt.state[u.master][k]) for k in _STATE_KEYS}
                step = int(self.opt.state[u.master]["step"])
            full["master"] = self._gather(u, u.master)
            offset = 0
            for n, p in u.named:
                states[n] = {k: v[offset:offset + p.numel()].view(p.shape).clone() for k, v in full.items()}
                offset += p.numel()
        return states, step

    def load_state_by_name(self, states: dict, step: int) -> None:
        for u in self.units:
            sl = slice(u.start, u.start + u.shard_size)
            if all("master" in states.get(n, {}) for n, _ in u.named):
                flat = u.flat([states[n]["master"].float() for n, _ in u.named])
                with torch.no_grad():
                    u.master.copy_(flat[sl])
                    if u.param_shard is not None and not u.shared:
                        u.param_shard.copy_(u.master.detach())
            if all(all(k in states.get(n, {}) for k in _STATE_KEYS) for n, _ in u.named):
                flat = {k: u.flat([states[n][k].float() for n, _ in u.named]) for k in _STATE_KEYS}
                self.opt.state[u.master] = {"step": torch.tensor(float(step)),
                                            **{k: flat[k][sl].clone() for k in _STATE_KEYS}}


class Zero3Hooks:
    """Gathers and frees stage-3 units around their use, and reduces a layer's gradient once its
    last backward of the step has passed (stages 2 and 3; module docstring). Install with
    :meth:`attach`; the executor calls :meth:`backward_done` after each backward action.

    Args:
        microbatches: backward passes per chunk and step (the last one reduces).
        tp: the tensor-parallel group (its partial gradients are summed before the reduction).
        reduce_in_backward: ``False`` under a split backward (the weight gradients come in W):
            everything is then reduced at the optimizer step.
    """

    def __init__(self, optimizer: FullyShardedAdamW, chunks: Sequence[nn.Module], *, prefetch: int = 0,
                 reshard_after_forward: bool = True, microbatches: int = 1, tp: Optional[CommGroup] = None,
                 reduce_in_backward: bool = True):
        self.opt, self.chunks = optimizer, list(chunks)
        self.microbatches, self.tp, self.reduce_in_backward = microbatches, tp, reduce_in_backward
        self.prefetch, self.reshard = prefetch, reshard_after_forward
        by_name = {u.name: u for u in optimizer.units}
        # a chunk's root units: the root and its tied embedding copy (either may be absent)
        self.root = {c: [by_name[n] for n in (f"chunk{c}.root", f"chunk{c}.tied_embedding") if n in by_name]
                     for c in range(len(self.chunks))}
        self.layers = {c: [by_name[f"chunk{c}.layers.{k}"] for k in chunk.layers.keys() if f"chunk{c}.layers.{k}" in by_name]
                       for c, chunk in enumerate(self.chunks)}
        self.memory = None
        self._handles = []

    def attach(self) -> "Zero3Hooks":
        for c, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._chunk_pre(c)))
            self._handles.append(chunk.register_forward_hook(self._chunk_post(c)))
            units = self.layers[c]
            for i, (layer, unit) in enumerate(zip(chunk.layers.values(), units)):
                self._handles.append(layer.register_forward_pre_hook(self._layer_pre(c, i)))
                self._handles.append(layer.register_forward_hook(self._layer_post(c, i)))
        return self

    def _gather(self, unit, phase) -> None:
        if unit is not None:
            unit.gather(phase=phase, memory=self.memory)

    # ------------------------------------------------------------------ chunk (root unit)
    def _chunk_pre(self, c):
        def hook(module, args):
            for unit in self.root[c]:
                self._gather(unit, "forward")
        return hook

    def _chunk_post(self, c):
        def hook(module, args, out):
            if not self.root[c]:
                return
            for unit in self.root[c]:
                if self.reshard and not unit.in_backward:
                    unit.free()
            if torch.is_tensor(out) and out.requires_grad and torch.is_grad_enabled():
                out.register_hook(self._backward_gather(c, None))
        return hook

    # ------------------------------------------------------------------ layers
    def _layer_pre(self, c, i):
        def hook(module, args):
            units = self.layers[c]
            self._gather(units[i], "forward")
            if self.prefetch and i + 1 < len(units):
                self._gather(units[i + 1], "forward")
            x = args[0] if args else None
            if torch.is_tensor(x) and x.requires_grad and torch.is_grad_enabled() and not units[i].in_backward:
                # The gradient of this layer's input: its backward has passed; the layer before
                # (if any) runs next. An input that is a leaf (a received activation) gets its
                # gradient as its own accumulation, possibly before this layer's weights get
                # theirs: the layer is then reduced at the end of the backward action.
                x.register_hook(self._backward_boundary(c, i, leaf=x.grad_fn is None))
        return hook

    def _layer_post(self, c, i):
        def hook(module, args, out):
            unit = self.layers[c][i]
            if unit.in_backward:          # a recomputation inside backward: keep it whole
                return
            if self.reshard:
                unit.free()
            if i == len(self.layers[c]) - 1 and torch.is_tensor(out) and out.requires_grad and torch.is_grad_enabled():
                out.register_hook(self._backward_gather(c, i))
        return hook

    def _backward_gather(self, c, i):
        # The output gradient of layer i (None: of the chunk) is ready: gather what runs backward next.
        def hook(grad):
            if i is None:
                for unit in self.root[c]:
                    self._enter_backward(unit)
            else:
                self._enter_backward(self.layers[c][i])
                if self.prefetch and i > 0:
                    self._enter_backward(self.layers[c][i - 1])
        return hook

    def _backward_boundary(self, c, i, leaf: bool):
        # Layer i's input gradient is ready: its weights' gradients are complete (an accumulation
        # runs as soon as it is ready, before any other node); reduce it after the step's last
        # pass, free layer i, gather layer i-1 (whose output it is).
        def hook(grad):
            units = self.layers[c]
            unit = units[i]
            unit.passes += 1
            if not leaf:
                self._maybe_reduce(unit)
            if self.reshard:
                unit.free()
            if i > 0:
                self._enter_backward(units[i - 1])
                if self.prefetch and i > 1:
                    self._enter_backward(units[i - 2])
        return hook

    def _maybe_reduce(self, unit) -> None:
        if self.reduce_in_backward and unit.passes == self.microbatches and unit.shard_grad is None:
            if self.memory is not None:      # the moment this layer's whole gradient is largest
                self.memory.record(action=f"reduce {unit.name}", microbatch=-1)
            self.opt.reduce_in_backward(unit, self.tp)

    def _enter_backward(self, unit) -> None:
        if unit is None:
            return
        self._gather(unit, "backward")
        unit.in_backward = True

    def backward_done(self, chunk: int) -> None:
        """End of a backward action on ``chunk``: free what is still whole (the root, a layer whose
        input needed no gradient) and reduce a first layer whose input was a leaf."""
        for unit in self.layers[chunk]:
            self._maybe_reduce(unit)
        for unit in [*self.root[chunk], *self.layers[chunk]]:
            unit.in_backward = False
            if self.reshard:
                unit.free()

    def reset(self) -> None:
        """After an abandoned step: every unit freed, no backward in progress."""
        for unit in self.opt.units:
            unit.in_backward = False
            unit.free()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
