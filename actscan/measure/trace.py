"""The first operation that breaks (`--trace`): one batch rerun under a dispatch mode.

Why: the recorder sees module outputs, and a module holds many operations. An fp16
intermediate `x * 1e5` that a later `tanh` or `clamp` brings back into range overflows
inside the module while its output looks fine, and a non-finite module output says which
module but not which of its operations. A `TorchDispatchMode` sees every aten operation,
in the forward and in autograd's backward, below autograd (so the model runs as it would).

How, and what it costs (docs/performance.md): pass 1 runs the batch (forward, loss,
backward as the recorded pass does, the loss scaled as it was) and, per operation with a
floating-point output, reduces on the device max |x| of its output and of its inputs (one
reduction per tensor version: NaN and inf propagate through max, so one number says
finite, inf or NaN); they reach the host in one transfer after the pass, with the
operation's name, module path and phase (Python strings, no sync). The first operation
that makes NaN from inputs without NaN, inf from finite inputs (a non-finite scalar
argument, as a causal mask's -inf, is given, not made), or a finite value beyond the
run's precision (fp16 65504, bf16's largest; fp32: non-finite only) is the one that
broke. Only then, pass 2 reruns the same batch up to that operation (same random state)
and reads what pass 1 did not keep: the Python line of the caller's code that ran it (for
a backward operation the line of the forward operation whose gradient it computes:
anomaly mode records it, on in pass 2 only when the find is in the backward), its
output's largest finite |x| and inf/nan count and its inputs'; it stops there.

Module paths: forward pre/post hooks (one `HookSet`) keep the current module. A backward
operation runs in an autograd node; each module's post-hook tags the nodes its forward
created (walking back from its outputs to nodes already tagged, innermost module first),
so `torch._C._current_autograd_node()` names the module.

torch.compile: the run already scans the eager original (`unwrap_compiled`); compiled
submodules run eagerly during the trace (`torch.compiler.set_stance("force_eager")`), as
a dispatch mode cannot see inside a compiled graph.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from actscan.measure.hooks import HookSet
from actscan.measure.inputs import Batch
from actscan.measure.prepare import TORCH_DTYPES, call_model, dtype_name
from actscan.measure.profile import PassSpec, Profiled
from actscan.records import TraceInput, TraceOp, TraceRecord

__all__ = ["TraceRun", "broke", "ceiling_of", "trace_batch", "trace_profile", "trace_run"]

_TAG = "actscan_module"  # the autograd node metadata key: the module that created it
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # actscan/
_MODE_FRAMES = ("__torch_dispatch__", "_stack")  # this module's frames under the model's
_MODELS = os.path.join(_PKG, "models") + os.sep  # the built-in family: the model's code
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def ceiling_of(dtype: torch.dtype) -> float:
    """The largest finite value an output may hold before it counts as out of range: the
    run's precision (fp16, bf16); fp32 and wider judge non-finite values only."""
    if dtype in (torch.float16, torch.bfloat16):
        return float(torch.finfo(dtype).max)
    return math.inf


@dataclass(frozen=True)
class TraceRun:
    """How the traced batch runs, as the recorded pass ran it: its loss, whether the
    backward runs and its loss scale, the autocast, the precision judged, the step."""

    loss_of: Callable[[Any, Batch], torch.Tensor]
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    precision: torch.dtype  # the run's low precision (dtype, or autocast's)
    backward: bool = True
    loss_scale: float = 1.0
    step: int = 0
    batch: int = 0
    reason: str = "asked"  # why the trace ran: asked | overflow | non-finite | diverged


class _Found(Exception):
    """Stops pass 2 at the operation it reran up to."""


