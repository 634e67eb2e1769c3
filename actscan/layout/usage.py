"""How the forward pass uses each parameter, measured rather than guessed from shapes.

Two measurements feed the init-scale check (and `--init` on transformers configs):

* `measure_usage`: one small forward pass under a `TorchFunctionMode` that sees every
  linear / matmul / `@` / bmm / einsum / grouped-mm / conv / embedding call. A parameter that
  enters such a call as the weight operand (itself, a view, a slice of a fused 3-D expert
  tensor, a transpose) gets the size the call contracts over: its real fan-in, whatever its
  storage layout (GPT-2's (in, out) Conv1D, Mixtral's (experts, 2·ffn, hidden)). Parameters
  never used that way (Mamba's `A_log` and `D`, a bias passed to a kernel, position tables
  read by indexing) are "structured": no fan-in rule applies to them.
* `probe_gain`: a norm's effective per-channel gain, from feeding the module a
  zero-mean unit-RMS probe. Reading `weight` as the gain is wrong for norms that scale by
  (1 + w) (Gemma), where w = 0 at init is a gain of 1.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from actscan.layout.detect import is_norm
from actscan.measure.gemms import GEMM_NAMES, Operand, parse_gemm
from actscan.measure.gemms import storage_key as _storage_key
from actscan.measure.hooks import HookSet, Watcher
from actscan.measure.recorder import first_tensor

_CONV = {"conv1d", "conv2d", "conv3d"}
_CONV_T = {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
_EMBED = {"embedding", "embedding_bag"}
# torch's fused layers: the calls inside are not seen, but their weights are stored
# (out, in…) like F.linear's, and 1-D tensors are biases.
_FUSED = {
    "multi_head_attention_forward", "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd", "bilinear", "lstm", "gru", "rnn_tanh", "rnn_relu",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
}  # fmt: skip
# Norm calls: a linear/conv output that enters one directly is "normed" (its weight's
# scale cancels: conv → BatchNorm, linear → LayerNorm, F.normalize's L2 norm).
_NORMS = {"batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm", "normalize"}
_DIVS = {"div", "__truediv__", "true_divide"}  # x / ‖x‖: an L2 norm written out (CLIP's)
# A product read by sin/cos (after a scale by a constant): a Fourier-feature map
_PERIODIC = {"sin", "cos"}
_SCALAR_MULS = {"mul", "__mul__", "__rmul__"}
# Every name the spy reads: any other call passes straight through (most calls of a
# forward, and every call of the hooks sharing the pass: views, reductions, copies).
_WATCHED = frozenset().union(
    GEMM_NAMES, _CONV, _CONV_T, _EMBED, _FUSED, _NORMS, _DIVS, _PERIODIC, _SCALAR_MULS
)


@dataclass(frozen=True)
class ParamUse:
    """How one parameter entered the forward pass (its first use of each kind)."""

    # "matmul" | "conv" | "embedding" | "bias" | "normed" (output into a norm) |
    # "periodic" (its product read by sin/cos)
    op: str
    fan_in: int | None = None  # size the call contracts over (matmul/conv weights)
    fan_out: int | None = None
    # the operand it multiplies has unit L2 norm over the contraction (F.normalize'd
    # rows): the output's std is the weight's own, whatever the fan-in
    unit_input: bool = False


@dataclass(frozen=True)
class Usage:
    """Result of `measure_usage`: parameter name → uses; norm module name → input shape."""

    uses: dict[str, tuple[ParamUse, ...]] = field(default_factory=dict)
    norm_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def normed(self, name: str) -> bool:
        """Whether the parameter's linear/conv output went straight into a norm."""
        return any(u.op == "normed" for u in self.uses.get(name, ()))

    def periodic(self, name: str) -> bool:
        """Whether the parameter's product went (scaled by a constant) into sin/cos."""
        return any(u.op == "periodic" for u in self.uses.get(name, ()))

    def role(self, name: str) -> ParamUse | None:
        """The use that decides what a parameter is: embedding > matmul/conv > bias."""
        got = self.uses.get(name, ())
        for op in ("embedding", "matmul", "conv", "bias"):
            for u in got:
                if u.op == op:
                    return u
        return None


Flag = torch.Tensor | bool  # a 0-d bool on the pass's device, read after the pass


