"""GPTConfig: the model's sizes and building blocks, validated on construction (pure Python).

The defaults are GPT-2 (LayerNorm, GELU MLP, learned positions, biases, tied embeddings, full
multi-head attention). The options select the blocks of Llama-, Mistral- and Qwen-style models:
RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied embeddings.
:func:`llama_config` is a tiny Llama-style model; :mod:`mlmkit.model.presets` has the shapes of
published models (for the estimator and planner; nothing is allocated).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Set as AbstractSet
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Optional, Sequence

from mlmkit.scalars import plain_bool

__all__ = ["ATTENTIONS", "MLPS", "NORMS", "POSITIONS", "ROUTERS", "DROP_POLICIES", "GPTConfig", "split_layers", "llama_config", "moe_config",
           "check_keys", "tiny_config", "MAX_EXPERTS", "MAX_LAYERS"]

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("sdpa", "eager")
ROUTERS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


#: Most layers a GPTConfig takes: the model, the executor and the estimators place every layer by
#: index (``layers=10**9`` filled 24 GB in a plan's stage split before it could answer); real models
#: have at most a few hundred.
MAX_LAYERS = 2**16
#: Most experts per layer a GPTConfig takes: the model builds each expert, and the estimators count
#: each expert's tokens (``experts=10**20`` was a MemoryError); real mixtures have at most a few hundred.
MAX_EXPERTS = 2**16


def check_keys(cls, data: dict) -> None:
    """ValueError naming every key of ``data`` that is not a field of the dataclass ``cls``, every
    field without a default that ``data`` lacks (a TypeError from the constructor before), or
    ``data`` itself when it is not a mapping of field names to values."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__}: expected an object of field names and values, got "
                         f"{type(data).__name__} {data!r:.60}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known keys are {sorted(known)}")
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{cls.__name__}: missing key(s) {missing}; each needs a value")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig: {name}={value!r} must be an integer >= 1")


def _choice(name: str, value: object, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"GPTConfig: {name}={value!r} is not one of {', '.join(map(repr, options))}")


