"""`--formats`: how every GEMM of the recorded pass would fare in FP8, MXFP8 or NVFP4.

During the recorded forward a `TorchFunctionMode` sees each contraction call (the calls
`measure/gemms.py` parses: nn.Linear's F.linear, matmul / `@` / bmm, addmm (GPT-2's
Conv1D), einsum, grouped-mm; and `F.scaled_dot_product_attention`, whose QKᵀ and PV are
two GEMMs, the probabilities recomputed for the cast only), casts its input and weight in
each chosen format (`measure/casts.py`) and, with backward on, puts a tensor hook on its
output that casts the output gradient. Every figure is summed into a device tensor per
(GEMM, operand, format); `result()` reads them all in one transfer after the pass. A
weight is cast once per pass (it does not change within it): once per GEMM, and a weight
several GEMMs share (a tied embedding and head, one Linear under two names) once for all
of them, its figures kept by its view and version; so is an input the next GEMM reads
again (a normed input into q, k and v or gate and up projections).

A GEMM is named by the module that runs it (the innermost one on the call stack): a
Linear is its own path; a module whose forward runs several contractions (an attention
module's QKᵀ and PV, a fused-experts module) names each `path:op#i`, i its rank within one
call of the module; a module's SDPA call names `path.sdpa.qk` and `path.sdpa.pv`. Side
computations of actscan's own probes run `aside()` (and, with backward on, under
no_grad), and are not GEMMs of the model.

Off (no formats), nothing of this runs: no mode, no hooks.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from actscan.measure.casts import (
    FIGURES,
    FORMATS,
    FP8,
    N_SUMS,
    Recipe,
    Scratch,
    operand_figures,
    quantize_all,
)
from actscan.measure.gemms import (
    GEMM_NAMES,
    SDPA_NAME,
    Gemm,
    Operand,
    Sdpa,
    is_aside,
    parse_gemm,
    parse_sdpa,
    storage_key,
)
from actscan.measure.hooks import HookSet, Watcher
from actscan.records import LowPrecRecord

__all__ = ["Delayed", "LowPrecWatch", "delayed_steps", "low_precision_records", "lowprec_watch"]

Key = tuple[str, int, str]  # (module path, rank within one call of the module, op)
# actscan.distributed.merge.merge_state's shape: (state, {attribute: op}, device), in place
MergeState = Callable[[Any, dict[str, str], torch.device], None]


def _from_rows(
    q: torch.Tensor, t: torch.Tensor, contract: Sequence[int], block: int
) -> torch.Tensor:
    """`_as_rows`' inverse: Q(t) laid out as (rows, K) back in `t`'s shape."""
    if block == 0 or list(contract) == [t.dim() - 1]:
        return q.reshape(t.shape)
    order = [d for d in range(t.dim()) if d not in contract] + list(contract)
    q = q.reshape([int(t.shape[d]) for d in order])
    return q.permute(*sorted(range(t.dim()), key=order.__getitem__))


def _as_rows(t: torch.Tensor, contract: Sequence[int], block: int) -> torch.Tensor:
    """`t` as (rows, K), K the contracted dims flattened last; a per-tensor recipe needs no
    layout (one flat row, no copy)."""
    if block == 0:
        return t.reshape(1, -1)
    keep = [d for d in range(t.dim()) if d not in contract]
    k = math.prod(int(t.shape[d]) for d in contract)
    if list(contract) == [t.dim() - 1]:
        return t.reshape(-1, k)
    return t.permute(*keep, *contract).reshape(-1, k)


@dataclass
class _Sums:
    """One (GEMM, operand, format)'s figures: sums (and a max) on the device."""

    acc: torch.Tensor
    calls: int = 0

    def add(self, figures: torch.Tensor) -> None:
        self.acc[:N_SUMS] += figures[:N_SUMS].double()
        self.acc[N_SUMS:] = torch.maximum(self.acc[N_SUMS:], figures[N_SUMS:].double())
        self.calls += 1


