"""CPU ranks: keep freed host memory in the process instead of giving it back to the kernel each step.

On CPU, PyTorch's tensors come from glibc's ``malloc``. By default glibc hands memory back to the
kernel as soon as enough of it is free at the top of the heap (``M_TRIM_THRESHOLD``, 128 KiB at
first, adjusted as the program runs) and gives big blocks their own ``mmap`` (``M_MMAP_THRESHOLD``),
unmapped again on ``free``. A training step frees a microbatch's activations and allocates the next
one's of the same sizes, so the kernel maps, zeroes and faults the same pages in again and again.
GPU runs do not pay this: PyTorch's caching allocator keeps freed device memory. On CPU,
:func:`keep_freed_memory` does the same for the heap: freed blocks stay in the process and are
reused.

Measured on this project's 2-core machine (4 ranks, zb-h1 at pp=4, 8 microbatches, the pipeline
benchmark's model): 1,600 to 3,400 page faults per step and rank before, about 700 after (CPython's
own 16 KiB frame-stack chunks make most of the rest); the step's CPU time over all ranks went from
6-11% above 1F1B's to 1-5% above (a zero-bubble schedule holds each microbatch's weight-gradient
inputs until W, which changes the order of frees and made glibc trim the heap top each step).
The resident set then stays at its peak: fine for a training process, whose next step needs it again.

mlmkit calls it where it starts CPU ranks (:func:`mlmkit.distributed.run_ranks`, the cluster's
engines, ``python -m mlmkit.train``); it does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import numbers

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's mallopt parameters (malloc.h)
MIB = 2**20


def keep_freed_memory(*, trim_threshold: int = 512 * MIB, mmap_threshold: int = 32 * MIB) -> bool:
    """Tell glibc's ``malloc`` to keep up to ``trim_threshold`` bytes of free memory at the top of
    the heap and to serve blocks below ``mmap_threshold`` bytes (glibc's maximum: 32 MiB on 64-bit)
    from the heap. Process-wide; returns whether it took effect (``False`` without glibc)."""
    for name, value in (("trim_threshold", trim_threshold), ("mmap_threshold", mmap_threshold)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"keep_freed_memory: {name}={value!r} must be a positive number of bytes")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):        # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and ok
