"""Shapes of published models, as :class:`~mlmkit.model.config.GPTConfig` (pure Python).

For the estimator and the planner: building a config allocates nothing. Each preset names its
source. ``preset(name, **overrides)`` returns a config (e.g. ``preset("llama3-8b", seq_len=4096)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlmkit.model.config import GPTConfig

__all__ = ["PRESETS", "Preset", "preset"]


@dataclass(frozen=True)
class Preset:
    """A published model's shape and where it comes from."""

    name: str
    config: GPTConfig
    source: str


_LLAMA3 = dict(norm="rmsnorm", mlp="swiglu", position="rope", rope_theta=500000.0, bias=False,
               tie_embeddings=False, vocab_size=128256, seq_len=8192, make_vocab_size_divisible_by=128)
_LLAMA3_SOURCE = ("Dubey et al. 2024, 'The Llama 3 Herd of Models', table 3 (layers, model dimension, FFN "
                  "dimension, attention heads, key/value heads, RoPE base 500,000, vocabulary 128K: 128,256 "
                  "in the released tokenizer, sequence length 8,192)")

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("quickstart", GPTConfig(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=4),
           "mlmkit's own quickstart model (mlmkit.train.demo_config): a 4-layer byte-level GPT, hidden 64, "
           "small enough to train on CPU ranks"),
    Preset("gpt3-175b",
           GPTConfig(vocab_size=50257, seq_len=2048, hidden=12288, heads=96, layers=96, ffn_hidden=4 * 12288,
                     make_vocab_size_divisible_by=128),
           "Brown et al. 2020, 'Language Models are Few-Shot Learners', table 2.1 (96 layers, d_model 12288, "
           "96 heads, context 2048; GPT-2's 50,257-token vocabulary); the layout of Narayanan et al. 2021, "
           "'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM'"),
    Preset("llama3-8b", GPTConfig(hidden=4096, heads=32, kv_heads=8, layers=32, ffn_hidden=14336, **_LLAMA3),
           _LLAMA3_SOURCE),
    Preset("llama3-70b", GPTConfig(hidden=8192, heads=64, kv_heads=8, layers=80, ffn_hidden=28672, **_LLAMA3),
           _LLAMA3_SOURCE),
    Preset("llama3-405b", GPTConfig(hidden=16384, heads=128, kv_heads=8, layers=126, ffn_hidden=53248, **_LLAMA3),
           _LLAMA3_SOURCE),
    Preset("mixtral-8x7b",
           GPTConfig(vocab_size=32000, seq_len=32768, hidden=4096, heads=32, kv_heads=8, layers=32, ffn_hidden=14336,
                     norm="rmsnorm", mlp="swiglu", position="rope", rope_theta=1e6, bias=False, tie_embeddings=False,
                     experts=8, top_k=2, make_vocab_size_divisible_by=128),
           "Jiang et al. 2024, 'Mixtral of Experts', table 1 (dim 4096, 32 layers, head dim 128, 32 heads, 8 KV "
           "heads, hidden dim 14336, context 32768, vocabulary 32000, 8 experts, top 2): 46.7B parameters, 12.9B "
           "active per token"),
]}


def preset(name: str, **overrides) -> GPTConfig:
    """The config of a published model (``PRESETS``), with optional field overrides."""
    key = name.strip().lower() if isinstance(name, str) else name       # "GPT3-175B" as papers write it
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[key].config, **overrides) if overrides else PRESETS[key].config