@dataclass
class _Frame:
    """A module being run: its path and how many GEMMs its call has run so far."""

    path: str
    gemms: int = 0
    sdpa: int = 0  # its scaled_dot_product_attention calls (named apart: `path.sdpa.qk`)
    module: nn.Module | None = None  # its own parameters, as they are while it runs


# the delayed figures' sums per (GEMM, operand), in this order
DELAYED = ("nonzero", "flushed", "saturated", "err", "sq", "grew", "steps")


@dataclass
class Delayed:
    """FP8 delayed scaling across `--steps` (Transformer Engine's DelayedScaling, amax
    history longer than the run, "max" over it, margin 0): each step's cast of an operand
    takes its scale from the largest amax of the previous steps (step 0: the recorded
    pass), so an operand whose amax grows past that history saturates. Per (GEMM,
    operand), on the device: the history's amax, the fp8 figures of every step's cast
    under it and whether the amax grew past it. `names`: the records' GEMM names of the
    step-0 pass's keys."""

    history: dict[tuple[Key, str], torch.Tensor] = field(default_factory=dict)
    sums: dict[tuple[Key, str], torch.Tensor] = field(default_factory=dict)
    names: dict[Key, str] = field(default_factory=dict)
    steps: bool = False  # False while the recorded pass seeds the history
    # data parallel (a distributed run's ranks): the history is reduced (MAX) over the
    # ranks before every step's forward, as TE reduces the amax over the group, and the
    # figures SUM over the ranks' rows at the end; None: one process
    merge: MergeState | None = None
    device: torch.device | None = None
    unmerged: bool = False  # the ranks cast different GEMMs: each kept its own history

    def sync(self) -> None:
        """Before a step's forward: every rank's history becomes the ranks' MAX (their
        step-0 rows, then each step's inputs and gradients), so each rank casts its rows
        under the scale one process would use for the whole batch."""
        # every rank takes the same branches here: a collective one rank skipped would hang
        if self.merge is None or self.device is None or self.unmerged:
            return
        keys = sorted(self.history, key=repr)
        if not _same_keys(keys, self.merge, self.device):
            self.unmerged = True
            return
        if not keys:
            return
        st = _Merged()
        st.maxes = torch.stack([self.history[k].to(self.device, torch.float64) for k in keys])
        self.merge(st, {"maxes": "max"}, self.device)
        for i, k in enumerate(keys):
            self.history[k] = st.maxes[i].to(self.history[k])

    def seed(self, key: Key, operand: str, x: torch.Tensor) -> None:
        """Step 0: the operand's amax joins the history."""
        amax = _amax(x)
        k = (key, operand)
        self.history[k] = amax if k not in self.history else torch.maximum(self.history[k], amax)

    def cast(self, key: Key, operand: str, x: torch.Tensor) -> None:
        """A step's cast of the operand under the history's scale; then its amax joins
        the history (per call: a GEMM called twice in a step sees its first call's)."""
        k = (key, operand)
        hist = self.history.get(k)
        amax = _amax(x)
        if hist is None:  # first seen during the steps: it only seeds
            self.history[k] = amax
            return
        f = operand_figures(x.reshape(1, -1), [FP8], operand, ref=hist)[0]
        fig = dict(zip(FIGURES, f, strict=True))
        one = torch.ones((), dtype=torch.float64, device=x.device)
        grew = (amax > hist).double()
        vec = torch.stack([fig[n] for n in DELAYED[:5]] + [grew, one])
        self.sums[k] = vec if k not in self.sums else self.sums[k] + vec
        self.history[k] = torch.maximum(hist, amax)

    def merged(self, records: Sequence[LowPrecRecord]) -> tuple[LowPrecRecord, ...]:
        """The fp8 records with their delayed figures (one transfer; a distributed run's
        sums merged over the ranks first)."""
        keys = list(self.sums)
        if self.merge is not None and self.device is not None and not self.unmerged:
            keys.sort(key=repr)  # before any early return: every rank joins the collectives
            if not _same_keys(keys, self.merge, self.device):
                self.unmerged = True
            elif keys:
                st = _Merged()
                st.sums = torch.stack([self.sums[k][:5].to(self.device) for k in keys])
                st.maxes = torch.stack([self.sums[k][5:].to(self.device) for k in keys])
                self.merge(st, {"sums": "sum", "maxes": "max"}, self.device)
                for i, k in enumerate(keys):
                    self.sums[k] = torch.cat([st.sums[i], st.maxes[i]]).to(self.sums[k])
        if not self.sums:
            return tuple(records)
        values = torch.stack([self.sums[k] for k in keys]).cpu().tolist()  # the one transfer
        by = {(self.names.get(key), operand): dict(zip(DELAYED, v, strict=True))
              for (key, operand), v in zip(keys, values, strict=True)}  # fmt: skip
        out = []
        for r in records:
            d = by.get((r.gemm, r.operand)) if r.format == "fp8" else None
            if d is not None and d["steps"] > 0:
                r = replace(
                    r,
                    delayed_underflow=_ratio(d["flushed"], d["nonzero"]),
                    delayed_saturation=_ratio(d["saturated"], d["nonzero"]),
                    delayed_error=_ratio(d["err"], d["sq"]),
                    amax_grew=d["grew"] > 0,
                    steps=int(d["steps"]),
                )
            out.append(r)
        return tuple(out)


