"""Hardware descriptions for the planner (pure Python): what one accelerator can compute and move.

A :class:`Hardware` is a small frozen dataclass; :data:`GPUS` holds presets for common data-centre
GPUs, each with its source (vendor datasheets). Bandwidths are bytes per second in one direction
per GPU: NVLink for groups that fit in a node, the network (one NIC per GPU) beyond.

Achievable efficiency is not a datasheet number. The planner uses two global constants per GPU
type (never per model): ``efficiency``, the fraction of the dense peak a large Transformer layer
reaches end to end (GEMMs plus the memory-bound operations between them), and ``half_width``, the
per-GPU GEMM width (``hidden / tp``) at which that fraction halves (narrow shards use the tensor
cores badly): ``eff(w) = efficiency * w / (w + half_width)``. They were set once against the
published Megatron-LM runs on A100 and H100 (benchmarks/RESULTS.md lists every row and the miss).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["GPUS", "Hardware", "hardware", "local_cpu"]

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator type and its node (see module docstring)."""

    name: str
    peak_tflops: float            # dense bf16 (the training dtype) TFLOP/s
    memory_bytes: float
    hbm_bandwidth: float          # bytes/s
    intra_node_bandwidth: float   # bytes/s per GPU, one direction (NVLink)
    gpus_per_node: int
    inter_node_bandwidth: float   # bytes/s per GPU, one direction (network)
    latency_s: float = 10e-6      # per message or collective step
    efficiency: float = 0.8
    half_width: float = 100.0
    source: str = ""
    # What sets the time of mlmkit's own runs on CPU ranks (``local-cpu``, measured by
    # mlmkit.distributed.calibrate_local_cpu); the GPU presets keep the defaults.
    runtime: str = "megatron"     # "megatron": Megatron-LM's overlaps; "mlmkit": mlmkit's executor, nothing overlapped
    precision: str = "bf16"       # the training dtype the prediction assumes
    op_overhead_s: float = 0.0    # host time per dispatched operator (kernel launches hide it on GPUs)
    recompute_overhead_s: float = 0.0   # host time of one recomputed region beyond its operators
    # measured ((group size, gap s, latency s), ...): a small all-reduce after `gap` seconds of work
    collective_latency: tuple = ()
    # measured ((op, factor), ...): an all-gather's or reduce-scatter's latency over an all-reduce's
    # in the same group after the same work; default 0.5 (half the ring steps). gloo here: 0.75-1.2
    collective_factor: tuple = ()
    p2p_latency: tuple = ()       # measured ((pipeline stages, latency s), ...) of one message; default latency_s
    cores: Optional[float] = None  # processors the ranks share; None: one per rank
    framework_bytes: float = 2 * GiB   # per rank beyond the model: CUDA context, NCCL, workspaces (GPUs)

    def __post_init__(self) -> None:
        # Every number feeds a step time or a memory figure: a NaN, an infinity or a negative latency
        # gave rankings of impossible times (NaN rows sorted anywhere, negative steps first).
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Hardware: name={self.name!r} must be a non-empty string")
        if not isinstance(self.source, str):
            raise ValueError(f"Hardware {self.name!r}: source={self.source!r} must be a string (where the figures "
                             f"come from)")
        for name in ("peak_tflops", "memory_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            _check_number(self.name, name, getattr(self, name), positive=True)
        for name in ("latency_s", "half_width", "op_overhead_s", "recompute_overhead_s", "framework_bytes"):
            _check_number(self.name, name, getattr(self, name), positive=False)
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, numbers.Integral) or self.gpus_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: gpus_per_node={self.gpus_per_node!r} must be an integer >= 1")
        if not _is_number(self.efficiency) or not 0 < self.efficiency <= 1:
            raise ValueError(f"Hardware {self.name!r}: efficiency={self.efficiency!r} must be in (0, 1]")
        if self.runtime not in ("megatron", "mlmkit"):
            raise ValueError(f"Hardware {self.name!r}: runtime={self.runtime!r}; expected 'megatron' or 'mlmkit'")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"Hardware {self.name!r}: precision={self.precision!r}; expected 'bf16' or 'fp32'")
        # the calibration tables: tuples of entries (a number here failed with "not iterable")
        for name, size in (("collective_factor", 2), ("collective_latency", 3), ("p2p_latency", 2)):
            table = getattr(self, name)
            if not isinstance(table, (tuple, list)) or not all(isinstance(e, (tuple, list)) and len(e) == size
                                                               for e in table):
                raise ValueError(f"Hardware {self.name!r}: {name}={table!r} must be a tuple of {size}-tuples "
                                 f"(() when not measured)")
        for op, factor in self.collective_factor:
            if op not in ("all_gather", "reduce_scatter") or not _is_number(factor) or not 0 < factor < math.inf:
                raise ValueError(f"Hardware {self.name!r}: collective_factor ({op!r}, {factor!r}): expected "
                                 f"'all_gather' or 'reduce_scatter' with a factor > 0")
        for entry in self.collective_latency:
            if (len(entry) != 3 or isinstance(entry[0], bool) or not isinstance(entry[0], numbers.Integral) or entry[0] < 2
                    or not all(_is_number(x) and 0 <= x < math.inf for x in entry[1:])):
                raise ValueError(f"Hardware {self.name!r}: collective_latency entry {entry!r}: expected (group size "
                                 f">= 2, gap s >= 0, latency s >= 0), finite")
        for entry in self.p2p_latency:
            if (len(entry) != 2 or isinstance(entry[0], bool) or not isinstance(entry[0], numbers.Integral) or entry[0] < 2
                    or not _is_number(entry[1]) or not 0 <= entry[1] < math.inf):
                raise ValueError(f"Hardware {self.name!r}: p2p_latency entry {entry!r}: expected (pipeline stages "
                                 f">= 2, latency s >= 0), finite")
        if self.cores is not None and (not _is_number(self.cores) or not 0 < self.cores < math.inf):
            raise ValueError(f"Hardware {self.name!r}: cores={self.cores!r} must be a finite number > 0, or None "
                             f"(one processor per rank)")

    def compute_efficiency(self, width: float) -> float:
        """Achieved fraction of the peak for per-GPU GEMMs ``width`` wide (``hidden / tp``)."""
        return self.efficiency * width / (width + self.half_width)

    def collective_time(self, op: str, nbytes: float, n: int, bw: float, gap: float = 0.0) -> float:
        """Seconds of one ring collective (``all_reduce``, ``all_gather``, ``reduce_scatter``) of
        ``nbytes`` over ``n`` ranks at ``bw`` after ``gap`` seconds of work: the measured latency
        of an ``n``-rank group (``collective_latency``, interpolated in the gap; an all-gather or
        reduce-scatter takes ``collective_factor`` of it, measured, or half: half the ring steps)
        when there is one, else ``latency_s`` per ring step."""
        if n <= 1:
            return 0.0
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        share = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        if self.collective_latency:
            sizes = sorted({k for k, _, _ in self.collective_latency})
            near = min(sizes, key=lambda k: abs(k - n))
            curve = [(g, t) for k, g, t in self.collective_latency if k == near]
            latency = _interpolate(curve, gap) * (n - 1) / (near - 1)   # another size: scaled by ring steps
            latency *= 1.0 if op == "all_reduce" else dict(self.collective_factor).get(op, 0.5)
        else:
            latency = steps * self.latency_s
        return share * nbytes / bw + latency

    def message_latency(self, stages: int = 2) -> float:
        """One point-to-point message's latency in a pipeline of ``stages`` ranks (measured:
        the nearest size; else ``latency_s``)."""
        if not self.p2p_latency:
            return self.latency_s
        return min(self.p2p_latency, key=lambda kv: abs(kv[0] - stages))[1]

    def link(self, group_size: int, stride: int) -> float:
        """Bandwidth of a group of ``group_size`` ranks ``stride`` apart in rank order: NVLink when
        the group fits in one node, else the network."""
        return self.intra_node_bandwidth if group_size * stride <= self.gpus_per_node else self.inter_node_bandwidth


