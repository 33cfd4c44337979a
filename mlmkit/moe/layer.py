"""The mixture-of-experts MLP with expert parallelism (Megatron-Core's MoE layer, all-to-all dispatcher).

forward, for this rank's tokens ``x [s, b, h]`` (``[s/t, b, h]`` with sequence parallelism, ``s/cp``
with context parallelism) flattened to ``[T, h]``:

1. route: router logits ``x W_r^T`` ``[T, E]`` (fp32) -> top-k experts and weights per token
   (:func:`mlmkit.moe.routing.route`); with a capacity factor, over-full experts drop assignments;
2. permute: the ``T k`` assignments sorted by expert (stable), ``[A, h]`` copies of their tokens;
3. dispatch: the expert counts are exchanged over the ep group (all-to-all of ``[ep, E/ep]``
   counts), then the tokens travel to the ranks holding their experts
   (``all_to_all_single`` with uneven splits); received rows are regrouped by local expert;
4. experts: each local expert's MLP on its rows (with ``expert_tp > 1`` the rows of the expert-tp
   group are all-gathered, padded to the longest, and the outputs reduce-scattered back, as
   sequence parallelism does);
5. combine: the inverse all-to-all brings every output back to its token's rank, where it is
   un-permuted and summed with the router weights: ``y_t = sum_j w_tj E_j(x_t)`` (plus the shared
   expert's output, a dense tensor-parallel MLP every token goes through); with ``config.dropout``
   the sum then goes through the hidden dropout, as a dense MLP's output does.

backward: the same path reversed (autograd): the all-to-alls swap their splits, the router gets the
gradient of its weights through the combine and, with ``moe_aux_loss_coeff``, the gradient of the
load-balancing loss ``aux = E sum_e f_e P_e`` (Switch) and the z-loss, injected as Megatron-LM
does: an identity on the layer's output whose backward adds ``d(aux)/d(router)``.

Gradients: expert weights are reduced over the expert-data-parallel group and divided by
``dp * cp`` (each expert copy summed tokens routed from several replicas); dense weights, the
router and the shared expert included, over dp x cp as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mlmkit.distributed import CommGroup
from mlmkit.model.config import GPTConfig
from mlmkit.moe.routing import balance_terms, capacity, capacity_keep, route
from mlmkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_parameter
from mlmkit.tensor_parallel.random import dropout

__all__ = ["ExpertGroups", "ExpertMLP", "MoELayer", "Router", "all_to_all"]


@dataclass
class ExpertGroups:
    """The groups a MoE layer uses: ``ep`` (ranks splitting the experts), ``expert_tp`` (ranks
    splitting each expert) and ``tokens`` (ranks splitting one microbatch's tokens: tp with sequence
    parallelism, times cp), over which routing statistics are summed."""

    ep: CommGroup
    expert_tp: CommGroup
    tokens: CommGroup

    @classmethod
    def single(cls) -> "ExpertGroups":
        return cls(ep=CommGroup.single("ep"), expert_tp=CommGroup.single("expert_tp"),
                   tokens=CommGroup.single("tp_cp"))


class _AllToAll(torch.autograd.Function):
    """Rows to ranks (uneven splits); backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group: CommGroup, send, recv, site):
        ctx.group, ctx.send, ctx.recv, ctx.site = group, send, recv, site
        return group.all_to_all(x, send_splits=send, recv_splits=recv, site=site, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        out = ctx.group.all_to_all(grad.contiguous(), send_splits=ctx.recv, recv_splits=ctx.send, site=ctx.site,
                                   phase="backward")
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, group: CommGroup, *, send: list[int], recv: list[int], site: str) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over ``group`` (``x [N, ...]``, ``send``/``recv`` row counts)."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(send), list(recv), site)


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; backward also hands ``scale`` as the gradient of ``aux`` (a scalar whose
    graph reaches the router), so the auxiliary losses train the router without travelling to the
    pipeline's last stage (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


def _seeded(seed: int, name: str, std: float):
    from mlmkit.model.blocks import seeded_normal

    return seeded_normal(seed, name, std)


