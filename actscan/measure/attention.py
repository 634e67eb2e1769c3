"""Attention probes: per layer and per head, the pre-softmax score max and std, the
normalised attention entropy and the mass on the first key ("sink").

Transformers models: every attention module of a 5.x model asks transformers'
`AttentionInterface` for the function its config names (`config._attn_implementation`).
For the run, each config that names `eager` or `sdpa` names `actscan_probe_eager` /
`actscan_probe_sdpa` instead: a function registered under that name which calls the
family's own implementation (the `eager_attention_forward` of the model's modeling
module, or transformers' sdpa function) with the very same arguments, so the output is
the one the model computes, bit for bit. On the side, under no_grad and on the device, it
recomputes the scores from the detached q and k (GQA/MQA by grouping the query heads,
scaling, Gemma 2's soft-cap, T5's position bias, the model's own mask: causal, sliding
window, padding, or none for an encoder) and folds them into per-head accumulators; the
one host transfer is at the end. The mask interface gets the same registration (the
original implementation's mask builder), so the masks are the ones the model would build.
Configs are restored, registrations removed, in `finally`. Setting the config attribute
directly is what `PreTrainedModel.set_attn_implementation` does on success, without its
source-code heuristics and warnings.

Each layer is self-checked once merged: the recomputed probabilities against what eager
returns, or the recomputed output p·V against sdpa's output (relative error ≤ 1e-3, ×30
in half precision); a layer that disagrees is dropped, with a note.

The built-in `actscan-gpt` marks its scores with an `AttentionLogits` module: a forward
hook reads them (causal mask), same statistics. Attention modules that compute their
scores themselves (GPT-Neo) and hold q/k projections and a head count are recomputed from
those projections' outputs under each reading (scaled by 1/√d or not, causal or not),
self-checked against the probabilities the module returns or hands to its dropout: the
one reading that reproduces them is kept, a layer none (or two scalings) reproduce is
dropped with a note. Other families whose attention never calls the interface get one
note, never a crash.

`scores_only=True` is the optimizer steps' mode (`--steps`: the attention-score maximum
per layer and step): each layer keeps one device scalar, the largest |score| over every
head and position (masked ones included, as the built-in model's `attn_max` was always
read and calibrated), with no softmax, statistics or self-check; the step loop keeps only
the layers the full probes checked at step 0.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from actscan.measure.gemms import aside
from actscan.measure.hooks import HookSet
from actscan.measure.moments import merge_moments
from actscan.models.gpt import Attention, AttentionLogits
from actscan.records import AttentionRecord, HeadRecord, Layout

PROBE_PREFIX = "actscan_probe_"
# A distributed run's in-place merge of accumulators across ranks: (state, spec, device).
MergeState = Callable[[Any, dict[str, str], torch.device], None]
PROBED = ("eager", "sdpa")
# Self-check tolerance (relative): fp32 recomputation agrees to ~1e-6; half-precision
# models round their probabilities/outputs at 2^-8 relative.
CHECK_TOL = {torch.float32: 1e-3, torch.float64: 1e-3}
CHECK_TOL_HALF = 3e-2


@dataclass
class _Acc:
    """Device-side running statistics of one attention layer (merged exactly: counts,
    sums, Chan's merge of mean/M2, maxima)."""

    name: str
    order: int
    impl: str
    heads: int = 0
    kv_heads: int | None = None
    queries: int = 0
    keys: int = 0
    calls: int = 0
    softcap: float | None = None
    window: int | None = None
    scaling: float | None = None  # the scale on q·kᵀ (None: not measured, the built-in)
    head_dim: int | None = None
    tol: float = 1e-3
    t: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None  # why this layer's statistics cannot be trusted

    def fold_max(self, m: torch.Tensor) -> None:
        """scores_only: the running max |score| (a device scalar)."""
        m = m.to(torch.float64)
        self.t["amax"] = torch.maximum(self.t["amax"], m) if "amax" in self.t else m

    def merge(self, s: dict[str, torch.Tensor]) -> None:
        if not self.t:
            self.t = s
            return
        t = self.t
        t["n"], t["mean"], t["m2"] = merge_moments(
            (t["n"], t["mean"], t["m2"]), (s["n"], s["mean"], s["m2"])
        )
        t["max"] = torch.maximum(t["max"], s["max"])
        t["err"] = torch.maximum(t["err"], s["err"])
        for k in ("ent", "rows", "sink", "sink_rows", "keys"):
            t[k] = t[k] + s[k]

    def fold_rows(self, q: torch.Tensor, k: torch.Tensor, scaling: float) -> None:
        """The largest and smallest nonzero L2 norm of the query and key rows (per head
        vector, every position): equal when a norm made them (QK-norm; a rotary embedding after
        it is a rotation and keeps them). Device scalars, merged by max/min."""
        self.scaling, self.head_dim = scaling, int(q.shape[-1])
        t = self.t
        for key, x in (("q", q), ("k", k)):
            rows = torch.linalg.vector_norm(x.detach().float(), dim=-1)
            # an all-zero row (a padding token's zero embedding) is 0 through any norm
            lo = torch.where(rows > 0, rows, math.inf).amin()
            t[key + "hi"] = torch.maximum(t[key + "hi"], rows.amax().to(torch.float64))
            t[key + "lo"] = torch.minimum(t[key + "lo"], lo.to(torch.float64))


def head_stats(scores: torch.Tensor, allowed: torch.Tensor, bias: torch.Tensor) -> dict[str, Any]:
    """Per-head statistics of one call. scores (B, H, Tq, Tk) float32, a scratch tensor
    this function overwrites; allowed (bool) and bias (float: the additive mask, 0 or a
    position bias where allowed, -inf elsewhere) broadcastable to it with a head
    dimension of 1 or H. Also returns the probabilities ("p") and which queries have a key
    ("rows_ok") for the self-check.

    Fused passes only, no log over the scores: H(p) = log Z − Σ p·s with log Z = s_max −
    log p_max per query. Sums run in float32 (pairwise): M2 = Σs² − n·mean² carries a
    relative error ≲ 1e-7·(1 + mean²/std²), far below what the checks resolve."""
    h = scores.shape[1]
    neg = scores.add_(bias)  # in place (no new (Tq, Tk) tensors but p): masked → -inf
    nk = allowed.sum(dim=-1, dtype=scores.dtype)  # (B|1, 1|H, Tq): allowed keys per query
    nk = nk.expand(scores.shape[0], nk.shape[1], scores.shape[2])
    count = nk.sum(dim=(0, 2)).to(torch.float64).expand(h)  # (H,)
    row_max = neg.amax(dim=-1)  # (B, H, Tq)
    p = torch.softmax(neg, dim=-1)  # NaN on rows with no allowed key
    s0 = neg.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)  # masked → 0, in place
    total = s0.sum(dim=(0, 2, 3)).to(torch.float64)
    squares = torch.linalg.vector_norm(s0, dim=(0, 2, 3)).to(torch.float64) ** 2
    mean = total / count.clamp_min(1)
    m2 = (squares - count * mean * mean).clamp_min(0)
    log_z = row_max - torch.log(p.amax(dim=-1))
    entropy = log_z - torch.linalg.vecdot(p, s0)  # (B, H, Tq)
    valid = nk >= 2
    ent = torch.where(valid, entropy / torch.log(nk.clamp_min(2)), 0.0)
    sink_ok = valid & allowed[..., 0].expand_as(valid)
    sink = torch.where(sink_ok, p[..., 0], 0.0)
    return {
        "n": count,
        "mean": mean,
        "m2": m2,
        "max": row_max.amax(dim=(0, 2)).to(torch.float64),
        "ent": ent.sum(dim=(0, 2)).to(torch.float64),
        "rows": valid.sum(dim=(0, 2)).to(torch.float64).expand(h),
        "sink": sink.sum(dim=(0, 2)).to(torch.float64),
        "sink_rows": sink_ok.sum(dim=(0, 2)).to(torch.float64).expand(h),
        "keys": torch.where(valid, nk, 0.0).sum(dim=(0, 2)).to(torch.float64).expand(h),
        "err": torch.zeros((), dtype=torch.float64, device=scores.device),
        "p": p,
        "rows_ok": nk >= 1,
    }


