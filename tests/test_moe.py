"""Mixture of experts with expert parallelism: dropless training in every layout of the parity suite
against the serial MoE model, the capacity rule against a serial reference, all-to-all bytes against
the routing, the estimator for forced even routing, checkpoints across ep, auxiliary losses, bad input."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mlmkit.distributed import ProcessGroups, run_ranks
from mlmkit.estimate import estimate_train_comm, estimate_train_memory, moe_parameter_counts
from mlmkit.estimate.compare import compare_comm, compare_memory
from mlmkit.model import GPT, gather_full
from mlmkit.model.config import moe_config
from mlmkit.model.gpt import moe_layers
from mlmkit.model.presets import preset
from mlmkit.moe.routing import capacity, capacity_keep, route
from mlmkit.trace.export import merge_traces
from mlmkit.train import TrainConfig
from mlmkit.train.checkpoint import load_checkpoint, save_checkpoint
from mlmkit.train.trainer import Trainer, traced_step

from parity_helpers import first_step_gradients, one_copy, reduced_gradients

MODEL = moe_config(seq_len=16, hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=64)
STEPS = 3
FP32_TOL = 1e-5
# Parameters after 3 AdamW steps: see tests/test_context_parallel.py. These tests take Adam's eps = 1e-6
# (not 1e-8): the update g / (sqrt(v) + eps) of an element whose gradient is near zero turns a rounding
# difference dg of its gradient into up to lr * dg / eps of parameter, and the expert-tp layout's shared
# expert has such elements (max difference 7e-5 with eps = 1e-8 on one host, 4.5e-6 with 1e-6; a missing
# gradient reduction moves a parameter by ~lr = 3e-3).
PARAM_TOL = 5e-5
BF16_LOSS_RTOL, BF16_TENSOR_RTOL = 1e-2, 2e-2


def _config(model=None, **options) -> TrainConfig:
    base = dict(micro_batch_size=2, global_batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=1, max_steps=5,
                grad_clip=1.0, weight_decay=0.01, eps=1e-6)
    return TrainConfig(model=model or MODEL, **{**base, **options})


def _starve(experts: int):
    """Route no token to the upper half of the experts (their ranks get empty all-to-alls and run
    their experts on zero rows): the router's logits for them are pushed down before the top-k."""
    import mlmkit.moe.layer as layer

    original = layer.route

    def starved(logits, **kw):
        mask = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        mask[experts // 2:] = -1e4
        return original(logits + mask, **kw)

    layer.route = starved
    return lambda: setattr(layer, "route", original)


def _train(rank, world_size, cfg_dict, starve=False):
    restore = _starve(TrainConfig.from_dict(cfg_dict).model.experts) if starve else None
    try:
        return _run(rank, world_size, cfg_dict)
    finally:
        if restore:
            restore()


def _run(rank, world_size, cfg_dict):
    cfg, groups, trainer = first_step_gradients(world_size, cfg_dict)
    grads = reduced_gradients(cfg, groups, trainer)
    row = trainer.finish_step()
    losses, aux = [row["loss"]], [row["aux_loss"]]
    for _ in range(STEPS - 1):
        row = trainer.train_step()
        losses.append(row["loss"])
        aux.append(row["aux_loss"])
    params = {}
    for chunk in trainer.chunks:
        params.update(gather_full(chunk))
    return {"losses": losses, "aux": aux, "grads": one_copy(cfg, groups, trainer, grads),
            "params": one_copy(cfg, groups, trainer, params)}


_SERIAL = {}


def _serial(cfg: TrainConfig, starve: bool = False) -> dict:
    key = json.dumps(cfg.model.to_dict(), sort_keys=True) + cfg.precision + str(starve) + str(cfg.global_batch_size)
    if key not in _SERIAL:
        _SERIAL[key] = _train(0, 1, _config(cfg.model, precision=cfg.precision,
                                            global_batch_size=cfg.global_batch_size).to_dict(), starve)
    return _SERIAL[key]


def _close(a, b, precision, tol) -> bool:
    return (a.double() - b.double()).abs().max().item() <= tol


# ------------------------------------------------------------------------------- dropless parity
# ep 2 and 4, ep x tp (sequence parallel), ep x pp with several schedules (dualpipev included), ep x
# cp, expert tensor parallelism, ZeRO-1, recomputation, both p2p paths, the auxiliary losses, sigmoid
# routing with a shared expert, Switch (top-1), GELU experts with biases, bf16.
AUX = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
LAYOUTS = {
    "ep2-dp2": dict(dp=2, ep=2),
    "ep4-dp4-aux": dict(dp=4, ep=4, model=AUX),
    "ep2-tp2-sp-aux": dict(tp=2, ep=2, sequence_parallel=True, model=AUX),
    "ep2-pp2-dp2-1f1b-batched": dict(pp=2, dp=2, ep=2, batch_p2p=True),
    "ep2-pp2-dp2-zbh1": dict(pp=2, dp=2, ep=2, schedule="zb-h1"),
    "ep2-pp2-dp2-interleaved": dict(pp=2, dp=2, ep=2, schedule="interleaved-1f1b", chunks=2, model={"layers": 4}),
    "ep2-pp2-dp2-dualpipev-aux": dict(pp=2, dp=2, ep=2, schedule="dualpipev", chunks=2, global_batch_size=16,
                                      model={"layers": 4, **AUX}),
    "ep4-cp2-dp2": dict(cp=2, dp=2, ep=4),
    # ep = 1: every rank holds every expert, and each expert's replicas (all tp x cp x dp ranks of a
    # stage) reduce its gradients together (they once were never reduced: replicas drifted apart).
    "ep1-dp2": dict(dp=2),
    "ep1-tp2-sp-cp2-zero1": dict(tp=2, cp=2, sequence_parallel=True, zero1=True),
    "expert_tp2-tp2-sp-gelu-bias-shared": dict(tp=2, expert_tp=2, sequence_parallel=True,
                                               model={"mlp": "gelu", "bias": True, "moe_shared_ffn_hidden": 32}),
    "ep2-dp2-zero1-full": dict(dp=2, ep=2, zero1=True, recompute="full"),
    "ep2-dp2-sigmoid-shared": dict(dp=2, ep=2, model={"moe_router": "sigmoid", "moe_shared_ffn_hidden": 32}),
    "ep2-dp2-switch-top1": dict(dp=2, ep=2, model={"top_k": 1, "moe_renormalize": False, "moe_aux_loss_coeff": 0.01}),
    "ep2-tp2-sp-bf16": dict(tp=2, ep=2, sequence_parallel=True, precision="bf16"),
    # Experts 2 and 3 get no token: their ranks send and receive empty all-to-alls.
    "ep4-dp4-starved-aux": dict(dp=4, ep=4, starve=True, model=AUX),
    "expert_tp2-ep2-tp2-sp-starved": dict(tp=2, dp=2, expert_tp=2, ep=2, sequence_parallel=True, starve=True),
    "ep2-pp2-dp2-starved-capacity": dict(pp=2, dp=2, ep=2, starve=True, model={"moe_capacity_factor": 1.0}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropless_layout_matches_serial(layout):
    options = dict(LAYOUTS[layout])
    starve = options.pop("starve", False)
    model = MODEL if "model" not in options else moe_config(**{**MODEL.to_dict(), **options.pop("model")})
    cfg = _config(model, **options)
    precision = cfg.precision
    results = run_ranks(_train, world_size=cfg.world_size, args=(cfg.to_dict(), starve), timeout_s=300)
    ref = _serial(cfg, starve)
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            tol = FP32_TOL * abs(want) if precision == "fp32" else BF16_LOSS_RTOL * abs(want)
            assert abs(got - want) <= tol, (layout, r["losses"], ref["losses"])
        assert r["aux"] == pytest.approx(ref["aux"], rel=1e-4 if precision == "fp32" else 5e-2, abs=1e-9)
    for kind in ("grads", "params"):
        merged = {}
        for r in results:
            merged.update(r[kind])
        assert set(merged) == set(ref[kind]), set(merged) ^ set(ref[kind])
        if precision == "bf16":
            # In bf16 a token whose top-k router scores are closer than bf16's rounding (0.4%) can go
            # to another expert in another layout; the experts it left and joined then get visibly
            # different gradients. Losses agree to bf16's noise (above); so do most tensors.
            errors = sorted((merged[n].double() - ref[kind][n].double()).norm().item()
                            / (ref[kind][n].double().norm().item() + 1e-30) for n in merged)
            assert errors[len(errors) // 2] <= BF16_TENSOR_RTOL, (layout, kind, errors)
            continue
        tol = FP32_TOL if kind == "grads" else PARAM_TOL
        bad = [n for n in merged if not _close(merged[n], ref[kind][n], precision, tol)]
        assert not bad, (layout, kind, bad[:5])
    assert ref["losses"][-1] < ref["losses"][0]


def test_auxiliary_losses_train_the_router():
    """The load-balancing loss changes the router's gradient (and only what feeds the router), and
    its reported value is Switch's E * sum_e f_e P_e recomputed from the serial routing."""
    grads = {}
    for coeff in (0.0, 0.1):
        model = moe_config(**{**MODEL.to_dict(), "moe_aux_loss_coeff": coeff})
        trainer = Trainer(_config(model, global_batch_size=2), groups=ProcessGroups.single())
        trainer.begin_step()
        while not trainer.executor.done:
            trainer.executor.step_action()
        grads[coeff] = {n: p.grad.clone() for n, p in trainer.named_parameters()}
        history = [layer.history[0] for layer in moe_layers(trainer.chunks[0])]
    router = "layers.1.mlp.router.weight"
    assert not torch.allclose(grads[0.0][router], grads[0.1][router])
    assert torch.equal(grads[0.0]["head_weight"], grads[0.1]["head_weight"])   # after the last MoE layer
    # recompute layer 0's aux loss from the serial model's own routing
    serial = GPT(model)
    tokens, _ = trainer.data.batch(0, 2)
    captured = {}
    serial.layers["0"].mlp.router.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
    serial(tokens)
    r = route(captured["logits"], top_k=model.top_k)
    T, E = r.scores.shape
    f = torch.bincount(r.indices.reshape(-1), minlength=E).float() / (T * model.top_k)
    P = r.scores.mean(0)
    assert history[0]["aux_loss"] == pytest.approx(0.1 * E * float((f * P).sum().detach()), rel=1e-5)


@pytest.mark.parametrize("router,top_k", [("softmax", 2), ("softmax", 1), ("sigmoid", 2)])
def test_auxiliary_loss_gradients_are_those_of_the_textbook_losses(router, top_k):
    """The gradients the auxiliary losses inject (an identity on each MoE layer's output whose
    backward adds them; every layout's parity run shares that code with its serial reference)
    against autograd of the losses written out here from the router's logits: Switch's
    ``aux = a E sum_e f_e P_e`` (f: share of the T k assignments, no gradient; P: mean score) and
    ST-MoE's ``z = c mean_t logsumexp(logits_t)^2`` (Fedus et al. 2021; Zoph et al. 2022), summed
    over the layers and added to the cross-entropy. Every gradient, serial model, one microbatch."""
    a, c = 0.05, 0.01
    shape = {**MODEL.to_dict(), "moe_router": router, "top_k": top_k, "moe_renormalize": top_k > 1}
    tokens, targets = Trainer(_config(moe_config(**shape)), groups=ProcessGroups.single()).data.batch(0, 2)
    with_losses = GPT(moe_config(**{**shape, "moe_aux_loss_coeff": a, "moe_z_loss_coeff": c}))
    with_losses(tokens, targets).backward()
    plain = GPT(moe_config(**shape))
    logits = []
    for layer in moe_layers(plain):
        layer.router.register_forward_hook(lambda m, i, out: logits.append(out))
    total = plain(tokens, targets)
    E = MODEL.experts
    for lg in logits:                                              # [T, E] per layer
        r = route(lg, top_k=top_k, score=router, renormalize=top_k > 1)
        f = torch.bincount(r.indices.reshape(-1), minlength=E).float() / (lg.shape[0] * top_k)
        total = total + a * E * (f * r.scores.mean(0)).sum() + c * torch.logsumexp(lg, dim=-1).pow(2).mean()
    total.backward()
    assert len(logits) == MODEL.layers
    want = dict(plain.named_parameters())
    for n, p in with_losses.named_parameters():
        torch.testing.assert_close(p.grad, want[n].grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    ce_only = GPT(moe_config(**shape))
    ce_only(tokens, targets).backward()
    for i in range(MODEL.layers):            # the losses moved every router's gradient: the check has teeth
        n = f"layers.{i}.mlp.router.weight"
        assert not torch.allclose(want[n].grad, dict(ce_only.named_parameters())[n].grad, rtol=1e-3, atol=0), n


def _plain_mlp(module, x: torch.Tensor, kind: str) -> torch.Tensor:
    """An (expert or shared) MLP written out from its weights: ``fc2(act(fc1 x))``, SwiGLU's fc1
    holding [gate; up]."""
    y = F.linear(x, module.fc1.weight, module.fc1.bias)
    if kind == "gelu":
        y = F.gelu(y)
    else:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return F.linear(y, module.fc2.weight, module.fc2.bias)


@pytest.mark.parametrize("options", [
    dict(mlp="gelu", bias=True, moe_shared_ffn_hidden=32),
    dict(top_k=1, moe_renormalize=False),
    dict(moe_router="sigmoid", moe_capacity_factor=0.5, moe_drop_policy="probs"),
], ids=["gelu-bias-shared", "top1", "sigmoid-capacity"])
def test_moe_layer_is_the_weighted_sum_of_its_experts(options):
    """The layer's permute, expert and un-permute path (shared by every layout's parity run and its
    serial reference) against the definition token by token: ``y_t = sum_j w_tj E_j(x_t)`` over the
    kept assignments, plus the shared expert, each MLP written out from its weights; and the
    gradients of the input and of every parameter through both."""
    cfg = moe_config(**{**MODEL.to_dict(), **options})
    layer = GPT(cfg).layers["1"].mlp
    x = torch.randn(cfg.seq_len, 3, cfg.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def grads(y):
        layer.zero_grad()
        x.grad = None
        (y * g).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    got = layer(x)
    got_grads = grads(got)
    tokens = x.reshape(-1, cfg.hidden)                                          # [T, h]
    r = route(tokens @ layer.router.weight.t(), top_k=cfg.top_k, score=cfg.moe_router, renormalize=cfg.moe_renormalize)
    keep = torch.ones_like(r.indices, dtype=torch.bool)
    if cfg.moe_capacity_factor is not None:
        cap = capacity(tokens.shape[0], top_k=cfg.top_k, experts=cfg.experts, factor=cfg.moe_capacity_factor)
        keep = capacity_keep(r.indices, r.weights, experts=cfg.experts, cap=cap, policy=cfg.moe_drop_policy)
        assert not keep.all()
    rows = []
    for t in range(tokens.shape[0]):
        y_t = torch.zeros(cfg.hidden)
        for j in range(cfg.top_k):
            if keep[t, j]:
                y_t = y_t + r.weights[t, j] * _plain_mlp(layer.experts[str(int(r.indices[t, j]))], tokens[t], cfg.mlp)
        rows.append(y_t)
    want = torch.stack(rows)
    if layer.shared is not None:
        want = want + _plain_mlp(layer.shared, tokens, cfg.mlp)
    want = want.view_as(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, grads(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- capacity mode
def _capacity_kept(routing, *, cap: int, policy: str) -> list[list[bool]]:
    """A direct, loop-by-loop implementation of the capacity rule: each expert keeps its ``cap``
    assignments with the largest weights (ties: earlier token, then earlier choice) or the first
    ``cap`` in token order; returns, per token and choice, whether the assignment is kept."""
    T, k = routing.indices.shape
    per_expert = {}
    for t in range(T):
        for j in range(k):
            per_expert.setdefault(int(routing.indices[t, j]), []).append((-float(routing.weights[t, j]), t, j))
    kept = [[False] * k for _ in range(T)]
    for items in per_expert.values():
        if policy == "probs":
            items.sort()
        else:
            items.sort(key=lambda x: (x[1], x[2]))
        for _, t, j in items[:cap]:
            kept[t][j] = True
    return kept


def _capacity_reference(logits: torch.Tensor, *, top_k: int, cap: int, policy: str) -> int:
    """The number of assignments :func:`_capacity_kept` drops."""
    return sum(row.count(False) for row in _capacity_kept(route(logits, top_k=top_k), cap=cap, policy=policy))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_assignments_the_rule_names(policy):
    """Which assignments survive, not only how many (the layouts' parity runs share
    :func:`capacity_keep` with their serial reference, and the trace counts drops only): random
    logits, and integer ones whose equal weights exercise the tie rule, over token counts, top-k and
    capacities that drop from none to most."""
    g = torch.Generator().manual_seed(0)
    checked = dropped = 0
    for trial in range(48):
        T, k, E = [(13, 2, 4), (32, 1, 8), (7, 3, 5), (20, 2, 3)][trial % 4]
        logits = torch.randn(T, E, generator=g) if trial % 2 else torch.randint(0, 3, (T, E), generator=g).float()
        r = route(logits, top_k=k)
        cap = capacity(T, top_k=k, experts=E, factor=[0.3, 0.75, 1.0, 2.0][trial // 4 % 4])
        keep = capacity_keep(r.indices, r.weights, experts=E, cap=cap, policy=policy)
        assert keep.tolist() == _capacity_kept(r, cap=cap, policy=policy), (trial, T, k, E, cap)
        checked, dropped = checked + T * k, dropped + int((~keep).sum())
    assert 0 < dropped < checked


def _first_step_moe_trace(rank, world_size, cfg_dict):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single())
    trainer.train_step()
    return trainer.traces()["moe"], trainer.traces()["comm"]


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(tp=2, ep=2, sequence_parallel=True)], ids=["dp2-ep2", "tp2-sp-ep2"])
def test_capacity_drops_match_a_serial_reference(layout, policy):
    model = moe_config(**{**MODEL.to_dict(), "moe_capacity_factor": 0.5, "moe_drop_policy": policy})
    cfg = _config(model, **layout)
    traces = run_ranks(_first_step_moe_trace, world_size=cfg.world_size, args=(cfg.to_dict(),), timeout_s=300)
    moe = merge_traces([{"moe": m} for m, _ in traces])["moe"]
    for (rank, site), calls in moe.groupby(["rank", "site"]).call:      # each layer's calls 0, 1, ... in order
        assert list(calls) == list(range(cfg.microbatches)), (rank, site, list(calls))
    # Serial reference: the same global batch through the serial model (identical weights at step 0),
    # the router logits of every layer and microbatch cut into the token groups each rank routed.
    serial = GPT(model)
    logits = {}
    for i in range(model.layers):
        serial.layers[str(i)].mlp.router.register_forward_hook(
            lambda m, inp, out, i=i: logits.setdefault(i, []).append(out.detach()))
    trainer = Trainer(_config(model), groups=ProcessGroups.single())
    tokens, _ = trainer.data.batch(0, cfg.global_batch_size)
    b, s, k, E = cfg.micro_batch_size, model.seq_len, model.top_k, model.experts
    for mb in tokens.split(b):
        serial(mb)
    t = cfg.tp
    expected = total = 0
    for i in range(model.layers):
        for out in logits[i]:                                  # one serial microbatch: [s * b, E], s-major
            for part in out.split(s // t * b):                 # each tensor-parallel rank's tokens
                cap = math.ceil(0.5 * part.shape[0] * k / E)
                expected += _capacity_reference(part, top_k=k, cap=cap, policy=policy)
                total += part.shape[0] * k
    assert int(moe.dropped.sum()) == expected, (int(moe.dropped.sum()), expected)
    assert 0 < expected < total


# ------------------------------------------------------------------------------- bytes
def test_all_to_all_bytes_equal_what_the_routing_decided():
    model = moe_config(**{**MODEL.to_dict(), "moe_capacity_factor": 1.0})
    cfg = _config(model, dp=4, ep=4)
    traces = run_ranks(_first_step_moe_trace, world_size=4, args=(cfg.to_dict(),), timeout_s=300)
    h, E, ep = model.hidden, model.experts, 4
    local = E // ep
    for rank, (moe, comm) in enumerate(traces):
        a2a = comm[(comm.axis == "ep") & (comm.op == "all_to_all")]
        expected_peer = {}
        for row in moe.itertuples():
            kept = row.kept                                     # this rank's assignments per expert
            mine = sum(kept[rank * local:(rank + 1) * local])
            incoming = sum(row.received) - mine                 # rows from the other ranks
            for peer in range(ep):
                if peer == rank:
                    continue
                out_rows = sum(kept[peer * local:(peer + 1) * local])
                expected_peer[peer] = expected_peer.get(peer, 0) + 2 * out_rows * h * 4 + local * 8
            # what came in goes back (combine) and its gradient arrives again: 2 * incoming rows out
            expected_peer["in"] = expected_peer.get("in", 0) + 2 * incoming * h * 4
        total_expected = sum(v for k, v in expected_peer.items())
        assert int(a2a.wire_bytes.sum()) == total_expected, rank
        per_peer = a2a.groupby(a2a.ranks.map(lambda r: r[1])).wire_bytes.sum()
        assert set(per_peer.index) == set(range(ep)) - {rank}


@pytest.fixture(scope="module")
def uniform_traces():
    model = moe_config(**{**MODEL.to_dict(), "moe_force_uniform": True})
    out = {}
    for name, options in {"tp2-sp-ep4-zero1": dict(tp=2, dp=2, ep=4, sequence_parallel=True, zero1=True),
                          "expert_tp2-gelu-bias-shared": dict(tp=2, dp=2, expert_tp=2, ep=2, sequence_parallel=True),
                          "pp2-ep2-full-bf16": dict(pp=2, dp=2, ep=2, recompute="full", precision="bf16"),
                          "cp2-ep4": dict(cp=2, dp=2, ep=4),
                          "tp2-sp-dp2-ep1-zero1": dict(tp=2, dp=2, sequence_parallel=True, zero1=True),
                          # ZeRO-1 under bf16: fp32 gradients reduce-scattered, bf16 parameters gathered
                          # (the experts' too: 6 bytes per element on the wire, not an all-reduce's 8)
                          "dp4-ep2-zero1-bf16": dict(dp=4, ep=2, zero=1, precision="bf16"),
                          # a split backward: the experts' fc1/fc2 inputs and output gradients held from I to W
                          "pp2-cp2-zbh1": dict(pp=2, cp=2, schedule="zb-h1"),
                          # a capacity that drops half of the assignments (fewer rows on the wire and
                          # in the experts), the load-balancing and z losses' saved tensors, sigmoid scores
                          "ep2-drops-aux-z-sigmoid": dict(dp=2, ep=2, model=dict(
                              moe_capacity_factor=0.5, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                              moe_router="sigmoid")),
                          # drops by position over expert-tp; sigmoid scores without the balancing loss
                          # keep no graph (a stage ending in the MoE layer peaked inside its forward)
                          "tp2-sp-expert_tp2-pp2-drops-sigmoid": dict(
                              tp=2, pp=2, expert_tp=2, sequence_parallel=True, model=dict(
                                  moe_capacity_factor=0.75, moe_drop_policy="position", moe_router="sigmoid")),
                          # a split backward walks the shared expert first: its fc2's output gradient is
                          # kept before anything is freed; full recomputation: every layer's tensors for
                          # W are kept before the chunk's first checkpointed input is freed
                          "tp2-sp-pp2-shared-zbh1": dict(tp=2, pp=2, sequence_parallel=True, schedule="zb-h1",
                                                         model=dict(moe_shared_ffn_hidden=32)),
                          "pp2-dp2-ep2-zbh1-full": dict(pp=2, dp=2, ep=2, schedule="zb-h1", recompute="full"),
                          # the hidden dropout after the MoE MLP (its mask, the tp ranks' own stream with SP)
                          "tp2-sp-pp2-dropout-shared-zbh1": dict(tp=2, pp=2, sequence_parallel=True, schedule="zb-h1",
                                                                 model=dict(dropout=0.1, moe_shared_ffn_hidden=32)),
                          # tokens x top_k not a multiple of the experts: the round robin loads some experts
                          # one row more, and a rank's 4 tokens reach only experts 0-3 of 6, so ep rank 1 gets
                          # one expert's rows, experts 4 and 5 run nothing and ZeRO-1 holds no gradient for them
                          "uneven-idle-tp2-sp-cp2-ep2-zero1": dict(
                              tp=2, cp=2, ep=2, sequence_parallel=True, zero=1, micro_batch_size=1, global_batch_size=4,
                              model=dict(experts=6, top_k=1, moe_renormalize=False)),
                          # ... the same rows over expert-tp with a capacity, and plain data parallelism,
                          # which zero-fills the idle experts' gradients for its all-reduce
                          "uneven-idle-expert_tp2-capacity": dict(
                              tp=2, cp=2, ep=2, expert_tp=2, sequence_parallel=True, micro_batch_size=1,
                              global_batch_size=4, model=dict(experts=6, top_k=1, moe_renormalize=False,
                                                              moe_capacity_factor=1.0, bias=True, mlp="gelu")),
                          # ... under bf16, where every parameter has its fp32 gradient buffer from the start
                          # (the idle experts' fc2 biases are summed over expert-tp too)
                          "uneven-idle-expert_tp2-bf16": dict(
                              tp=2, cp=2, ep=2, expert_tp=2, sequence_parallel=True, micro_batch_size=1,
                              global_batch_size=4, precision="bf16",
                              model=dict(experts=6, top_k=1, moe_renormalize=False, bias=True))}.items():
        m = model if "gelu" not in name else moe_config(**{**model.to_dict(), "mlp": "gelu", "bias": True,
                                                           "moe_shared_ffn_hidden": 32})
        m = moe_config(**{**m.to_dict(), **options.pop("model", {})})
        cfg = _config(m, **options)
        out[name] = cfg, merge_traces(run_ranks(traced_step, world_size=cfg.world_size, args=(cfg.to_dict(),),
                                                timeout_s=300))
    return out


def test_estimator_is_exact_for_forced_even_routing(uniform_traces):
    for name, (cfg, traces) in uniform_traces.items():
        comm = compare_comm(traces["comm"], estimate_train_comm(cfg))
        assert (comm.measured == comm.estimated).all(), (name, comm[comm.measured != comm.estimated])
        assert comm[comm.kind == "ep"].measured.gt(0).all() or cfg.ep == 1
        memory = compare_memory(traces["memory"], estimate_train_memory(cfg))
        assert (memory.measured == memory.estimated).all(), (name, memory[memory.measured != memory.estimated])


@pytest.mark.parametrize("experts,top_k,layout", [(6, 1, dict(tp=2, cp=2, ep=2, sequence_parallel=True)),
                                                   (6, 4, dict(dp=2, ep=2)), (4, 2, dict(dp=4, ep=4)),
                                                   (6, 2, dict(tp=2, dp=2, ep=2, expert_tp=2, sequence_parallel=True))])
def test_a_routers_expected_traffic_is_the_mean_of_the_forced_routings(experts, top_k, layout):
    # Without a capacity, every rank sends as many rows as it has assignments for other ranks' experts
    # and receives its own experts' rows from each peer: over the ep ranks, the forced round robin
    # and an even routing's mean move the same rows, whether or not tokens x top_k divides by experts
    # (a rank's 4 tokens x 1 over 6 experts: an expert's mean share is 2/3 of a row, not none).
    model = moe_config(**{**MODEL.to_dict(), "experts": experts, "top_k": top_k, "moe_renormalize": top_k > 1})
    cfg = _config(model, micro_batch_size=1, global_batch_size=4 * layout.get("dp", 1), **layout)
    forced = estimate_train_comm(cfg.replace(model={"moe_force_uniform": True}))
    routed = estimate_train_comm(cfg)
    for axis in ("ep", "expert-tp"):      # (a fraction of a row's bytes rounded per expert)
        assert forced[axis].mean() == pytest.approx(routed[axis].mean(), rel=1e-3), \
            (axis, forced[axis].tolist(), routed[axis].tolist())
    counts_only = cfg.microbatches * model.layers * (cfg.ep - 1) * (experts // cfg.ep) * 8   # the int64 counts
    assert routed["ep"].gt(counts_only).all(), (routed["ep"].tolist(), counts_only)      # rows move too


def test_parameter_counts_of_mixtral():
    counts = moe_parameter_counts(preset("mixtral-8x7b"))
    assert round(counts["total"] / 1e9, 1) == 46.7 and round(counts["active"] / 1e9, 1) == 12.9


# ------------------------------------------------------------------------------- checkpoints
def _save(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology))
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    save_checkpoint(trainer, directory)
    losses += [trainer.train_step()["loss"] for _ in range(2)]
    return losses


def _resume(rank, world_size, cfg_dict, directory):
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, groups=ProcessGroups.build(cfg.topology) if world_size > 1 else ProcessGroups.single())
    assert load_checkpoint(trainer, directory) == 2
    return [trainer.train_step()["loss"] for _ in range(2)]


def test_checkpoint_at_ep2_zero1_resumes_in_other_layouts(tmp_path):
    saved = _config(dp=2, ep=2, zero1=True)
    losses = run_ranks(_save, world_size=2, args=(saved.to_dict(), str(tmp_path)), timeout_s=300)[0]
    for options in (dict(), dict(dp=4, ep=4), dict(tp=2, ep=2, sequence_parallel=True, zero1=True), dict(dp=2)):
        cfg = _config(**options)
        got = run_ranks(_resume, world_size=cfg.world_size, args=(cfg.to_dict(), str(tmp_path)), timeout_s=300)
        for r in got:
            assert r == pytest.approx(losses[2:], rel=1e-5), (options, r, losses)


# ------------------------------------------------------------------------------- bad input, CLI
@pytest.mark.parametrize("options,needle", [
    (dict(model={"experts": 4, "top_k": 5}), "top_k=5 is more than experts=4"),
    (dict(model={"experts": 4, "top_k": 1}), "top_k=1 with moe_renormalize=True"),
    (dict(dp=3, ep=3, global_batch_size=6), "experts=4 is not divisible by ep=3"),
    (dict(tp=2, ep=2), "needs sequence_parallel=True"),
    (dict(dp=2, ep=2, model={"experts": 0}), "the model has no experts"),
    # A dense model with a degree no expert grid fits: the missing experts are named, not the grid.
    (dict(expert_tp=2, model={"experts": 0}), "ep=1, expert_tp=2: the model has no experts"),
    (dict(ep=2), "ep=2 x expert_tp=1 = 2 does not divide tp x cp x dp = 1x1x1 = 1"),
    (dict(model={"moe_capacity_factor": 0}), "moe_capacity_factor=0 must be a finite number > 0"),
    # inf passed: OverflowError in the first step's routing on every rank; an infinite auxiliary
    # weight made every weight NaN from the second step
    (dict(model={"moe_capacity_factor": float("inf")}), "moe_capacity_factor=inf must be a finite number > 0, or None"),
    (dict(model={"moe_aux_loss_coeff": float("inf")}), "moe_aux_loss_coeff=inf must be a finite number >= 0"),
    (dict(model={"moe_z_loss_coeff": float("inf")}), "moe_z_loss_coeff=inf must be a finite number >= 0"),
    (dict(model={"moe_router": "relu"}), "moe_router='relu' is not one of"),
])
def test_bad_moe_configs_fail_before_any_process(options, needle):
    options = dict(options)
    model = options.pop("model", {})
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        _config(moe_config(**{**MODEL.to_dict(), **model}), **options)


def _groups_without_experts(rank, world_size, cfg_dict):
    from dataclasses import replace

    cfg = TrainConfig.from_dict(cfg_dict)
    try:
        Trainer(cfg, groups=ProcessGroups.build(replace(cfg.topology, experts=False)))
    except ValueError as err:
        return str(err)
    return None


def test_groups_without_the_expert_grid_are_refused():
    """Groups built from a topology that says "no experts" would leave each replica of an expert
    with its own gradient: a model with experts refuses them, naming the fix, on every rank."""
    cfg = _config(dp=2)
    assert cfg.topology.experts and cfg.topology.expert_dp == 2
    for message in run_ranks(_groups_without_experts, world_size=2, args=(cfg.to_dict(),), timeout_s=120):
        assert message is not None and "Topology(..., experts=True)" in message, message


def test_cli_moe_matches_the_serial_run(tmp_path):
    def run(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-2000:]
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    flags = ["-m", "mlmkit.train", "--tp", "1", "--pp", "1", "--experts", "4", "--top-k", "2",
             "--moe-aux-loss-coeff", "0.01", "--steps", "2"]
    serial = run([sys.executable, *flags])
    parallel = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *flags, "--dp", "2",
                    "--ep", "2", "--micro-batch-size", "2"])
    serial_mbs = run([sys.executable, *flags, "--micro-batch-size", "2"])
    assert [r["loss"] for r in parallel] == pytest.approx([r["loss"] for r in serial_mbs], abs=1e-5)
    assert all(r["aux_loss"] > 0 and r["dropped"] == 0 for r in parallel + serial)


def test_hidden_dropout_follows_the_moe_layer():
    """With ``dropout`` the MoE layer's output (experts and shared expert summed) goes through the
    hidden dropout, as a dense MLP's does (Megatron-LM's bias-dropout-add after the MoE layer): in
    training every element is either dropped or the evaluation output scaled by 1 / (1 - p)."""
    from mlmkit.distributed import CommGroup
    from mlmkit.moe.layer import MoELayer
    from mlmkit.tensor_parallel.random import TPRandomState

    p = 0.5
    cfg = moe_config(**{**MODEL.to_dict(), "dropout": p, "moe_shared_ffn_hidden": 32})
    layer = MoELayer(cfg, layer=0, tp=CommGroup.single("tp"), sequence_parallel=False, rng=TPRandomState(seed=0))
    x = torch.randn(cfg.seq_len, 2, cfg.hidden)
    evaluated = layer.eval()(x)
    trained = layer.train()(x)
    dropped = trained == 0
    assert 0.3 < dropped.float().mean().item() < 0.7
    assert torch.allclose(trained[~dropped], evaluated[~dropped] / (1 - p), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="needs rng"):
        MoELayer(cfg, layer=0, tp=CommGroup.single("tp"), sequence_parallel=False)
