"""Two Reports side by side, and the precision-divergence pass (same weights, two dtypes).

The comparison itself is pure: it matches the layers, stream points and branches of two
Reports, takes ratios (always B ÷ A), splits findings into A only / B only / both and
words a one-line verdict. No torch is imported for that.

`precision_divergence` is the one part that runs a model: a ratio of two RMS values
cannot say whether bf16 computes the *same* activations as fp32, only that they have the
same scale. It runs the higher-precision model once, keeping each chosen module's output
(detached, fp32) for one batch, then a cast deep copy with hooks that reduce
Σ(a−b)², Σa², Σab, Σb² against the kept tensors on the device; one host transfer at the
end. Memory: one batch of the chosen outputs (meant for the small models one compares).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from actscan import __version__
from actscan.compare.steps import StepsComparison, compare_steps
from actscan.numfmt import num
from actscan.records import Finding, LayerRecord, Layout, ModelInfo, StreamPoint
from actscan.report.output import dumps, json_safe
from actscan.report.report import SCHEMA_VERSION, Report

if TYPE_CHECKING:
    from torch import nn

    from actscan.measure.inputs import InputSource

# Mantissa bits: "higher precision" is the side with more of them (fp16 beats bf16).
_MANTISSA = {"fp32": 23, "fp16": 10, "bf16": 7}


# -- records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerPair:
    """One layer of A and its partner in B (matched by name, else by structure)."""

    name_a: str
    name_b: str
    role: str
    block: int | None
    matched_by: str  # "name" | "structure"
    rms_a: float | None
    rms_b: float | None
    ratio: float | None  # rms_b / rms_a
    grad_rms_a: float | None
    grad_rms_b: float | None
    grad_ratio: float | None


@dataclass(frozen=True)
class StreamPair:
    """The residual stream at the same k in A and B (None where one side has no point)."""

    k: int
    block: int | None
    name_a: str | None
    name_b: str | None
    rms_a: float | None
    rms_b: float | None
    ratio: float | None
    grad_rms_a: float | None
    grad_rms_b: float | None
    grad_ratio: float | None


@dataclass(frozen=True)
class BranchPair:
    block: int
    kind: str  # "attn" | "mlp"
    name_a: str | None
    name_b: str | None
    ratio_a: float | None  # branch RMS ÷ entering stream RMS, side A
    ratio_b: float | None
    rms_ratio: float | None  # branch RMS B ÷ A


@dataclass(frozen=True)
class FindingDiff:
    a_only: tuple[Finding, ...] = ()
    b_only: tuple[Finding, ...] = ()
    both: tuple[tuple[Finding, Finding], ...] = ()


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


@dataclass(frozen=True)
class LayerDivergence:
    """Outputs of one module in the lower precision against the higher one (one batch)."""

    name: str
    role: str
    block: int | None
    order: int  # first-call index in execution order
    rel_err: float | None  # ‖a − b‖ / ‖a‖, a = higher precision
    cosine: float | None  # ⟨a, b⟩ / (‖a‖ ‖b‖)
    rms: float | None  # RMS of the reference output


@dataclass(frozen=True)
class Divergence:
    reference: str  # label of the higher-precision side ("fp32")
    other: str  # label of the lower-precision side ("bf16")
    reference_side: str  # "a" | "b"
    threshold: float
    scope: str  # "stream+branches" | "all"
    layers: tuple[LayerDivergence, ...]
    first: str | None  # first layer (execution order) whose rel_err exceeds threshold

    @property
    def worst(self) -> LayerDivergence | None:
        finite = [d for d in self.layers if d.rel_err is not None]
        return max(finite, key=lambda d: _sortable(d.rel_err), default=None)

    def layer(self, name: str) -> LayerDivergence:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(name)


@dataclass(frozen=True)
class Comparison:
    a: Report
    b: Report
    label_a: str
    label_b: str
    layers: tuple[LayerPair, ...]
    stream: tuple[StreamPair, ...]
    branches: tuple[BranchPair, ...]
    unmatched_a: tuple[str, ...]
    unmatched_b: tuple[str, ...]
    findings: FindingDiff
    divergence: Divergence | None = None
    verdict: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (stream name, its points paired by k) per residual stream both sides have, when a
    # side has several (encoder-decoder); `stream` is the primary (decoder) one's
    streams: tuple[tuple[str, tuple[StreamPair, ...]], ...] = ()
    # both sides took optimizer steps (`--steps N`): their dynamics side by side
    steps: StepsComparison | None = None

    @property
    def match(self) -> str:
        return "name" if all(p.matched_by == "name" for p in self.layers) else "name+structure"

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document of `actscan compare` (docs/interface-extensions.md)."""

        def finding(f: Finding) -> dict[str, Any]:
            return {**asdict(f), "severity": f.severity.value, "layers": list(f.layers)}

        div = None
        if self.divergence is not None:
            d = self.divergence
            div = {
                "reference": d.reference, "other": d.other, "reference_side": d.reference_side,
                "threshold": d.threshold, "scope": d.scope, "first": d.first,
                "layers": [asdict(x) for x in d.layers],
            }  # fmt: skip
        return json_safe(
            {
                "schema_version": SCHEMA_VERSION,
                "kind": "compare",
                "tool": {"name": "actscan", "version": __version__},
                "labels": {"a": self.label_a, "b": self.label_b},
                "match": self.match,
                "stream": [asdict(p) for p in self.stream],
                "streams": [
                    {"name": name, "points": [asdict(p) for p in pairs]}
                    for name, pairs in self.streams
                ],
                "branches": [asdict(p) for p in self.branches],
                "layers": [asdict(p) for p in self.layers],
                "unmatched": {"a": list(self.unmatched_a), "b": list(self.unmatched_b)},
                "summary": {"a": dict(self.a.summary), "b": dict(self.b.summary)},
                "findings": {
                    "a_only": [finding(f) for f in self.findings.a_only],
                    "b_only": [finding(f) for f in self.findings.b_only],
                    "both": [{"a": finding(x), "b": finding(y)} for x, y in self.findings.both],
                },
                "divergence": div,
                **({"steps": asdict(self.steps)} if self.steps is not None else {}),
                "verdict": self.verdict,
                "notes": list(self.notes),
                "a": self.a.to_dict(),
                "b": self.b.to_dict(),
            }
        )

    def to_json(self, indent: int | None = 2) -> str:
        return dumps(self.to_dict(), indent=indent)