def _weight_view(t: torch.Tensor, contract: Sequence[int]) -> tuple[Any, ...] | None:
    """What a weight's figures depend on: its storage, the view of it the GEMM reads, the
    contracted dims and the version (an in-place update makes it another weight)."""
    key = storage_key(t)
    if key is None:
        return None
    return (key, t.storage_offset(), tuple(t.shape), t.stride(), tuple(contract), t.dtype,
            t._version)  # fmt: skip


def _amax(x: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(x.detach().float().reshape(-1))
    return torch.maximum(-lo, hi)


@dataclass
class LowPrecWatch:
    """The state of one recorded pass's low-precision watch (see the module docstring)."""

    recipes: tuple[Recipe, ...]
    backward: bool
    hooks: HookSet
    params: set[int]
    stack: list[_Frame] = field(default_factory=list)
    sums: dict[tuple[Key, str, str], _Sums] = field(default_factory=dict)
    seen_weights: set[tuple[Key, int]] = field(default_factory=set)
    ops: dict[Key, tuple[str, ...]] = field(default_factory=dict)  # operand names per GEMM
    gemm_error: bool = False  # --gemm-error: each forward GEMM's output error per format
    # (GEMM, format) → [‖Q(X)Q(W)ᵀ − XWᵀ‖², ‖XWᵀ‖²] summed over calls, on the device
    output_sums: dict[tuple[Key, str], torch.Tensor] = field(default_factory=dict)
    delayed: Delayed | None = None  # --steps with fp8: seeds it (step 0) or casts by it
    # the casts' buffers on CPU, kept from operand to operand through the pass (fresh ones
    # per operand fault their pages in; on a GPU the caching allocator keeps them)
    scratch: Scratch = field(default_factory=Scratch)
    # a weight's figures by its view (`_weight_view`): a weight two GEMMs share (tied, or
    # the same Linear under two names) is cast once per pass
    weight_figures: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    # the last input's (view, tensor, figures): the same activation read by the next GEMM
    # (q/k/v or gate/up projections of one normed input) is cast once. The tensor is kept
    # so that its storage, part of the view's key, cannot be freed and reused meanwhile.
    last_input: tuple[tuple[Any, ...], torch.Tensor, torch.Tensor] | None = None

    def _fold(
        self, key: Key, operand: str, t: torch.Tensor, contract: Sequence[int], *,
        figures: bool = True,
    ) -> list[torch.Tensor] | None:  # fmt: skip
        """Fold the figures of `t`'s casts (`figures`); with `--gemm-error`, return each
        recipe's Q(t) in `t`'s shape."""
        if not t.is_floating_point() or t.numel() == 0 or t.is_complex():
            return None
        if t.dim() == 0:  # a dot product's scalar gradient
            t, contract = t.reshape(1), [0]
        if self.delayed is not None:
            with torch.no_grad():
                if self.delayed.steps:  # a step's cast: nothing else
                    self.delayed.cast(key, operand, t)
                    return None
                self.delayed.seed(key, operand, t)
        block = max(r.block for r in self.recipes)
        casts: list[torch.Tensor] | None = [] if self.gemm_error else None
        with torch.no_grad():
            rows = _as_rows(t.detach(), contract, block)
            if not figures:  # a weight already folded: only its casts
                qs = quantize_all(rows, self.recipes, operand)
                return [_from_rows(q, t, contract, block) for q in qs]
            shared = operand in ("weight", "input") and casts is None
            view = _weight_view(t, contract) if shared else None
            cast = None
            if view is not None and operand == "weight":
                cast = self.weight_figures.get(view)
            elif view is not None and self.last_input is not None and self.last_input[0] == view:
                cast = self.last_input[2]
            if cast is None:
                scratch = self.scratch if rows.device.type == "cpu" else None
                cast = operand_figures(rows, self.recipes, operand, casts=casts, scratch=scratch)
                if view is not None and operand == "weight":
                    self.weight_figures[view] = cast
                elif view is not None:
                    self.last_input = (view, t, cast)
            for r, f in zip(self.recipes, cast, strict=True):
                slot = self.sums.get((key, operand, r.name))
                if slot is None:
                    acc = torch.zeros(len(FIGURES), dtype=torch.float64, device=t.device)
                    slot = self.sums[(key, operand, r.name)] = _Sums(acc)
                slot.add(f)
        return None if casts is None else [_from_rows(q, t, contract, block) for q in casts]

    def _output_error(self, key: Key, gemm: Gemm, casts: Sequence[list[torch.Tensor]]) -> None:
        """`--gemm-error`: the GEMM redone on every recipe's Q(operands), against the same
        GEMM of the operands themselves in fp32 (no bias: it is added in high precision)."""
        with torch.no_grad():
            ref = gemm.product([o.tensor.detach().float() for o in gemm.operands])
            if ref is None:
                return
            ref_sq = ref.square().sum()
            for i, r in enumerate(self.recipes):
                out = gemm.product([c[i] for c in casts])
                if out is None:
                    return
                sums = torch.stack([(out - ref).square().sum(), ref_sq]).double()
                slot = self.output_sums.get((key, r.name))
                if slot is None:
                    self.output_sums[(key, r.name)] = sums
                else:
                    slot += sums

    def _is_param(self, t: torch.Tensor) -> bool:
        """A parameter of the model, or of the module running: FSDP2 swaps a module's
        parameters for their gathered, unsharded tensors while it runs (new storage,
        not the sharded one the watch saw at its start), as GPT-2's Conv1D reads them."""
        key = storage_key(t)
        if key is None:
            return False
        if key in self.params:
            return True
        mod = self._frame().module
        own = mod._parameters.values() if mod is not None else ()
        return any(p is not None and storage_key(p) == key for p in own)

    def _names(self, operands: Sequence[Operand], op: str) -> tuple[str, ...]:
        if op == "linear" and len(operands) == 2:
            return ("input", "weight")  # by position: no parameter lookup on this path
        is_param = [self._is_param(o.tensor) for o in operands]
        if len(operands) == 2 and sum(is_param) == 1:
            return tuple("weight" if p else "input" for p in is_param)
        return ("lhs", "rhs", "third")[: len(operands)]  # an einsum's further operands: not cast

    def _cast_operands(self, key: Key, gemm: Gemm, names: Sequence[str]) -> None:
        """Fold each operand's casts; a weight only the first time this GEMM sees it."""
        self.ops.setdefault(key, (*names, *(("grad",) if self.backward else ())))
        casts = []
        for o, operand in zip(gemm.operands, names, strict=False):
            first = True
            if operand == "weight":
                wk = (key, storage_key(o.tensor) or id(o.tensor))
                first = wk not in self.seen_weights or self._stepping
                self.seen_weights.add(wk)
                if not first and not self.gemm_error:
                    continue
            casts.append(self._fold(key, operand, o.tensor, o.contract, figures=first))
        if self.gemm_error and len(casts) == len(gemm.operands):
            got = [c for c in casts if c is not None]
            if len(got) == len(casts):
                self._output_error(key, gemm, got)

    def _on_grad(self, out: Any, fold: Callable[[torch.Tensor], Any]) -> None:
        if self.backward and isinstance(out, torch.Tensor) and out.requires_grad:

            def grad_hook(g: torch.Tensor) -> None:
                with contextlib.suppress(Exception):  # never let bookkeeping break backward
                    fold(g)

            self.hooks.tensor(out, grad_hook)

    @property
    def _stepping(self) -> bool:
        """Casting a step under delayed scaling (the weights move: each call is cast)."""
        return self.delayed is not None and self.delayed.steps

    def _frame(self) -> _Frame:
        return self.stack[-1] if self.stack else _Frame("")

    def note(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """One contraction call of the model's forward: cast its operands, hook its output."""
        gemm = parse_gemm(name, args, kwargs)
        if gemm is None or not gemm.operands:
            return
        top = self._frame()
        key: Key = (top.path, top.gemms, gemm.op)
        top.gemms += 1
        self._cast_operands(key, gemm, self._names(gemm.operands, gemm.op))
        if isinstance(out, torch.Tensor):
            last = [out.dim() - 1] if out.dim() else [0]
            self._on_grad(out, lambda g: self._fold(key, "grad", g, last))

    def note_sdpa(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """One `scaled_dot_product_attention` call: its QKᵀ (q, k) and PV (the
        probabilities, recomputed here for the cast only, and v) as two GEMMs; with
        backward, PV's output gradient is the call's, QKᵀ's is recomputed from it."""
        sdpa = parse_sdpa(args, kwargs)
        if sdpa is None:
            return
        top = self._frame()
        qk_key: Key = (top.path, top.sdpa, "sdpa.qk")
        pv_key: Key = (top.path, top.sdpa, "sdpa.pv")
        top.sdpa += 1
        with torch.no_grad():
            qk, pv = sdpa.gemms(sdpa.probabilities())
        self._cast_operands(qk_key, qk, ("q", "k"))
        self._cast_operands(pv_key, pv, ("probs", "v"))
        del qk, pv  # P is recomputed in the backward rather than kept (t × t per head)

        def fold_grads(g: torch.Tensor, sdpa: Sdpa = sdpa) -> None:
            self._fold(pv_key, "grad", g, [g.dim() - 1])
            with torch.no_grad():
                ds = sdpa.score_grad(sdpa.probabilities(), g)
            self._fold(qk_key, "grad", ds, [ds.dim() - 1])

        self._on_grad(out, fold_grads)

    def merge(self, merge_state: MergeState, device: torch.device) -> bool:
        """Merge the ranks' sums in place before the one transfer, exactly: the inputs'
        and gradients' figures add up over the ranks' rows (their maxima, and the calls:
        each rank calls each GEMM once per batch, take the max);
        a weight's, the same on every rank (FSDP gathers the whole weight for the GEMM),
        are kept as they are (MAX of equal values). Each rank's per-tensor scales are its
        own tensor's, as data-parallel training casts them. False, and nothing merged,
        when the ranks did not run the same GEMMs (checked by a key count and digest)."""
        keys = sorted(self.sums, key=repr)
        outs = sorted(self.output_sums, key=repr)
        if not _same_keys([*keys, *outs], merge_state, device):  # once per pass, at its end
            return False
        data = [k for k in keys if k[1] != "weight"]
        weights = [k for k in keys if k[1] == "weight"]
        st = _Merged()
        st.sums = _rows([self.sums[k].acc[:N_SUMS] for k in data], N_SUMS, device)
        st.maxes = _rows([self.sums[k].acc[N_SUMS:] for k in data], 1, device)
        st.weights = _rows([self.sums[k].acc for k in weights], len(FIGURES), device)
        st.outputs = _rows([self.output_sums[k] for k in outs], 2, device)
        st.calls = [self.sums[k].calls for k in data]
        spec = {"sums": "sum", "maxes": "max", "weights": "max", "outputs": "sum", "calls": "max"}
        merge_state(st, spec, device)
        for i, k in enumerate(data):
            acc = self.sums[k].acc
            acc[:N_SUMS] = st.sums[i].to(acc)
            acc[N_SUMS:] = st.maxes[i].to(acc)
            self.sums[k].calls = int(st.calls[i])
        for i, k in enumerate(weights):
            self.sums[k].acc.copy_(st.weights[i])
        for i, o in enumerate(outs):
            self.output_sums[o] = st.outputs[i].to(self.output_sums[o])
        return True

    def records(self, block_names: Sequence[str] = ()) -> tuple[LowPrecRecord, ...]:
        """Every (GEMM, operand, format)'s record: the sums read back in one transfer."""
        if not self.sums:
            return ()
        items = list(self.sums.items())
        outs = list(self.output_sums.items())
        flat = torch.cat([*(s.acc for _, s in items), *(v for _, v in outs)])
        everything = flat.cpu().tolist()  # the one transfer
        n = len(FIGURES) * len(items)
        values = [everything[i : i + len(FIGURES)] for i in range(0, n, len(FIGURES))]
        output = {k: everything[n + 2 * i : n + 2 * i + 2] for i, (k, _) in enumerate(outs)}
        per_path: dict[str, set[int]] = {}
        for (path, rank, op), _, _ in self.sums:
            if not op.startswith("sdpa."):
                per_path.setdefault(path, set()).add(rank)
        first = {k: i for i, k in enumerate(self.ops)}
        rows = sorted(
            ((k, slot, v) for (k, slot), v in zip(items, values, strict=True)),
            key=lambda r: _order(r[0], first),
        )
        out = []
        for ((path, rank, op), operand, fmt), slot, vals in rows:
            v = dict(zip(FIGURES, vals, strict=True))
            name = _gemm_name(path, rank, op, per_path.get(path, set()))
            if self.delayed is not None:
                self.delayed.names[(path, rank, op)] = name
            err = output.get(((path, rank, op), fmt))
            op = "sdpa" if op.startswith("sdpa.") else op
            record = _record(name, op, operand, FORMATS[fmt], v, slot.calls, block_names)
            if err is not None and err[1] > 0:
                record = replace(record, gemm_error=math.sqrt(err[0] / err[1]))
            out.append(record)
        return tuple(out)


def _same_keys(keys: Sequence[Any], merge_state: MergeState, device: torch.device) -> bool:
    """Whether every rank holds the same keys, in the same order (their count and a digest
    of their reprs, reduced MIN and MAX over the ranks): what an element-wise merge needs."""
    digest = float(zlib.crc32(repr(list(keys)).encode()))
    same = _Merged()
    same.lo = torch.tensor([float(len(keys)), digest], dtype=torch.float64, device=device)
    same.hi = same.lo.clone()
    merge_state(same, {"lo": "min", "hi": "max"}, device)
    return torch.equal(same.lo, same.hi)


class _Merged:
    """The attributes one `merge_state` call merges (its declared spec names them)."""

    lo: torch.Tensor
    hi: torch.Tensor
    sums: torch.Tensor
    maxes: torch.Tensor
    weights: torch.Tensor
    outputs: torch.Tensor
    calls: list[int]


def _rows(rows: Sequence[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, width, dtype=torch.float64, device=device)
    return torch.stack([r.to(device, torch.float64) for r in rows])


_OPERANDS = ("input", "lhs", "weight", "rhs", "third", "q", "k", "probs", "v", "grad")


def _gemm_name(path: str, rank: int, op: str, ranks: set[int]) -> str:
    """A Linear is its path; a module running several contractions names each
    `path:op#i`; attention's fused call names its GEMMs `path.sdpa.qk` / `path.sdpa.pv`
    (`#i` from a module's second call on)."""
    if op.startswith("sdpa."):
        name = f"{path}.{op}" if path else op
        return f"{name}#{rank}" if rank else name
    return f"{path}:{op}#{rank}" if ranks != {0} or not path else path


def _order(k: tuple[Key, str, str], first: dict[Key, int]) -> tuple[int, int, int]:
    key, operand, fmt = k
    return first[key], _OPERANDS.index(operand), list(FORMATS).index(fmt)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _block_of(name: str, block_names: Sequence[str]) -> int | None:
    for i, b in enumerate(block_names):
        if name == b or name.startswith(b + ".") or name.startswith(b + ":"):
            return i
    return None


def _record(
    name: str,
    op: str,
    operand: str,
    recipe: Recipe,
    v: dict[str, float],
    calls: int,
    block_names: Sequence[str],
) -> LowPrecRecord:
    return LowPrecRecord(
        gemm=name,
        op=op,
        operand=operand,
        format=recipe.name,
        element=recipe.element(operand).name,
        block_size=recipe.block,
        block=_block_of(name, block_names),
        values=int(v["values"]),
        nonzero=int(v["nonzero"]),
        underflow=_ratio(v["flushed"], v["nonzero"]),
        saturation=_ratio(v["saturated"], v["nonzero"]),
        error=_ratio(v["err"], v["sq"]),
        range_worst=v["range_max"] if v["range_blocks"] > 0 else None,
        range_mean=_ratio(v["range_sum"], v["range_blocks"]),
        calls=calls,
    )


class _Mode(Watcher):
    """Sees every torch call of the forward; hands the model's contraction calls on."""

    def __init__(self, watch: LowPrecWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name in GEMM_NAMES or name == SDPA_NAME) and not is_aside():
            w = self.watch
            if not w.backward or torch.is_grad_enabled() or w._stepping:
                with contextlib.suppress(Exception):  # never let bookkeeping break the pass
                    if name == SDPA_NAME:
                        w.note_sdpa(args, kwargs, out)
                    else:
                        w.note(name, args, kwargs, out)
        return out


@contextlib.contextmanager
def lowprec_watch(
    model: nn.Module,
    formats: Sequence[str],
    backward: bool,
    hooks: HookSet,
    *,
    gemm_error: bool = False,
    delayed: Delayed | None = None,
) -> Iterator[tuple[LowPrecWatch, Callable[[], contextlib.AbstractContextManager[Any]]]]:
    """The watch's state and a context manager to put around each forward (where the mode
    is active). Its module and tensor hooks go into `hooks` (the caller's scope)."""
    params = {k for p in model.parameters() if (k := storage_key(p)) is not None}
    recipes = tuple(FORMATS[f] for f in formats)
    watch = LowPrecWatch(recipes, backward, hooks, params, gemm_error=gemm_error, delayed=delayed)

    def pre(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, _args: Any) -> None:
            watch.stack.append(_Frame(path, module=mod))

        return hook

    def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if watch.stack:
            watch.stack.pop()

    for path, mod in model.named_modules():
        hooks.forward_pre(mod, pre(path))
        hooks.forward(mod, post)

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        watch.stack.clear()
        try:
            with _Mode(watch):
                yield
        finally:
            watch.last_input = None  # no activation kept past its forward

    yield watch, forward


def low_precision_records(
    watch: LowPrecWatch | None, block_names: Sequence[str]
) -> tuple[LowPrecRecord, ...]:
    """The records of a pass's watch (none when `--formats` is off)."""
    return () if watch is None else watch.records(block_names)


@contextlib.contextmanager
def delayed_steps(
    model: nn.Module, delayed: Delayed | None
) -> Iterator[Callable[[], contextlib.AbstractContextManager[Any]]]:
    """Around the step loop: a context manager for each step's forward that casts every
    GEMM operand (and, through tensor hooks, its output gradient) in fp8 under the
    delayed scale of `delayed` (None: nothing, `contextlib.nullcontext`)."""
    if delayed is None:
        yield contextlib.nullcontext
        return
    delayed.steps = True
    with HookSet() as hooks, lowprec_watch(model, ("fp8",), True, hooks, delayed=delayed) as got:
        watch_forward = got[1]

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            delayed.sync()  # the ranks' amax history, MAX-reduced (one process: nothing)
            with watch_forward():
                yield

        yield forward