class _Modules:
    """The current module path (forward hooks), and the tags on autograd nodes that let
    the backward name the module whose forward created each node."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.model = model

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        with HookSet() as hooks:
            for name, mod in self.model.named_modules():
                hooks.forward_pre(mod, self._enter(name), with_kwargs=True)
                hooks.forward(mod, self._leave(name))
            yield

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            _tag((args, kwargs), self.current())  # what the caller's own code made
            self.stack.append(name)

        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            _tag(out, name)  # what its own code made after its last child

        return hook


def _tag(out: Any, name: str) -> None:
    """Tag with `name` every autograd node reachable from `out` not tagged yet: the nodes
    `name`'s own code created since its last child module ran (children tag theirs when
    they return, and a child's inputs are tagged as its parent's when it is called).
    Each node is walked once, so the tags cost one walk of the graph per pass."""
    todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        meta = _meta(node)
        if _TAG in meta or type(node).__name__ == "AccumulateGrad":
            continue
        meta[_TAG] = name
        todo.extend(nxt for nxt, _ in node.next_functions)


def _meta(node: Any) -> dict[str, Any]:
    """An autograd node's metadata dict (a property; torch's stubs type it a method)."""
    return cast(dict[str, Any], node.metadata)


def _node_module() -> str:
    node = torch._C._current_autograd_node()
    return str(_meta(node).get(_TAG, "")) if node is not None else ""


def _floats(out: Any) -> list[torch.Tensor]:
    return [
        t
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
    ]


class _Watch(TorchDispatchMode):
    """Pass 1: per operation with a floating output, on the device, max |x| of its output
    and of its inputs (one reduction each: NaN when one holds NaN, inf when one holds inf,
    else the largest value; an input an earlier operation made is not reduced again); on
    the host its name, module and phase, and whether a scalar argument is non-finite
    (`masked_fill(mask, -inf)` writes the infinities it was given)."""

    def __init__(self, modules: _Modules) -> None:
        super().__init__()
        self.modules = modules
        self.phase = "forward"
        self.sites: list[tuple[str, str, str]] = []  # (op, module, phase)
        self.rows: list[torch.Tensor] = []
        self.given: list[bool] = []  # a non-finite scalar argument
        # tensor → (its version, its max |x|): inputs made by earlier operations
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # (this mode is off inside: its reductions are not seen) inputs before the op:
        # an in-place op writes into its input
        leaves = tree_leaves((args, kwargs or {}))
        ins = [self._top(t) for t in _floats(leaves)]
        out = func(*args, **(kwargs or {}))
        floats = _floats(out)
        if floats:
            outs = [self._top(t, fresh=True) for t in floats]
            top_in = torch.stack(ins).amax() if ins else outs[0].new_zeros(())
            top_out = outs[0] if len(outs) == 1 else torch.stack(outs).amax()
            self.rows.append(torch.stack([top_out, top_in]))
            self.given.append(any(type(v) is float and not math.isfinite(v) for v in leaves))
            module = self.modules.current() if self.phase == "forward" else _node_module()
            self.sites.append((str(func), module, self.phase))
        return out

    def _top(self, t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """max |t| in fp32 (NaN/inf when it holds them): an input's is reused while its
        version holds (autograd bumps it after an in-place op returns, so an in-place
        op's output, the input it wrote, is reduced `fresh`)."""
        kept = None if fresh else self.seen.get(t)
        if kept is not None and kept[0] == t._version:
            return cast(torch.Tensor, kept[1])
        top = t.detach().abs().amax().float()
        self.seen[t] = (t._version, top)
        return top

    def host(self) -> list[list[float]]:
        """Every operation's (output, input) max |x|: the one transfer."""
        return torch.stack(self.rows).cpu().tolist() if self.rows else []


def _breaks(row: Sequence[float], given: bool, ceiling: float) -> bool:
    """Whether this operation broke: it made NaN from inputs without NaN, inf from finite
    inputs (and no non-finite scalar argument), or a finite value beyond the ceiling. An
    operation passing on the non-finite values it was given did not."""
    out, top_in = row
    if math.isnan(out):
        return not math.isnan(top_in)
    if math.isinf(out):
        return math.isfinite(top_in) and not given
    return out > ceiling


def _bad(row: Sequence[float]) -> bool:
    return not math.isfinite(row[0])


def _reduce(ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest finite |x|, non-finite count) over `ts`, in fp32, on the device."""
    amax, bad = [], []
    for t in ts:
        a = t.detach().abs().float()
        fin = torch.isfinite(a)
        amax.append(torch.where(fin, a, 0.0).amax())
        bad.append(fin.logical_not().sum(dtype=torch.float32))
    if len(ts) == 1:
        return amax[0], bad[0]
    return torch.stack(amax).amax(), torch.stack(bad).sum()


class _Stop(TorchDispatchMode):
    """Pass 2: count operations as pass 1 did and, at operation `at`, take its stack and
    its inputs' ranges, then stop the pass."""

    def __init__(self, at: int, op: str) -> None:
        super().__init__()
        self.at, self.op, self.i = at, op, 0
        self.inputs: tuple[TraceInput, ...] = ()
        self.output: TraceInput | None = None  # its output's largest finite |x|, inf/nan
        self.stack: list[str] | None = None
        self.same = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _floats(out):
            return out
        if self.i == self.at:
            self.same = str(func) == self.op
            self.inputs = tuple(_input(t) for t in _floats((args, kwargs or {})))
            self.output = _input(_floats(out)[0])
            self.stack = _stack()
            raise _Found
        self.i += 1
        return out


def _stack() -> list[str]:
    """The caller's stack at this operation: the live one when it holds a frame of the
    caller's (the forward, a custom autograd Function's backward, a hook), else the stack
    of the forward that created the running autograd node (anomaly mode keeps it)."""
    live = traceback.format_stack()
    node = torch._C._current_autograd_node()
    if node is None or user_frame(live)[0] is not None:
        return live
    forward = _meta(node).get("traceback_")
    return list(forward) if forward else live


def _input(t: torch.Tensor) -> TraceInput:
    amax, bad = (float(v) for v in _reduce([t]))  # pass 2, one operation: read at once
    return TraceInput(
        dtype=dtype_name(t.dtype), shape=tuple(t.shape), max_abs=amax, nonfinite=int(bad)
    )


def user_frame(stack: Sequence[str]) -> tuple[str | None, str | None]:
    """("file:line in func", the line's code) of the innermost frame of the model's code in
    a formatted stack (traceback.format_stack's strings, outermost first): below the last
    frame of actscan itself (which called the model or the loss), outside torch. The
    built-in family (actscan/models) is model code. (None, None) when there is none."""
    frames = []
    for entry in stack:
        m = _FRAME.search(entry)
        if m is not None:
            frames.append((os.path.abspath(m["file"]), int(m["line"]), m["func"]))
    while frames and (frames[-1][2] in _MODE_FRAMES or frames[-1][0].startswith(_TORCH)):
        frames.pop()  # this mode's own frames, and torch's dispatch under the model's line
    inner = [i for i, (path, _, _) in enumerate(frames) if _ours(path)]
    for path, line, func in reversed(frames[inner[-1] + 1 if inner else 0 :]):
        if path.startswith(_TORCH) or path.startswith("<"):
            continue
        code = linecache.getline(path, line).strip() or None
        return f"{_shown_path(path)}:{line} in {func}", code
    return None, None


def _shown_path(path: str) -> str:
    """A path under the working directory relative to it (as the user typed it)."""
    here = os.getcwd() + os.sep
    return path[len(here) :] if path.startswith(here) else path


def _ours(path: str) -> bool:
    return path.startswith(_PKG + os.sep) and not path.startswith(_MODELS)


def _one_pass(
    model: nn.Module, batch: Batch, run: TraceRun, mode: TorchDispatchMode, phase: Any
) -> None:
    """The batch's forward, loss and backward (gradients not written to `.grad`) under
    `mode`; `phase(name)` is told when the backward starts."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.set_grad_enabled(run.backward), run.autocast(), mode:
        out = call_model(model, batch)
        loss = run.loss_of(out, batch) if run.backward else None
        del out
        if loss is not None and loss.requires_grad and params:
            scaled = loss.float() * run.loss_scale if run.loss_scale != 1.0 else loss
            phase("backward")
            torch.autograd.grad(scaled, params, allow_unused=True)


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Compiled functions run eagerly (a dispatch mode cannot see inside their graphs).
    Nothing was compiled when dynamo was never imported (importing it takes seconds)."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def _kept_buffers(model: nn.Module) -> Iterator[None]:
    """Buffers as they were before the traced passes (BatchNorm's running statistics move
    in train mode): a trace leaves the steps after it exactly what they were without it."""
    with torch.no_grad():
        kept = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)


def trace_batch(model: nn.Module, batch: Batch, run: TraceRun) -> TraceRecord:
    """Rerun `batch` (already on the run's device and dtype) instrumented and name the
    first operation whose output is non-finite or beyond `run.precision`'s range, or, when
    none is, the one with the largest output (its headroom). The model, its `.grad` and
    the random state are left as they were."""
    ceiling = ceiling_of(run.precision)
    devices = [batch_device(model)] if batch_device(model).type == "cuda" else []
    modules = _Modules(model)
    watch = _Watch(modules)
    with _kept_buffers(model), _eager(), modules.hooked(), torch.random.fork_rng(devices=devices):
        _one_pass(model, batch, run, watch, lambda p: setattr(watch, "phase", p))
    rows = watch.host()
    first, peak = _pick(rows, watch, ceiling)
    at = first if first is not None else peak
    op = None
    if at is not None:
        name, module, phase = watch.sites[at]
        stop = _locate(model, batch, run, at, name, phase)
        source, code = user_frame(stop.stack) if stop.same and stop.stack else (None, None)
        top = rows[at][0]
        output = stop.output if stop.same else None
        op = TraceOp(
            index=at,
            op=name,
            module=module,
            phase=phase,
            max_abs=output.max_abs if output else (top if math.isfinite(top) else None),
            nonfinite=output.nonfinite if output else 0,
            inputs=stop.inputs if stop.same else (),
            source=source,
            code=code,
        )
    return TraceRecord(
        reason=run.reason,
        step=run.step,
        batch=run.batch,
        dtype=dtype_name(run.precision),
        ceiling=None if math.isinf(ceiling) else ceiling,
        ops=len(rows),
        backward_ops=sum(1 for _, _, p in watch.sites if p == "backward"),
        first=op if first is not None else None,
        peak=op if first is None else None,
    )


def _pick(rows: list[list[float]], watch: _Watch, ceiling: float) -> tuple[int | None, int | None]:
    """(the first operation that broke, None) or, when none did, (None, the operation with
    the largest finite output)."""
    first = next((i for i, r in enumerate(rows) if _breaks(r, watch.given[i], ceiling)), None)
    if first is None:  # non-finite from the start (a weight, the inputs): where it shows
        shows = next((i for i, r in enumerate(rows) if _bad(r)), None)
        if shows is not None and not watch.given[shows] and not math.isfinite(rows[shows][1]):
            return shows, None
    if first is not None:
        return first, None
    # the peak among the model's operations (the loss's include counts: nll's total weight)
    finite = [i for i, r in enumerate(rows) if not _bad(r) and watch.sites[i][1]]
    finite = finite or [i for i, r in enumerate(rows) if not _bad(r)]
    return None, max(finite, key=lambda i: rows[i][0], default=None)


def _locate(model: nn.Module, batch: Batch, run: TraceRun, at: int, op: str, phase: str) -> _Stop:
    """Pass 2 up to operation `at` (it stops there): its stack, output and inputs.
    `same` is False when the rerun took another path (no line to trust)."""
    stop = _Stop(at, op)
    devices = [batch_device(model)] if batch_device(model).type == "cuda" else []
    with (
        _kept_buffers(model),
        _eager(),
        torch.random.fork_rng(devices=devices),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # anomaly mode's, and its report of the stop
        # anomaly mode keeps each autograd node's forward stack: a backward op's line
        anomaly = (
            torch.autograd.detect_anomaly(check_nan=False)
            if phase == "backward"
            else contextlib.nullcontext()
        )
        with anomaly, contextlib.suppress(_Found):
            _one_pass(model, batch, run, stop, lambda _p: None)
    return stop


def batch_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def broke(profiled: Profiled) -> str | None:
    """Why the recorded pass calls for a trace: "non-finite" (an output or an output
    gradient holds inf/nan), "overflow" (a finite output beyond the run's precision, as
    under autocast an fp32 output can be), else None."""
    spec = profiled.spec
    ceiling = ceiling_of(precision_of(spec))
    raws = profiled.raw.values()
    if any(r.nonfinite for r in raws) or any(
        r.grad_sumsq is not None and not math.isfinite(r.grad_sumsq) for r in raws
    ):
        return "non-finite"
    if any(math.isfinite(r.max_abs) and r.max_abs > ceiling for r in raws):
        return "overflow"
    return None


def precision_of(spec: PassSpec) -> torch.dtype:
    """The precision the run's values live in: autocast's, else the run's dtype."""
    return TORCH_DTYPES[spec.amp] if spec.amp else (spec.dtype or spec.model_dtype)


def trace_run(profiled: Profiled, *, reason: str, step: int = 0, batch: int = 0) -> TraceRun:
    """How the trace reruns a batch of `profiled`'s pass: its loss, backward and scale."""
    spec = profiled.spec
    return TraceRun(
        loss_of=profiled.chosen.loss_of,
        autocast=spec.autocast,
        precision=precision_of(spec),
        backward=profiled.backward,
        loss_scale=spec.loss_scale,
        step=step,
        batch=batch,
        reason=reason,
    )


def untraced_note(profiled: Profiled, asked: bool) -> str | None:
    """The note of a trace that was called for (asked, or the pass broke) but cannot run:
    a distributed rank holds a shard of the model, not the model."""
    if not profiled.ranks.sharded:
        return None
    reason = None if asked else broke(profiled)
    if not asked and reason is None:
        return None
    why = "asked (--trace)" if asked else f"the pass broke ({reason})"
    return (
        f"trace: not run although {why}: a distributed rank holds a shard of the model, "
        "not the model; rerun in one process (without --nproc) to name the first "
        "operation out of range"
    )


def trace_profile(model: nn.Module, profiled: Profiled, asked: bool) -> TraceRecord | None:
    """The trace of the recorded pass: asked for (`--trace`: batch 0), or because it broke
    (its batches in turn until one names the operation: the recorder merges batches, so
    it cannot say which one broke). None when neither; a distributed rank does not trace
    (its shard of the model is not the model: `untraced_note` says so)."""
    reason = broke(profiled)
    if reason is None and not asked:
        return None
    if profiled.ranks.sharded:
        return None
    source = profiled.ranks.rows_of(profiled.chosen.source)
    last: TraceRecord | None = None
    for i in range(profiled.spec.batches if reason else 1):
        run = trace_run(profiled, reason=reason or "asked", batch=i)
        last = trace_batch(model, profiled.spec.cast(source(i)), run)
        if last.first is not None:
            return last
    return last
