"""The recorder's reduction of one fp32 CPU output in one read, where torch takes eight.

`Recorder._reduce` wants, per output: Σx, each row's L2 norm, per-channel max and min,
and exact counts of finite values and of zeros. In torch that is a pass each (two maps
written and summed for the counts): memory-bound passes that cost more next to the GEMMs
on a CPU with slow caches than on one with fast ones (on an Intel Xeon, the eight of them
over a 512 × 768 output took 0.68 ms; one compiled read 0.09 ms). `reduce_kernels` is that
read: one loop, built with llvmlite (the `fast` extra) when first used; without it the
recorder keeps its torch passes.

The figures are the same fp32 quantities: a row's squares and sum in fp32 lanes (only the
order of the sum differs), rows added in fp64, the counts exact (each row's below 2**24).
A NaN stays in its column's max and min, as torch's amax and amin carry it. Nothing is
read back on the host: the figures stay tensors, as the torch passes' do.
"""

from __future__ import annotations

from typing import Any

import torch

from actscan.measure.compiled import lazy

__all__ = ["available", "loader", "reduce", "runs_on", "sums"]


def _load() -> Any:
    from actscan.measure import reduce_kernels  # compiles the loop (~0.07 s)

    return reduce_kernels


_kernels = lazy(_load)  # `reduce_kernels` (the compiled loop), or None without llvmlite


def loader() -> Any:
    """The kernels' loader, for `compiled.preload` (None: not installed)."""
    return _kernels()


def available() -> bool:
    """Whether the compiled reduction can run here (llvmlite importable, the loop built)."""
    return _kernels() is not None


def runs_on(device: torch.device) -> bool:
    """The loop is built (llvmlite is here) and the device is the CPU (`reduce` takes
    fp32: the recorder upcasts a half-precision chunk into its scratch first, as for its
    torch passes)."""
    return device.type == "cpu" and available()


def reduce(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σx fp64, row norms fp32 (rows,), [finite, zeros] fp64, per-column max, min (c,))
    of a C-contiguous 2-D fp32 CPU `x`, as `Recorder._reduce` queues them.

    On the caller's thread alone: a second thread would land on the core where torch's
    own OpenMP worker still spins after the last op (splitting measured 0.07 s against
    0.05 s over a GPT-2 pass at two threads)."""
    r, c = x.shape
    buf = torch.empty(2 * c + r)  # hi, lo (the loop sets them to ∓inf first) and norms
    hi, lo, norms = buf[:c], buf[c : 2 * c], buf[2 * c :]
    acc = torch.zeros(3, dtype=torch.float64)
    _kernels().rows(x, hi, lo, norms, acc)
    return acc[0], norms, acc[1:], hi, lo


def sums(x: torch.Tensor) -> torch.Tensor:
    """(Σx, Σx²) in fp64 of a contiguous fp32 CPU `x`, in one read (`runs_on(x.device)`)."""
    acc = torch.zeros(2, dtype=torch.float64)
    _kernels().sums(x, acc)
    return acc
