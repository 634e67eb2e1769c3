"""The layout proves itself: per block, stream in + Σ branch writes = stream out, measured.

`structure.detect_layout` guesses branches from module names. Names lie: Gemma adds the
output of `post_feedforward_layernorm`, not of `mlp`; ReZero adds `α·attn`; a Mamba block
has a mixer, not attention. So one forward pass (the recorded pass's first batch, the
hooks riding on it: actscan.layout.probe) records, inside every block, each module's
output that has the stream's shape (a strided sample of `PROOF_ROWS` of its rows) and
which module consumed which tensor (by tensor identity). From that data flow:

- writes: the stream-shaped outputs that no module inside the block consumes (what the
  block adds, whatever the module is: the branch itself, a post-branch norm, a gain);
- the equation ‖x_in + Σ writes − x_out‖ ≤ tolerance(dtype) · (‖x_out − x_in‖ + ρ‖x_out‖)
  must hold: relative to the size of the writes, not of the output, so a stream 1e5×
  its branches cannot hide a wrong write (a q projection) under a tolerance of the output;
  ρ‖x_out‖ is the rounding the stream's own size brings to the sum (4 unit roundoffs);
- if not, post-norm placement (x_out = norm(x_in + Σ writes)): the equation holds at the
  input of the block's stream norms; then fitted scalar coefficients (DeepNorm's α·x,
  a bare-parameter gate); then subsets of the candidates; else the block is unverified.

Norms of any combination of the recorded vectors come from one Gram matrix per block,
computed on the device when the block returns, and all Grams reach the host in one
transfer after the pass: no host sync inside hooks. An encoder-decoder's two stacks are
proven in the same pass, each block under its own stream's name (`BlockInfo.stream`).
"""

from __future__ import annotations

import inspect
import itertools
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, overload

import torch
from torch import nn

from actscan.layout.detect import is_act, is_norm
from actscan.measure.gemms import aside
from actscan.measure.hooks import HookSet, Watcher
from actscan.measure.state import eval_mode
from actscan.records import BlockInfo, BlockProof, BranchInfo, Layout, Role

# ‖x_in + Σ writes − x_out‖ allowed per dtype of the stream, relative to the writes
# (‖x_out − x_in‖): a few roundings of the additions themselves (unit roundoff 2⁻²⁴,
# 2⁻¹¹, 2⁻⁸).
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
# …plus what rounding the sum x_in + Σ writes in the stream's dtype costs, relative to
# ‖x_out‖: each add rounds to u·|x_out| per element, two adds with a margin make 4u.
ROUNDING = {
    torch.float64: 4 * 2.0**-53,
    torch.float32: 4 * 2.0**-24,
    torch.float16: 4 * 2.0**-11,
    torch.bfloat16: 4 * 2.0**-8,
}
MAX_SEARCH = 24  # candidate groups searched in subsets (beyond: unverified)
# Rows (tokens) of each recorded vector the proof keeps: the equation holds row by row, so
# a strided sample of the rows proves what all of them do, at a fixed cost per block.
PROOF_ROWS = 64
ZERO_COEF = 1e-3  # a fitted write coefficient this small: the candidate is no write
UNIT_COEF = 1e-2  # a fitted write coefficient this close to 1: a plain write

Key = tuple[Any, ...]

_CROSS = re.compile(r"cross|encoder_?attn|enc_?dec", re.I)
_SSM = re.compile(r"mamba|ssm|rwkv|hyena|s4d?(\b|_)", re.I)
_MIXER = re.compile(r"mixer", re.I)
_ATTN = re.compile(r"attn|attention", re.I)
_MOE = re.compile(r"expert|moe", re.I)
_SSM_PARAMS = {"A_log", "dt_bias"}


def _key(t: torch.Tensor) -> Key:
    """Identity of a tensor's view (same storage, offset, shape, strides) and of its
    values: the version counter moves with every in-place op (Llama 4's MoE adds its
    routed experts into the shared expert's output with `add_`)."""
    try:
        return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), _version(t))
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference-mode tensor has no version counter
        return -1


def _storage(k: Key) -> Key:
    """The storage a tensor key views and its size: equal for a tensor and its transpose
    or reshape (the same values), different for anything computed from it."""
    return k if k[0] == "id" else (k[0], k[1], math.prod(k[2]), k[4])