# -- numbers --------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    """b ÷ a; 1 when both are 0 (nothing changed), inf when only a is 0, None if missing."""
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return float("nan")
    if a == 0:
        return 1.0 if b == 0 else math.copysign(math.inf, b)
    return b / a


def _sortable(x: float | None) -> float:
    if x is None or math.isnan(x):
        return math.inf  # non-finite divergence is the worst there is
    return x


# -- matching ---------------------------------------------------------------------------------
_LINEAR_TYPES = ("Linear", "Conv1D", "Conv1d")


def _kind(rec: LayerRecord) -> str:
    """Coarse module kind that survives renaming: projections meet projections."""
    if rec.type.endswith(_LINEAR_TYPES):
        return "linear"
    return "dropout" if "Dropout" in rec.type else "module"


def _structural_keys(layers: Sequence[LayerRecord]) -> dict[str, tuple[Any, ...]]:
    """(role, block, nesting depth inside the block, kind, position) per layer name.

    Positions follow execution order, so `blocks.3.mlp.down` in one model meets
    `transformer.h.3.mlp.c_proj` in another: both the 2nd projection, one level inside
    block 3's MLP branch.
    """
    block_names = {r.block: r.name for r in layers if r.role == "stream" and r.block is not None}
    groups: dict[tuple[Any, ...], list[tuple[int, int, str]]] = defaultdict(list)
    for i, r in enumerate(layers):
        prefix = block_names.get(r.block)
        depth = None
        if prefix is not None and r.name.startswith(prefix + "."):
            depth = r.name[len(prefix) + 1 :].count(".") + 1
        groups[(r.role, r.block, depth, _kind(r))].append(
            (r.order if r.order >= 0 else 10**9, i, r.name)
        )
    keys: dict[str, tuple[Any, ...]] = {}
    for group, items in groups.items():
        for pos, (_, _, name) in enumerate(sorted(items)):
            keys[name] = (*group, pos)
    return keys