def grouped_scores(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (B, Hq, Tq, D) · k (B, Hkv, Tk, D)ᵀ · scaling → (B, Hq, Tq, Tk) in float32, query
    head h reading kv head h // (Hq / Hkv) (transformers' repeat_kv), without repeating k;
    the scaling is applied to q (a (Tq, D) pass, not a (Tq, Tk) one)."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} key/value heads")
    qf = (q.detach().float() * scaling).reshape(b, hkv, (hq // hkv) * tq, d)
    s = torch.matmul(qf, k.detach().float().transpose(-1, -2))
    return s.reshape(b, hq, tq, tk)


def call_scaling(query: torch.Tensor, kwargs: dict[str, Any]) -> float:
    """The scale an attention call puts on q·kᵀ: its `scaling`, 1/√d when absent."""
    scaling = kwargs.get("scaling")
    return float(query.shape[-1] ** -0.5 if scaling is None else scaling)


def scores(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The pre-softmax scores (B, Hq, Tq, Tk), float32, before the mask: q·kᵀ times the
    call's scaling (1/√d when absent), soft-capped (Gemma 2), plus a position bias (T5)."""
    s = grouped_scores(query, key, call_scaling(query, kwargs))
    softcap = kwargs.get("softcap")
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    position = kwargs.get("position_bias")
    if isinstance(position, torch.Tensor):
        s.add_(position.detach().float()[..., : key.shape[2]])
    return s


def grouped_apply(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p (B, Hq, Tq, Tk) · v (B, Hkv, Tk, D) → (B, Hq, Tq, D), grouped as above."""
    b, hq, tq, tk = p.shape
    hkv = v.shape[1]
    out = torch.matmul(p.reshape(b, hkv, (hq // hkv) * tq, tk), v.detach().float())
    return out.reshape(b, hq, tq, v.shape[-1])


CHECKED_QUERIES = 32  # sdpa's self-check compares p·V with its output at this many queries


@functools.lru_cache(maxsize=16)
def checked_queries(tq: int, device: torch.device) -> torch.Tensor | None:
    """The queries sdpa's self-check compares: every k-th from the first, and the last
    (≤ CHECKED_QUERIES + 1 of them), so every batch row and head is checked, at early and
    late positions alike (a sliding window or a causal offset shows at the late ones);
    None (all of them) for a short sequence. Cached: one index per length and device, not
    one host-to-device copy per layer and batch."""
    if tq <= CHECKED_QUERIES:
        return None
    idx = list(range(0, tq, -(-tq // CHECKED_QUERIES)))
    if idx[-1] != tq - 1:
        idx.append(tq - 1)
    t = torch.tensor(idx, dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


MASKED_NATS = 50.0  # an additive mask this far below its row's best is a mask, not a bias


def _allowed(
    mask: torch.Tensor | None, causal: bool, tq: int, tk: int, window: int | None, dev: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed bool, additive bias: the mask's value where allowed, -inf elsewhere), each
    (B|1, 1|H, Tq, Tk), from the mask the implementation received (None; bool, True =
    attend; float, additive with the dtype's minimum or -inf where masked)."""
    if mask is None:
        ok = torch.ones(1, 1, tq, tk, dtype=torch.bool, device=dev)
        if causal:
            i = torch.arange(tq, device=dev)[:, None]
            j = torch.arange(tk, device=dev)[None, :]
            ok = (j <= i)[None, None]  # sdpa's is_causal: top-left aligned
            if window is not None:
                ok = ok & (i - j < window)
        return ok, torch.zeros(ok.shape, device=dev).masked_fill_(~ok, -math.inf)
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    mask = mask[..., :tk]
    if mask.dtype == torch.bool:
        return mask, torch.zeros(mask.shape, device=dev).masked_fill_(~mask, -math.inf)
    ok = mask > torch.finfo(mask.dtype).min / 2  # False on -inf and on the dtype's minimum
    m = mask.float()
    # A finite mask value (Swin's shifted windows: −100) ≥ MASKED_NATS below its row's
    # best masks too: its key's weight is ≤ e^-50 of that key's at equal scores, and its
    # value is no score (−100 among unit scores reads as a score std of ~50).
    top = torch.where(ok, m, -math.inf).amax(dim=-1, keepdim=True)
    ok = ok & (m >= top - MASKED_NATS)
    return ok, torch.where(ok, m, -math.inf)


class AttentionProbes:
    """Records attention statistics while active (a context manager around the measured
    batches). `records()` after exit gives the AttentionRecords; `notes` says what could
    not be probed."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout | None = None,
        family: str = "",
        *,
        scores_only: bool = False,
        interface: bool = True,
    ) -> None:
        self.model = model
        self.layout = layout
        self.family = family or str(getattr(getattr(model, "config", None), "model_type", ""))
        self.scores_only = scores_only
        self.interface = interface  # False: the built-in model's markers only
        self.names = {id(m): n for n, m in model.named_modules()}
        self.accs: dict[str, _Acc] = {}
        # the q/k fallback: per layer one accumulator per reading, and its failures
        self.fallback: dict[str, list[_Acc]] = {}
        self.fallback_errors: dict[str, str] = {}
        self.notes: list[str] = []
        self._stack = contextlib.ExitStack()
        self._active = False

    # -- install / remove -----------------------------------------------------------
    def __enter__(self) -> AttentionProbes:
        try:
            if not self._builtin() and self.interface:
                self._interface()
                if not self.scores_only:
                    self._projections()
            self._active = True
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self._stack.close()

    def _acc(self, module: nn.Module, impl: str) -> _Acc:
        name = self.names.get(id(module), type(module).__name__)
        acc = self.accs.get(name)
        if acc is None:
            acc = self.accs[name] = _Acc(name=name, order=len(self.accs), impl=impl)
        return acc

    def _builtin(self) -> bool:

        hooks = self._stack.enter_context(HookSet())
        for mod in self.model.modules():
            if isinstance(mod, Attention) and isinstance(mod.logits, AttentionLogits):
                hooks.forward(mod.logits, self._builtin_hook(mod))
        return len(hooks) > 0

    def _builtin_hook(self, attn: nn.Module) -> Any:
        def hook(_m: nn.Module, _args: Any, scores: torch.Tensor) -> None:
            if not self._active:
                return
            acc = self._acc(attn, "builtin")
            if self.scores_only:
                acc.calls += 1
                acc.fold_max(scores.detach().abs().amax())
                return
            with torch.no_grad(), torch.autocast(scores.device.type, enabled=False), aside():
                s = scores.detach().to(torch.float32, copy=True)  # a scratch copy
                tq, tk = s.shape[-2], s.shape[-1]
                allowed, bias = _allowed(None, True, tq, tk, None, s.device)
                self._fold(acc, s, allowed, bias, kv_heads=s.shape[1])

        return hook

    def _interface(self) -> None:
        configs = _configs(self.model)
        if not configs:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        skipped = sorted(
            {str(c._attn_implementation) for c in configs if c._attn_implementation not in PROBED}
            - {"None"}
        )
        if skipped:
            self.notes.append(
                f"attention probes unavailable for {self.family or 'this model'}: attention "
                f"implementation {', '.join(skipped)} is not probed (eager and sdpa are)"
            )
        upcast = [m for m in self.model.modules() if getattr(m, "reorder_and_upcast_attn", False)]
        if upcast:  # GPT-2's upcast path runs only when the name is literally "eager"
            self.notes.append(
                f"attention probes unavailable for {self.family}: reorder_and_upcast_attn "
                "takes a path outside the attention interface"
            )
            return
        targets = [c for c in configs if c._attn_implementation in PROBED]
        for impl in sorted({c._attn_implementation for c in targets}):
            name = PROBE_PREFIX + impl
            AttentionInterface.register(name, self._probe(impl))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
            self._stack.callback(AttentionInterface._global_mapping.pop, name, None)
            self._stack.callback(AttentionMaskInterface._global_mapping.pop, name, None)
        for c in targets:
            self._stack.callback(
                setattr, c, "_attn_implementation_internal", c._attn_implementation_internal
            )
            c._attn_implementation_internal = PROBE_PREFIX + c._attn_implementation

    # -- the fallback: scores from the module's own q/k projections -------------------
    def _projections(self) -> None:
        """Hooks on attention modules that compute their scores themselves (GPT-Neo):
        `_projection_modules` lists them; each call recomputes the scores from its q/k
        projections' outputs under every reading of `_READINGS`, each into its own
        accumulator, self-checked against the probabilities the module returns or hands
        to a dropout. `records()` keeps the one reading that reproduces them (one host
        transfer); a layer the interface probed keeps the interface's statistics."""
        hooks = self._stack.enter_context(HookSet())
        for mod, q, k, probs in _projection_modules(self.model):
            seen: dict[str, torch.Tensor] = {}
            hooks.forward(q, _keep_output(seen, "q"))
            hooks.forward(k, _keep_output(seen, "k"))
            if probs is not None:
                hooks.forward_pre(probs, _keep_input(seen, "p"))
            hooks.forward_pre(mod, _clear(seen), with_kwargs=True)
            hooks.forward(mod, self._projection_hook(mod, seen), with_kwargs=True)

    def _projection_hook(self, mod: nn.Module, seen: dict[str, torch.Tensor]) -> Any:
        def hook(_m: nn.Module, _args: Any, kwargs: dict[str, Any], out: Any) -> None:
            name = self.names.get(id(mod), type(mod).__name__)
            if not self._active or name in self.accs:
                return  # an interface-probed layer (or the fallback failed before)
            ref = seen.get("p")
            if ref is None and isinstance(out, tuple) and len(out) > 1:
                ref = out[1] if isinstance(out[1], torch.Tensor) else None
            group = self.fallback.setdefault(name, [])
            try:
                with torch.no_grad(), torch.autocast(seen["q"].device.type, enabled=False), aside():
                    self._measure_projections(mod, name, seen, ref, kwargs, group)
            except Exception as err:  # the model's output stands; the layer is dropped
                self.fallback_errors[name] = f"{type(err).__name__}: {err}".splitlines()[0]

        return hook

    def _measure_projections(
        self,
        mod: nn.Module,
        name: str,
        seen: dict[str, torch.Tensor],
        ref: torch.Tensor | None,
        kwargs: dict[str, Any],
        group: list[_Acc],
    ) -> None:
        heads = int(getattr(mod, "num_heads", 0) or getattr(mod, "num_attention_heads", 0))
        q, k = seen["q"], seen["k"]
        if ref is None or ref.dim() != 4 or heads <= 0 or q.shape[-1] % heads:
            raise ValueError("no probabilities to check the recomputed scores against")
        d = q.shape[-1] // heads
        b, tq, tk = q.shape[0], q.shape[-2], k.shape[-2]
        qh = q.reshape(b, tq, heads, d).transpose(1, 2)
        kh = k.reshape(b, tk, k.shape[-1] // d, d).transpose(1, 2)
        if tuple(ref.shape) != (b, heads, tq, tk):
            raise ValueError(f"probabilities of shape {tuple(ref.shape)}")
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) else None
        for i, (scaling, causal) in enumerate(_READINGS):
            if len(group) <= i:
                group.append(
                    _Acc(name=name, order=len(self.accs) + len(self.fallback), impl="projections")
                )
            acc = group[i]
            s = grouped_scores(qh, kh, d**-0.5 if scaling else 1.0)
            allowed, bias = _allowed(mask, False, tq, tk, None, s.device)
            if causal:
                tri = torch.ones(tq, tk, dtype=torch.bool, device=s.device).tril(tk - tq)
                allowed = allowed & tri
                bias = bias.masked_fill(~tri, -math.inf)
            acc.tol = CHECK_TOL.get(q.dtype, CHECK_TOL_HALF)
            stats = self._fold(acc, s, allowed, bias, kv_heads=kh.shape[1], keep=True)
            acc.fold_rows(qh, kh, d**-0.5 if scaling else 1.0)
            err = stats["p"].sub_(ref.detach().float()).abs_().nan_to_num_(0.0).amax()
            acc.t["err"] = torch.maximum(acc.t["err"], err.to(torch.float64))

    def _choose_fallback(self) -> None:
        """Per fallback layer, the reading whose probabilities match the module's (one
        host transfer for all): the best within tolerance, no reading of another scaling
        within 10× of it (an ambiguous match, near-uniform attention where the scaling
        cannot be told, is dropped with its reason, never guessed)."""
        groups = {n: g for n, g in self.fallback.items() if g and all(a.t for a in g)}
        for n, err in self.fallback_errors.items():
            self.accs.setdefault(n, _Acc(name=n, order=len(self.accs), impl="projections"))
            self.accs[n].error = err
        if not groups:
            return
        errs = torch.stack([a.t["err"] for g in groups.values() for a in g]).cpu().tolist()
        at = 0
        for name, group in groups.items():
            mine, at = errs[at : at + len(group)], at + len(group)
            if name in self.accs:
                continue
            best = min(range(len(group)), key=lambda i: mine[i])
            near = max(10 * mine[best], group[best].tol * 1e-2)
            # readings that match as well: the same scaling is the same statistics (the
            # model's mask already causal), another scaling would be a guess
            scalings = {_READINGS[i][0] for i, e in enumerate(mine) if e <= near}
            acc = group[best]
            if mine[best] <= acc.tol and len(scalings) == 1:
                self.accs[name] = acc
            else:
                acc.error = (
                    "scores recomputed from its q/k projections match its probabilities "
                    f"under no single reading (errors {', '.join(f'{e:.2g}' for e in mine)})"
                )
                self.accs[name] = acc

    # -- the probe ------------------------------------------------------------------
    def _probe(self, impl: str) -> Any:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        def original(module: nn.Module) -> Any:
            if impl == "sdpa":
                return ALL_ATTENTION_FUNCTIONS["sdpa"]
            home = vars(sys.modules.get(type(module).__module__) or sys)
            # the family's eager function, by its usual name or a prefixed one
            # (TimesFM's simple_eager_attention_forward)
            fn = home.get("eager_attention_forward") or next(
                (f for k, f in home.items() if k.endswith("eager_attention_forward")), None
            )
            if fn is None:
                raise RuntimeError(
                    f"actscan attention probes: {type(module).__module__} has no "
                    "eager_attention_forward to call"
                )
            return fn

        def probe(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            out = original(module)(module, query, key, value, attention_mask, *args, **kwargs)
            if self._active and not args:
                acc = self._acc(module, impl)
                if acc.error is None:
                    dev = query.device.type
                    # under autocast the model's matmuls ran in half precision: compare
                    # at that tolerance, but recompute in float32
                    half = torch.is_autocast_enabled(dev)
                    try:
                        with torch.no_grad(), torch.autocast(dev, enabled=False), aside():
                            if self.scores_only:
                                acc.calls += 1
                                s = scores(query, key, kwargs)
                                acc.fold_max(s.abs_().amax())
                                return out
                            self._measure(
                                acc,
                                module,
                                impl,
                                query,
                                key,
                                value,
                                attention_mask,
                                kwargs,
                                out,
                                half,
                            )
                    except Exception as err:  # the model's output stands; the layer is dropped
                        acc.error = f"{type(err).__name__}: {err}".splitlines()[0]
            elif self._active:
                self._acc(module, impl).error = "positional arguments after the mask"
            return out

        return probe

    def _measure(
        self,
        acc: _Acc,
        module: nn.Module,
        impl: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Any,
        kwargs: dict[str, Any],
        out: Any,
        half: bool = False,
    ) -> None:
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask of type {type(mask).__name__}")
        softcap = kwargs.get("softcap")
        window = kwargs.get("sliding_window")
        tq, tk = query.shape[2], key.shape[2]
        s = scores(query, key, kwargs)
        if impl == "sdpa":
            flag = kwargs.get("is_causal")
            causal = bool(flag if flag is not None else getattr(module, "is_causal", True))
            causal = causal and tq > 1 and mask is None
        else:
            causal = False  # eager applies exactly the mask it is given
        allowed, bias = _allowed(mask, causal, tq, tk, window, s.device)
        acc.softcap = float(softcap) if softcap is not None else None
        acc.window = int(window) if isinstance(window, int) else None
        acc.tol = CHECK_TOL_HALF if half else CHECK_TOL.get(query.dtype, CHECK_TOL_HALF)
        stats = self._fold(acc, s, allowed, bias, kv_heads=key.shape[1], keep=True)
        acc.fold_rows(query, key, call_scaling(query, kwargs))
        dropout = float(kwargs.get("dropout") or 0.0)
        if dropout > 0 and module.training:
            return  # the model's probabilities are dropped out: nothing exact to compare
        p, rows = stats["p"], stats["rows_ok"]
        if impl == "eager" and isinstance(out, tuple) and isinstance(out[1], torch.Tensor):
            # NaN only on queries with no allowed key (p is undefined there): not compared
            err = p.sub_(out[1].detach().float()).abs_().nan_to_num_(0.0).amax()
        else:
            attn_out = out[0] if isinstance(out, tuple) else out
            ref = attn_out.detach().float().transpose(1, 2)  # (B, H, Tq, D)
            at = checked_queries(tq, ref.device)
            if at is not None:  # a spread of queries: p·V over every one costs a T² pass
                p, ref, rows = p[:, :, at], ref[:, :, at], rows[..., at]
            mine = grouped_apply(p, value)  # a fresh tensor: its passes run in place
            diff = mine.sub_(ref).abs_().masked_fill_(~rows[..., None], 0.0).amax()
            scale = torch.maximum(ref.amax(), ref.amin().neg())  # max |ref|, no |ref| copy
            err = diff / scale.clamp_min(1e-30)
        acc.t["err"] = torch.maximum(acc.t["err"], err.to(torch.float64))

    def _fold(
        self,
        acc: _Acc,
        scores: torch.Tensor,
        allowed: torch.Tensor,
        bias: torch.Tensor,
        *,
        kv_heads: int,
        keep: bool = False,
    ) -> dict[str, torch.Tensor]:
        stats = head_stats(scores, allowed, bias)
        acc.calls += 1
        acc.heads = scores.shape[1]
        acc.kv_heads = kv_heads
        acc.queries = max(acc.queries, scores.shape[2])
        acc.keys = max(acc.keys, scores.shape[3])
        extra = {k: stats.pop(k) for k in ("p", "rows_ok")}
        acc.merge(stats)
        if "qhi" not in acc.t:  # no rows seen yet (the built-in never sees q and k)
            zero = torch.zeros((), dtype=torch.float64, device=scores.device)
            acc.t.update(qhi=zero, khi=zero, qlo=zero + math.inf, klo=zero + math.inf)
        return {**stats, **extra} if keep else stats

    # -- results --------------------------------------------------------------------
    def score_maxima(self) -> dict[str, tuple[str, torch.Tensor]]:
        """scores_only: per layer that ran (first-call order) its implementation and the
        device scalar max |score| since the last `reset()`; layers that failed are left out."""
        accs = sorted(self.accs.values(), key=lambda a: a.order)
        return {a.name: (a.impl, a.t["amax"]) for a in accs if a.error is None and "amax" in a.t}

    def reset(self) -> None:
        """Forget the accumulated statistics (the layers' order and errors stay)."""
        for a in self.accs.values():
            a.t, a.calls = {}, 0

    # How each accumulator reduces across ranks (actscan.distributed.merge.merge_state).
    MERGE: ClassVar[dict[str, str]] = {
        "n,mean,m2": "chan",
        "max": "max",
        "err": "max",
        "ent": "sum",
        "rows": "sum",
        "sink": "sum",
        "sink_rows": "sum",
        "keys": "sum",
        "qhi,khi": "max",
        "qlo,klo": "min",
    }

    def records(self, merge: MergeState | None = None) -> tuple[AttentionRecord, ...]:
        """The merged records (one host transfer for all layers), and notes for what was
        not probed or did not check out. `merge`: a distributed run's rank first merges
        its accumulators with every other rank's through it (every rank probed the same
        layers; actscan.distributed.merge.merge_state)."""
        self._choose_fallback()
        accs = sorted(self.accs.values(), key=lambda a: a.order)
        failed = [a for a in accs if a.error is not None or not a.t]
        good = [a for a in accs if a not in failed]
        out: list[AttentionRecord] = []
        if good and merge is not None:
            _merge_ranks(good, self.MERGE, merge)
        if good:
            keys = ("n", "mean", "m2", "max", "ent", "rows", "sink", "sink_rows", "keys")
            rows = [torch.stack([a.t[k].reshape(-1).expand(a.heads) for k in keys]) for a in good]
            row_keys = ("err", "qhi", "qlo", "khi", "klo")
            errs = torch.stack([torch.stack([a.t[k] for k in row_keys]) for a in good])
            host = torch.cat(rows, dim=1).cpu().tolist()
            err_host = errs.cpu().tolist()
            col = 0
            for a, (err, *norms) in zip(good, err_host, strict=True):
                cols = [[host[r][col + h] for r in range(len(keys))] for h in range(a.heads)]
                col += a.heads
                if not err <= a.tol:
                    failed.append(a)
                    a.error = f"recomputed attention differs from the model's by {err:.2g}"
                    continue
                out.append(self._record(a, cols, norms))
        if failed:
            first = failed[0]
            self.notes.append(
                f"attention probes dropped {len(failed)} layer{'s' if len(failed) > 1 else ''} "
                f"of {self.family or 'the model'} (first {first.name}: {first.error})"
            )
        explained = any(n.startswith("attention probes unavailable") for n in self.notes)
        if not accs and not explained and self._attention_like():
            self.notes.append(
                f"attention probes unavailable for {self.family or type(self.model).__name__}: "
                "its attention does not call transformers' attention interface"
            )
        return tuple(out)

    def _record(self, a: _Acc, cols: list[list[float]], norms: list[float]) -> AttentionRecord:
        heads = []
        keys_sum = 0.0
        rows_sum = 0.0
        for h, (n, _mean, m2, mx, ent, rows, sink, sink_rows, keys) in enumerate(cols):
            std = math.sqrt(max(m2, 0.0) / n) if n > 0 else None
            heads.append(
                HeadRecord(
                    head=h,
                    score_max=mx if n > 0 else None,
                    score_std=std,
                    entropy=ent / rows if rows > 0 else None,
                    sink=sink / sink_rows if sink_rows > 0 else None,
                )
            )
            keys_sum, rows_sum = keys, rows
        layout = self.layout
        block = layout.block_of.get(a.name) if layout is not None else None
        stream = None
        if layout is not None and layout.streams and block is not None:
            stream = next((b.stream for b in layout.blocks if b.index == block), None)
        kind = "cross" if layout is not None and layout.role(a.name) == "cross_attn" else "self"
        return AttentionRecord(
            name=a.name,
            block=block,
            heads=tuple(heads),
            queries=a.queries,
            keys=a.keys,
            mean_keys=keys_sum / rows_sum if rows_sum > 0 else None,
            kv_heads=a.kv_heads,
            kind=kind,
            calls=a.calls,
            softcap=a.softcap,
            sliding_window=a.window,
            stream=stream,
            q_norm=_constant(norms[0], norms[1]),
            k_norm=_constant(norms[2], norms[3]),
            scaling=a.scaling,
            head_dim=a.head_dim,
        )

    def _attention_like(self) -> bool:
        """Does the model hold attention modules (so silence would mislead)?"""
        return any("Attention" in type(m).__name__ for m in self.model.modules())


# Rows of one norm agree to float32 rounding (~1e-6 relative; half precision ~1e-3); rows
# of a linear map of the stream spread as a χ over head_dim (±1/√(2d): ±4% at d = 256).
NORMED_SPREAD = 1e-2


def _constant(hi: float, lo: float) -> float | None:
    """The rows' common L2 norm when their largest and smallest agree (a norm made them),
    else None (they spread, were all zero, or were not measured)."""
    if not (math.isfinite(hi) and math.isfinite(lo)) or hi <= 0:
        return None
    return (hi + lo) / 2 if hi - lo <= NORMED_SPREAD * hi else None


# The fallback's readings of q·kᵀ: (scaled by 1/√d, causal). The self-check picks one.
_READINGS = ((True, True), (False, True), (True, False), (False, False))
_Q = ("q_proj", "query", "q")
_K = ("k_proj", "key", "k")


def _projection_modules(
    model: nn.Module,
) -> list[tuple[nn.Module, nn.Module, nn.Module, nn.Module | None]]:
    """(attention module, its q projection, its k projection, the dropout it hands its
    probabilities to, if any) for every module named like attention whose class holds
    q/k `nn.Linear` children and a head count, and whose modeling module has no
    `eager_attention_forward` (its attention never goes through the interface)."""
    out: list[tuple[nn.Module, nn.Module, nn.Module, nn.Module | None]] = []
    for mod in model.modules():
        if "Attention" not in type(mod).__name__:
            continue
        if getattr(sys.modules.get(type(mod).__module__), "eager_attention_forward", None):
            continue
        kids = dict(mod.named_children())
        q = next((kids[n] for n in _Q if isinstance(kids.get(n), nn.Linear)), None)
        k = next((kids[n] for n in _K if isinstance(kids.get(n), nn.Linear)), None)
        heads = getattr(mod, "num_heads", None) or getattr(mod, "num_attention_heads", None)
        if q is None or k is None or not isinstance(heads, int):
            continue
        drop = kids.get("attn_dropout") or kids.get("attention_dropout")
        out.append((mod, q, k, drop if isinstance(drop, nn.Dropout) else None))
    return out


def _keep_output(seen: dict[str, torch.Tensor], key: str) -> Callable[..., None]:
    def hook(_m: nn.Module, _args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            seen[key] = out.detach()

    return hook


def _keep_input(seen: dict[str, torch.Tensor], key: str) -> Callable[..., None]:
    def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen[key] = args[0].detach()

    return hook


def _clear(seen: dict[str, torch.Tensor]) -> Callable[..., None]:
    def hook(_m: nn.Module, _args: Any, _kwargs: Any) -> None:
        seen.clear()

    return hook


def _configs(model: nn.Module) -> list[Any]:
    """Every transformers config object the model's modules hold, with their sub-configs
    (several modules may share one; an encoder-decoder may hold several)."""
    if "transformers" not in sys.modules:
        return []
    seen: dict[int, Any] = {}
    stack: list[Any] = [
        m.config
        for m in model.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
    ]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if hasattr(sub, "_attn_implementation_internal"):
                stack.append(sub)
    return list(seen.values())


@contextlib.contextmanager
def attention_probes(
    model: nn.Module, layout: Layout | None = None, family: str = "", enabled: bool = True
) -> Iterator[AttentionProbes | None]:
    """`AttentionProbes` around a block of forward passes (None when not enabled)."""
    if not enabled:
        yield None
        return
    with AttentionProbes(model, layout, family) as probes:
        yield probes


def _merge_ranks(accs: list[_Acc], spec: dict[str, str], merge_state: MergeState) -> None:
    """Merge the layers' accumulators across ranks in place: one collective per kind."""

    for a in accs:  # expanded views cannot be written into
        a.t = {k: v.contiguous().clone() for k, v in a.t.items()}
    keys = {k for attrs in spec for k in attrs.split(",")}
    state = types.SimpleNamespace(**{k: [a.t[k] for a in accs] for k in keys})
    merge_state(state, spec, accs[0].t["n"].device)