@dataclass(frozen=True)
class _Pending:
    """A use decided by values the pass computed, read after it in one transfer (a host
    read inside the forward would sync a GPU once per call): a matmul weight contracted
    against convex weights is a table ("embedding"), against unit rows a unit-input
    matmul; `normed`: an output divided by its own L2 norm (None: not that kind)."""

    use: ParamUse
    convex: Flag = False
    unit: Flag = False
    normed: Flag | None = None

    def resolve(self, read: dict[int, bool]) -> ParamUse | None:
        def val(f: Flag) -> bool:
            return read[id(f)] if isinstance(f, torch.Tensor) else bool(f)

        if self.normed is not None:
            return self.use if val(self.normed) else None
        if val(self.convex):
            return ParamUse("embedding")
        if val(self.unit):
            return ParamUse("matmul", self.use.fan_in, self.use.fan_out, unit_input=True)
        return self.use


def _resolve(uses: dict[str, list[ParamUse | _Pending]]) -> dict[str, tuple[ParamUse, ...]]:
    """Every pending use decided (one stack and transfer of all their flags), then each
    parameter's first use of each kind, in the order the pass met them."""
    flags = [
        f
        for got in uses.values()
        for u in got
        if isinstance(u, _Pending)
        for f in (u.convex, u.unit, u.normed)
        if isinstance(f, torch.Tensor)
    ]
    read: dict[int, bool] = {}
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    for fs in by_device.values():
        values = torch.stack([f.reshape(()) for f in fs]).tolist()
        read.update((id(f), bool(v)) for f, v in zip(fs, values, strict=True))
    out: dict[str, tuple[ParamUse, ...]] = {}
    for pname, got in uses.items():
        kept: list[ParamUse] = []
        for u in got:
            use = u.resolve(read) if isinstance(u, _Pending) else u
            if use is not None and all(k.op != use.op for k in kept):
                kept.append(use)
        if kept:
            out[pname] = tuple(kept)
    return out


# storage identity → (parameter name, the parameter): a hit counts only while that
# parameter still holds that storage, so a freed StorageImpl's reused address cannot be
# mistaken for a parameter (a norm's gain read as a matmul weight under FSDP).
Owners = dict[int, tuple[str, torch.Tensor]]


def _prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