def match_layers(
    a: Sequence[LayerRecord], b: Sequence[LayerRecord]
) -> tuple[tuple[LayerPair, ...], tuple[str, ...], tuple[str, ...]]:
    """Pairs by exact name first; the rest by structure (role, block, nesting, kind,
    position); leftovers are unmatched."""
    by_name_b = {r.name: r for r in b}
    pairs: list[tuple[LayerRecord, LayerRecord, str]] = []
    left_a: list[LayerRecord] = []
    for r in a:
        partner = by_name_b.pop(r.name, None)
        if partner is None:
            left_a.append(r)
        else:
            pairs.append((r, partner, "name"))
    keys_a, keys_b = _structural_keys(a), _structural_keys(b)
    left_b = {keys_b[r.name]: r for r in b if r.name in by_name_b}
    unmatched_a: list[str] = []
    for r in left_a:
        partner = left_b.pop(keys_a[r.name], None)
        if partner is None:
            unmatched_a.append(r.name)
        else:
            pairs.append((r, partner, "structure"))
    order_a = {r.name: i for i, r in enumerate(a)}
    pairs.sort(key=lambda t: order_a[t[0].name])
    out = tuple(
        LayerPair(
            name_a=x.name, name_b=y.name, role=x.role, block=x.block, matched_by=how,
            rms_a=x.rms, rms_b=y.rms, ratio=ratio(x.rms, y.rms), grad_rms_a=x.grad_rms,
            grad_rms_b=y.grad_rms, grad_ratio=ratio(x.grad_rms, y.grad_rms),
        )
        for x, y, how in pairs
    )  # fmt: skip
    unmatched_b = tuple(r.name for r in b if r.name in {v.name for v in left_b.values()})
    return out, tuple(unmatched_a), unmatched_b


def match_stream(a: Sequence[StreamPoint], b: Sequence[StreamPoint]) -> tuple[StreamPair, ...]:
    """Stream points paired by k (residual additions so far): the depth axis both share."""
    pa, pb = {p.k: p for p in a}, {p.k: p for p in b}
    out = []
    for k in sorted(pa.keys() | pb.keys()):
        x, y = pa.get(k), pb.get(k)
        out.append(
            StreamPair(
                k=k, block=(x or y).block,  # type: ignore[union-attr]
                name_a=x.name if x else None, name_b=y.name if y else None,
                rms_a=x.rms if x else None, rms_b=y.rms if y else None,
                ratio=ratio(x.rms, y.rms) if x and y else None,
                grad_rms_a=x.grad_rms if x else None, grad_rms_b=y.grad_rms if y else None,
                grad_ratio=ratio(x.grad_rms, y.grad_rms) if x and y else None,
            )
        )  # fmt: skip
    return tuple(out)


def match_streams(a: Report, b: Report) -> tuple[tuple[str, tuple[StreamPair, ...]], ...]:
    """Each residual stream both reports have, its points paired by (stream, k)."""
    sb = {s.name: s for s in b.streams}
    return tuple(
        (s.name, match_stream(s.points, sb[s.name].points)) for s in a.streams if s.name in sb
    )


