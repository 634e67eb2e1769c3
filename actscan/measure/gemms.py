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

from actscan.measure.hooks import unwatched_scope

__all__ = [
    "GEMM_NAMES",
    "SDPA_NAME",
    "Gemm",
    "Operand",
    "Sdpa",
    "aside",
    "is_aside",
    "parse_gemm",
    "parse_sdpa",
    "storage_key",
]

_LINEAR = {"linear"}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm"}
_RMATMUL = {"__rmatmul__"}
_ADDMM = {"addmm", "baddbmm", "addbmm"}
_EINSUM = {"einsum"}
_GROUPED = {"_grouped_mm", "grouped_mm", "_scaled_grouped_mm"}
GEMM_NAMES = frozenset().union(_LINEAR, _MATMUL, _RMATMUL, _ADDMM, _EINSUM, _GROUPED)
# the fused attention call: two GEMMs (QKᵀ, PV) and a softmax in one kernel (`parse_sdpa`)
SDPA_NAME = "scaled_dot_product_attention"


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
    recomputed scores, the layout proof's Gram matrix): not GEMMs of the model, and not
    seen by actscan's own `Watcher` modes (`hooks.unwatched_scope`)."""
    depth = getattr(_ASIDE, "depth", 0)
    _ASIDE.depth = depth + 1
    try:
        with unwatched_scope():
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
    equation: str = ""  # einsum's
    repeat: int = 1  # SDPA's grouped-query attention: each rhs head serves `repeat` q heads

    def product(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The contraction itself (no bias) of `tensors` standing for the operands, in
        their shapes: what `--gemm-error` compares, Q(X)·Q(W)ᵀ against X·Wᵀ. None for a
        call it cannot redo (a grouped-mm, whose groups are in its offsets)."""
        if len(tensors) != 2 or len(self.operands) != 2:
            if self.op == "einsum" and len(tensors) == len(self.operands):
                return torch.einsum(self.equation, *tensors)
            return None
        a, b = tensors
        if self.op == "linear":
            return torch.nn.functional.linear(a, b)
        if self.op == "einsum":
            return torch.einsum(self.equation, a, b)
        if self.op.startswith("sdpa."):
            b = b.repeat_interleave(self.repeat, -3) if self.repeat > 1 else b
            return a @ b.transpose(-1, -2) if self.op == "sdpa.qk" else a @ b
        if self.op == "grouped_mm":
            return None
        out = torch.matmul(a, b)
        return out.sum(0) if self.op == "addbmm" else out


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
    if len(out) != len(ops):
        return Gemm("einsum", tuple(out))
    return Gemm("einsum", tuple(out), equation=eq)


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


@dataclass(frozen=True)
class Sdpa:
    """One `F.scaled_dot_product_attention` call, as torch defines it: S = scale·QKᵀ (+ the
    mask), P = softmax(S), O = PV. Its two GEMMs are QKᵀ (q and k, both contracted over
    the head dim) and PV (the probabilities over the keys, v over its rows). With
    `enable_gqa` the key/value heads are repeated to the query heads, as the kernel does."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float
    gqa: bool

    @property
    def repeat(self) -> int:
        """Query heads per key/value head (1 unless `enable_gqa`)."""
        if not self.gqa or self.q.dim() < 3 or self.k.dim() < 3:
            return 1
        return max(int(self.q.shape[-3]) // int(self.k.shape[-3]), 1)

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.repeat, -3) if self.repeat > 1 else t

    def probabilities(self) -> torch.Tensor:
        """P in fp32 (no dropout), what the PV GEMM multiplies; a query with every key
        masked has P = 0 (the kernels write 0 there, softmax would give NaN)."""
        q, k = self.q.float(), self._expand(self.k).float()
        s = (q @ k.transpose(-1, -2)) * self.scale
        if self.causal:
            t, n = s.shape[-2], s.shape[-1]
            keep = torch.ones(t, n, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, -math.inf)
        if self.mask is not None:
            m = self.mask
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        return torch.softmax(s, -1).nan_to_num(0.0)

    def score_grad(self, p: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
        """The gradient of the QKᵀ GEMM's output from the attention output's gradient:
        dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)), times the scale S = scale·QKᵀ applies."""
        dp = d_out.float() @ self._expand(self.v).float().transpose(-1, -2)
        return p * (dp - (dp * p).sum(-1, keepdim=True)) * self.scale

    def gemms(self, p: torch.Tensor) -> tuple[Gemm, Gemm]:
        """(QKᵀ, PV) as contractions: q and k over their last dim, P over its last (the
        keys), v over its rows (the keys)."""
        qn, kn, vn = self.q.dim(), self.k.dim(), self.v.dim()
        q = Operand(self.q, (qn - 1,), (qn - 2,))
        k = Operand(self.k, (kn - 1,), (kn - 2,))
        probs = Operand(p, (p.dim() - 1,), (p.dim() - 2,))
        v = Operand(self.v, (vn - 2,), (vn - 1,))
        rep = self.repeat
        return Gemm("sdpa.qk", (q, k), repeat=rep), Gemm("sdpa.pv", (probs, v), repeat=rep)


def parse_sdpa(args: Sequence[Any], kwargs: dict[str, Any]) -> Sdpa | None:
    """The `scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
    is_causal, scale, enable_gqa)` call's tensors and rules; None when it is not one."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

    def arg(i: int, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(names[i], default)

    q, k, v, mask = arg(0), arg(1), arg(2), arg(3)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return None
    scale = arg(6)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask = mask if isinstance(mask, torch.Tensor) else None
    return Sdpa(q, k, v, mask, bool(arg(5, False)), scale, bool(kwargs.get("enable_gqa", False)))