class _Spy(Watcher):
    """Notes which parameters enter contraction calls, and with what contracted size."""

    def __init__(self, owner: Owners) -> None:
        super().__init__()
        self.owner = owner
        self.uses: dict[str, list[ParamUse | _Pending]] = {}
        # id of a linear/conv output → (the output, its weight's name), while alive
        self.outputs: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        # id of a product with a parameter (any GEMM, or one scaled by a constant) → the same
        self.products: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _WATCHED and self.owner:
            with contextlib.suppress(Exception):  # never let bookkeeping break the pass
                self._note(name, list(args), kwargs)
        out = func(*args, **kwargs)
        if (name == "linear" or name in _CONV) and self.owner:
            with contextlib.suppress(Exception):
                self._keep(args, kwargs, out)
        if (name in GEMM_NAMES or name in _SCALAR_MULS) and self.owner:
            with contextlib.suppress(Exception):
                self._keep_product(name, args, kwargs, out)
        return out

    def _keep(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Remember a linear/conv output and its weight, to see whether a norm reads it."""
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        pname = self._param(w) if isinstance(w, torch.Tensor) else None
        if pname is not None and isinstance(out, torch.Tensor):
            self.outputs[id(out)] = (weakref.ref(out), pname)

    def _keep_product(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Remember a GEMM's output with its parameter operand, and carry it through a
        scale by a constant (2π · x): to see whether sin/cos reads it."""
        if not isinstance(out, torch.Tensor):
            return
        if name in _SCALAR_MULS:
            pair = [a for a in args[:2] if isinstance(a, torch.Tensor) and a.dim() > 0]
            held = _held(self.products, pair[0]) if len(pair) == 1 else None
            if held is not None:
                self.products[id(out)] = (weakref.ref(out), held)
            return
        gemm = parse_gemm(name, args, kwargs)
        for o in gemm.operands if gemm is not None else ():
            pname = self._param(o.tensor)
            if pname is not None:
                self.products[id(out)] = (weakref.ref(out), pname)
                return

    def _use(self, pname: str, op: str) -> None:
        self._put(pname, ParamUse(op))

    def _put(self, pname: str, use: ParamUse | _Pending) -> None:
        got = self.uses.setdefault(pname, [])
        if isinstance(use, _Pending) or all(isinstance(u, _Pending) or u.op != use.op for u in got):
            got.append(use)

    def _normed(self, x: Any) -> None:
        held = _held(self.outputs, x)
        if held is not None:
            self._use(held, "normed")

    def _divided(self, x: Any, by: Any) -> None:
        """x / ‖x‖ over the last dim (an L2 norm written out) of a linear/conv output."""
        held = _held(self.outputs, x)
        if held is None or not isinstance(by, torch.Tensor) or x.dim() < 1:
            return
        norm = x.detach().float().norm(dim=-1, keepdim=True)
        if by.shape == norm.shape:
            close = ((by.detach().float() - norm).abs() <= 1e-8 + 1e-4 * norm.abs()).all()
            self._put(held, _Pending(ParamUse("normed"), normed=close))

    def _param(self, t: Any) -> str | None:
        key = _storage_key(t)
        hit = self.owner.get(key) if key is not None else None
        if hit is None or _storage_key(hit[1]) != key:
            return None
        return hit[0]

    def _add(self, t: Any, use: ParamUse | _Pending) -> None:
        pname = self._param(t)
        if pname is not None:
            self._put(pname, use)

    def _contracted(self, o: Operand, operands: Sequence[Operand], op: str) -> ParamUse | _Pending:
        """A matmul weight, or a table: a parameter contracted against weights that are
        ≥ 0 and sum to 1 over the contraction (an interpolation, a one-hot selection:
        SigLIP 2 resizes its position table so) is read as a mixture of its rows, whose
        std is at most the table's own: no fan-in rule applies, as for an embedding."""
        if op != "linear" and len(operands) == 2 and self._param(o.tensor) is not None:
            other = operands[1] if operands[0] is o else operands[0]
            unit = self._param(other.tensor) is None and _unit_rows(other)
            return _Pending(ParamUse("matmul", o.fan_in, o.fan_out), _convex(other), unit)
        return ParamUse("matmul", o.fan_in, o.fan_out)

    def _note(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        def arg(i: int, key: str) -> Any:
            return args[i] if len(args) > i else kwargs.get(key)

        if name in _NORMS:
            self._normed(arg(0, "input"))
            return
        if name in _DIVS:
            self._divided(arg(0, "input"), arg(1, "other"))
            return
        if name in _PERIODIC:
            held = _held(self.products, arg(0, "input"))
            if held is not None:
                self._use(held, "periodic")
            return
        if name in _SCALAR_MULS:
            return
        gemm = parse_gemm(name, args, kwargs)
        if gemm is not None:
            # linear: its weight alone (the input is never a parameter's use as a matmul)
            operands = gemm.operands[-1:] if gemm.op == "linear" else gemm.operands[::-1]
            for o in operands:
                if gemm.op != "einsum" or o.fan_in > 1:
                    self._add(o.tensor, self._contracted(o, gemm.operands, gemm.op))
            for bias in gemm.biases:
                self._add(bias, ParamUse("bias"))
        elif name in _CONV or name in _CONV_T:
            w, b = arg(1, "weight"), arg(2, "bias")
            if isinstance(w, torch.Tensor) and w.dim() >= 2:
                rf = _prod(w.shape[2:])
                # transposed convs store (in, out/groups, k…); torch's own init convention
                self._add(w, ParamUse("conv", int(w.shape[1]) * rf, int(w.shape[0]) * rf))
            if b is not None:
                self._add(b, ParamUse("bias"))
        elif name in _FUSED:
            flat = [
                x
                for a in (*args, *kwargs.values())
                for x in (a if isinstance(a, list | tuple) else [a])
            ]
            for t in flat:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1:
                    use = (
                        ParamUse("matmul", _prod(t.shape[1:]), int(t.shape[0]))
                        if t.dim() >= 2
                        else ParamUse("bias")
                    )
                    self._add(t, use)
        elif name in _EMBED:
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self._add(t, ParamUse("embedding"))


_SAMPLED = 64  # vectors read along an operand's longest other dim, at most


def _sampled(o: Operand) -> torch.Tensor | None:
    """The operand, every k-th index of its longest dim not contracted (≤ _SAMPLED of
    them): a view, no copy. The two flags below are properties of how the operand was
    made (a softmax, an interpolation, F.normalize), which hold for every vector or for
    none, so a sample decides them; reading all of them cost a GPT-2 forward 33M values."""
    t = o.tensor
    if not (t.is_floating_point() and o.contract and t.numel()):
        return None
    t = t.detach()
    other = [d for d in range(t.dim()) if d not in o.contract]
    if other:
        d = max(other, key=lambda k: t.shape[k])
        step = -(-t.shape[d] // _SAMPLED)
        t = t[(slice(None),) * d + (slice(None, None, step),)]
    return t


def _convex(o: Operand) -> Flag:
    """Whether an operand's values are ≥ 0 and sum to 1 over its contracted dims, on a
    sample of its vectors (on the device: read after the pass)."""
    t = _sampled(o)
    if t is None:
        return False
    # two reductions, no copy: its min (NaN stays NaN: not ≥ 0), its sums
    sums = t.sum(dim=o.contract, dtype=torch.float32)
    return (t.amin() >= 0) & ((sums - 1).abs() <= 1e-4).all()


def _unit_rows(o: Operand) -> Flag:
    """Whether an operand's vectors over its contracted dims have L2 norm 1 (rows
    F.normalize'd: SwiftFormer's additive attention reads q @ w_g on them), on a sample
    of them; on the device."""
    t = _sampled(o)
    if t is None:
        return False
    norms = torch.linalg.vector_norm(t, dim=o.contract, dtype=torch.float32)
    return ((norms - 1).abs() <= 1e-3).all()


def _held(table: dict[int, tuple[weakref.ref[torch.Tensor], str]], x: Any) -> str | None:
    """The parameter name kept for tensor `x` in `table`, while that very tensor lives."""
    got = table.get(id(x)) if isinstance(x, torch.Tensor) else None
    return got[1] if got is not None and got[0]() is x else None


def _owners(model: nn.Module) -> Owners:
    owner: Owners = {}
    for pname, p in model.named_parameters():  # tied parameters: the first name
        key = _storage_key(p)
        if key is not None and key not in owner:
            owner[key] = (pname, p)
    return owner


def _live_owners(model: nn.Module, owner: Owners, hooks: HookSet) -> None:
    """Add the parameters each module holds when it is called: FSDP swaps in unsharded
    parameters (other storages than the sharded ones `_owners` saw) for its forward."""

    def pre(mname: str) -> Callable[..., None]:
        def hook(mod: nn.Module, _inputs: Any) -> None:
            for pname, p in mod.named_parameters(recurse=False):
                key = _storage_key(p)
                if key is None or (key in owner and owner[key][1] is p):
                    continue  # the same parameter (tied): its first name stays
                owner[key] = (f"{mname}.{pname}" if mname else pname, p)

        return hook

    for mname, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)):
            hooks.forward_pre(mod, pre(mname))


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP shards the model's parameters (DTensors outside its forward)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def first_batch_of_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """The first sample of a batch: every top-level tensor whose leading size is the batch
    size, read off the token ids (`input_ids`, or an integer first argument), else off the
    first floating-point tensor."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    ok = isinstance(ids, torch.Tensor) and not ids.is_floating_point()
    first = ids if ok else first_tensor((args, kwargs))
    if first is None or first.dim() == 0 or first.shape[0] <= 1:
        return args, kwargs
    n = first.shape[0]

    def cut(v: Any) -> Any:
        return v[:1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _norm_shapes(
    model: nn.Module, into: dict[str, tuple[int, ...]], hooks: HookSet, batch: int
) -> None:
    def pre(name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, inputs: tuple[Any, ...]) -> None:
            if name not in into and inputs and isinstance(inputs[0], torch.Tensor):
                shape = tuple(inputs[0].shape)
                if batch > 1 and shape and shape[0] % batch == 0:
                    shape = (shape[0] // batch, *shape[1:])  # one sample's
                into[name] = shape

        return hook

    for name, mod in model.named_modules():
        if is_norm(mod) and isinstance(getattr(mod, "weight", None), nn.Parameter):
            hooks.forward_pre(mod, pre(name))


@contextlib.contextmanager
def watch_usage(model: nn.Module, hooks: HookSet, batch: int = 1) -> Iterator[Callable[[], Usage]]:
    """Watch the forward passes run inside: yields a function that reads the `Usage`.

    Its hooks go into `hooks` (the caller removes them); the `TorchFunctionMode` that sees
    every call is active inside the `with` only. Random generators and no_grad are the
    caller's; the model's mode too. `batch`: the pass's batch size; each norm's input
    shape is kept as one sample's (the leading size ÷ `batch`, where it divides), the
    shape its gain is probed at.
    """
    owner = _owners(model)
    shapes: dict[str, tuple[int, ...]] = {}
    spy = _Spy(owner)
    _norm_shapes(model, shapes, hooks, batch)
    if _sharded(model):
        _live_owners(model, owner, hooks)
    with spy:
        yield lambda: Usage(_resolve(spy.uses), dict(shapes))


def _usage_pass(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Usage:
    with HookSet() as hooks, watch_usage(model, hooks) as usage:
        model(*args, **kwargs)
    return usage()


def measure_usage(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Usage:
    """One no-grad forward pass on the first sample of (args, kwargs), watching every call.

    Raises whatever the model raises (the caller falls back to shape-based fan-in). The
    model's mode is left to the caller; random generators are left as they were. A scan
    measures usage inside the layout proof's pass instead (`layout.probe.probe_pass`).
    """
    small_args, small_kwargs = first_batch_of_one(args, kwargs)
    devices = [d for d in {p.device for p in model.parameters()} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            return _usage_pass(model, small_args, small_kwargs)
        except Exception:
            if small_args is args and small_kwargs is kwargs:
                raise
        # the batch could not be cut to one sample: the full batch
        return _usage_pass(model, args, kwargs)


# --------------------------------------------------------------------------- norm gains


def _candidate_shapes(weight: torch.Tensor) -> list[tuple[int, ...]]:
    shapes = [(1, 7, *weight.shape)]
    if weight.dim() == 1:
        c = int(weight.shape[0])
        shapes += [(1, c, 7), (1, c, 3, 3), (1, c, 2, 2, 2), (2, c)]
    return shapes


# Probe inputs by (shape, normalised dims, dtype, device): every norm of a model probed at
# one shape reads the same seeded x, drawn and normalised once.
ProbeCache = dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def probe_gain(
    mod: nn.Module,
    weight: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    cache: ProbeCache | None = None,
) -> torch.Tensor | None:
    """Per-channel effective gain of a norm (shape of `weight`), or None if it cannot tell.

    The probe x is zero-mean and unit-RMS along the axes the norm normalises (the trailing
    `weight.dim()` axes for LayerNorm/RMSNorm, each channel over batch and space for
    BatchNorm/GroupNorm/InstanceNorm), so the norm maps it to itself times the gain. The
    odd part (f(x) − f(−x))/2 removes any bias; the gain per channel is its least-squares
    slope on x. Run under no_grad with a fixed generator; the module is left as it was.
    `cache`: probe inputs kept across calls (the same x for every norm of one shape).
    """
    for s in [shape] if shape is not None else _candidate_shapes(weight):
        g = _probe(mod, weight, s, {} if cache is None else cache)
        if g is not None:
            return g
    return None


def _axes(
    mod: nn.Module, weight: torch.Tensor, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(normalised dims, dims the gain is constant over) a norm of `weight`'s shape may
    use on an input of `shape`, the likeliest first: a channel norm's statistics over
    batch and space, a LayerNorm's over the trailing dims, then any other axis the
    gain's channels may sit on (a channels-first LayerNorm normalises over dim 1)."""
    nd = weight.dim()
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    # a channel norm reads (N, C, …): on a recorded (N, C) input the trailing axis is its
    # channel, not the axis it normalises (LeViT's BatchNorm1d over flattened tokens)
    channel = nd == 1 and isinstance(mod, nn.modules.batchnorm._NormBase | nn.GroupNorm)
    spatial = (0, *range(2, len(shape)))
    if channel and len(shape) >= 2 and shape[1] == weight.shape[0]:
        out.append((spatial, spatial))
    if len(shape) > nd and tuple(shape[-nd:]) == tuple(weight.shape):
        out.append((tuple(range(len(shape) - nd, len(shape))), tuple(range(len(shape) - nd))))
    if nd == 1 and len(shape) >= 2:
        for a in range(1, len(shape)):
            if shape[a] == weight.shape[0]:
                rest = tuple(d for d in range(len(shape)) if d != a)
                out += [(rest, rest), ((a,), rest)]
    return list(dict.fromkeys(out))


def _probe(
    mod: nn.Module, weight: torch.Tensor, shape: tuple[int, ...], cache: ProbeCache
) -> torch.Tensor | None:
    """The gain read with the first normalised axes whose probe the norm maps to a
    per-channel multiple of itself (the fit's residual under 1%); if none does, the
    likeliest axes' slope, as before."""
    first: torch.Tensor | None = None
    for norm_dims, reduce_dims in _axes(mod, weight, shape):
        got = _probe_axes(mod, weight, shape, norm_dims, reduce_dims, cache)
        if got is None:
            continue
        gain, fit = got
        if fit <= 1e-2:
            return gain
        first = gain if first is None else first
    return first


def _probe_axes(
    mod: nn.Module,
    weight: torch.Tensor,
    shape: tuple[int, ...],
    norm_dims: tuple[int, ...],
    reduce_dims: tuple[int, ...],
    cache: ProbeCache,
) -> tuple[torch.Tensor, float] | None:
    """(per-channel gain, relative residual of odd(f)(x) ≈ gain·x) with x normalised over
    `norm_dims`; None when the norm cannot be run on it."""
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    key = (tuple(shape), norm_dims, dtype, weight.device)
    if key not in cache:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        x = x - x.mean(norm_dims, keepdim=True)
        x = x / x.pow(2).mean(norm_dims, keepdim=True).sqrt().clamp_min(1e-12)
        cache[key] = (x, x.to(device=weight.device, dtype=dtype), (x * x).sum(reduce_dims))
    x, xt, xx = cache[key]
    try:
        with torch.no_grad(), _without_fused_activation(mod):
            pos, neg = _first(mod(xt.clone())), _first(mod(-xt))  # the cached x stays
    except Exception:  # a norm that wants more than one tensor (conditional norms, …)
        return None
    if pos is None or neg is None or tuple(pos.shape) != tuple(shape):
        return None
    odd = (pos.double() - neg.double()).cpu() / 2
    gain = (odd * x).sum(reduce_dims) / xx
    if not torch.isfinite(gain).all():
        return None
    kept = [1 if d in reduce_dims else s for d, s in enumerate(shape)]
    miss = (odd - gain.reshape(kept) * x).norm() / odd.norm().clamp_min(1e-30)
    return gain.reshape(weight.shape), float(miss)


# where activation classes live: torch's (nn.ReLU, …) and transformers' ACT2FN classes
_ACTIVATION_MODULES = frozenset({"torch.nn.modules.activation", "transformers.activations"})


@contextlib.contextmanager
def _without_fused_activation(mod: nn.Module) -> Iterator[None]:
    """A norm's activation children (a fused activation: BiT's GroupNormActivation,
    timm's NormAct) swapped for Identity while probed: the odd part of ReLU(g·x) is g·x/2,
    which read as a gain of 0.5 on a gain of 1. Put back after; other norms: unchanged."""
    saved = {
        k: c
        for k, c in mod._modules.items()
        if c is not None
        and type(c).__module__ in _ACTIVATION_MODULES
        and next(c.parameters(), None) is None
    }
    try:
        for k in saved:
            mod._modules[k] = nn.Identity()
        yield
    finally:
        mod._modules.update(saved)


@contextlib.contextmanager
def _whole_params(mod: nn.Module) -> Iterator[dict[str, nn.Parameter]]:
    """A sharded (FSDP, DTensor) module's own parameters gathered whole for a probe (a
    norm's gain: d values), the shards put back after. Plain modules: nothing changes."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists: skip the import
        yield {}  # (loading torch.distributed.tensor costs ~1–2 s a run)
        return
    from torch.distributed.tensor import DTensor

    saved = {k: p for k, p in mod._parameters.items() if isinstance(p, DTensor)}
    # An FSDP2 parameter is a Parameter and a DTensor at once: torch's stubs make that
    # intersection impossible (isinstance narrows to nothing), so name the DTensor side.
    whole = {
        k: nn.Parameter(cast(DTensor, p).full_tensor().detach(), requires_grad=False)
        for k, p in saved.items()
    }
    try:
        mod._parameters.update(whole)
        yield whole
    finally:
        mod._parameters.update(saved)


def _first(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def norm_gains(
    model: nn.Module, shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[float, float]]:
    """Norm module name → (mean, std) over channels of its effective gain, where measurable."""
    out: dict[str, tuple[float, float]] = {}
    cache: ProbeCache = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if not (is_norm(mod) and isinstance(weight, nn.Parameter)):
            continue
        with _whole_params(mod) as whole:
            weight = whole.get("weight", weight)
            g = probe_gain(mod, weight, (shapes or {}).get(name), cache)
            if g is None and shapes and name in shapes:
                g = probe_gain(mod, weight, cache=cache)
        if g is not None:
            out[name] = (float(g.mean()), float(g.std(unbiased=False)))
    return out
