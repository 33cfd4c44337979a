"""Rows of the benchmark table, medians, and RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from dataclasses import dataclass
from typing import Optional

__all__ = ["Row", "alternate", "format_table", "median", "paired", "write_results"]


@dataclass
class Row:
    """One line of the table.

    ``mlmkit`` and ``baseline`` are medians; ``ratio`` is the median of per-repetition ratios when
    the two sides ran as pairs (it cancels slow drifts of a noisy machine), else their quotient.
    """

    benchmark: str
    case: str
    mlmkit: float
    baseline: float
    unit: str
    target: str
    met: Optional[bool]
    note: str = ""
    ratio: Optional[float] = None

    def __post_init__(self) -> None:
        if self.ratio is None:
            self.ratio = self.mlmkit / self.baseline if self.baseline else float("nan")


def paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """(median ours, median theirs, median of ours_i / theirs_i)."""
    return median(ours), median(theirs), median([a / b for a, b in zip(ours, theirs)])


def alternate(ours, base, reps: int, *, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Time ``ours()`` and ``base()`` (each returns seconds) ``reps`` times, alternating which runs first."""
    for _ in range(warmup):
        ours(), base()
    a, b = [], []
    for i in range(reps):
        if i % 2:
            a.append(ours()); b.append(base())
        else:
            b.append(base()); a.append(ours())
    return a, b


def median(xs) -> float:
    return statistics.median(xs)


def format_table(rows: list[Row]) -> str:
    head = "| benchmark | case | mlmkit | baseline | ratio | target | met | note |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        met = "n/a" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.benchmark} | {r.case} | {r.mlmkit:.4g} {r.unit} | {r.baseline:.4g} {r.unit} | "
                     f"{r.ratio:.3f} | {r.target} | {met} | {r.note} |")
    return "\n".join(lines)


def _cpu() -> str:
    """The processor's model name and the vector units that change GEMM speed (Linux; else the
    architecture): results of different hosts are not comparable row by row."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    units = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    return f"{model}; {', '.join(units) or 'no AVX2'}"


def machine() -> str:
    import torch

    return (f"{os.cpu_count()} cores ({_cpu()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}, {'CUDA' if torch.cuda.is_available() else 'CPU only'}")


def write_results(rows: list[Row], *, command: str, path: str, explanations: str = "") -> str:
    text = (f"# Benchmark results\n\n- date: {datetime.datetime.now().isoformat(timespec='seconds')}\n"
            f"- machine: {machine()}\n- command: `{command}`\n\n"
            "Medians of several repetitions; mlmkit and the baseline are interleaved in the same run. "
            "ratio = mlmkit / baseline.\n\n" + format_table(rows) + "\n")
    if explanations:
        text += "\n## Notes on rows that miss their target\n\n" + explanations + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text