def match_branches(a: Report, b: Report) -> tuple[BranchPair, ...]:
    ba = {(r.block, r.kind): r for r in a.branches}
    bb = {(r.block, r.kind): r for r in b.branches}
    out = []
    for key in sorted(ba.keys() | bb.keys(), key=lambda t: (t[0], t[1] != "attn")):
        x, y = ba.get(key), bb.get(key)
        out.append(
            BranchPair(
                block=key[0], kind=key[1], name_a=x.name if x else None,
                name_b=y.name if y else None, ratio_a=x.ratio if x else None,
                ratio_b=y.ratio if y else None,
                rms_ratio=ratio(x.rms, y.rms) if x and y else None,
            )
        )  # fmt: skip
    return tuple(out)


def diff_findings(
    a: Sequence[Finding], b: Sequence[Finding], a_to_b: Mapping[str, str]
) -> FindingDiff:
    """Same check on both sides = "both" (severity may differ). Within a check, findings
    whose layers map onto each other pair first, the rest in order."""
    paired: dict[int, Finding] = {}  # index in a → its partner in b
    b_left = list(b)
    for exact in (True, False):  # all exact layer matches first, then any of the check
        for i, fa in enumerate(a):
            if i in paired:
                continue
            mapped = tuple(a_to_b.get(n, n) for n in fa.layers)
            hit = next(
                (
                    fb
                    for fb in b_left
                    if fb.check == fa.check and (fb.layers == mapped or not exact)
                ),
                None,
            )
            if hit is not None:
                b_left.remove(hit)
                paired[i] = hit
    both = [(fa, paired[i]) for i, fa in enumerate(a) if i in paired]
    a_only = [fa for i, fa in enumerate(a) if i not in paired]
    return FindingDiff(a_only=tuple(a_only), b_only=tuple(b_left), both=tuple(both))


def compare_reports(
    a: Report,
    b: Report,
    *,
    label_a: str = "A",
    label_b: str = "B",
    divergence: Divergence | None = None,
) -> Comparison:
    """Everything the compare table shows, computed once."""
    layers, un_a, un_b = match_layers(a.layers, b.layers)
    stream = match_stream(a.stream, b.stream)
    streams = match_streams(a, b)
    a_to_b = {p.name_a: p.name_b for p in layers}
    for pairs in (stream, *(ps for _, ps in streams)):
        a_to_b.update({p.name_a: p.name_b for p in pairs if p.name_a and p.name_b})
    findings = diff_findings(a.findings, b.findings, a_to_b)
    notes: list[str] = []
    if un_a or un_b:
        notes.append(
            f"{len(un_a)} layer(s) of A and {len(un_b)} of B have no partner "
            "(matched by name, then by role, block and position in the block)"
        )
    cmp = Comparison(
        a=a, b=b, label_a=label_a, label_b=label_b, layers=layers, stream=stream,
        branches=match_branches(a, b), unmatched_a=un_a, unmatched_b=un_b, findings=findings,
        divergence=divergence, notes=tuple(notes), streams=streams,
        steps=compare_steps(a.dynamics, b.dynamics, label_a=label_a, label_b=label_b)
        if a.dynamics is not None and b.dynamics is not None else None,
    )  # fmt: skip
    return replace(cmp, verdict=verdict(cmp))


# -- verdict ---------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    if x is None or isinstance(x, str) or not math.isfinite(x):
        return num(x)
    return f"{100 * x:.2g}%"


def _badness(findings: Sequence[Finding]) -> tuple[int, int]:
    """(worst severity rank, count at that rank); (-1, 0) without findings."""
    if not findings:
        return -1, 0
    worst = max(f.severity.rank for f in findings)
    return worst, sum(1 for f in findings if f.severity.rank == worst)