def _is_number(value) -> bool:
    # numbers.Real: numpy scalars (a DataFrame's figures) are numbers too; a bool is not
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def _check_number(hw: str, name: str, value, *, positive: bool) -> None:
    ok = _is_number(value) and (0 < value if positive else 0 <= value) and value < math.inf
    if not ok:
        raise ValueError(f"Hardware {hw!r}: {name}={value!r} must be a finite number {'> 0' if positive else '>= 0'}")


def _interpolate(curve, x: float) -> float:
    """Piecewise-linear through ``curve`` ((x, y), ...), flat beyond its ends."""
    pts = sorted(curve)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


_NV = "NVIDIA datasheet"
GPUS: dict[str, Hardware] = {h.name: h for h in [
    Hardware(name="a100-80gb", peak_tflops=312.0, memory_bytes=80 * GiB, hbm_bandwidth=2.039e12,
             intra_node_bandwidth=300e9, gpus_per_node=8, inter_node_bandwidth=25e9, latency_s=10e-6,
             efficiency=0.72, half_width=96.0,
             source=f"{_NV}: A100 80GB SXM, BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink 600 GB/s (both "
                    "directions); DGX A100: 8 GPUs, 8x 200 Gb/s HDR InfiniBand (one per GPU). "
                    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    Hardware(name="h100-sxm", peak_tflops=989.0, memory_bytes=80 * GiB, hbm_bandwidth=3.35e12,
             intra_node_bandwidth=450e9, gpus_per_node=8, inter_node_bandwidth=50e9, latency_s=8e-6,
             efficiency=0.62, half_width=160.0,
             source=f"{_NV}: H100 SXM, BF16 989 TFLOPS dense (1,979 with sparsity), HBM3 3.35 TB/s, NVLink "
                    "900 GB/s; DGX H100: 8 GPUs, 400 Gb/s NDR per GPU. "
                    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    Hardware(name="h200", peak_tflops=989.0, memory_bytes=141e9, hbm_bandwidth=4.8e12,
             intra_node_bandwidth=450e9, gpus_per_node=8, inter_node_bandwidth=50e9, latency_s=8e-6,
             efficiency=0.62, half_width=160.0,
             source=f"{_NV}: H200 SXM, BF16 989 TFLOPS dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; "
                    "HGX H200 8-GPU nodes, 400 Gb/s per GPU. https://www.nvidia.com/en-us/data-center/h200/"),
    Hardware(name="b200", peak_tflops=2250.0, memory_bytes=180e9, hbm_bandwidth=8e12,
             intra_node_bandwidth=900e9, gpus_per_node=8, inter_node_bandwidth=50e9, latency_s=8e-6,
             efficiency=0.55, half_width=256.0,
             source=f"{_NV}: DGX B200, 8 B200 GPUs, 1,440 GB HBM3e (180 GB each) at 64 TB/s, NVLink 5 1.8 TB/s "
                    "per GPU, BF16 2.25 PFLOPS dense per GPU, 400 Gb/s per GPU. "
                    "https://www.nvidia.com/en-us/data-center/dgx-b200/ (efficiency constants: no published "
                    "Megatron runs to set them against; those of the H100 scaled down, a guess)"),
]}


def local_cpu(*, gflops_by_width: dict, op_overhead_s: float, recompute_overhead_s: float, collective_latency: dict,
              bandwidth: float, p2p_latency: dict, cores: float, memory_bytes: float, framework_bytes: float,
              ranks: int, collective_factor: Optional[dict] = None) -> Hardware:
    """The ``local-cpu`` :class:`Hardware` from a calibration's measurements (see
    :func:`mlmkit.distributed.calibrate_local_cpu`, which measures and calls this): the peak and
    ``half_width`` fitted to the matmul throughput per width (least squares over a grid of
    half-widths), fp32, mlmkit's runtime, the ranks sharing ``cores`` processors."""
    widths = sorted(gflops_by_width)
    best = None
    for half in [0.5 * k for k in range(0, 513)]:
        shape = [w / (w + half) for w in widths]
        peak = sum(g * f for g, f in zip((gflops_by_width[w] for w in widths), shape)) / sum(f * f for f in shape)
        err = sum((gflops_by_width[w] - peak * f) ** 2 for w, f in zip(widths, shape))
        if best is None or err < best[0]:
            best = (err, peak, half)
    _, peak, half = best
    return Hardware(
        name="local-cpu", peak_tflops=peak / 1e3, memory_bytes=memory_bytes, hbm_bandwidth=20e9,
        intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, gpus_per_node=ranks,
        latency_s=p2p_latency[min(p2p_latency)], efficiency=1.0, half_width=half, runtime="mlmkit",
        precision="fp32", op_overhead_s=op_overhead_s, recompute_overhead_s=recompute_overhead_s,
        collective_latency=tuple(sorted((n, g, t) for (n, g), t in collective_latency.items())),
        collective_factor=tuple(sorted((collective_factor or {}).items())),
        p2p_latency=tuple(sorted(p2p_latency.items())), cores=cores, framework_bytes=framework_bytes,
        source=f"measured on this machine for {ranks} ranks by mlmkit.distributed.calibrate_local_cpu: fp32 matmul "
               f"{', '.join(f'w={w}: {gflops_by_width[w]:.0f}' for w in widths)} GFLOP/s; "
               f"{op_overhead_s * 1e6:.1f} us per operator; {recompute_overhead_s * 1e6:.0f} us per recomputed "
               f"region; all-reduce latency (group size, after a gap of work) "
               f"{', '.join(f'n={n} {g * 1e3:.2f} ms: {t * 1e3:.2f} ms' for (n, g), t in sorted(collective_latency.items()))}; "
               f"{''.join(f'{op} {f:.2f}x of that; ' for op, f in sorted((collective_factor or {}).items()))}"
               f"{bandwidth / 1e9:.2f} GB/s; message latency in a 1F1B pipeline "
               f"{', '.join(f'p={p}: {t * 1e3:.2f} ms' for p, t in sorted(p2p_latency.items()))}; "
               f"{cores} cores; {framework_bytes / 2**20:.0f} MiB resident per rank before any model")


def hardware(name_or_hw, **overrides) -> Hardware:
    """A preset by name (:data:`GPUS`), or a :class:`Hardware` as is; ``overrides`` change fields.
    ``"local-cpu"`` is measured, not a preset: build it with
    :func:`mlmkit.distributed.calibrate_local_cpu` (``python -m mlmkit.plan --gpu local-cpu`` does)."""
    if isinstance(name_or_hw, Hardware):
        hw = name_or_hw
    elif not isinstance(name_or_hw, str):
        raise ValueError(f"gpu={name_or_hw!r}: give a preset's name ({', '.join(sorted(GPUS))}) or a "
                         f"mlmkit.plan.Hardware(...)")
    elif (key := name_or_hw.strip().lower()) in GPUS:   # "H100-SXM" as written on a spec sheet
        hw = GPUS[key]
    elif key == "local-cpu":
        raise ValueError("gpu='local-cpu' is measured on this machine, not a preset: "
                         "hw = mlmkit.distributed.calibrate_local_cpu(ranks=4), then plan(..., gpu=hw) "
                         "(the CLI's --gpu local-cpu calibrates by itself)")
    else:
        close = [g for g in sorted(GPUS) if g.startswith(key[:4])]
        raise ValueError(f"unknown GPU {name_or_hw!r}"
                         + (f" (did you mean {' or '.join(repr(g) for g in close)}?)" if close else "")
                         + f"; choose one of {', '.join(sorted(GPUS))} or pass a mlmkit.plan.Hardware(...)")
    return replace(hw, **overrides) if overrides else hw
