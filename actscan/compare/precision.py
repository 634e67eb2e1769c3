"""The precision-divergence pass of `actscan compare`: same weights, two precisions.

A ratio of two RMS values cannot say whether bf16 computes the *same* activations as
fp32, only that they have the same scale. This pass runs the higher-precision model once,
keeping each chosen module's output (detached, fp32) for one batch, then a cast deep copy
with hooks that reduce Σ(a−b)², Σa², Σab, Σb² against the kept tensors on the device; one
host transfer at the end. Memory: one batch of the chosen outputs (meant for the small
models one compares). The caller's model is never cast or moved: both runs use copies.
Hooks go through a `HookSet` (measure/hooks.py) and leave with it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from actscan.compare.pairs import Divergence, LayerDivergence
from actscan.errors import UsageError
from actscan.layout.detect import detect_layout
from actscan.layout.proof import prove_layout
from actscan.measure.hooks import HookSet
from actscan.measure.inputs import Batch, InputSource, token_source
from actscan.measure.prepare import TORCH_DTYPES, cast_batch, resolve_device
from actscan.measure.recorder import first_tensor
from actscan.records import Layout, ModelInfo

__all__ = ["Precision", "default_inputs", "divergence_targets", "precision_divergence"]

# Mantissa bits: "higher precision" is the side with more of them (fp16 beats bf16).
_MANTISSA = {"fp32": 23, "fp16": 10, "bf16": 7}


@dataclass(frozen=True)
class Precision:
    """How one side ran: weights in `dtype`, optionally under autocast to `amp`."""

    dtype: str = "fp32"
    amp: str | None = None

    @property
    def bits(self) -> int:
        """Mantissa bits of the arithmetic: autocast computes in `amp`."""
        bits = _MANTISSA.get(self.dtype, 23)
        return min(bits, _MANTISSA[self.amp]) if self.amp else bits

    @property
    def label(self) -> str:
        return f"{self.dtype} amp {self.amp}" if self.amp else self.dtype


def default_inputs(info: ModelInfo, batch: int, seq_len: int, seed: int) -> InputSource:
    """The random token ids scan() invents for `info` (same seed → the same ids)."""
    if not (info.vocab_size and info.task in ("causal-lm", "encoder")):
        raise UsageError("cannot invent inputs for this model: pass --input or --input-shape")
    return token_source(
        info.vocab_size,
        batch,
        seq_len,
        seed,
        mask=info.task == "encoder",
        as_kwargs=info.family != "actscan-gpt",
    )


def divergence_targets(model: nn.Module, layout: Layout, scope: str) -> list[tuple[str, Any]]:
    """Modules whose outputs are compared: the stream and branches (+ final norm, head),
    or every named module with scope "all"."""
    mods = dict(model.named_modules())
    if scope == "all":
        return [(n, m) for n, m in mods.items() if n]
    names: list[str] = []
    for b in layout.blocks:
        names += [br.name for br in b.branch_list()] + [b.name]
    names += [n for n in (layout.final_norm, layout.head) if n]
    if not layout.blocks:
        names = [n for n in mods if n]
    return [(n, mods[n]) for n in dict.fromkeys(names) if n in mods]


def precision_divergence(
    model: nn.Module,
    source: InputSource,
    *,
    high: Precision,
    low: Precision,
    reference_side: str,
    threshold: float,
    layout: Layout | None = None,
    scope: str = "stream+branches",
    device: str | None = None,
    model_type: str | None = None,
) -> Divergence:
    """Relative RMS error and cosine of each chosen module's output in `low` against `high`.

    Both runs use deep copies of `model` (the caller's model is never cast or moved) and
    batch 0 of `source`. Forward only: divergence of activations, not of gradients.
    """

    dev = resolve_device(device, model)
    layout = layout or detect_layout(model, model_type)
    batch = source(0)
    stream_in = layout.blocks[0].name if layout.blocks and scope != "all" else None
    ref = _Copy(model, high, batch, dev)
    if layout.blocks and scope != "all":
        # the branches each block really adds (post-branch norms, post-LN encoders)
        layout = prove_layout(ref.model, layout, ref.forward).layout
    targets = [n for n, _ in divergence_targets(model, layout, scope)]
    points = _Points(targets, stream_in)
    kept, order = _reference_outputs(ref, points)
    del ref
    sums, numel = _sums_against(lambda: _Copy(model, low, batch, dev), points, kept)
    layers = [
        _layer(name, layout, order[i], sums[i], numel[i])
        for i, name in enumerate(points.names)
        if order[i] >= 0  # else it never ran
    ]
    layers.sort(key=lambda d: d.order)
    first = next(
        (d.name for d in layers if d.rel_err is not None and not (d.rel_err <= threshold)),
        None,  # nan/inf count as over the threshold
    )
    return Divergence(
        reference=high.label,
        other=low.label,
        reference_side=reference_side,
        threshold=threshold,
        scope=scope,
        layers=tuple(layers),
        first=first,
    )


class _Copy:
    """A deep copy of the caller's model in one precision, with batch 0 cast for it."""

    def __init__(self, model: nn.Module, p: Precision, batch: Batch, dev: torch.device) -> None:

        self.precision = p
        self.device = dev
        self.model = copy.deepcopy(model).eval()
        dt = TORCH_DTYPES[p.dtype]
        self.model.to(device=dev, dtype=dt)
        self.batch = cast_batch(batch, dev, dt)
        self.amp = TORCH_DTYPES[p.amp] if p.amp else None

    def forward(self) -> None:
        b = self.batch
        with torch.no_grad():
            if self.amp is None:
                self.model(*b.args, **b.kwargs)
            else:
                with torch.autocast(self.device.type, dtype=self.amp):
                    self.model(*b.args, **b.kwargs)


@dataclass(frozen=True)
class _Points:
    """The compared outputs: each target module's, then the stream's input (if any)."""

    targets: Sequence[str]
    stream_in: str | None

    @property
    def names(self) -> list[str]:
        return [*self.targets, *([f"{self.stream_in}:input"] if self.stream_in else [])]

    def hook(self, hooks: HookSet, m: nn.Module, on_output: Callable[[int, Any], None]) -> None:
        """Forward hooks on the chosen modules of copy `m` (+ the stream input)."""
        mods = dict(m.named_modules())
        for i, name in enumerate(self.targets):
            hooks.forward(mods[name], lambda _m, _a, out, i=i: on_output(i, out))
        if self.stream_in is not None:
            j = len(self.targets)

            def pre(_m: Any, args: Any, kwargs: dict[str, Any]) -> None:
                hidden = first_tensor(args)
                on_output(j, hidden if hidden is not None else first_tensor(kwargs))

            hooks.forward_pre(mods[self.stream_in], pre, with_kwargs=True)


def _reference_outputs(
    ref: _Copy, points: _Points
) -> tuple[list[list[torch.Tensor | None]], list[int]]:
    """Pass 1, the higher precision: every call's output (detached, fp32) per point, and
    each point's first-call index in execution order (-1: never ran)."""
    n = len(points.names)
    kept: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
    order = [-1] * n
    seen = [0]

    def keep(i: int, out: Any) -> None:
        t = first_tensor(out)
        if order[i] < 0:
            order[i], seen[0] = seen[0], seen[0] + 1
        kept[i].append(None if t is None else t.detach().float().clone())

    with HookSet() as hooks:
        points.hook(hooks, ref.model, keep)
        ref.forward()
    return kept, order


def _sums_against(
    make_low: Callable[[], _Copy], points: _Points, kept: list[list[torch.Tensor | None]]
) -> tuple[list[list[float]], list[int]]:
    """Pass 2, the lower precision: Σ(a−b)², Σa², Σab, Σb² per point against the kept
    outputs, reduced on the device (one host transfer), and the elements counted.

    The copy is made here (after the reference copy is gone) and freed before the
    transfer, as are the kept outputs: at most one copy is alive at a time."""
    low = make_low()
    n = len(points.names)
    acc = torch.zeros(n, 4, dtype=torch.float64, device=low.device)
    calls = [0] * n
    numel = [0] * n  # host-side: shapes are known without a device sync

    def reduce(i: int, out: Any) -> None:
        t = first_tensor(out)
        c = calls[i]
        calls[i] += 1
        if t is None or c >= len(kept[i]):
            return
        a = kept[i][c]
        if a is None or a.shape != t.shape:
            return
        x = t.detach().float()
        sums = [(a - x).square().sum(), a.square().sum(), (a * x).sum(), x.square().sum()]
        acc[i] += torch.stack(sums).to(torch.float64)
        numel[i] += a.numel()

    with HookSet() as hooks:
        points.hook(hooks, low.model, reduce)
        low.forward()
    del low
    kept.clear()  # free the reference outputs before the host transfer
    return acc.cpu().tolist(), numel  # the one host transfer


def _layer(name: str, layout: Layout, order: int, sums: list[float], n: int) -> LayerDivergence:
    """One point's relative error and cosine from its four sums over `n` elements."""
    err2, aa, ab, bb = sums
    rel = math.sqrt(err2 / aa) if n and aa > 0 else (0.0 if n and err2 == 0 else None)
    if n and not math.isfinite(err2):
        rel = math.inf
    cos = ab / math.sqrt(aa * bb) if n and aa > 0 and bb > 0 else None
    if n and not all(math.isfinite(v) for v in (ab, bb)):
        cos = float("nan")  # Inf/NaN in the lower precision: no angle to speak of
    is_input = name.endswith(":input")
    return LayerDivergence(
        name=name,
        role="stream" if is_input else layout.role(name),
        block=0 if is_input else layout.block_of.get(name),
        order=order,
        rel_err=rel,
        cosine=cos,
        rms=math.sqrt(aa / n) if n else None,
    )