def top_1_refusal(said: str) -> str:
    """The refusal of top-1 routing with renormalised weights, for a command line (``said``: how the
    top-1 was given); GPTConfig's own names the field instead of the flag."""
    return (f"{said} with renormalised expert weights gives every token weight 1 and the router no gradient "
            f"from the loss: add --no-moe-renormalize (Switch Transformer's raw router score)")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A decoder-only Transformer: GPT-2 by default, Llama-style with the options below.

    The serial model is ``GPT(config)``; a tensor-parallel one splits ``hidden``, ``heads``,
    ``ffn_hidden`` and the padded vocabulary over tp, and the KV heads when ``tp <= kv_heads``
    (:meth:`check_parallel` says what divides what, before any process starts).
    """

    vocab_size: int
    """Real vocabulary size (token ids are in ``[0, vocab_size)``)."""
    seq_len: int
    """Tokens per sample (also the number of learned position embeddings)."""
    hidden: int
    """Width ``h`` of the residual stream."""
    heads: int
    """Attention (query) heads ``a``; ``hidden`` divides by it."""
    layers: int
    """Transformer layers ``L``."""
    ffn_hidden: Optional[int] = None
    """MLP inner width; ``None`` means ``4 * hidden``."""
    kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention; 1: multi-query). ``None``: ``heads`` (full
    multi-head attention). ``heads`` divides by it; query heads ``h * heads/kv_heads`` share one."""
    norm: str = "layernorm"
    """``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama)."""
    mlp: str = "gelu"
    """``"gelu"``: ``fc2(gelu(fc1 x))``; ``"swiglu"``: ``fc2(silu(gate x) * up x)`` (Llama)."""
    gate_up_fused: bool = True
    """SwiGLU only: gate and up projections in one column-parallel matrix ``fc1`` (each rank holds
    matching halves), else two (``gate``, ``up``). The same function either way."""
    position: str = "learned"
    """``"learned"`` position embeddings (GPT-2) or ``"rope"`` rotary embeddings (Su et al. 2021)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama 3: 500000)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (Llama: none)."""
    attention: str = "sdpa"
    """``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient
    kernels where the device has them; no s x s scores kept); ``"eager"``: explicit softmax(QK^T)V.
    Attention dropout in training always takes the eager path (its masks come from mlmkit's
    tensor-parallel random streams)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and both residual branches."""
    tie_embeddings: bool = True
    """Output head reuses the word-embedding matrix (with pp > 1, first and last stage each hold a
    copy whose gradients are summed over the embedding group)."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections use ``init_std / sqrt(2 * layers)``."""
    seed: int = 1234
    """Seed of every initial weight (weights are a function of (seed, parameter name), not of tp) and
    of the dropout streams (:mod:`mlmkit.tensor_parallel.random`)."""
    make_vocab_size_divisible_by: int = 1
    """As in Megatron-LM: the vocabulary is padded to a multiple of this times tp. Megatron's default
    is 128 (GPU-friendly shapes); 1 keeps shard tables of tiny teaching models readable."""
    layernorm_eps: float = 1e-5
    """Epsilon of the normalisation layers (LayerNorm or RMSNorm)."""
    # ------------------------------------------------------------------ mixture of experts
    experts: int = 0
    """Experts per MoE layer; 0: every layer has the dense MLP. With experts, every layer's MLP is a
    mixture of experts (:mod:`mlmkit.moe`): a router sends each token to ``top_k`` of them."""
    top_k: int = 2
    """Experts each token is sent to."""
    moe_router: str = "softmax"
    """Router scores: ``"softmax"`` over the experts (Switch, GShard, Mixtral) or ``"sigmoid"`` per
    expert (DeepSeek-V3)."""
    moe_renormalize: bool = True
    """Weights of a token's top-k experts rescaled to sum to 1 (Mixtral, DeepSeek-V3); ``False``
    keeps the raw scores (Switch; needed with ``top_k=1``, where renormalising gives weight 1 and the
    router no gradient from the language-model loss)."""
    moe_ffn_hidden: Optional[int] = None
    """Inner width of each expert MLP (``None``: ``ffn_hidden``). Experts use the ``mlp`` kind."""
    moe_shared_ffn_hidden: int = 0
    """Inner width of a shared expert every token also goes through (DeepSeek); 0: none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss of Switch / GShard: ``E * sum_e f_e P_e`` per layer and
    microbatch (``f_e``: share of routed tokens, ``P_e``: mean router probability)."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE): the mean squared log-sum-exp of the router logits."""
    moe_capacity_factor: Optional[float] = None
    """``None``: dropless (every token reaches its experts, Megatron-Core's default). Else each rank
    lets each expert take at most ``ceil(capacity_factor * tokens * top_k / experts)`` of its
    tokens; the rest are dropped (counted) and pass through the residual only. The capacity is per
    rank, as in Megatron-Core: layouts that split a microbatch's tokens differently (tensor
    parallelism with sequence parallelism, context parallelism, the micro-batch size) drop different
    tokens, so only layouts that split them alike (pipeline, data and expert parallelism) give the
    serial model's numbers; a checkpoint resumed across such a change continues with other drops.
    Dropping is a threshold: where two router weights tie at an expert's capacity (equal in fp32,
    seen with sigmoid scores of a small router), the rounding of another summation order (data
    parallelism's reduced gradients) can keep the other one, and the runs part by one token's
    route (measured: 0.8% on one expert's weights after 3 steps, from one tie in 159 boundaries)."""
    moe_drop_policy: str = "probs"
    """With a capacity: which tokens an over-full expert keeps, the highest router weights
    (``"probs"``) or the first in sequence order (``"position"``)."""
    moe_force_uniform: bool = False
    """Route token ``t``'s ``j``-th choice to expert ``(t * top_k + j) mod experts`` whatever the
    router says (weights still come from the router; ``t`` counts each rank's own tokens from 0):
    exactly even load when a rank's tokens x top_k divides by experts, else the first experts take
    one assignment more (and with fewer assignments than experts the last get none). For tests and
    for checking the estimator, which reproduces it exactly (like Megatron-LM's
    ``--moe-router-force-load-balancing``). Being per rank, it routes by layout: where a
    microbatch's tokens are split over ranks (sequence or context parallelism) a token gets
    another expert than in the serial model, so only layouts that split them alike (pipeline, data
    and expert parallelism, the same micro-batch size) give the serial model's numbers (measured:
    tp=4 with SP and cp=2: by step 3 the loss 1.2e-5 and the gradient norm 3.4e-3 apart, relative)."""

    def __post_init__(self) -> None:
        for f in fields(self):       # numpy numbers (a DataFrame's rows) are taken as the Python numbers they equal
            value = plain_bool(getattr(self, f.name))      # numpy's bools too
            object.__setattr__(self, f.name, value)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
                object.__setattr__(self, f.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                object.__setattr__(self, f.name, float(value))
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "make_vocab_size_divisible_by"):
            _positive_int(name, getattr(self, name))
        if self.layers > MAX_LAYERS:
            raise ValueError(f"GPTConfig: layers={self.layers} is more than mlmkit plans, builds or estimates "
                             f"(at most {MAX_LAYERS})")
        if self.ffn_hidden is not None:
            _positive_int("ffn_hidden", self.ffn_hidden)
        if self.kv_heads is not None:
            _positive_int("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"GPTConfig: heads={self.heads} is not divisible by kv_heads={self.kv_heads}; "
                                 f"each key/value head serves an equal group of query heads")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig: hidden={self.hidden} is not divisible by heads={self.heads}")
        _choice("norm", self.norm, NORMS)
        _choice("mlp", self.mlp, MLPS)
        _choice("position", self.position, POSITIONS)
        _choice("attention", self.attention, ATTENTIONS)
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary positions need an even head dimension, got hidden/heads = "
                             f"{self.head_dim}")
        for name in ("tie_embeddings", "bias", "gate_up_fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)!r} must be true or false (a bool)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be a number in [0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"GPTConfig: seed={self.seed!r} must be an integer >= 0")
        for name in ("init_std", "layernorm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                # inf passed before: infinite weights (init_std) or a normalisation that outputs zeros
                raise ValueError(f"GPTConfig: {name}={v!r} must be a finite number > 0")
        self._check_moe()

    def _check_moe(self) -> None:
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"GPTConfig: experts={self.experts!r} must be an integer >= 0 (0: dense MLP)")
        if self.experts > MAX_EXPERTS:
            raise ValueError(f"GPTConfig: experts={self.experts} is more than mlmkit plans, builds or estimates "
                             f"(at most {MAX_EXPERTS} per layer)")
        _positive_int("top_k", self.top_k)
        _choice("moe_router", self.moe_router, ROUTERS)
        _choice("moe_drop_policy", self.moe_drop_policy, DROP_POLICIES)
        for name in ("moe_renormalize", "moe_force_uniform"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)!r} must be true or false (a bool)")
        if self.moe_ffn_hidden is not None:
            _positive_int("moe_ffn_hidden", self.moe_ffn_hidden)
        if isinstance(self.moe_shared_ffn_hidden, bool) or not isinstance(self.moe_shared_ffn_hidden, int) \
                or self.moe_shared_ffn_hidden < 0:
            raise ValueError(f"GPTConfig: moe_shared_ffn_hidden={self.moe_shared_ffn_hidden!r} must be an integer "
                             f">= 0 (0: no shared expert)")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"GPTConfig: {name}={v!r} must be a finite number >= 0 (an infinite weight makes "
                                 f"the router's gradient, then every weight, NaN)")
        cf = self.moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < math.inf):
            raise ValueError(f"GPTConfig: moe_capacity_factor={cf!r} must be a finite number > 0, or None (dropless: "
                             f"no capacity at all)")
        if not self.experts:
            return
        if self.top_k > self.experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} is more than experts={self.experts}; a token goes "
                             f"to top_k different experts")
        if self.top_k == 1 and self.moe_renormalize:
            raise ValueError("GPTConfig: top_k=1 with moe_renormalize=True gives every token weight 1 and the "
                             "router no gradient from the loss; set moe_renormalize=False (Switch Transformer)")

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.experts > 0

    @property
    def moe_ffn(self) -> int:
        """Inner width of one expert."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) attention: fewer key/value heads than query heads."""
        return self.num_kv_heads < self.heads

    def kv_replicas(self, tp: int) -> int:
        """TP ranks that hold each key/value head: 1 when the heads split (``tp <= kv_heads``),
        ``tp / kv_heads`` when they are replicated (``tp > kv_heads``, as in Megatron-LM)."""
        kv = self.num_kv_heads
        return tp // kv if tp > kv else 1

    def padded_vocab(self, tp: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_parallel(self, *, tp: int = 1, pp: int = 1, chunks: int = 1,
                       sequence_parallel: bool = False, cp: int = 1, cp_split: str = "balanced",
                       ep: int = 1, expert_tp: int = 1) -> None:
        """Raise ValueError if this model cannot be split ``tp`` ways, into ``pp * chunks`` stages, its
        sequence over ``cp`` ranks and its experts over ``ep`` ranks (``expert_tp`` ways each)."""
        if (ep > 1 or expert_tp > 1) and not self.moe:
            raise ValueError(f"ep={ep}, expert_tp={expert_tp}: the model has no experts (experts=0); set "
                             f"GPTConfig(experts=...) or ep=1, expert_tp=1")
        if self.moe:
            if self.experts % ep:
                raise ValueError(f"experts={self.experts} is not divisible by ep={ep}: expert parallelism gives "
                                 f"each ep rank experts/ep whole experts; pick ep among the divisors of "
                                 f"{self.experts}")
            for name, width in (("moe_ffn_hidden", self.moe_ffn), ("hidden", self.hidden)):
                if width % expert_tp:
                    raise ValueError(f"{name}={width} is not divisible by expert_tp={expert_tp}")
            if tp > 1 and not sequence_parallel:
                raise ValueError(f"mixture of experts with tp={tp} needs sequence_parallel=True (as in "
                                 f"Megatron-LM): each tensor-parallel rank routes its own share of the tokens")
            if self.moe_shared_ffn_hidden % tp:
                raise ValueError(f"moe_shared_ffn_hidden={self.moe_shared_ffn_hidden} is not divisible by tp={tp}")
        for name, value in (("hidden", self.hidden), ("heads", self.heads), ("ffn_hidden", self.ffn)):
            if value % tp:
                raise ValueError(
                    f"{name}={value} is not divisible by tp={tp}: tensor parallelism splits {name} "
                    f"evenly across ranks; pick tp among the divisors of {value}."
                )
        kv = self.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"kv_heads={kv} and tp={tp}: key/value heads are split over tp when tp divides them and "
                f"replicated when they divide tp; pick tp among the divisors or multiples of {kv}."
            )
        if cp > 1:
            from mlmkit.context_parallel.split import check_split

            check_split(self.seq_len, cp, cp_split, tp=tp, sequence_parallel=sequence_parallel)
            if self.dropout:
                raise ValueError(
                    f"context parallelism (cp={cp}) needs dropout=0, got dropout={self.dropout}: mlmkit's ring "
                    f"attention has no attention dropout (long-context runs such as Llama 3's train without "
                    f"dropout). Set dropout=0 or cp=1.")
        elif sequence_parallel and self.seq_len % tp:
            raise ValueError(f"sequence parallelism: seq_len={self.seq_len} is not divisible by tp={tp}")
        stages = pp * chunks
        if stages > self.layers:
            raise ValueError(
                f"{stages} pipeline stages (pp={pp} x chunks={chunks}) but only layers={self.layers}: "
                f"each stage needs at least one layer."
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        check_keys(cls, data)
        return cls(**data)


def tiny_config(**overrides) -> GPTConfig:
    """The teaching model of the tests and notebooks: 2 layers, hidden 64, 4 heads, vocab 101, seq 16."""
    base = dict(vocab_size=101, seq_len=16, hidden=64, heads=4, layers=2)
    base.update(overrides)
    return GPTConfig(**base)


def moe_config(**overrides) -> GPTConfig:
    """A tiny mixture-of-experts model: Llama-style blocks, 4 SwiGLU experts, top-2 (Mixtral-like)."""
    base = dict(vocab_size=256, seq_len=32, hidden=64, heads=4, kv_heads=2, layers=2, ffn_hidden=128,
                norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
                experts=4, top_k=2)
    base.update(overrides)
    return GPTConfig(**base)


def llama_config(**overrides) -> GPTConfig:
    """A tiny Llama-style model (byte vocabulary): RMSNorm, SwiGLU, rotary positions, 4 query heads
    sharing 2 key/value heads, no biases, untied embeddings; 4 layers, hidden 64, seq 32."""
    base = dict(vocab_size=256, seq_len=32, hidden=64, heads=4, kv_heads=2, layers=4, ffn_hidden=176,
                norm="rmsnorm", mlp="swiglu", position="rope", rope_theta=10000.0, bias=False,
                tie_embeddings=False)
    base.update(overrides)
    return GPTConfig(**base)


def split_layers(num_layers: int, num_stages: int,
                 layers_per_stage: Optional[Sequence[int]] = None) -> list[tuple[int, ...]]:
    """Global layer indices of each (virtual) pipeline stage: evenly, earlier stages taking the
    remainder, or as ``layers_per_stage`` lists them (one positive whole count per stage, in stage
    order, summing to ``num_layers``). The model, the executor and the estimators split alike.

    Raises:
        ValueError: more stages than layers, or counts of another length, sum or kind (a count
            list for another model once estimated layers the model does not have).
    """
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages but only {num_layers} layers: each stage needs at least one layer")
    if layers_per_stage is None:
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (1 if i < extra else 0) for i in range(num_stages)]
    if isinstance(layers_per_stage, (str, bytes, AbstractSet, Mapping)) or not isinstance(layers_per_stage, Iterable):
        raise ValueError(f"layers_per_stage={layers_per_stage!r} must be a list of {num_stages} layer counts, in "
                         f"stage order")
    counts = list(layers_per_stage)
    if (len(counts) != num_stages or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in counts)
            or sum(counts) != num_layers or min(counts) < 1):
        raise ValueError(
            f"layers_per_stage={counts} must list {num_stages} positive whole counts summing to {num_layers}"
        )
    out, start = [], 0
    for n in counts:
        out.append(tuple(range(start, start + int(n))))
        start += int(n)
    return out
