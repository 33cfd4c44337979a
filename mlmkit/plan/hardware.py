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

from dataclasses import dataclass, replace

__all__ = ["GPUS", "Hardware", "hardware"]

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

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Hardware {self.name!r}: {name}={value!r} must be a positive number")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: gpus_per_node={self.gpus_per_node!r} must be an integer >= 1")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Hardware {self.name!r}: efficiency={self.efficiency!r} must be in (0, 1]")

    def compute_efficiency(self, width: float) -> float:
        """Achieved fraction of the peak for per-GPU GEMMs ``width`` wide (``hidden / tp``)."""
        return self.efficiency * width / (width + self.half_width)

    def link(self, group_size: int, stride: int) -> float:
        """Bandwidth of a group of ``group_size`` ranks ``stride`` apart in rank order: NVLink when
        the group fits in one node, else the network."""
        return self.intra_node_bandwidth if group_size * stride <= self.gpus_per_node else self.inter_node_bandwidth


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


def hardware(name_or_hw, **overrides) -> Hardware:
    """A preset by name (:data:`GPUS`), or a :class:`Hardware` as is; ``overrides`` change fields."""
    if isinstance(name_or_hw, Hardware):
        hw = name_or_hw
    elif name_or_hw in GPUS:
        hw = GPUS[name_or_hw]
    else:
        raise ValueError(f"unknown GPU {name_or_hw!r}; choose one of {', '.join(sorted(GPUS))} "
                         f"or pass a mlmkit.plan.Hardware(...)")
    return replace(hw, **overrides) if overrides else hw