class Router(nn.Module):
    """``logits = x W^T`` in fp32, ``W [E, h]`` replicated on every rank (a dense parameter; with
    sequence parallelism its gradient is summed over tp, each tp rank having routed its own tokens)."""

    def __init__(self, config: GPTConfig, *, site: str, sequence_parallel: bool, device=None):
        super().__init__()
        E, h = config.experts, config.hidden
        w = _seeded(config.seed, f"{site}.router.weight", config.init_std)((E, h))
        self.weight = mark_parameter(nn.Parameter(w.to(device)), split_dim=None, global_shape=(E, h),
                                     sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.float().t()                   # [T, h] -> [T, E]


class ExpertMLP(nn.Module):
    """One expert: the model's MLP kind (GELU or fused SwiGLU) of width ``moe_ffn``, split over the
    expert-tp group. Input and output ``[n, 1, h]``; with ``expert_tp > 1`` the rows of the group are
    gathered before ``fc1`` and reduce-scattered after ``fc2`` (sequence-parallel style)."""

    def __init__(self, config: GPTConfig, *, name: str, expert_tp: CommGroup, device=None, wgrad=None):
        super().__init__()
        h, ffn, self.kind = config.hidden, config.moe_ffn, config.mlp
        sp = expert_tp.size > 1
        kw = dict(tp=expert_tp, sequence_parallel=sp, bias=config.bias, device=device, wgrad=wgrad)
        out_std = config.init_std / math.sqrt(2 * config.layers)
        if config.mlp == "gelu":
            self.fc1 = ColumnParallelLinear(h, ffn, site=f"{name}.fc1", init=_seeded(config.seed, f"{name}.fc1.weight",
                                                                                      config.init_std), **kw)
        else:
            gate, up = (_seeded(config.seed, f"{name}.{p}.weight", config.init_std) for p in ("gate", "up"))
            self.fc1 = ColumnParallelLinear(h, 2 * ffn, site=f"{name}.fc1", partitions=2,
                                            init=lambda shape: torch.cat([gate((shape[0] // 2, shape[1])),
                                                                          up((shape[0] // 2, shape[1]))]), **kw)
        self.fc2 = RowParallelLinear(ffn, h, tp=expert_tp, sequence_parallel=sp, site=f"{name}.fc2", bias=config.bias,
                                     device=device, wgrad=wgrad, init=_seeded(config.seed, f"{name}.fc2.weight", out_std))
        for p in self.parameters():
            p.expert = True
            if getattr(p, "sequence_parallel", False):     # fc2's bias: summed over expert-tp, not tp
                p.sequence_parallel = False
                p.expert_tp_sum = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.kind == "gelu":
            y = F.gelu(y)
        else:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return self.fc2(y)


class MoELayer(nn.Module):
    """A mixture of ``config.experts`` expert MLPs replacing the dense MLP of layer ``layer``
    (module docstring). This rank holds experts ``[ep_rank E/ep, (ep_rank + 1) E/ep)``, named by
    their global index (``layers.3.mlp.experts.5.fc1.weight``), so names and initial weights do not
    depend on the layout."""

    def __init__(self, config: GPTConfig, *, layer: int, tp: CommGroup, sequence_parallel: bool,
                 groups: Optional[ExpertGroups] = None, rng=None, device=None, wgrad=None):
        super().__init__()
        groups = groups or ExpertGroups.single()
        if config.dropout and rng is None:
            raise ValueError(f"MoELayer: dropout={config.dropout} needs rng (a TPRandomState) for its hidden "
                             f"dropout; pass the model's, or set dropout=0")
        self.config, self.layer, self.groups, self.rng = config, layer, groups, rng
        self.site = f"layers.{layer}.mlp"
        self.sp = sequence_parallel
        E, ep = config.experts, groups.ep.size
        self.local_count = E // ep
        self.first = groups.ep.rank * self.local_count
        h = config.hidden
        self.router = Router(config, site=self.site, sequence_parallel=sequence_parallel, device=device)
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(config, name=f"{self.site}.experts.{e}", expert_tp=groups.expert_tp, device=device,
                              wgrad=wgrad)
            for e in range(self.first, self.first + self.local_count)})
        if config.moe_shared_ffn_hidden:
            from mlmkit.model.blocks import ParallelMLP

            self.shared = ParallelMLP(config, layer=layer, tp=tp, sequence_parallel=sequence_parallel, rng=rng,
                                      device=device, wgrad=wgrad, ffn=config.moe_shared_ffn_hidden,
                                      name=f"{self.site}.shared", dropout=False)
        else:
            self.shared = None
        self.aux_scale = 1.0          # the executor sets cp / microbatches (see module docstring)
        self.history: list[dict] = []  # per forward (recomputations excluded): routing statistics

    # ------------------------------------------------------------------ helpers
    def _recomputing(self) -> bool:
        return bool(getattr(self.rng, "recomputing", False))

    def _record(self, *, routed, kept, dropped, aux, z, received) -> None:
        if self._recomputing():
            return
        self.history.append({"routed": routed, "kept": kept, "dropped": dropped, "aux_loss": aux, "z_loss": z,
                             "received": received})
        tr = self.groups.ep.tracer
        if tr is not None and tr.enabled and hasattr(tr, "record_moe"):
            tr.record_moe(site=self.site, routed=routed, kept=kept, received=received, dropped=dropped,
                          aux_loss=aux, z_loss=z)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, g = self.config, self.groups
        shape = x.shape                                               # [s, b, h] (local tokens)
        tokens = x.reshape(-1, shape[-1])                            # [T, h]
        T, E, k = tokens.shape[0], cfg.experts, cfg.top_k
        logits = self.router(tokens)                                  # [T, E] fp32
        r = route(logits, top_k=k, score=cfg.moe_router, renormalize=cfg.moe_renormalize,
                  force_uniform=cfg.moe_force_uniform, scores_grad=cfg.moe_aux_loss_coeff > 0)
        weights, indices = r.weights, r.indices
        keep = None
        if cfg.moe_capacity_factor is not None:
            cap = capacity(T, top_k=k, experts=E, factor=cfg.moe_capacity_factor)
            keep = capacity_keep(indices, weights, experts=E, cap=cap, policy=cfg.moe_drop_policy)
        # ---------------------------------------------------------- statistics and auxiliary losses
        with torch.no_grad():
            counts, score_sums, zsum = balance_terms(logits, r, experts=E)
            stats = torch.cat([counts, score_sums, zsum.view(1), torch.tensor([float(T)], device=counts.device)])
        if g.tokens.size > 1:
            g.tokens.all_reduce(stats, site=f"{self.site}.router_stats", phase="forward")
        total_counts, total_scores, total_z, total_T = stats[:E], stats[E:2 * E], stats[2 * E], stats[2 * E + 1]
        f = total_counts / (total_T * k)
        aux_value = float(E * (f * total_scores / total_T).sum()) * cfg.moe_aux_loss_coeff
        z_value = float(total_z / total_T) * cfg.moe_z_loss_coeff
        aux_local = None      # this rank's part of the microbatch's auxiliary losses (with a graph)
        if cfg.moe_aux_loss_coeff > 0:
            aux_local = cfg.moe_aux_loss_coeff * E * (f * r.scores.sum(dim=0)).sum() / total_T
        if cfg.moe_z_loss_coeff > 0:
            zl = cfg.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).sum() / total_T
            aux_local = zl if aux_local is None else aux_local + zl
        # ---------------------------------------------------------- permute by expert
        flat_tok = torch.arange(T, device=x.device).repeat_interleave(k)      # [T k] token of each assignment
        flat_e, flat_w = indices.reshape(-1), weights.reshape(-1)
        if keep is not None:
            mask = keep.reshape(-1)
            flat_tok, flat_e, flat_w = flat_tok[mask], flat_e[mask], flat_w[mask]
        order = torch.sort(flat_e, stable=True).indices
        tok_sorted, e_sorted = flat_tok[order], flat_e[order]
        per_expert = torch.bincount(e_sorted, minlength=E)                    # [E] kept assignments
        rows = tokens[tok_sorted]                                             # [A, h]
        # ---------------------------------------------------------- dispatch over ep
        L = self.local_count
        if g.ep.size > 1:
            send_counts = per_expert.view(g.ep.size, L)                        # to rank j: its experts' counts
            recv_counts = g.ep.all_to_all(send_counts.reshape(-1).contiguous(), send_splits=[L] * g.ep.size,
                                          recv_splits=[L] * g.ep.size, site=f"{self.site}.counts",
                                          phase="forward").view(g.ep.size, L)  # [source, local expert]
            send = send_counts.sum(1).tolist()
            recv = recv_counts.sum(1).tolist()
            rows = all_to_all(rows, g.ep, send=send, recv=recv, site=f"{self.site}.dispatch")
        else:
            recv_counts = per_expert.view(1, L)
        # received rows are [source][local expert]; regroup them [local expert][source]
        block = recv_counts.reshape(-1)                                      # sizes in received order
        starts = torch.cumsum(block, 0) - block
        by_expert = torch.cat([torch.arange(int(starts[s * L + e]), int(starts[s * L + e] + block[s * L + e]),
                                            device=x.device)
                               for e in range(L) for s in range(recv_counts.shape[0])]) if rows.shape[0] else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        grouped = rows[by_expert]
        sizes = recv_counts.sum(0).tolist()                                   # rows per local expert
        # ---------------------------------------------------------- experts
        outs = []
        offset = 0
        padded = self._padded_sizes(sizes)
        for i, e in enumerate(range(self.first, self.first + L)):
            n, n_pad = sizes[i], padded[i]
            chunk = grouped[offset:offset + n]
            offset += n
            if n_pad > n:
                chunk = torch.cat([chunk, chunk.new_zeros(n_pad - n, chunk.shape[1])])
            if n_pad == 0:
                outs.append(chunk)
                continue
            y = self.experts[str(e)](chunk.unsqueeze(1)).squeeze(1)          # [n_pad, h]
            outs.append(y[:n])
        out_grouped = torch.cat(outs) if outs else grouped
        inverse = torch.empty_like(by_expert)
        inverse[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        out_rows = out_grouped[inverse]                                       # back in received order
        if g.ep.size > 1:
            out_rows = all_to_all(out_rows, g.ep, send=recv, recv=send, site=f"{self.site}.combine")
        # ---------------------------------------------------------- un-permute and weight
        w_sorted = flat_w[order].to(out_rows.dtype)
        y = torch.zeros_like(tokens).index_add(0, tok_sorted, out_rows * w_sorted[:, None])
        if self.shared is not None:
            y = y + self.shared(x).reshape(-1, shape[-1])
        y = y.view(shape)
        if aux_local is not None and torch.is_grad_enabled():
            y = _AttachAux.apply(y, aux_local, float(self.aux_scale))
        if self.config.dropout:
            # The hidden dropout after the MLP, as for a dense layer (Megatron-LM's bias-dropout-add
            # after the MoE layer): a sequence-parallel rank holds its own tokens, so its own stream.
            gen = self.rng.tensor_parallel if self.sp else self.rng.replicated
            y = dropout(y, self.config.dropout, generator=gen, training=self.training)
        routed = counts.long().tolist()
        kept = per_expert.tolist()
        self._record(routed=routed, kept=kept, dropped=int(sum(routed) - sum(kept)), aux=aux_value, z=z_value,
                     received=sizes)
        return y

    def _padded_sizes(self, sizes: list[int]) -> list[int]:
        # With expert tensor parallelism every member of the group computes every local expert on the
        # rows of the whole group, each contributing rows padded to the longest.
        etp = self.groups.expert_tp
        if etp.size == 1:
            return sizes
        t = torch.tensor(sizes, dtype=torch.int64, device=self.router.weight.device)
        etp.all_reduce(t, op="max", site=f"{self.site}.expert_tp_sizes", phase="forward")
        return t.tolist()

    def extra_repr(self) -> str:
        c = self.config
        return (f"experts={c.experts} (here {self.first}..{self.first + self.local_count - 1}), top_k={c.top_k}, "
                f"router={c.moe_router}, ep={self.groups.ep.size}, expert_tp={self.groups.expert_tp.size}, "
                f"capacity_factor={c.moe_capacity_factor}")
