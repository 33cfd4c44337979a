"""The model's building blocks (GPTConfig options) against a plain-PyTorch model, shard layouts of
grouped-query attention and SwiGLU, the estimator's parameter mirror, published presets, bad configs."""

import itertools

import pytest
import torch

from mlmkit import Topology
from mlmkit.distributed import CommGroup
from mlmkit.estimate import local_parameters, total_parameters
from mlmkit.model import GPT, GPTConfig, tiny_config
from mlmkit.model.blocks import _RMSNorm
from mlmkit.model.config import llama_config
from mlmkit.model.gpt import Stage, split_layers
from mlmkit.model.presets import PRESETS, preset
from mlmkit.model.reference import PlainTransformer
from mlmkit.tensor_parallel import shard_full, unshard

OPTIONS = {
    "gpt2": {},
    "rmsnorm": dict(norm="rmsnorm"),
    "swiglu": dict(mlp="swiglu", ffn_hidden=96),
    "swiglu-unfused": dict(mlp="swiglu", ffn_hidden=96, gate_up_fused=False),
    "rope": dict(position="rope", rope_theta=500.0),
    "gqa": dict(kv_heads=2),
    "mqa": dict(kv_heads=1),
    "no-bias-untied": dict(bias=False, tie_embeddings=False),
    "llama": dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=96, position="rope", kv_heads=2, bias=False,
                  tie_embeddings=False),
    "llama-eager": dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=96, position="rope", kv_heads=2, bias=False,
                        tie_embeddings=False, attention="eager"),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_equals_plain_pytorch(name):
    cfg = tiny_config(**OPTIONS[name])
    model = GPT(cfg)
    ref = PlainTransformer(cfg).load_mlmkit(model.state_dict())
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=g)
    loss, ref_loss = model(tokens, targets), ref(tokens, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    loss.backward()
    ref_loss.backward()
    # the output projection of the last layer and the embedding: gradients agree too
    last = model.layers[str(cfg.layers - 1)]
    assert torch.allclose(last.attn.proj.weight.grad, ref.blocks[-1].o.weight.grad, atol=1e-6)
    assert torch.allclose(model.embedding.weight.grad[: cfg.vocab_size], ref.embed.weight.grad, atol=1e-6)


@pytest.mark.parametrize("options", [
    dict(make_vocab_size_divisible_by=128),
    dict(OPTIONS["llama"], gate_up_fused=False),
    dict(experts=4, top_k=2, moe_shared_ffn_hidden=96, mlp="gelu"),
], ids=["gpt2-padded-vocab", "llama-unfused-untied", "moe-gelu-bias-shared"])
def test_initial_weights_follow_megatrons_rule(options):
    """The initial weights themselves (the parity runs copy them to their reference, so a wrong
    initialisation passes them): every weight matrix N(0, init_std^2), the layers' output projections
    (attention proj, every fc2: dense, expert, shared expert) N(0, (init_std / sqrt(2 L))^2) (Shoeybi
    et al. 2019; Megatron-LM's scaled_init_method_normal), biases 0, norm gains 1, the vocabulary's
    padding rows 0, and no two matrices alike (each draws from its own name's stream)."""
    cfg = tiny_config(layers=4, hidden=128, heads=4, **options)
    model = GPT(cfg)
    scaled = cfg.init_std / (2 * cfg.layers) ** 0.5
    matrices = {}
    for n, p in model.named_parameters():
        p = p.detach()
        if p.ndim == 1:
            assert torch.equal(p, torch.zeros_like(p) if n.endswith(".bias") else torch.ones_like(p)), n
            continue
        if n in ("embedding.weight", "head_weight"):
            assert not p[cfg.vocab_size:].any(), n
            p = p[:cfg.vocab_size]
        want = scaled if n.endswith(("proj.weight", "fc2.weight")) else cfg.init_std
        assert abs(float(p.std()) / want - 1) < 0.15, (n, float(p.std()), want)
        assert abs(float(p.mean())) < 5 * want / p.numel() ** 0.5, (n, float(p.mean()))
        matrices[n] = p
    assert len(matrices) >= 2 + 2 * cfg.layers
    for (a, x), (b, y) in itertools.combinations(matrices.items(), 2):
        if x.shape == y.shape:
            assert not torch.allclose(x, y), (a, b)


def test_gpt2_defaults_unchanged():
    # The default model is today's GPT-2: same parameters by name and shape, SDPA equals the explicit
    # softmax(QK^T)V path (which is the previous implementation, bit for bit) to fp32 rounding.
    cfg = tiny_config()
    assert (cfg.norm, cfg.mlp, cfg.position, cfg.kv_heads, cfg.bias, cfg.tie_embeddings) == \
        ("layernorm", "gelu", "learned", None, True, True)
    sdpa, eager = GPT(cfg), GPT(tiny_config(attention="eager"))
    assert [(n, p.shape) for n, p in sdpa.named_parameters()] == [(n, p.shape) for n, p in eager.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(sdpa.parameters(), eager.parameters()))
    t = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    assert abs(sdpa(t, t).item() - eager(t, t).item()) <= 1e-6


def test_fused_and_unfused_swiglu_are_the_same_function():
    a, b = GPT(llama_config(layers=2)), GPT(llama_config(layers=2, gate_up_fused=False))
    t = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    assert abs(a(t, t).item() - b(t, t).item()) <= 1e-6


def test_rmsnorm_backward_is_exact():
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-5), (x, w))


