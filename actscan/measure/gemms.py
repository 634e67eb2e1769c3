"""Which tensors a contraction call multiplies, and over which dimensions: one parser of
linear / matmul / `@` / mm / bmm / addmm / baddbmm / einsum / grouped-mm calls as a
`TorchFunctionMode` sees them.

Two readers share it, so they see the same GEMMs: the usage watch (`layout/usage.py`: a
weight's fan-in is the size it is contracted over) and the low-precision recorder
(`measure/lowprec.py`: each operand is cast in blocks along the dimension it is contracted
over, as the block-scaled formats do).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GEMM_NAMES", "Gemm", "Operand", "aside", "is_aside", "parse_gemm", "storage_key"]

_LINEAR = {"linear"}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm"}
_RMATMUL = {"__rmatmul__"}
_ADDMM = {"addmm", "baddbmm", "addbmm"}
_EINSUM = {"einsum"}
_GROUPED = {"_grouped_mm", "grouped_mm", "_scaled_grouped_mm"}
GEMM_NAMES = frozenset().union(_LINEAR, _MATMUL, _RMATMUL, _ADDMM, _EINSUM, _GROUPED)


def storage_key(t: Any) -> int | None:
    """The identity of the tensor's storage (its StorageImpl), not its address: memory FSDP
    frees after a module's forward is reused by activations at the same address."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):  # no storage (fake, functional)
        return None


_ASIDE = threading.local()


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """Marks actscan's own side computations inside a forward (the attention probes'
    recomputed scores, the layout proof's Gram matrix): not GEMMs of the model."""
    depth = getattr(_ASIDE, "depth", 0)
    _ASIDE.depth = depth + 1
    try:
        yield
    finally:
        _ASIDE.depth = depth


def is_aside() -> bool:
    return getattr(_ASIDE, "depth", 0) > 0


@dataclass(frozen=True)
class Operand:
    """One multiplied tensor: the dims the call contracts over and its own free dims (not
    contracted, not shared with another operand as a batch dim), both as non-negative
    indices into `tensor.shape`."""

    tensor: torch.Tensor
    contract: tuple[int, ...]
    free: tuple[int, ...]

    @property
    def fan_in(self) -> int:
        return math.prod(int(self.tensor.shape[d]) for d in self.contract)

    @property
    def fan_out(self) -> int:
        return math.prod(int(self.tensor.shape[d]) for d in self.free)


@dataclass(frozen=True)
class Gemm:
    """One contraction call: its operands in call order (the input first) and the bias
    tensors it adds."""

    op: str
    operands: tuple[Operand, ...]
    biases: tuple[Any, ...] = ()


def _lhs(a: Any) -> Operand | None:
    """`a` on the left of a @ b: contracted over its last dim, free over its rows."""
    if not isinstance(a, torch.Tensor) or a.dim() < 1:
        return None
    n = a.dim()
    return Operand(a, (n - 1,), (n - 2,) if n >= 2 else ())


def _rhs(b: Any) -> Operand | None:
    """`b` on the right of a @ b: contracted over its rows, free over its columns."""
    if not isinstance(b, torch.Tensor) or b.dim() < 1:
        return None
    n = b.dim()
    return Operand(b, (n - 2,), (n - 1,)) if n >= 2 else Operand(b, (0,), ())


def _mm(op: str, a: Any, b: Any, biases: tuple[Any, ...] = ()) -> Gemm:
    operands = tuple(o for o in (_lhs(a), _rhs(b)) if o is not None)
    return Gemm(op, operands, biases)


def _einsum(args: Sequence[Any]) -> Gemm | None:
    if not args:
        return None
    eq = args[0]
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
    if not isinstance(eq, str):
        return None
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops) or "." in eq:
        return None
    if not arrow:  # implicit output: letters that appear once, sorted
        letters = "".join(terms)
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    out: list[Operand] = []
    for i, (term, t) in enumerate(zip(terms, ops, strict=True)):
        if not isinstance(t, torch.Tensor) or t.dim() != len(term):
            continue
        others = "".join(x for j, x in enumerate(terms) if j != i)
        contract = tuple(d for d, c in enumerate(term) if c not in rhs)
        free = tuple(d for d, c in enumerate(term) if c in rhs and c not in others)
        out.append(Operand(t, contract, free))
    return Gemm("einsum", tuple(out))


def parse_gemm(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Gemm | None:
    """The GEMM a call named `name` makes with (args, kwargs), or None when it is none."""

    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(key)

    if name in _LINEAR:
        x, w, b = arg(0, "input"), arg(1, "weight"), arg(2, "bias")
        operands = []
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            operands.append(Operand(x, (x.dim() - 1,), ()))
        if isinstance(w, torch.Tensor) and w.dim() >= 1:
            operands.append(Operand(w, (w.dim() - 1,), tuple(range(w.dim() - 1))))
        return Gemm("linear", tuple(operands), (b,) if b is not None else ())
    if name in _MATMUL:
        return _mm(name, arg(0, "input"), arg(1, "other") if name != "mm" else arg(1, "mat2"))
    if name in _RMATMUL:
        return _mm("matmul", arg(1, "other"), arg(0, "self"))
    if name in _ADDMM:
        second = "batch" if name != "addmm" else "mat"
        bias = arg(0, "input")
        return _mm(name, arg(1, f"{second}1"), arg(2, f"{second}2"), (bias,))
    if name in _GROUPED:
        return _mm("grouped_mm", arg(0, "mat_a"), arg(1, "mat_b"))
    if name in _EINSUM:
        return _einsum(args)
    return None
