"""What every compiled CPU kernel of actscan shares: loading it on first use (or in the
background, ahead of the pass), lending a tensor's memory to numpy, and splitting rows
over the torch threads.

The kernels (`cast_kernels` with numba; `reduce_kernels` and `steps.moved_kernel` with
llvmlite, through `jit`) are optional: both come with the `fast` extra, and without it
each caller runs its torch passes. A kernel's dependency is imported only when it first
runs, so `actscan --help` and a run that needs none of them never pay the import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

__all__ = ["MIN_PART", "borrowed", "lazy", "preload", "split_rows"]


def lazy(load: Callable[[], Any]) -> Callable[[], Any]:
    """`load()` (an import of an optional dependency's module) on the first call, then
    its module, or None if the import failed: nothing is imported until it is used. A
    call while another thread is loading it (`preload`) waits for that load."""
    got: list[Any] = []
    lock = threading.Lock()

    def module() -> Any:
        if not got:
            with lock:
                if not got:
                    try:
                        got.append(load())
                    except ImportError:  # numba or llvmlite (the `fast` extra) is not installed
                        got.append(None)
        return got[0]

    return module


def preload(*loaders: Callable[[], Any]) -> None:
    """Load these `lazy` modules in a background thread, now: numba's import and a
    kernel's first call take ~0.5 s (llvmlite's build ~0.07 s), mostly while the caller
    builds its model (torch's kernels release the GIL), so the pass that uses them does
    not wait. The pass's own first call waits for the load, so which path runs never
    depends on timing."""
    if loaders:
        threading.Thread(
            target=lambda: [load() for load in loaders], name="actscan-preload", daemon=True
        ).start()


_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8"}


class _Borrowed:
    """A C-contiguous tensor's memory as numpy sees it, through the array interface:
    `Tensor.numpy()` would mark the storage not resizable for good, and FSDP frees an
    unsharded parameter by resizing its storage to 0. Holds the tensor, so the memory
    lives as long as the array does."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.__array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), True),  # read-only: the kernels only read
            "version": 3,
        }


def borrowed(t: torch.Tensor) -> Any:
    """`t`'s memory (fp32 or fp64, C-contiguous, CPU) as a numpy array, not a copy."""
    return np.asarray(_Borrowed(t))


_POOL: ThreadPoolExecutor | None = None
MIN_PART = 1 << 18  # values below which a thread costs more than it saves


def split_rows(fn: Callable[[tuple[int, int]], Any], rows: int, values: int) -> list[Any]:
    """`fn((start, stop))` over ranges of whole rows of an operand of `rows` rows and
    `values` values, one per torch thread (the kernels release the GIL): a user's threads
    speed the kernels as they speed the pass."""
    n = max(1, min(torch.get_num_threads(), rows, values // MIN_PART))
    if n == 1:
        return [fn((0, rows))]
    global _POOL
    if _POOL is None or _POOL._max_workers < n - 1:
        _POOL = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="actscan-kernels")
    cuts = [rows * i // n for i in range(n + 1)]
    rest = [_POOL.submit(fn, (cuts[i], cuts[i + 1])) for i in range(1, n)]
    return [fn((cuts[0], cuts[1])), *(f.result() for f in rest)]  # the caller's thread does one