@pytest.mark.parametrize("t,kv", [(2, 2), (4, 2), (4, 1), (2, 1)])
def test_kv_head_shards(t, kv):
    # Query heads split over tp; key/value heads split when tp <= kv_heads, else each is held by the
    # tp/kv ranks whose query heads use it. Shards reassemble to the serial weight, and back.
    cfg = llama_config(heads=4, kv_heads=kv, hidden=32, layers=1, ffn_hidden=64, tie_embeddings=False)
    serial = {n: p.detach() for n, p in GPT(cfg).named_parameters()}
    ranks = [GPT(cfg, tp=CommGroup(axis="tp", ranks=list(range(t)), global_rank=r, pg=None)) for r in range(t)]
    for r, m in enumerate(ranks):
        kvw = m.layers["0"].attn.kv.weight
        assert kvw.tp_replicas == max(1, t // kv)
        # rank r's query heads [r a/t, (r+1) a/t) use the first key/value head it holds
        assert (r * 4 // t) // (4 // kv) == (r // kvw.tp_replicas) * max(1, kv // t)
    for n, meta in ranks[0].named_parameters():
        parts = [dict(m.named_parameters())[n].detach() for m in ranks]
        if getattr(meta, "vocab_rows", None):
            continue                                   # vocabulary padding: covered by the checkpoint tests
        full = unshard(parts, dim=meta.tp_split_dim, partitions=meta.tp_partitions, replicas=meta.tp_replicas)
        assert torch.equal(full, serial[n]), n
        for r in range(t):
            mine = shard_full(serial[n], dim=meta.tp_split_dim, tp_size=t, tp_rank=r, partitions=meta.tp_partitions,
                              replicas=meta.tp_replicas)
            assert torch.equal(mine, parts[r]), (n, r)


def test_fused_gate_up_holds_matching_halves():
    cfg = llama_config(layers=1, ffn_hidden=64, hidden=32, heads=4)
    full = GPT(cfg).layers["0"].mlp.fc1.weight.detach()            # [gate; up], 2 x 64 rows
    for r in range(4):
        m = GPT(cfg, tp=CommGroup(axis="tp", ranks=[0, 1, 2, 3], global_rank=r, pg=None))
        local = m.layers["0"].mlp.fc1.weight.detach()
        gate, up = local.chunk(2)
        assert torch.equal(gate, full[:64][r * 16:(r + 1) * 16]) and torch.equal(up, full[64:][r * 16:(r + 1) * 16])


CFGS = [tiny_config(layers=4), llama_config(), llama_config(gate_up_fused=False, kv_heads=1),
        llama_config(kv_heads=4, bias=True, norm="layernorm", tie_embeddings=True)]


@pytest.mark.parametrize("cfg", CFGS, ids=["gpt2", "llama", "mqa-unfused", "mha-bias"])
def test_estimator_parameters_mirror_the_model(cfg):
    # Names, order, sizes, split dimension and replication of every local parameter, every layout.
    for t, p, v in [(1, 1, 1), (2, 2, 1), (4, 1, 1), (2, 2, 2)]:
        topo = Topology(tp=t, pp=p)
        layout = split_layers(cfg.layers, p * v)
        for r, tr in itertools.product(range(p), range(t)):
            tp = CommGroup(axis="tp", ranks=list(range(t)), global_rank=tr, pg=None)
            real = []
            for c in range(v):
                vs = c * p + r
                m = GPT(cfg, tp=tp, stage=Stage(layers=layout[vs], pre_process=vs == 0, post_process=vs == p * v - 1,
                                                index=vs, pp_rank=r))
                real += [(n, q.numel(), q.tp_split_dim, q.tp_replicas) for n, q in m.named_parameters()]
            est = [(q.name, q.numel, q.split_dim, q.replicas) for q in local_parameters(cfg, topo, pp_rank=r, chunks=v)]
            assert real == est, (t, p, v, r, tr)


def test_published_presets():
    # Parameter counts as published (Llama 3: Meta's released models; GPT-3: "175B").
    assert total_parameters(preset("llama3-8b")) == 8_030_261_248
    assert total_parameters(preset("llama3-70b")) == 70_553_706_496
    assert abs(total_parameters(preset("llama3-405b")) / 405.85e9 - 1) < 0.002
    assert abs(total_parameters(preset("gpt3-175b")) / 175e9 - 1) < 0.01
    for p in PRESETS.values():
        assert p.source and p.config.layers > 0
    assert preset("llama3-8b", seq_len=4096).seq_len == 4096
    with pytest.raises(ValueError, match="unknown model preset 'llama9'"):
        preset("llama9")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kv_heads=3), r"heads=4 is not divisible by kv_heads=3"),
    (dict(norm="batchnorm"), r"norm='batchnorm' is not one of 'layernorm', 'rmsnorm'"),
    (dict(mlp="relu"), r"mlp='relu' is not one of"),
    (dict(position="alibi"), r"position='alibi' is not one of"),
    (dict(attention="flash"), r"attention='flash' is not one of"),
    (dict(hidden=12, heads=4, position="rope"), r"rotary positions need an even head dimension, got hidden/heads = 3"),
    (dict(rope_theta=0), r"rope_theta=0 must be a finite number > 0"),
    # infinite values passed: weights of inf (NaN from the first step), a normalisation that outputs
    # zeros (the loss stayed at ln 256), no rotation
    (dict(init_std=float("inf")), r"init_std=inf must be a finite number > 0"),
    (dict(layernorm_eps=float("inf")), r"layernorm_eps=inf must be a finite number > 0"),
    (dict(rope_theta=float("inf"), position="rope"), r"rope_theta=inf must be a finite number > 0"),
    (dict(bias="no"), r"bias='no' must be true or false"),
])
def test_bad_model_options(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_config(**kwargs)


def test_tp_and_kv_heads_must_divide_one_another():
    with pytest.raises(ValueError, match=r"kv_heads=2 and tp=3"):
        GPTConfig(vocab_size=256, seq_len=12, hidden=48, heads=6, kv_heads=2, layers=2).check_parallel(tp=3)
    llama_config(heads=8, kv_heads=2, hidden=64).check_parallel(tp=8)    # replicated: fine


def test_shard_table_finds_the_group_of_a_container():
    # A ModuleDict (or an MLP) has no tp of its own: the table must still say which rank holds what.
    from mlmkit.model import shard_table
    from mlmkit.model.config import llama_config
    from mlmkit.model.gpt import ParallelMLP
    from mlmkit.tensor_parallel import TPRandomState

    tp = CommGroup(axis="tp", ranks=[0, 1], global_rank=1, pg=None)
    mlp = ParallelMLP(llama_config(), layer=0, tp=tp, sequence_parallel=False, rng=TPRandomState(seed=0, tp_rank=1))
    table = shard_table(torch.nn.ModuleDict({"mlp": mlp}))
    assert set(table.tp_rank) == {1} and set(table.tp_size) == {2} and set(table["rank"]) == {1}
    fc1 = table.set_index("name").loc["mlp.fc1.weight"]
    assert fc1.partitions == 2 and fc1.local_shape == (176, 64) and fc1.global_shape == (352, 64)
