"""Where freed host memory goes in this process: a probe of glibc's malloc through its public API.

Imports nothing but ctypes, so a fresh interpreter running it (the control) starts from glibc's own
defaults, whatever torch would have allocated and freed on import.
"""

import ctypes
import ctypes.util

MIB = 2**20
_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def probe(*, blocks: int = 4, block_mib: int = 24, rounds: int = 2) -> list[dict]:
    """Allocate ``blocks`` blocks of ``block_mib`` MiB (the size of a microbatch's activations),
    write them, free them all, ``rounds`` times, as a training step does. Per round: how many were
    given their own mmap (unmapped again on free) and how many bytes the heap gave back to the
    kernel after the frees (faulted in again next time). Both 0 when freed memory is kept."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    out = []
    for _ in range(rounds):
        before = libc.mallinfo2()
        ptrs = [libc.malloc(block_mib * MIB) for _ in range(blocks)]
        assert all(ptrs), "malloc failed"
        for p in ptrs:
            ctypes.memset(p, 1, block_mib * MIB)
        held = libc.mallinfo2()
        for p in ptrs:
            libc.free(p)
        after = libc.mallinfo2()
        out.append({"mmapped": held.hblks - before.hblks, "trimmed_bytes": max(0, held.arena - after.arena)})
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(probe()))
