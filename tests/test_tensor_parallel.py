"""Tensor parallelism against the serial model: logits, loss, every gradient; comm counted by the ops."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from mlmkit import Topology
from mlmkit.distributed import ProcessGroups, RankFailure, run_ranks
from mlmkit.model import GPT, gather_full, shard_table, tiny_config
from mlmkit.tensor_parallel import (
    RowParallelLinear,
    TPRandomState,
    dropout,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from mlmkit.trace import Tracer
from tp_helpers import CFG, batch

TOL = 1e-5


def _serial():
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, targets = batch(CFG)
    logits = model.gather_logits(model(tokens))
    loss = model(tokens, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.item(), grads


def _tp_run(rank, world_size, tp, sp):
    groups = ProcessGroups.build(Topology(tp=tp))
    model = GPT(CFG, tp=groups.tp, sequence_parallel=sp)
    tokens, targets = batch(CFG)
    logits = model.gather_logits(model(tokens)).detach()
    loss = model(tokens, targets)
    loss.backward()
    sync_sequence_parallel_grads(model, groups.tp)
    grads = gather_full(model, grads=True)
    return logits, loss.item(), grads


@pytest.fixture(scope="module")
def serial():
    return _serial()


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_gpt_matches_serial(serial, tp, sp):
    ref_logits, ref_loss, ref_grads = serial
    results = run_ranks(_tp_run, world_size=tp, args=(tp, sp), timeout_s=120)
    for rank, (logits, loss, grads) in enumerate(results):
        assert abs(loss - ref_loss) <= TOL, (rank, loss, ref_loss)
        assert (logits - ref_logits).abs().max().item() <= TOL
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            assert g.shape == ref_grads[name].shape, name
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= TOL, f"rank {rank} {name}: max |grad diff| {diff:.2e}"


def _count_comm(rank, world_size, sp):
    tracer = Tracer(rank=rank)
    groups = ProcessGroups.build(Topology(tp=world_size), tracer=tracer)
    model = GPT(CFG, tp=groups.tp, sequence_parallel=sp)
    tokens, targets = batch(CFG)
    model(tokens, targets).backward()
    return tracer.comm_frame()


def test_comm_per_layer_counted_by_operators():
    b, s, h = 2, CFG.seq_len, CFG.hidden
    full_bytes = b * s * h * 4
    plain = run_ranks(_count_comm, world_size=2, args=(False,))[0]
    seq = run_ranks(_count_comm, world_size=2, args=(True,))[0]
    for layer in range(CFG.layers):
        rows = plain[plain.site.str.startswith(f"layers.{layer}.")]
        assert len(rows) == 4 and set(rows.op) == {"all_reduce"}
        assert (rows.bytes == full_bytes).all()
        assert sorted(rows.phase) == ["backward", "backward", "forward", "forward"]
        srows = seq[seq.site.str.startswith(f"layers.{layer}.")]
        assert sorted(srows.op.value_counts().items()) == [("all_gather", 4), ("reduce_scatter", 4)]
        assert (srows.bytes == full_bytes).all()  # the full [s, b, h] is gathered / reduce-scattered
        # Same total volume on the wire: all-reduce = reduce-scatter + all-gather.
        assert srows.wire_bytes.sum() == rows.wire_bytes.sum() == 4 * 2 * (2 - 1) * full_bytes // 2


def _cross_entropy(rank, world_size, vocab, padded):
    groups = ProcessGroups.build(Topology(tp=world_size))
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 3, padded, generator=g, dtype=torch.float64).float()
    targets = torch.randint(0, vocab, (5, 3), generator=g)
    targets[1, 2] = targets[4, 0] = -100
    local = full.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, tp=groups.tp, vocab_start=rank * (padded // world_size),
                                        vocab_size=vocab)
    loss.sum().backward()
    return full, targets, loss.detach(), local.grad


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy(tp):
    vocab, padded = 101, 104  # 3 padded columns, on the last rank
    results = run_ranks(_cross_entropy, world_size=tp, args=(vocab, padded))
    full, targets, _, _ = results[0]
    logits = full[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100, reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([logits.grad, torch.zeros(5, 3, padded - vocab)], dim=-1)
    for rank, (_, _, loss, grad) in enumerate(results):
        assert (loss.reshape(-1) - ref).abs().max().item() <= 1e-6
        assert loss[1, 2] == 0 and loss[4, 0] == 0
        assert (grad - ref_grad.chunk(tp, dim=-1)[rank]).abs().max().item() <= 1e-6


def _operators(rank, world_size):
    """Each TP operator's forward and input gradient on this rank. Inputs and upstream gradients are
    seeded per rank (``x_r``, ``G_r``) or shared (``X``, ``C``) so the driver can rebuild them."""
    from mlmkit.tensor_parallel import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp,
                                        reduce_scatter_to_sequence, scatter_to_sequence, scatter_to_tp)
    groups = ProcessGroups.build(Topology(tp=world_size))
    tp, t = groups.tp, world_size
    out = {}
    for name, op, shape_in, shape_up in [
        ("copy_to_tp", copy_to_tp, (4, 2, 8), (4, 2, 8)),
        ("reduce_from_tp", reduce_from_tp, (4, 2, 8), (4, 2, 8)),
        ("scatter_to_tp", scatter_to_tp, (4, 2, 8), (4, 2, 8 // t)),
        ("gather_from_tp", gather_from_tp, (4, 2, 8 // t), (4, 2, 8)),
        ("scatter_to_sequence", scatter_to_sequence, (8, 2, 4), (8 // t, 2, 4)),
        ("gather_from_sequence", gather_from_sequence, (8 // t, 2, 4), (8, 2, 4)),
        ("reduce_scatter_to_sequence", reduce_scatter_to_sequence, (8, 2, 4), (8 // t, 2, 4)),
    ]:
        x = _operand(name, "x", rank, shape_in).requires_grad_(True)
        y = op(x * 1.0, tp, site="test")        # x * 1.0: reduce_from_tp works in place on a fresh tensor
        y.backward(_operand(name, "g", rank, shape_up))
        out[name] = (y.detach(), x.grad)
    return out


def _operand(name, kind, rank, shape):
    # An operator whose forward input is replicated (copy, the scatters) gets the same x on every
    # rank; an upstream gradient the next op would see replicated (scatter_to_*, gather_from_tp's
    # output: the same loss everywhere) gets the same G on every rank; the rest differ by rank.
    replicated = {("copy_to_tp", "x"), ("scatter_to_tp", "x"), ("scatter_to_sequence", "x"),
                  ("gather_from_tp", "g"), ("reduce_from_tp", "g")}
    seed = 1000 * len(name) + (0 if (name, kind) in replicated else rank + 1) + (500 if kind == "g" else 0)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_operators_forward_and_backward(t):
    # The f, g and sequence-parallel operators one by one, against their definitions (Shoeybi et al.
    # 2019, fig. 3; Korthikanti et al. 2022, sec. 4.2.2). scatter_to_tp and scatter_to_sequence are
    # used by no layer, so nothing else checks them.
    results = run_ranks(_operators, world_size=t)
    x = {n: [_operand(n, "x", r, results[r][n][1].shape) for r in range(t)] for n in results[0]}

    def g(name, r):
        return _operand(name, "g", r, results[r][name][0].shape)

    for r, res in enumerate(results):
        expect = {
            "copy_to_tp": (x["copy_to_tp"][r], sum(g("copy_to_tp", q) for q in range(t))),
            "reduce_from_tp": (sum(x["reduce_from_tp"]), g("reduce_from_tp", r)),
            "scatter_to_tp": (x["scatter_to_tp"][r].chunk(t, -1)[r], torch.cat([g("scatter_to_tp", q) for q in range(t)], -1)),
            "gather_from_tp": (torch.cat(x["gather_from_tp"], -1), g("gather_from_tp", r).chunk(t, -1)[r]),
            "scatter_to_sequence": (x["scatter_to_sequence"][r].chunk(t, 0)[r],
                                    torch.cat([g("scatter_to_sequence", q) for q in range(t)], 0)),
            "gather_from_sequence": (torch.cat(x["gather_from_sequence"], 0),
                                     sum(g("gather_from_sequence", q) for q in range(t)).chunk(t, 0)[r]),
            "reduce_scatter_to_sequence": (sum(x["reduce_scatter_to_sequence"]).chunk(t, 0)[r],
                                           torch.cat([g("reduce_scatter_to_sequence", q) for q in range(t)], 0)),
        }
        for name, (y, dx) in expect.items():
            got_y, got_dx = res[name]
            assert got_y.shape == y.shape and (got_y - y).abs().max().item() <= 1e-6, (t, r, name, "forward")
            assert got_dx.shape == dx.shape and (got_dx - dx).abs().max().item() <= 1e-6, (t, r, name, "backward")


def _dropout_streams(rank, world_size):
    groups = ProcessGroups.build(Topology(tp=2))
    rng = TPRandomState(seed=7, tp_rank=groups.tp.rank)
    rep = torch.rand(8, generator=rng.replicated)
    tpr = torch.rand(8, generator=rng.tensor_parallel)
    # A stage without the head: its output is the residual stream, which must stay identical on
    # every TP rank even with dropout on (replicated stream outside the TP region).
    from mlmkit.model import Stage
    cfg = tiny_config(dropout=0.3)
    model = GPT(cfg, tp=groups.tp, stage=Stage(layers=(0, 1), pre_process=True, post_process=False))
    model.train()
    tokens, _ = batch(cfg)
    hidden = model(tokens).detach()
    model.eval()
    hidden_eval = model(tokens).detach()
    return rep, tpr, hidden, hidden_eval


def test_dropout_agrees_where_megatron_agrees():
    (rep0, tp0, h0, e0), (rep1, tp1, h1, e1) = run_ranks(_dropout_streams, world_size=2)
    assert torch.equal(rep0, rep1)
    assert not torch.equal(tp0, tp1)
    assert torch.equal(h0, h1)              # residual stream identical across TP ranks
    assert not torch.allclose(h0, e0)       # and dropout really was applied
    torch.testing.assert_close(e0, e1)


def test_dropout_drops_at_rate_p_and_scales_the_kept_by_one_over_one_minus_p():
    """The rate and the scale themselves (the parity runs draw the same masks on both sides, so a
    wrong rate would pass them): a mask of 200k draws keeps 1 - p of them within 5 sigma, the kept
    values are x / (1 - p), the backward scales the gradient by the same mask, and the generator
    alone decides the mask."""
    x = torch.randn(200_000, requires_grad=True)
    for p in (0.1, 0.5, 0.8):
        g = torch.Generator().manual_seed(3)
        y = dropout(x, p, generator=g, training=True)
        kept = y != 0
        sigma = (p * (1 - p) / x.numel()) ** 0.5
        assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma, (p, kept.float().mean().item())
        torch.testing.assert_close(y[kept], x.detach()[kept] / (1 - p), rtol=0, atol=0)
        (grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(grad, kept.float() / (1 - p), rtol=0, atol=0)
        again = dropout(x, p, generator=torch.Generator().manual_seed(3), training=True)
        assert torch.equal(again, y)
    assert dropout(x, 0.5, generator=g, training=False) is x and dropout(x, 0.0, generator=g, training=True) is x


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-shared-expert"])
def test_every_dropout_site_of_the_model_drops_at_the_configured_rate(monkeypatch, moe):
    """Each of the model's dropout sites (embedding; per layer the attention probabilities, the
    attention output and the MLP's or the MoE layer's output) is called with the config's p and
    drops about that share of its nonzero inputs (the attention probabilities hold the causal
    mask's zeros already)."""
    import mlmkit.model.blocks as blocks
    import mlmkit.model.gpt as gpt
    import mlmkit.moe.layer as moe_layer

    calls = []

    def recording(x, p, *, generator, training):
        y = dropout(x, p, generator=generator, training=training)
        calls.append((p, x.detach(), y.detach()))
        return y

    monkeypatch.setattr(blocks, "dropout", recording)
    monkeypatch.setattr(gpt, "dropout", recording)
    monkeypatch.setattr(moe_layer, "dropout", recording)
    p = 0.3
    extra = dict(experts=4, top_k=2, moe_shared_ffn_hidden=32) if moe else {}
    cfg = tiny_config(dropout=p, attention="eager", **extra)
    model = GPT(cfg)
    model.train()
    tokens, _ = batch(cfg)
    model(tokens)
    # the shared expert's own MLP passes p = 0 (its output joins the routed sum, dropped once after)
    off = [(x, y) for q, x, y in calls if q == 0.0]
    assert len(off) == (cfg.layers if moe else 0) and all(torch.equal(x, y) for x, y in off)
    calls = [c for c in calls if c[0] != 0.0]
    assert len(calls) == 1 + 3 * cfg.layers, len(calls)
    for i, (got_p, x, y) in enumerate(calls):
        assert got_p == p, (i, got_p)
        live = x != 0
        kept = (y != 0) & live
        share = kept.sum().item() / live.sum().item()
        sigma = (p * (1 - p) / live.sum().item()) ** 0.5
        assert abs(share - (1 - p)) < 5 * sigma, (i, share, live.sum().item())
        torch.testing.assert_close(y[kept], x[kept] / (1 - p))


def test_shard_table_and_vocab_padding():
    model = GPT(CFG)
    df = shard_table(model)
    row = df.set_index("name").loc["layers.0.attn.qkv.weight"]
    assert row.local_shape == row.global_shape == (192, 64) and row.split_dim == 0
    assert CFG.padded_vocab(4) == 104 and CFG.padded_vocab(2) == 102 and CFG.padded_vocab(1) == 101
    assert tiny_config(make_vocab_size_divisible_by=128).padded_vocab(2) == 256  # Megatron's rule


def _shards_tp2(rank, world_size):
    groups = ProcessGroups.build(Topology(tp=2))
    return shard_table(GPT(CFG, tp=groups.tp, sequence_parallel=True))


def test_shard_table_tp2():
    df = run_ranks(_shards_tp2, world_size=2)[1].set_index("name")
    assert df.loc["layers.1.attn.qkv.weight"].local_shape == (96, 64)
    assert df.loc["layers.1.attn.qkv.weight"].global_shape == (192, 64)
    assert df.loc["layers.1.attn.proj.weight"].local_shape == (64, 32)
    assert df.loc["layers.1.attn.proj.weight"].split_dim == 1
    assert df.loc["layers.1.mlp.fc1.weight"].local_shape == (128, 64)
    assert df.loc["embedding.weight"].local_shape == (51, 64)
    assert df.loc["embedding.weight"].global_shape == (102, 64)
    assert pd.isna(df.loc["layers.1.ln1.weight"].split_dim)
    assert bool(df.loc["layers.1.ln1.weight"].sequence_parallel)
    assert set(df.tp_rank) == {1}


@pytest.mark.parametrize("overrides,tp,needle", [
    ({"hidden": 66, "heads": 3}, 4, "hidden=66 is not divisible by tp=4"),
    ({"heads": 2}, 4, "heads=2 is not divisible by tp=4"),
    ({"ffn_hidden": 130}, 4, "ffn_hidden=130 is not divisible by tp=4"),
])
def test_bad_divisibility_fails_before_any_process(overrides, tp, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_config(**overrides).check_parallel(tp=tp)


def _wrong_shape(rank, world_size, which):
    groups = ProcessGroups.build(Topology(tp=2))
    if which == "row":
        layer = RowParallelLinear(128, 64, tp=groups.tp, site="layers.0.mlp.fc2")
        layer(torch.zeros(16, 2, 128))  # the full input instead of this rank's slice
    else:
        GPT(CFG, tp=groups.tp).layers["0"].mlp.fc1(torch.zeros(16, 2, 32))


def test_wrong_shape_names_local_and_global_shapes():
    with pytest.raises(RankFailure, match=r"expects input \[\.\.\., 64\] on each rank: its slice of the "
                                          r"global \[\.\.\., 128\] split over tp=2; got \[16, 2, 128\]"):
        run_ranks(_wrong_shape, world_size=2, args=("row",))
    with pytest.raises(RankFailure, match=r"'layers.0.mlp.fc1' expects input \[\.\.\., 64\].*got \[16, 2, 32\]"):
        run_ranks(_wrong_shape, world_size=2, args=("column",))


def test_token_out_of_vocabulary():
    with pytest.raises(ValueError, match=r"token id 101 is outside the vocabulary \[0, 101\)"):
        GPT(CFG)(torch.full((1, 4), 101))
