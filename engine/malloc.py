"""glibc's malloc, told to keep freed memory: for processes that allocate and free buffers of megabytes over and over
(the engine's steps on CPU, the kvstore's KV blocks). Torch-free: the kvstore imports it."""

import ctypes


def keep_freed_memory_in_process() -> None:
    """Stop glibc from returning large freed blocks to the kernel (mmap/munmap, trimming the heap).

    glibc serves blocks over 32 MiB, or freed at the heap's top, from fresh pages, so a process that allocates
    megabytes again and again page-faults them in every time. On CPU every engine step allocates and frees
    activations of megabytes (oneDNN's packing buffers too), and the kvstore copies a reload's blocks into fresh
    buffers: both spend system time on page faults that reused memory avoids (docs/benchmarks.md). vLLM asks CPU
    users to preload tcmalloc for the same reason; this needs nothing installed. Freed memory stays
    this process's to reuse."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)
