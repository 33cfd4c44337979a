"""GPTConfig: the model's sizes, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

__all__ = ["GPTConfig", "reject_unknown_keys", "tiny_config"]


def reject_unknown_keys(cls, data: dict) -> None:
    """ValueError naming every key of ``data`` that is not a field of the dataclass ``cls``."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known keys are {sorted(known)}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig: {name}={value!r} must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT-2-style decoder (pre-LayerNorm, learned positions, GELU MLP).

    The serial model is ``GPT(config)``; a tensor-parallel one splits ``hidden``, ``heads``,
    ``ffn_hidden`` and the padded vocabulary over tp, so each must divide by tp
    (:meth:`check_parallel` says so before any process starts).
    """

    vocab_size: int
    """Real vocabulary size (token ids are in ``[0, vocab_size)``)."""
    seq_len: int
    """Tokens per sample (also the number of learned position embeddings)."""
    hidden: int
    """Width ``h`` of the residual stream."""
    heads: int
    """Attention heads ``a``; ``hidden`` divides by it."""
    layers: int
    """Transformer layers ``L``."""
    ffn_hidden: Optional[int] = None
    """MLP inner width; ``None`` means ``4 * hidden``."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and both residual branches."""
    tie_embeddings: bool = True
    """Output head reuses the word-embedding matrix (with pp > 1, first and last stage each hold a
    copy whose gradients are summed over the embedding group)."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections use ``init_std / sqrt(2 * layers)``."""
    seed: int = 1234
    """Seed of every initial weight (weights are a function of (seed, parameter name), not of tp)."""
    make_vocab_size_divisible_by: int = 1
    """As in Megatron-LM: the vocabulary is padded to a multiple of this times tp. Megatron's default
    is 128 (GPU-friendly shapes); 1 keeps shard tables of tiny teaching models readable."""
    layernorm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "make_vocab_size_divisible_by"):
            _positive_int(name, getattr(self, name))
        if self.ffn_hidden is not None:
            _positive_int("ffn_hidden", self.ffn_hidden)
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig: hidden={self.hidden} is not divisible by heads={self.heads}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be a number in [0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"GPTConfig: seed={self.seed!r} must be an integer >= 0")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig: tie_embeddings={self.tie_embeddings!r} must be true or false (a bool)")
        for name in ("init_std", "layernorm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"GPTConfig: {name}={v!r} must be a number > 0")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_parallel(self, *, tp: int = 1, pp: int = 1, chunks: int = 1,
                       sequence_parallel: bool = False) -> None:
        """Raise ValueError if this model cannot be split ``tp`` ways and into ``pp * chunks`` stages."""
        for name, value in (("hidden", self.hidden), ("heads", self.heads), ("ffn_hidden", self.ffn)):
            if value % tp:
                raise ValueError(
                    f"{name}={value} is not divisible by tp={tp}: tensor parallelism splits {name} "
                    f"evenly across ranks; pick tp among the divisors of {value}."
                )
        if sequence_parallel and self.seq_len % tp:
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
        reject_unknown_keys(cls, data)
        return cls(**data)


def tiny_config(**overrides) -> GPTConfig:
    """The teaching model of the tests and notebooks: 2 layers, hidden 64, 4 heads, vocab 101, seq 16."""
    base = dict(vocab_size=101, seq_len=16, hidden=64, heads=4, layers=2)
    base.update(overrides)
    return GPTConfig(**base)