def _is_view(k: Key, of: Key) -> bool:
    return k == of or (k[0] != "id" and _storage(k) == _storage(of))


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _like(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Stream-shaped up to a flattening of the leading dims (OPT adds in (B·T, C)), or
    the channels-last form of a channels-first stream (`_channels_last`)."""
    if not shape or t.numel() != math.prod(shape):
        return False
    return t.shape[-1:] == shape[-1:] or _channels_last(t, shape)


def _channels_last(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """t holds a channels-first stream (B, C, *spatial) with the channels last: (B,
    *spatial, C) or (B, spatial flattened, C), as a ConvNeXt or windowed-attention block
    computes inside while its input and output are (B, C, H, W)."""
    return (
        len(shape) >= 3
        and t.dim() >= 2
        and t.shape[-1] != shape[-1]
        and t.shape[-1] == shape[1]
        and t.shape[0] == shape[0]
        and t.numel() == math.prod(shape)
    )


def _first_float(obj: Any) -> torch.Tensor | None:
    return next((t for t in _tensors(obj) if t.is_floating_point()), None)


@dataclass
class _Node:
    """One module call inside a block."""

    name: str
    order: int
    in_keys: tuple[Key, ...]
    out_key: Key | None  # first float output (any shape)
    in_key: Key | None  # first float input


@dataclass
class _Trace:
    """What one block call recorded (host: keys; device: stream-shaped values)."""

    block: int
    shape: tuple[int, ...]  # the stream's; outputs of the same numel and width count
    x_in: Key
    nodes: list[_Node] = field(default_factory=list)
    values: dict[Key, torch.Tensor] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)  # keeps data_ptr keys unique
    keys: list[Key] = field(default_factory=list)  # rows of the Gram matrix
    x_out: Key | None = None
    dtype: torch.dtype | None = None
    gram: torch.Tensor | None = None
    note: str = ""
    out_shape: tuple[int, ...] | None = None  # set when the block changes the shape
    # operands of the block's functional adds that no module returned: (key, order, the
    # module that ran last before the add)
    added: list[tuple[Key, int, str]] = field(default_factory=list)
    sums: set[Key] = field(default_factory=set)  # what those adds returned
    out: Key | None = None  # the block's output, whatever its shape (the next one's input?)
    # the last activation's (input, output key): stored when the output is x_out
    # (post-activation, relu(x + F(x))), so the equation can hold at its input
    act: tuple[torch.Tensor, Key] | None = None


class BlockWatch:
    """Hooks on the blocks and everything inside them, for one forward pass; `install`
    puts them into the caller's `HookSet`, which removes them."""

    def __init__(
        self, model: nn.Module, blocks: Sequence[BlockInfo], rows: int | None = PROOF_ROWS
    ) -> None:
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.blocks = blocks
        self.rows = rows  # rows kept per vector (None: all of them)
        self.traces: dict[int, _Trace] = {}
        self.stack: list[_Trace] = []
        self.order = 0
        # float64 Grams keep residuals down to ~1e-8; MPS has no float64
        self.acc = torch.float64
        # The first error of a hook: the hooks go inert and the proof says so (a hook on
        # the recorded pass must never break it).
        self.failed: Exception | None = None
        # modules inside a block that ran while no block hook had fired: their block was
        # run as `block.forward(...)`, which no module hook sees (SqueezeBERT's encoder)
        self.bypassed: set[str] = set()
        # each stream's last block output, alive until the next block's: its address is
        # never reused meanwhile, so the next block's input is its view only if it is one
        self.held: dict[str, torch.Tensor] = {}
        self.stream_of = {b.index: b.stream for b in blocks}

    def install(self, hooks: HookSet) -> BlockWatch:
        for b in self.blocks:
            block = self.modules[b.name]
            hooks.forward_pre(block, self._guard(self._enter(b.index)), with_kwargs=True)
            for name, mod in block.named_modules(prefix=b.name):
                if name != b.name:
                    hooks.forward(mod, self._guard(self._inner(name)), with_kwargs=True)
            hooks.forward(block, self._guard(self._leave(b.index)), with_kwargs=True)
        return self

    def adds(self) -> AbstractContextManager[Any]:
        """Around the forward: records the stream-shaped operands of every `+` inside a
        block, so a write computed by functional ops (a transpose, a gate, a window
        un-partition after the branch module) is a candidate too. Reads only."""
        return _AddWatch(self)

    def _add(self, args: tuple[Any, ...], out: Any, inplace: bool) -> None:
        if not self.stack or not self.stack[-1].shape or not isinstance(out, torch.Tensor):
            return
        tr = self.stack[-1]
        if not out.is_floating_point() or not _like(out, tr.shape):
            return
        last = tr.nodes[-1].name if tr.nodes else ""
        tr.sums.add(_key(out))
        tr.keep.append(out)  # its key stays unique while the block runs
        for t in args[1:] if inplace else args[:2]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and _like(t, tr.shape):
                self.order += 1
                tr.added.append((self._store(tr, t), self.order, last))

    def _guard(self, hook: Callable[..., None]) -> Callable[..., None]:
        def guarded(*args: Any) -> None:
            if self.failed is None:
                try:
                    hook(*args)
                except Exception as err:  # the pass goes on; the proof reports it
                    self.failed = err

        return guarded

    def _store(self, tr: _Trace, t: torch.Tensor) -> Key:
        k = _key(t)
        tr.keep.append(t)
        if _like(t, tr.shape) and k not in tr.values:
            if _channels_last(t, tr.shape):  # back to the stream's own layout
                t = t.reshape(tr.shape[0], -1, tr.shape[1]).movedim(-1, 1).reshape(tr.shape)
            tr.values[k] = self._sample(t)  # a copy: later in-place ops must not change it
        return k

    def _sample(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of every step-th row of t as (rows, C): every stream-shaped tensor has
        the same rows, so the same positions are kept of each."""
        x = t.detach().reshape(-1, t.shape[-1])
        step = 1 if self.rows is None else max(1, -(-x.shape[0] // self.rows))
        return x[::step].clone()

    def _enter(self, index: int) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = kwargs.get("hidden_states")
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                x = _first_float((args, kwargs))
            if index in self.traces or x is None:
                self.stack.append(_Trace(index, (), ("none",), note="no input"))
                return
            tr = _Trace(index, tuple(x.shape), ("none",))
            tr.x_in = self._store(tr, x)
            self.stack.append(tr)

        return hook

    def _inner(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            if not self.stack:  # inside no block: its block ran without its own hooks
                if self._in_block_forward(name):
                    self.bypassed.add(name)
                return
            if not self.stack[-1].shape:
                return
            tr = self.stack[-1]
            self.order += 1
            ins = tuple(_key(t) for t in _tensors((args, kwargs)))
            tr.keep.extend(_tensors((args, kwargs)))
            x = _first_float((args, kwargs))
            y = _first_float(out)
            in_key = None
            if x is not None:
                in_key = _key(x)
                if _stream_op(mod) and _like(x, tr.shape):
                    self._store(tr, x)
            out_key = self._store(tr, y) if y is not None else None
            if x is not None and out_key is not None and is_act(mod) and _like(x, tr.shape):
                tr.act = (x, out_key)
            tr.nodes.append(_Node(name, self.order, ins, out_key, in_key))

        return hook

    def _in_block_forward(self, name: str) -> bool:
        """Whether `name`'s block is inside its own forward (called as block.forward(...),
        which no module hook sees: SqueezeBERT's encoder), rather than only lending a
        module to another method (LightGlue's match_assignment_layers[i].get_matchability
        on the layers whose forward never runs). Read off the Python frames, only for a
        module that runs while no block hook has fired."""
        block = next(
            (
                self.modules[b.name]
                for b in self.blocks
                if name.startswith(b.name + ".") and b.name in self.modules
            ),
            None,
        )
        fn = getattr(type(block), "forward", None)
        # a decorated forward (functools.wraps): the wrapper's frame or the original's
        fns = (fn, inspect.unwrap(fn)) if callable(fn) else ()
        codes = {getattr(f, "__code__", None) for f in fns} - {None}
        if block is None or not codes:
            return True
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code in codes and frame.f_locals.get("self") is block:
                return True
            frame = frame.f_back
        return False

    def _leave(self, index: int) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            tr = self.stack.pop() if self.stack else None
            if tr is None or tr.block != index:
                return
            if not tr.shape:  # it ran, on no float input: skipped with the reason
                self.traces.setdefault(index, tr)
                return
            y = _first_float(out)
            tr.out = None if y is None else _key(y)
            if y is not None:
                self.held[self.stream_of.get(index, "main")] = y
            if y is None:
                tr.note = "the block returned no tensor"
            elif tuple(y.shape) != tr.shape:  # x_out must match x_in exactly
                tr.note = "the block changes the stream's shape"
                tr.out_shape = tuple(y.shape)
            else:
                tr.x_out = self._store(tr, y)
                tr.dtype = y.dtype
                if tr.act is not None and tr.act[1] == tr.x_out:
                    x = tr.act[0]
                    if _key(x) not in tr.values and _key(x) != tr.x_out:  # not in place
                        self._store(tr, x)
                keys = list(tr.values)
                acc = torch.float32 if y.device.type == "mps" else self.acc
                with torch.no_grad(), aside():  # not a GEMM of the model (--formats)
                    v = torch.stack([tr.values[k].reshape(-1).to(acc) for k in keys])
                    tr.gram = v @ v.T  # on the device; read once after the pass
                tr.keys = keys
            tr.values.clear()
            tr.keep.clear()
            tr.act = None
            self.traces[index] = tr

        return hook


_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_CALL_IMPL = nn.Module._call_impl.__code__
_MODULE_PY = _CALL_IMPL.co_filename


def _in_forward() -> bool:
    """Whether the running op belongs to a module's own forward (it, or a function it
    calls), not to a hook: the nearest `Module._call_impl` up the stack called the
    module's `forward` directly. Another profiler's hook computing x_out − x_in must
    never become a candidate write (that would prove any block)."""
    frame: FrameType | None = sys._getframe(1)
    below: list[FrameType] = []
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            forward = getattr(type(frame.f_locals.get("self")), "forward", None)
            # with hooks, _call_impl runs forward and the hooks from a local `inner`
            called = next((f for f in reversed(below) if f.f_code.co_filename != _MODULE_PY), None)
            return called is not None and called.f_code is getattr(forward, "__code__", None)
        below.append(frame)
        frame = frame.f_back
    return False


_IADDS = {torch.Tensor.add_, torch.Tensor.__iadd__}
_ANY_ADD = frozenset(_ADDS | _IADDS)


class _AddWatch(Watcher):
    """The `+` calls of the forward, for `BlockWatch._add` (results returned untouched)."""

    def __init__(self, watch: BlockWatch) -> None:
        super().__init__()
        self.watch = watch
        self.record = watch._guard(watch._add)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # every op of the forward passes here: the cheapest test first
        if self.watch.stack and func in _ANY_ADD and _in_forward():
            self.record(args, out, func in _IADDS)
        return out


# --------------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class _Hypothesis:
    writes: tuple[Key, ...]
    norms: tuple[_Node, ...] = ()
    fitted: bool = False


@dataclass(frozen=True)
class _Outcome:
    residual: float
    writes: tuple[Key, ...]
    norms: tuple[_Node, ...]
    scales: dict[Key, float]  # fitted coefficients (writes), only when fitted
    stream_scale: float | None
    start: Key | None = None  # the stream restarts at this output, not at x_in


class _Block:
    """Host-side reasoning over one block's trace and Gram matrix."""

    def __init__(
        self, tr: _Trace, gram: torch.Tensor, modules: dict[str, nn.Module], rho: float = 1.0
    ) -> None:
        self.tr = tr
        self.g = gram
        self.rho = rho  # ‖x_out‖'s share of the allowance (rounding ÷ tolerance)
        self.modules = modules
        self.idx = {k: i for i, k in enumerate(tr.keys)}
        nodes = tr.nodes
        assert tr.x_out is not None
        raw: dict[Key, list[_Node]] = {tr.x_in: [], tr.x_out: []}
        for n in nodes:
            if n.out_key is not None and n.out_key in self.idx:
                raw.setdefault(n.out_key, []).append(n)
        # Aliases: views of one storage (MoE experts' (B·T, C) output and its reshape) and
        # exact copies are one tensor of the data flow.
        parent = {k: k for k in raw}

        def find(k: Key) -> Key:
            while parent[k] != k:
                k = parent[k]
            return k

        for a, b in itertools.combinations(raw, 2):
            if find(a) != find(b) and self._same(a, b):
                parent[find(b)] = find(a)
        self.alias = {k: find(k) for k in raw}
        self.groups: dict[Key, list[_Node]] = {}
        for k, ns in raw.items():
            self.groups.setdefault(self.alias[k], []).extend(ns)
        self.first = {k: min((n.order for n in ns), default=-1) for k, ns in self.groups.items()}
        consumed: set[Key] = set()
        for n in nodes:
            own = self.a(n.out_key)
            consumed.update(self.a(k) for k in n.in_keys if self.a(k) != own)
        ends = {self.a(tr.x_in), self.a(tr.x_out)}
        self.candidates = sorted(
            (k for k, ns in self.groups.items() if k not in ends and ns),
            key=lambda k: self.first[k],
        )
        self.terminals = [k for k in self.candidates if k not in consumed]
        produced = {k for k, ns in self.groups.items() if ns}
        taken = {self.a(k) for k, _, _ in tr.added}
        self.operand_terminals = [k for k in self.candidates if k in self.terminals or k in taken]
        # operands of functional adds no module returned (each once): tried last
        self.added: dict[Key, tuple[int, str]] = {}
        for k, order, last in tr.added:
            if self.a(k) not in produced and self.a(k) not in ends and k in self.idx:
                self.added.setdefault(self.a(k), (order, last))
        self._stream_path(nodes, modules, produced)
        # Norms of the block input itself where the stream continues from their output
        # (x ← LN(x) first: RWKV's first block's pre_ln; MiniMax's residual is its input
        # norm's output). Tried only after every hypothesis from x_in itself fails.
        self.entry_norms = [
            n
            for n in nodes
            if is_norm(modules[n.name])
            and n.in_key in self.idx
            and self.a(n.in_key) == self.a(tr.x_in)
            and n.out_key in self.idx
        ][:2]
        # …and norms whose input a module returned as the sum of a `+` (I-BERT adds the
        # residual inside its quantizer module, then normalizes): for the operand round
        self.operand_norms = self.stream_norms + [
            n
            for n in nodes
            if is_norm(modules[n.name])
            and n not in self.stream_norms
            and n.in_key in tr.sums
            and n.in_key in self.idx
            and n.out_key in self.idx
        ]

    def _stream_path(
        self, nodes: list[_Node], modules: dict[str, nn.Module], produced: set[Key]
    ) -> None:
        """The modules the stream itself passes through between its adds (`stream_norms`,
        in execution order) and the norms riding along after them (`chained`)."""
        # Norms the stream itself may pass through: their input is computed (a sum), not
        # a module's output nor the block input.
        self.stream_norms = [
            n
            for n in nodes
            if _stream_op(modules[n.name])
            and n.in_key in self.idx
            and self.a(n.in_key) not in produced
            and self.a(n.in_key) != self.a(self.tr.x_in)
            and n.out_key in self.idx
        ]
        # …and those the stream enters straight from one of them (Autoformer: a LayerNorm,
        # then a series decomposition x − AvgPool(x); after the last add, a decomposition
        # then the final LayerNorm), in execution order
        for n in nodes:
            outs = {self.a(m.out_key) for m in self.stream_norms}
            if (
                n not in self.stream_norms
                and _stream_op(modules[n.name])
                and n.in_key in self.idx
                and self.a(n.in_key) in outs
                and n.out_key in self.idx
                and self.a(n.out_key) != self.a(n.in_key)
            ):
                self.stream_norms.append(n)
        # …and the activation that makes the block's output from a sum (post-activation,
        # ResNet v1's relu(x + F(x)): UVDoc's residual blocks): the equation holds at its
        # input, as at a post-norm's
        self.stream_norms += [
            n
            for n in nodes
            if is_act(modules[n.name])
            and n.in_key in self.idx
            and self.a(n.in_key) not in produced
            and self.a(n.in_key) != self.a(self.tr.x_in)
            and n.out_key in self.idx
            and self.a(n.out_key) == self.a(self.tr.x_out)
        ][:1]
        self.stream_norms.sort(key=lambda n: n.order)
        # …and norms of a stream norm's output (a post-norm block's final norm after its
        # last post-branch norm: Conformer's final_layer_norm): no write lies between, so
        # each rides along with the norm it follows in every hypothesis (`_chained`).
        self.chained: dict[int, list[_Node]] = {}  # by the followed norm's call order
        level = list(self.stream_norms)
        while level:
            nxt = []
            for m in level:
                for n in nodes:
                    if (
                        is_norm(modules[n.name])
                        and n is not m
                        and n.in_key in self.idx
                        and n.out_key in self.idx
                        and self.a(n.in_key) == self.a(m.out_key)
                        and n.order > m.order
                        and not any(n in v for v in self.chained.values())
                    ):
                        self.chained.setdefault(m.order, []).append(n)
                        nxt.append(n)
            level = nxt

    @overload
    def a(self, k: Key) -> Key: ...
    @overload
    def a(self, k: Key | None) -> Key | None: ...
    def a(self, k: Key | None) -> Key | None:
        """The alias group a tensor key belongs to (itself when it has none)."""
        return None if k is None else self.alias.get(k, k)

    def _same(self, a: Key, b: Key) -> bool:
        if a[0] != "id" and b[0] != "id" and _storage(a) == _storage(b):
            return True  # same storage, size and version: the same values
        ia, ib = self.idx[a], self.idx[b]
        ga, gb, gab = float(self.g[ia, ia]), float(self.g[ib, ib]), float(self.g[ia, ib])
        return min(ga, gb) > 0 and ga + gb - 2 * gab <= 1e-12 * max(ga, gb)

    def norm(self, i: int) -> float:
        return math.sqrt(max(float(self.g[i, i]), 0.0))

    def _scale(self, start: int, target: int) -> float:
        """What a residual is measured against: the segment's writes, ‖target − start‖,
        plus ρ‖target‖ for the rounding of a sum as large as the target."""
        g = self.g
        delta2 = float(g[target, target] + g[start, start] - 2 * g[start, target])
        return math.sqrt(max(delta2, 0.0)) + self.rho * self.norm(target)

    def _residual(self, coef: dict[int, float], target: int, start: int) -> float:
        c = torch.zeros(len(self.idx), dtype=self.g.dtype)
        for i, v in coef.items():
            c[i] += v
        c[target] -= 1.0
        r2 = float(c @ self.g @ c)
        scale = self._scale(start, target)
        if scale == 0:
            return 0.0 if r2 <= 0 else math.inf
        return math.sqrt(max(r2, 0.0)) / scale

    def _segment(
        self, start: int, writes: Sequence[Key], target: int, fitted: bool
    ) -> tuple[float, dict[int, float]]:
        rows = [start] + [self.idx[k] for k in writes]
        if not fitted:
            coef: dict[int, float] = {}
            for i in rows:
                coef[i] = coef.get(i, 0.0) + 1.0
            return self._residual(coef, target, start), coef
        a = self.g[rows][:, rows]
        b = self.g[rows, target]
        sol = torch.linalg.lstsq(a, b.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        coef = {}
        for i, v in zip(rows, sol.tolist(), strict=True):
            coef[i] = coef.get(i, 0.0) + v
        return self._residual(coef, target, start), coef

    def evaluate(self, h: _Hypothesis) -> _Outcome:
        tr = self.tr
        assert tr.x_out is not None
        s = self.idx[tr.x_in]
        pending: list[Key] = []
        worst = 0.0
        scales: dict[Key, float] = {}
        stream_scale: float | None = None
        events: list[tuple[int, Key | None, _Node | None]] = [
            (self.first[k], k, None) for k in h.writes
        ] + [(n.order, None, n) for n in h.norms]
        for _, w, nrm in sorted(events, key=lambda e: e[0]):
            if w is not None:
                pending.append(w)
                continue
            assert nrm is not None and nrm.in_key is not None and nrm.out_key is not None
            res, coef = self._segment(s, pending, self.idx[nrm.in_key], h.fitted)
            worst = max(worst, res)
            scales.update({k: coef.get(self.idx[k], 1.0) for k in pending})
            stream_scale = coef.get(s) if h.fitted else None
            s, pending = self.idx[nrm.out_key], []
        res, coef = self._segment(s, pending, self.idx[tr.x_out], h.fitted)
        scales.update({k: coef.get(self.idx[k], 1.0) for k in pending})
        if h.fitted and stream_scale is None:
            stream_scale = coef.get(s)
        return _Outcome(
            max(worst, res), h.writes, h.norms, scales if h.fitted else {}, stream_scale
        )

    def hypotheses(self, operands: bool = False) -> Iterator[_Hypothesis]:
        """Most specific first: the data-flow writes, then post-norm, fitted, subsets.
        With `operands`, a module output that a `+` takes is a write even when a module
        consumes it too (FNet's Fourier output, taken by the wrapper that holds the add)."""
        t = tuple(self.operand_terminals if operands else self.terminals)
        norms = self.operand_norms if operands else self.stream_norms
        norm_sets = [
            tuple(c)
            for r in range(1, min(len(norms), 4) + 1)
            for c in itertools.combinations(norms, r)
        ]
        norm_sets.sort(key=len, reverse=True)
        chained = {tuple(n.order for n in c): c for c in map(self._chained, norm_sets)}
        norm_sets = list(chained.values())
        subsets = [t]
        if len(t) <= 8:
            subsets += [c for r in range(len(t) - 1, 0, -1) for c in itertools.combinations(t, r)]
        # unit coefficients everywhere first: a fit would zero out a spurious candidate
        for fitted in (False, True):
            for sub in subsets:
                yield _Hypothesis(sub, (), fitted)
                for ns in norm_sets:
                    yield _Hypothesis(sub, ns, fitted)
        # the stream restarts at a norm of the block input (a first block's extra norm)
        for entry in self.entry_norms:
            for fitted in (False, True):
                for sub in subsets:
                    yield _Hypothesis(sub, (entry,), fitted)
                    for ns in norm_sets:
                        yield _Hypothesis(sub, (entry, *ns), fitted)

    def _chained(self, norms: tuple[_Node, ...]) -> tuple[_Node, ...]:
        """The norms with the norms chained onto their outputs (see `chained`)."""
        out = list(norms)
        for n in out:  # grows while it is walked: chains of chains
            out.extend(c for c in self.chained.get(n.order, []) if c not in out)
        return tuple(out)

    def search(self, tol: float, added: bool = False) -> _Outcome | None:
        """Subsets (≤ 3) of every stream-shaped output, unit coefficients, vectorised;
        with `added`, the operands of the block's functional adds are candidates too."""
        cands = self.candidates[:MAX_SEARCH]
        if added:
            extra = sorted(self.added, key=lambda k: self.added[k][0])
            extra = extra[:MAX_SEARCH]
            cands = self.candidates[: MAX_SEARCH - len(extra)] + extra if extra else []
        if not cands:
            return None
        assert self.tr.x_out is not None  # a _Block is built once x_out is stored
        n = len(self.idx)
        combos = [c for r in (1, 2, 3) for c in itertools.combinations(range(len(cands)), r)]
        cm = torch.zeros(len(combos), n, dtype=self.g.dtype)
        for row, combo in enumerate(combos):
            for j in combo:
                cm[row, self.idx[cands[j]]] += 1.0
        cm[:, self.idx[self.tr.x_in]] += 1.0
        cm[:, self.idx[self.tr.x_out]] -= 1.0
        r2 = ((cm @ self.g) * cm).sum(1).clamp_min(0)
        scale = self._scale(self.idx[self.tr.x_in], self.idx[self.tr.x_out]) or 1.0
        res = r2.sqrt() / scale
        best = int(torch.argmin(res))
        if float(res[best]) > tol:
            return None
        return _Outcome(float(res[best]), tuple(cands[j] for j in combos[best]), (), {}, None)

    def restart(self, tol: float) -> _Outcome | None:
        """x_out = r + Σ writes, unit coefficients, r a module output of the block rather
        than its input: the block transforms its input first and adds onto that (PP-LCNet's
        depthwise conv + squeeze-excitation before its residual channel MLP; Inkling2's
        block boundary, where the stream restarts at the attention's output). r is the
        member a module reads (`_start`); the residual is relative to what the writes
        add, ‖x_out − r‖.
        r may be a `+` operand no module returned (a gate times the input)."""
        extra = sorted(self.added, key=lambda k: self.added[k][0])[:MAX_SEARCH]
        cands = self.candidates[: MAX_SEARCH - len(extra)] + extra
        combos = [c for r in (2, 3) for c in itertools.combinations(range(len(cands)), r)]
        if not combos:
            return None
        assert self.tr.x_out is not None
        t = self.idx[self.tr.x_out]
        cm = torch.zeros(len(combos), len(self.idx), dtype=self.g.dtype)
        starts = torch.zeros(len(combos), dtype=torch.long)
        for row, combo in enumerate(combos):
            for j in combo:
                cm[row, self.idx[cands[j]]] += 1.0
            starts[row] = self.idx[self._start([cands[j] for j in combo])]
        cm[:, t] -= 1.0
        g = self.g
        r2 = ((cm @ g) * cm).sum(1).clamp_min(0)
        d2 = (g[t, t] + g[starts, starts] - 2 * g[starts, t]).clamp_min(0)
        scale = d2.sqrt() + self.rho * self.norm(t)
        res = torch.where(scale > 0, r2.sqrt() / scale, torch.full_like(r2, math.inf))
        best = int(torch.argmin(res))
        if float(res[best]) > tol:
            return None
        members = [cands[j] for j in combos[best]]
        start = self._start(members)
        writes = tuple(k for k in members if k != start)
        return _Outcome(float(res[best]), writes, (), {}, None, start=start)

    def _start(self, members: Sequence[Key]) -> Key:
        """Of a sum, the stream: what a module of the block reads (the branch reads the
        stream, nothing reads the last write), then the earliest made."""
        # read by a module that computes something from it (not an identity drop-path)
        read = {
            self.a(k) for n in self.tr.nodes for k in n.in_keys if self.a(k) != self.a(n.out_key)
        }
        return min(
            members,
            key=lambda k: (k not in read, self.first[k] if k in self.first else self.added[k][0]),
        )

    def plain_chain(self) -> list[str]:
        """The modules x_out was computed by, last first, when the block is a plain chain
        of modules from x_in (an MLP layer, Conv→BN→ReLU): every tensor on the way is a
        module's output, so no functional op (a residual add) lies between x_in and x_out.
        Empty when the chain meets a tensor no module produced (other than the input of
        the block's first module, computed from x_in alone), or never reaches x_in."""
        by_out: dict[Key, list[_Node]] = {}
        by_view: dict[Key, list[_Node]] = {}
        for node in self.tr.nodes:
            if node.out_key is not None:
                by_out.setdefault(node.out_key, []).append(node)
                by_view.setdefault(_storage(node.out_key), []).append(node)
        start = self.tr.x_in
        # before the block's first module runs, only the block input exists: what
        # functional ops compute from it there (a TF-style pad) holds no branch to add
        opening = min(self.tr.nodes, key=lambda nd: nd.order).in_key if self.tr.nodes else None
        key: Key | None = self.tr.x_out
        chain: list[str] = []
        seen: set[Key] = set()
        while key is not None and not _is_view(key, start) and key not in seen:
            seen.add(key)
            # a view of a module's output (transpose, reshape) is the same values: no add
            producers = by_out.get(key) or by_view.get(_storage(key))
            if not producers and chain and key == opening:
                return chain
            if not producers:
                return []
            first = min(producers, key=lambda nd: nd.order)  # the outermost module
            chain.append(first.name)
            key = first.in_key
            inplace = getattr(self.modules[first.name], "inplace", False) is True
            if inplace and key is not None and key == first.out_key and key[0] != "id":
                # an in-place module (SuperPoint's ReLU(inplace=True)): its input was seen
                # after it wrote it; before, it was the same storage one version earlier
                key = (*key[:-1], key[-1] - 1)
        return chain if key is not None and _is_view(key, start) else []

    def addless_output(self) -> str | None:
        """The module whose output x_out is, when no `+` of the stream's shape ran in the
        block: a residual add has one (a functional or in-place add, recorded by the add
        watch), so a block without any is no residual block, whatever functional ops (an
        attention's matmuls and softmax) lie between its modules. XLM's attention list,
        whose residual add lives in the model's forward. None otherwise."""
        if self.tr.sums or self.tr.added or self.tr.x_out is None:
            return None
        out = self.a(self.tr.x_out)
        makers = [n for n in self.tr.nodes if n.out_key is not None and self.a(n.out_key) == out]
        if not makers:
            return None
        return min(makers, key=lambda n: n.order).name

    # -- naming ------------------------------------------------------------------------
    def _weighted(self, name: str) -> bool:
        return any(p.dim() >= 2 for p in self.modules[name].parameters())

    def _rep(self, key: Key) -> _Node:
        """The member of an alias group that names it: a computing module, outermost."""
        return min(
            self.groups[key],
            key=lambda n: (not self._weighted(n.name), n.name.count("."), n.order),
        )

    def branch_of(self, write: Key) -> tuple[str, str]:
        """(branch module, write module): walk back through norms/gains/dropouts."""
        key, seen = write, {write}
        rep = self._rep(key)
        while not self._weighted(rep.name):
            nxt = next(
                (
                    k
                    for n in self.groups[key]
                    for k in n.in_keys
                    if self.groups.get(self.a(k))
                    and self.a(k) not in seen
                    and self.a(k) != self.a(self.tr.x_in)
                ),
                None,
            )
            if nxt is None:
                break
            key = self.a(nxt)
            seen.add(key)
            rep = self._rep(key)
        w = self._rep(write)
        write_name = max(self.groups[write], key=lambda n: (n.order, -n.name.count("."))).name
        if key == write:
            return w.name, w.name
        return rep.name, write_name

    def region(self, branch: str, taken: set[str]) -> set[str]:
        """Modules feeding the branch inside its segment (backward data flow, stops at
        norms and the block input): BERT's `intermediate`, OPT's `fc1`."""
        by_out: dict[Key, list[_Node]] = {}
        for n in self.tr.nodes:
            if n.out_key is not None:
                by_out.setdefault(n.out_key, []).append(n)
        start = [n for n in self.tr.nodes if n.name == branch]
        todo = [k for n in start for k in n.in_keys]
        out = {branch}
        seen: set[Key] = set()
        while todo:
            k = todo.pop()
            if k in seen or k == self.tr.x_in:
                continue
            seen.add(k)
            producers = by_out.get(k, [])
            if any(is_norm(self.modules[p.name]) for p in producers):
                continue
            if self.a(k) in self.candidates and any(p.name in taken for p in producers):
                continue  # another branch's output
            for p in producers:
                if p.name not in out:
                    out.add(p.name)
                    todo.extend(p.in_keys)
        return out


def _stream_op(mod: nn.Module) -> bool:
    """A module the stream itself may pass through between its adds: a norm, or a module
    without parameters that is no activation (a series decomposition's x − trend)."""
    return is_norm(mod) or (
        not is_act(mod)
        and next(mod.parameters(), None) is None
        and not isinstance(mod, nn.Dropout | nn.Identity)
    )


def role_of(model_modules: dict[str, nn.Module], block: str, branch: str) -> tuple[str, bool]:
    """(Role value, is MoE) of a branch module from its path and classes inside the block.

    Attribute names first (a user's `attn` is attention whatever its class), then state-space
    markers (an `A_log`/`dt_bias` parameter, Mamba/SSM classes), then class names.
    """
    rel = branch[len(block) + 1 :].split(".") if branch != block else []
    path, attrs, classes = block, [], []
    for part in rel:
        path = f"{path}.{part}"
        attrs.append(part)
        classes.append(type(model_modules[path]).__name__)
    mod = model_modules[branch]
    attr_text, class_text = " ".join(attrs), " ".join(classes)
    if _CROSS.search(attr_text) or _CROSS.search(class_text):
        return Role.CROSS_ATTN.value, False
    if _ATTN.search(attr_text):
        return Role.ATTN.value, False
    ssm = any(n.rsplit(".", 1)[-1] in _SSM_PARAMS for n, _ in mod.named_parameters())
    if ssm or _SSM.search(attr_text) or _SSM.search(class_text):
        return Role.MIXER.value, False
    if _ATTN.search(class_text):
        return Role.ATTN.value, False
    if _MIXER.search(attr_text) or _MIXER.search(class_text):
        return Role.MIXER.value, False
    moe = bool(_MOE.search(type(mod).__name__)) or any(
        _MOE.search(n.rsplit(".", 1)[-1]) or _MOE.search(type(m).__name__)
        for n, m in mod.named_modules()
        if n
    )
    return Role.MLP.value, moe


# --------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class ProofResult:
    layout: Layout
    proofs: tuple[BlockProof, ...]
    notes: tuple[str, ...] = ()


def _unverified(
    b: BlockInfo,
    status: str,
    note: str,
    residual: float | None = None,
    tol: float | None = None,
    stream: str = "main",
) -> BlockInfo:
    proof = BlockProof(
        block=b.index,
        name=b.name,
        status=status,
        residual=residual,
        tolerance=tol,
        stream=stream,
        note=note,
    )
    return replace(b, proof=proof)


def _bypassed(b: BlockInfo, stream: str) -> BlockInfo:
    """A block whose modules ran but whose own hooks never fired: the model calls it as
    `block.forward(...)`, past every module hook, so its input and output are never seen
    and its layout cannot be proven. Said plainly: not a block that did not run."""
    proof = BlockProof(
        block=b.index,
        name=b.name,
        status="skipped",
        stream=stream,
        note=(
            "the model calls this block as block.forward(...), which bypasses module hooks: "
            "its modules ran, but its input and output cannot be seen, so its layout is not "
            "proven and the stream checks have no stream here"
        ),
        bypassed=True,
    )
    return replace(b, proof=proof)


def _idle(b: BlockInfo, stream: str) -> BlockInfo:
    """A block the forward never called: nothing was measured there, so there is nothing
    to prove (a tower the inputs did not reach, a list the model calls through a method
    other than forward). Skipped, with `ran` False: not a layout the proof failed on."""
    proof = BlockProof(
        block=b.index,
        name=b.name,
        status="skipped",
        stream=stream,
        note="the block did not run in the forward: nothing measured, nothing to prove",
        ran=False,
    )
    return replace(b, proof=proof)


def _plain(b: BlockInfo, chain: list[str], tol: float, stream: str) -> BlockInfo:
    """A block without a residual add: verified as plain, with no branches to judge."""
    note = (
        f"no residual add: the output is computed by {' ← '.join(chain[:4])}"
        + (" ← …" if len(chain) > 4 else "")
        + " from the block's input"
    )
    return _verified_plain(b, stream, note, tol)


def _verified_plain(
    b: BlockInfo, stream: str, note: str, tol: float | None, reshaped: bool = False
) -> BlockInfo:
    proof = BlockProof(
        block=b.index,
        name=b.name,
        status="verified",
        residual=None,
        tolerance=tol,
        placement="plain",
        stream=stream,
        note=note,
        reshaped=reshaped,
    )
    return replace(b, attn=None, mlp=None, adds=1, branches=(), proof=proof)


def _reshaped(b: BlockInfo, tr: _Trace, stream: str) -> BlockInfo:
    """A block whose output has another shape than its input (a downsampling stage, a
    strided convolution, a patch merge) is no residual add across its boundary: x_in +
    anything of x_in's shape cannot be x_out. Verified as plain, with no branches to
    judge; residual blocks inside it are not proven (the layout did not name them)."""
    note = (
        "not a residual block: it changes the stream's shape "
        f"({_shape(tr.shape)} → {_shape(tr.out_shape or ())})"
    )
    return _verified_plain(b, stream, note, None, reshaped=True)


def _shape(shape: Sequence[int]) -> str:
    return "×".join(str(d) for d in shape)


def prove_blocks(
    model: nn.Module,
    blocks: Sequence[BlockInfo],
    run: Callable[[], Any],
    *,
    stream: str | None = None,
) -> tuple[list[BlockInfo], dict[str, str]]:
    """Prove block lists. `run()` does the forward pass (the caller picks inputs, dtype,
    autocast). Returns the blocks with their branches and proofs, and the role updates of
    the modules inside them. Each proof is recorded under `stream`, else the block's own
    stream (`BlockInfo.stream`: "main", or "encoder"/"decoder" of an encoder-decoder)."""
    with eval_mode(model), HookSet() as hooks, torch.no_grad():
        watch = BlockWatch(model, blocks).install(hooks)
        with watch.adds():
            run()
    return read_blocks(model, watch, stream=stream)


def read_blocks(
    model: nn.Module, watch: BlockWatch, *, stream: str | None = None
) -> tuple[list[BlockInfo], dict[str, str]]:
    """The proofs of the blocks `watch` saw in its forward pass (see `prove_blocks`)."""
    watch.held.clear()
    if watch.failed is not None:
        raise watch.failed
    blocks = watch.blocks
    modules = dict(model.named_modules(remove_duplicate=False))
    traces = [watch.traces.get(b.index) for b in blocks]
    grams = [t.gram for t in traces if t is not None and t.gram is not None]
    # one device → host transfer for every block's Gram matrix
    flat = torch.cat([g.reshape(-1) for g in grams]).double().cpu() if grams else None
    out: list[BlockInfo] = []
    roles: dict[str, str] = {}
    offset = 0
    for b, tr in zip(blocks, traces, strict=True):
        if tr is not None and tr.out_shape is not None:
            out.append(_reshaped(b, tr, stream or b.stream))
            continue
        if tr is None:
            inner = any(m.startswith(b.name + ".") for m in watch.bypassed)
            out.append(_bypassed(b, stream or b.stream) if inner else _idle(b, stream or b.stream))
            continue
        if tr.gram is None:
            out.append(_unverified(b, "skipped", tr.note, stream=stream or b.stream))
            continue
        k = len(tr.keys)
        assert flat is not None
        gram = flat[offset : offset + k * k].reshape(k, k)
        offset += k * k
        out.append(_prove_one(b, tr, gram, modules, roles, stream or b.stream))
    return _chain(out, traces), roles


def _chain(blocks: list[BlockInfo], traces: Sequence[_Trace | None]) -> list[BlockInfo]:
    """Marks the blocks whose input is not their stream's previous block's output (nor a
    view of it): `BlockProof.chained`. Both must have run; a stream's first block is
    chained by definition."""
    out: list[BlockInfo] = []
    prev: dict[str, _Trace | None] = {}
    for b, tr in zip(blocks, traces, strict=True):
        before = prev.get(b.stream)
        prev[b.stream] = tr
        if (
            b.proof is None
            or tr is None
            or before is None
            or before.out is None
            or tr.x_in == ("none",)
            or _is_view(tr.x_in, before.out)
        ):
            out.append(b)
            continue
        out.append(replace(b, proof=replace(b.proof, chained=False)))
    return out


def _prove_one(
    b: BlockInfo,
    tr: _Trace,
    gram: torch.Tensor,
    modules: dict[str, nn.Module],
    roles: dict[str, str],
    stream: str,
) -> BlockInfo:
    if not torch.isfinite(gram).all():
        finite, gram = _finite_only(tr, gram)
        if finite is None:
            return _unverified(b, "unverified", "non-finite values in the block", stream=stream)
        tr = finite
    tol = 1e-4 if tr.dtype is None else TOLERANCE.get(tr.dtype, 1e-4)
    if gram.dtype != torch.float64 or tr.dtype == torch.float64:
        tol = max(tol, 1e-3 if gram.dtype != torch.float64 else tol)
    rounding = ROUNDING.get(tr.dtype, 2.0**-22) if tr.dtype is not None else 2.0**-22
    # a float32 Gram (MPS) cancels to ~√u32 of ‖x_out‖ itself: the output's norm stays the scale
    rho = 1.0 if gram.dtype != torch.float64 else min(1.0, rounding / tol)
    blk = _Block(tr, gram, modules, rho)
    first, found = _hypothesised(blk, tol)
    if found is None:
        found = blk.search(tol)
    if found is None and (chain := blk.plain_chain()):
        return _plain(b, chain, tol, stream)
    if found is None:
        found = blk.search(tol, added=True)
    if found is None:
        found = blk.restart(tol)
    if found is None and (made := blk.addless_output()):
        note = (
            f"no residual add: the output is {made}'s output and no + of the stream's "
            "shape ran inside the block"
        )
        return _verified_plain(b, stream, note, tol)
    if found is None:
        res = first.residual if first is not None else None
        return _unverified(
            b,
            "unverified",
            "no set of the block's stream-shaped outputs adds up to its output",
            res,
            tol,
            stream,
        )
    found = _drop_unfed(blk, found)
    branches: list[BranchInfo] = []
    taken: set[str] = set()
    named: list[tuple[Key, str, str]] = []
    functional = [w for w in found.writes if w in blk.added]
    for w in sorted((w for w in found.writes if w not in blk.added), key=lambda k: blk.first[k]):
        name, write = blk.branch_of(w)
        named.append((w, name, write))
        taken.add(name)
    for w, name, write in named:
        role, moe = role_of(modules, b.name, name)
        scale = found.scales.get(w)
        branches.append(
            BranchInfo(
                role=role,
                name=name,
                write=None if write == name else write,
                moe=moe,
                scale=None if scale is None or abs(scale - 1) <= 1e-3 else scale,
            )
        )
        for m in blk.region(name, taken - {name}):
            for sub, mod in modules[m].named_modules(prefix=m):
                if not (is_norm(mod) or is_act(mod)):
                    roles[sub] = role
    acts = found.norms and all(is_act(modules[n.name]) for n in found.norms)
    placement = "post-act" if acts else "post-norm" if found.norms else "additive"
    note = _proof_note(blk, found, functional, b.name)
    proof = BlockProof(
        block=b.index,
        name=b.name,
        status="verified",
        residual=found.residual,
        tolerance=tol,
        placement=placement,
        writes=tuple(br.write or br.name for br in branches),
        roles=tuple(br.role for br in branches),
        norms=tuple(n.name for n in found.norms),
        stream_scale=(
            found.stream_scale
            if found.stream_scale is not None and abs(found.stream_scale - 1) > 1e-3
            else None
        ),
        stream=stream,
        note=note,
    )
    first_of = {
        r: next((br.name for br in branches if br.role == r), None)
        for r in (Role.ATTN.value, Role.MLP.value)
    }
    return replace(
        b,
        attn=first_of[Role.ATTN.value],
        mlp=first_of[Role.MLP.value],
        adds=max(len(found.writes), 1),
        branches=tuple(branches),
        proof=proof,
    )


def _hypothesised(blk: _Block, tol: float) -> tuple[_Outcome | None, _Outcome | None]:
    """(the first hypothesis's outcome, the first that holds): the data-flow writes and
    their variants (`_Block.hypotheses`), then with `+` operands; a fit cut back to unit
    coefficients where they hold, a stream fitted at 0 restarted inside the block."""
    first: _Outcome | None = None
    found: _Outcome | None = None
    for tried, h in enumerate(blk.hypotheses()):
        o = blk.evaluate(h)
        first = first or o
        if o.residual <= tol:
            found = o
            break
        if tried >= 4096:
            break
    if found is None and (
        blk.operand_terminals != blk.terminals or blk.operand_norms != blk.stream_norms
    ):
        found = _first_holding(blk, blk.hypotheses(operands=True), tol)
    if found is not None and found.scales:
        found = _unfit(blk, found, tol)
    if (
        found is not None
        and found.stream_scale is not None
        and abs(found.stream_scale) <= ZERO_COEF
    ):
        # a stream fitted at 0: it restarts in the block; with no write left, the "proof"
        # only says x_out is tiny beside x_in (a stage's first block, no residual add, the
        # same shape by chance: x_out ≈ −2e-6·x_in): no equation, try the plain chain
        found = blk.restart(tol) or (found if _writes_left(found) else None)
    return first, found


def _drop_unfed(blk: _Block, found: _Outcome) -> _Outcome:
    """The writes without the exact zeros, when the block's input stream is exactly 0: a
    module on a zero stream (BLIP-2's zero-initialised query tokens through a zero-bias
    LayerNorm) writes 0 whatever its weights, so any such candidate holds the equation and
    says nothing of a branch. Dropping a zero changes no residual. On a living stream a
    zero write stays (a zeroed projection: a dead branch)."""
    if blk.norm(blk.idx[blk.tr.x_in]) != 0:
        return found
    kept = tuple(w for w in found.writes if blk.norm(blk.idx[w]) != 0)
    return found if kept == found.writes else replace(found, writes=kept)


def _finite_only(tr: _Trace, gram: torch.Tensor) -> tuple[_Trace | None, torch.Tensor]:
    """The trace without its non-finite vectors, when the stream itself is finite: a
    vector holding inf or NaN (an additive −inf attention mask added inside the block, of
    the stream's size) can be no write of a finite x_out − x_in, so it is no candidate.
    None when x_in or x_out is not finite (then nothing can be proven)."""
    finite = torch.isfinite(gram.diagonal()).tolist()  # one transfer, not one per vector
    keep = [i for i in range(len(tr.keys)) if finite[i]]
    kept = {tr.keys[i] for i in keep}
    if tr.x_in not in kept or tr.x_out not in kept:
        return None, gram
    # finite vectors have finite products with each other (fp64 Gram of sampled rows)
    sub = gram[keep][:, keep]
    if not torch.isfinite(sub).all():
        return None, gram
    return replace(tr, keys=[tr.keys[i] for i in keep]), sub


def _proof_note(blk: _Block, found: _Outcome, functional: list[Key], block: str) -> str:
    """What a verified block's proof says beyond its writes: where a restarting stream
    starts, and which writes are functional tensors (proven, not judged as branches)."""
    note = ""
    if found.start is not None:
        at = (
            f"a tensor computed by functional ops after {blk.added[found.start][1] or block}"
            if found.start in blk.added
            else f"{blk.branch_of(found.start)[1]}'s output"
        )
        note = (
            f"the stream restarts at {at} (the block's input reaches it through modules "
            "and functional ops, not an add); the writes add onto it"
        )
    if functional:
        after = sorted({blk.added[w][1] or block for w in functional})
        note = (note + "; " if note else "") + (
            f"{len(functional)} of the {len(found.writes)} writes "
            f"{'is a tensor' if len(functional) == 1 else 'are tensors'} computed by "
            f"functional ops (after {', '.join(after)}), not a module's output: the "
            "stream's equation is proven, those writes are not judged as branches"
        )
    return note


def _writes_left(found: _Outcome) -> bool:
    """Whether a proof with the stream fitted at 0 still has a write that carries it."""
    return any(abs(found.scales.get(w, 1.0)) > ZERO_COEF for w in found.writes)


def _first_holding(blk: _Block, hypotheses: Iterator[_Hypothesis], tol: float) -> _Outcome | None:
    """The first hypothesis whose equation holds (of at most 4096 tried)."""
    for tried, h in enumerate(hypotheses):
        o = blk.evaluate(h)
        if o.residual <= tol:
            return o
        if tried >= 4096:
            break
    return None


def _unfit(blk: _Block, found: _Outcome, tol: float) -> _Outcome:
    """A fit zeroes the candidates that are no writes (an encoder-decoder block's q/k/v
    projections, stream-shaped and consumed by functional ops: 9 candidates, too many for
    the subset search): drop them, and keep unit coefficients when they hold. A write
    that is exactly zero (a zeroed output projection) has no coefficient to fit: kept."""
    kept = tuple(
        w
        for w in found.writes
        if abs(found.scales.get(w, 1.0)) > ZERO_COEF or blk.norm(blk.idx[w]) == 0
    )
    # A candidate equal to the stream itself (a norm of a stream already normalised:
    # FocalNet's last stage, one token after its patch-merging norm) shares the stream's
    # coefficient in the fit (0.5 each): the writes it fitted at 1 hold with unit ones.
    ones = tuple(w for w in kept if abs(found.scales.get(w, 1.0) - 1) <= UNIT_COEF)
    tries = [(kept, False), (ones, False), (kept, True)] if kept != found.writes else []
    if not tries and ones != found.writes:
        tries = [(ones, False)]
    for writes, fitted in tries:
        if writes:
            o = blk.evaluate(_Hypothesis(writes, found.norms, fitted))
            if o.residual <= tol:
                return o
    return found


def prove_layout(model: nn.Module, layout: Layout, run: Callable[[], Any]) -> ProofResult:
    """The layout with every block proven (or marked), and notes for the user."""
    if not layout.blocks:
        return ProofResult(layout, ())
    try:
        blocks, roles = prove_blocks(model, layout.blocks, run)
    except Exception as err:  # the probe must never break a scan: say so and go on
        return proof_failed(layout, err)
    return proof_result(layout, blocks, roles)


def proof_failed(layout: Layout, err: Exception) -> ProofResult:
    """Every block skipped, with the reason: the probe pass (or its reading) raised."""
    note = (
        f"layout self-check could not run ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}): branch checks unverified"
    )
    blocks = [_unverified(b, "skipped", note, stream=b.stream) for b in layout.blocks]
    return ProofResult(
        replace(layout, blocks=tuple(blocks)),
        tuple(b.proof for b in blocks if b.proof is not None),
        (note,),
    )


def proof_result(layout: Layout, blocks: Sequence[BlockInfo], roles: dict[str, str]) -> ProofResult:
    """The proven blocks and role updates folded into the layout, with the user's notes."""
    new_roles = dict(layout.roles)
    for name, role in roles.items():
        if new_roles.get(name) not in (Role.NORM.value, Role.ACT.value, Role.STREAM.value):
            new_roles[name] = role
    proofs = tuple(b.proof for b in blocks if b.proof is not None)
    notes: list[str] = []
    # blocks that change the stream's shape and have no branch guess are not residual blocks
    bad = [
        p
        for p, b in zip(proofs, blocks, strict=True)
        if p.ran and (p.status == "unverified" or (p.status == "skipped" and b.branch_list()))
    ]
    idle = [p for p in proofs if not p.ran]
    if idle:
        notes.append(
            f"{len(idle)} of {len(proofs)} blocks did not run in the forward "
            f"({_blocks(p.block for p in idle)}: {_lists(p.name for p in idle)}): "
            "nothing was measured there (inputs that do not reach them, or a list the "
            "model calls through another method than forward)"
        )
    if bad:
        worst = max((p.residual for p in bad if p.residual is not None), default=None)
        notes.append(
            f"layout self-check: {len(bad)} of {len(proofs)} blocks unverified "
            f"({_blocks(p.block for p in bad)}"
            + (f"; residual up to {worst:.2g}" if worst is not None else "")
            + f"; {bad[0].note}): their branch checks (dead-branch) are skipped"
        )
    layout = replace(layout, blocks=tuple(blocks), roles=new_roles)
    return ProofResult(layout, proofs, tuple(notes))


def _lists(names: Iterator[str]) -> str:
    """The block lists (containers) the names belong to, in order, once each."""
    seen = dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else n for n in names)
    shown = list(seen)
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def _blocks(idx: Iterator[int] | Sequence[int]) -> str:
    ids = list(idx)
    shown = ", ".join(str(i) for i in ids[:6])
    return f"block{'s' if len(ids) > 1 else ''} {shown}" + (
        f" and {len(ids) - 6} more" if len(ids) > 6 else ""
    )