def verdict(cmp: Comparison) -> str:
    """One line: what changed from A to B, in the terms a user acts on."""
    d = cmp.divergence
    if d is not None:
        lo, hi = d.other, d.reference
        if d.first is not None:
            rec = d.layer(d.first)
            return (
                f"{lo} departs from {hi} by more than {_pct(d.threshold)} (relative RMS error) "
                f"from {d.first} on ({_pct(rec.rel_err)}, cos {num(rec.cosine)}): "
                f"run it in the precision you will actually train in."
            )
        w = d.worst
        where = f" (largest {_pct(w.rel_err)} at {w.name})" if w else ""
        return (
            f"{lo} stays within {_pct(d.threshold)} of {hi} (relative RMS error) at every "
            f"measured layer{where}; still, run it in the precision you will actually train in."
        )
    same = all(p.ratio == 1.0 for p in cmp.stream) and all(
        p.ratio == 1.0 for p in cmp.layers if p.ratio is not None
    )
    fd = cmp.findings
    if same and not fd.a_only and not fd.b_only and not cmp.unmatched_a and not cmp.unmatched_b:
        return "A and B measure the same: every matched ratio is 1 and the findings agree."
    ga, gb = cmp.a.summary.growth, cmp.b.summary.growth
    parts = []
    if isinstance(ga, float) and isinstance(gb, float) and ga > 0 and gb > 0:
        flatter = "B" if abs(math.log(gb)) < abs(math.log(ga)) else "A"
        parts.append(
            f"{flatter} keeps the stream flatter (growth over the embedding "
            f"×{num(ga)} in A, ×{num(gb)} in B)"
        )
    last = next((p for p in reversed(cmp.stream) if p.ratio is not None), None)
    if last is not None:
        parts.append(f"final stream RMS B/A ×{num(last.ratio)}")
    checks = lambda fs: ", ".join(dict.fromkeys(f.check for f in fs))  # noqa: E731
    if fd.a_only:
        parts.append(f"B clears {len(fd.a_only)} finding(s) of A ({checks(fd.a_only)})")
    if fd.b_only:
        parts.append(f"B adds {len(fd.b_only)} ({checks(fd.b_only)})")
    if not fd.a_only and not fd.b_only:
        parts.append("same findings on both sides" if fd.both else "no findings on either side")
    ba, bb = _badness(cmp.a.findings), _badness(cmp.b.findings)
    if ba != bb:
        parts.append(f"{'B' if bb < ba else 'A'} is the healthier side")
    return "; ".join(parts) + "."


