"""The learner's heap on glibc: memory a training step frees goes back to the kernel.

A training step allocates and frees gigabytes of activations and logits per update (a
SmolLM2-135M step of 8 rows: ~1.4 GB), in whichever worker thread trio hands it. glibc serves
blocks above a threshold with mmap and returns them when freed, but raises that threshold to the
size of each such block freed (up to 32 MiB), after which blocks of that size come from the
thread's arena and stay there: measured on SmolLM2-135M, five steps in worker threads grew the
learner's anonymous memory from 2.7 to 4.6-5.0 GB and its peak to 5.0-5.4 GB, still rising, where
the weights, gradients and AdamW moments are 2.4 GB. A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`)
also turns the raise off: at 256 KiB the same steps held 2.38 GB between steps and 3.9 GB at
their peak, flat. The price is a page fault per page of every large block: ~20 % longer steps on
SmolLM2 on this CPU (4.5-4.8 s -> 5.5-5.8 s); the embedded toy's tensors are below the threshold.

Rule: a learner sets the threshold at start unless the operator set MALLOC_MMAP_THRESHOLD_
(glibc's own variable, which then wins). Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
LEARNER_MMAP_THRESHOLD = 256 << 10


def limit_heap_growth(threshold: int = LEARNER_MMAP_THRESHOLD) -> str:
    """Fix glibc's mmap threshold at `threshold` bytes; what was done, for the start-up log."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return f"heap: MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} (set by the environment)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "heap: not glibc, allocator left as it is"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return "heap: mallopt refused the mmap threshold, allocator left as it is"
    return f"heap: blocks of {threshold >> 10} KiB and more are returned to the kernel when freed"
