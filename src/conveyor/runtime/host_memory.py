"""Keep freed host memory for reuse, as PyTorch's CUDA caching allocator does on a GPU.

keep_freed_memory()   # once per process; Pipeline and the profiler call it by default
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

__all__ = ["keep_freed_memory"]

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int


# Note [freed host memory]:
# glibc returns large freed blocks to the kernel (they were mmapped, or the heap top is
# trimmed), so the next step's tensors of the same sizes come back as fresh pages, each
# zeroed by a page fault. A pipeline step allocates and frees the same activation and
# gradient buffers every micro-batch: on this machine's CPU that was 5,000-10,000 page faults
# per step of one stage and 10-25% of its backward time (one stage timed alone, with and
# without; docs/timelines-and-planning.md). Raising
# the mmap and trim thresholds keeps the memory in the heap for reuse; the process then holds
# its peak, exactly as the CUDA caching allocator holds GPU memory.
@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory (blocks up to 1 GiB) for reuse instead of
    returning it to the kernel; process-wide, once. False where the C library is not glibc
    (nothing changes there)."""
    if platform.libc_ver()[0] != "glibc":
        logger.info("freed host memory is returned to the system: the C library is not glibc")
        return False
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    applied = bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    )
    if not applied:
        logger.warning(
            "glibc refused mallopt: freed host memory is returned to the system "
            "and steps pay page faults for it"
        )
    return applied