# -- the precision-divergence pass ------------------------------------------------------------
def default_inputs(info: ModelInfo, batch: int, seq_len: int, seed: int) -> InputSource:
    """The random token ids scan() invents for `info` (same seed → the same ids)."""
    from actscan.errors import UsageError
    from actscan.measure.inputs import token_source

    if not (info.vocab_size and info.task in ("causal-lm", "encoder")):
        raise UsageError("cannot invent inputs for this model: pass --input or --input-shape")
    return token_source(
        info.vocab_size, batch, seq_len, seed, mask=info.task == "encoder",
        as_kwargs=info.family != "actscan-gpt",
    )  # fmt: skip


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
    import torch

    from actscan.layout.detect import detect_layout
    from actscan.measure.prepare import TORCH_DTYPES, cast_batch, resolve_device
    from actscan.measure.recorder import first_tensor

    dev = resolve_device(device, model)
    layout = layout or detect_layout(model, model_type)
    batch = source(0)
    stream_in = layout.blocks[0].name if layout.blocks and scope != "all" else None

    def prepared(p: Precision) -> tuple[nn.Module, Any]:
        m = copy.deepcopy(model).eval()
        dt = TORCH_DTYPES[p.dtype]
        m.to(device=dev, dtype=dt)
        return m, cast_batch(batch, dev, dt)

    def run(p: Precision, m: nn.Module, b: Any) -> None:
        ctx = torch.autocast(dev.type, dtype=TORCH_DTYPES[p.amp]) if p.amp else None
        with torch.no_grad():
            if ctx is None:
                m(*b.args, **b.kwargs)
            else:
                with ctx:
                    m(*b.args, **b.kwargs)

    m_hi, b_hi = prepared(high)
    if layout.blocks and scope != "all":
        from actscan.layout.proof import prove_layout

        # the branches each block really adds (post-branch norms, post-LN encoders)
        layout = prove_layout(m_hi, layout, lambda m=m_hi, b=b_hi: run(high, m, b)).layout
    targets = divergence_targets(model, layout, scope)
    names = [n for n, _ in targets] + ([f"{stream_in}:input"] if stream_in else [])

    def hooked(m: nn.Module, on_output: Callable[[int, Any], None]) -> list[Any]:
        """Forward hooks on the chosen modules of copy `m` (+ the stream input)."""
        mods = dict(m.named_modules())
        handles = []
        for i, (name, _) in enumerate(targets):
            handles.append(
                mods[name].register_forward_hook(lambda _m, _a, out, i=i: on_output(i, out))
            )
        if stream_in is not None:
            j = len(targets)

            def pre(_m: Any, args: Any, kwargs: dict[str, Any]) -> None:
                hidden = first_tensor(args)
                on_output(j, hidden if hidden is not None else first_tensor(kwargs))

            handles.append(mods[stream_in].register_forward_pre_hook(pre, with_kwargs=True))
        return handles

    # Pass 1: the higher precision; keep every call's output (detached, fp32).
    kept: list[list[torch.Tensor | None]] = [[] for _ in names]
    order: list[int] = [-1] * len(names)
    seen = [0]

    def keep(i: int, out: Any) -> None:
        t = first_tensor(out)
        if order[i] < 0:
            order[i], seen[0] = seen[0], seen[0] + 1
        kept[i].append(None if t is None else t.detach().float().clone())

    handles = hooked(m_hi, keep)
    try:
        run(high, m_hi, b_hi)
    finally:
        for h in handles:
            h.remove()
    del m_hi

    # Pass 2: the lower precision; reduce against the kept tensors on the device.
    acc = torch.zeros(len(names), 4, dtype=torch.float64, device=dev)
    calls = [0] * len(names)
    numel = [0] * len(names)  # host-side: shapes are known without a device sync

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

    m_lo, b_lo = prepared(low)
    handles = hooked(m_lo, reduce)
    try:
        run(low, m_lo, b_lo)
    finally:
        for h in handles:
            h.remove()
    del m_lo
    kept.clear()  # free the reference outputs before the host transfer
    host = acc.cpu().tolist()  # the one host transfer

    layers = []
    for i, name in enumerate(names):
        if order[i] < 0:
            continue  # never ran
        err2, aa, ab, bb = host[i]
        n = numel[i]
        rel = math.sqrt(err2 / aa) if n and aa > 0 else (0.0 if n and err2 == 0 else None)
        if n and not math.isfinite(err2):
            rel = math.inf
        cos = ab / math.sqrt(aa * bb) if n and aa > 0 and bb > 0 else None
        if n and not all(math.isfinite(v) for v in (ab, bb)):
            cos = float("nan")  # Inf/NaN in the lower precision: no angle to speak of
        is_input = name.endswith(":input")
        layers.append(
            LayerDivergence(
                name=name, role="stream" if is_input else layout.role(name),
                block=0 if is_input else layout.block_of.get(name), order=order[i],
                rel_err=rel, cosine=cos, rms=math.sqrt(aa / n) if n else None,
            )
        )  # fmt: skip
    layers.sort(key=lambda d: d.order)
    first = next(
        (
            d.name
            for d in layers
            if d.rel_err is not None and not (d.rel_err <= threshold)  # nan/inf count
        ),
        None,
    )
    return Divergence(
        reference=high.label, other=low.label, reference_side=reference_side,
        threshold=threshold, scope=scope, layers=tuple(layers), first=first,
    )  # fmt: skip
