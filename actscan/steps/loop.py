"""The first optimizer steps (`scan(steps=N)`, `--steps N`): the step loop and what it measures.

Why: the right initial variance is the one that keeps the *update* sane, not only the
one that looks good at step 0 (a deep Post-LN stack is quiet at init and fragile once the
branches move). So after the step-0 profile the model takes N real optimizer steps and
each t = 0..N records, as scalars only:

- the loss and the stream RMS per k of the step's batch (batch index t of the input
  source: fresh seeded draws, or your inputs cycled);
- on a fixed probe batch (batch `PROBE_INDEX` of the same source: a separate seeded draw
  for invented inputs), run forward without gradient at every t: for every stream point,
  branch and the head, rel = ‖x_t − x_0‖/‖x_0‖, mean |x_t| and mean |x_t − x_0|; the
  logits' max and log Z (mean, std over positions) for causal LMs; per attention layer
  the largest |pre-softmax score| (`AttentionProbes(scores_only=True)`: the built-in
  model's score markers, and every family that calls transformers' attention interface
  unless `attention=False`), and its maximum over the layers;
- per trainable parameter tensor, the update ratio ‖W_{t+1} − W_t‖/‖W_t‖ and the RMS of
  the gradient the update used;
- each norm module's gain drift ‖g − 1‖/√n.

Cost: the step-0 pass is the profile itself (its gradient drives the first update: no
second pass); steps t ≥ 1 hook only the stream points of the step's batch (one norm per
point), and the probe is `probe_rows` sequences of its batch, not all of them. Every
step's scalars are reduced on the device to sums (of squares, of |x|, counts) and maxima,
which reach the host in one transfer per step; norms, means and ratios are taken there.
Sums and maxima are what a distributed run adds across its ranks (`LocalRanks`; one SUM
and one MAX all-reduce per step: actscan.distributed.steps), so its figures equal the
one-process run's.
Memory: O(steps × modules) scalars, the probe's stream/branch/head outputs at t = 0, one
copy of the caller's weights (`measure.state.caller_state`: restored bit for bit, also when a
step raises) and, from the first update on, one of the previous step's (for the update
ratios; before it, in one process, the caller's copy serves as W_0 where the run did not
cast the weights). Per update the ratios cost four fused (`torch._foreach_*`) passes over
the weights: ‖W_t‖, W_t − W_{t+1}, its norm, and the copy of W_{t+1} (not after the last).

Per-group learning rates: a model with a method `actscan_param_groups(lr) -> list[dict]`
(torch param-group dicts, each with its "params" and optionally its own "lr") trains with
those groups (μP scales hidden matrices' Adam learning rate by 1/width_mult this way);
otherwise one group holds every trainable parameter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from actscan.errors import UsageError
from actscan.layout.detect import is_norm
from actscan.measure.attention import AttentionProbes
from actscan.measure.inputs import Batch, InputSource
from actscan.measure.recorder import first_tensor
from actscan.measure.state import CallerWeights
from actscan.measure.streams import input_name
from actscan.records import (
    ChangeRecord,
    Dynamics,
    Layout,
    LogitStats,
    OptimizerInfo,
    ParamRecord,
    StepRecord,
    StreamPoint,
    UpdateRecord,
)
from actscan.steps.derived import block_updates

OPTIMIZERS = ("adamw", "adam", "sgd")
# The probe is batch PROBE_INDEX of the input source: for seeded sources (invented token
# ids, --input-shape) a draw no step batch uses; for a list of your batches, one of them.
PROBE_INDEX = 1_000_003
_vnorm = torch.linalg.vector_norm


@dataclass(frozen=True)
class StepSpec:
    """How to take the steps (validated by `check`)."""

    steps: int
    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup: int = 0

    def check(self) -> StepSpec:
        """Raise UsageError (one line) on a value no optimizer run could use."""
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise UsageError(f"--steps must be an integer ≥ 0, got {self.steps!r}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not _positive(self.lr):
            raise UsageError(f"--lr must be a finite number > 0, got {self.lr!r}")
        if not (_finite(self.eps) and self.eps >= 0):
            raise UsageError(f"--eps must be a finite number ≥ 0, got {self.eps!r}")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise UsageError(
                f"--weight-decay must be a finite number ≥ 0, got {self.weight_decay!r}"
            )
        if len(self.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in self.betas):
            raise UsageError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"--warmup must be an integer ≥ 0, got {self.warmup!r}")
        if self.warmup > self.steps:
            raise UsageError(
                f"--warmup {self.warmup} is longer than --steps {self.steps}: "
                "the steps would never reach the learning rate"
            )
        return self


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)


def _positive(x: Any) -> bool:
    return _finite(x) and x > 0


def warmup_factor(t: int, warmup: int) -> float:
    """Linear warmup: the update after measurement t uses lr × min(1, (t + 1)/warmup), so
    the first update is lr/warmup and update `warmup` − 1 is the full lr."""
    return 1.0 if warmup <= 0 else min(1.0, (t + 1) / warmup)


def optimizer_info(spec: StepSpec, model: nn.Module) -> OptimizerInfo:
    sgd = spec.optimizer == "sgd"
    config = getattr(model, "config", None)
    return OptimizerInfo(
        name=spec.optimizer, lr=float(spec.lr), betas=None if sgd else tuple(spec.betas),
        eps=None if sgd else float(spec.eps), weight_decay=float(spec.weight_decay),
        warmup=spec.warmup, parametrization=str(getattr(config, "parametrization", "sp")),
    )  # fmt: skip


def param_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """The model's own groups (`actscan_param_groups(lr)`), else one of all trainable
    parameters."""
    hook = getattr(model, "actscan_param_groups", None)
    if not callable(hook):
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = hook(lr)
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and "params" in g for g in groups
    ):
        raise UsageError(
            f"{type(model).__name__}.actscan_param_groups(lr) must return a list of "
            'dicts with "params" (torch param groups)'
        )
    return [{**g, "params": list(g["params"])} for g in groups]


def build_optimizer(spec: StepSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, weight_decay=spec.weight_decay)
    cls = torch.optim.AdamW if spec.optimizer == "adamw" else torch.optim.Adam
    return cls(
        groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
        weight_decay=spec.weight_decay,
    )  # fmt: skip


def probe_rows(model: nn.Module, batch: int) -> int:
    """Sequences of the probe batch that run: a quarter of a batch (at least one) keeps
    the per-step probe forward cheap; two when the model has BatchNorm (train-mode batch
    statistics need more than one sample)."""
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    want = max(2 if has_bn else 1, batch // 4)
    return max(1, min(batch, want))


def cut_batch(b: Batch, rows: int) -> Batch:
    """The first `rows` samples of every tensor whose leading dim is the batch's."""
    lead = b.token_ids if b.token_ids is not None else first_tensor((b.args, b.kwargs))
    if lead is None or not lead.dim() or lead.shape[0] <= rows:
        return b
    n = lead.shape[0]

    def cut(v: Any) -> Any:
        return v[:rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v

    return Batch(tuple(cut(a) for a in b.args), {k: cut(v) for k, v in b.kwargs.items()})


@dataclass(frozen=True)
class Point:
    """One probed output: a stream point (k), a branch (block, role) or the head."""

    name: str  # record name; a stream input is "<block>:input"
    kind: str  # "stream" | branch role | "head"
    k: int | None = None
    block: int | None = None


def probe_points(layout: Layout) -> list[Point]:
    """The primary stream's points (k = 0 at its first block's input), every branch, and
    the head."""
    out: list[Point] = []
    streams = layout.stream_blocks()
    if streams:
        blocks = streams[-1][1]  # the primary stream feeds the head: the last one
        if blocks:
            out.append(Point(input_name(blocks[0].name), "stream", k=0))
            k = 0
            for b in blocks:
                k += b.adds
                out.append(Point(b.name, "stream", k=k, block=b.index))
    for b in layout.blocks:
        for br in b.branch_list():
            out.append(Point(br.name, br.role, block=b.index))
    if layout.head:
        out.append(Point(layout.head, "head"))
    return out


class _Taps:
    """Forward (pre-)hooks that hand the first float tensor of each named output to
    `sink(index, tensor)` while `on`; the first call per pass only (shared modules)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.model, self.names = model, list(names)
        self.on = False
        self.seen: set[int] = set()
        self.sink: Callable[[int, torch.Tensor], None] = lambda i, t: None
        self._handles: list[Any] = []

    def __enter__(self) -> _Taps:
        mods = dict(self.model.named_modules())
        try:
            for i, name in enumerate(self.names):
                if name.endswith(":input"):
                    mod = mods.get(name.removesuffix(":input"))
                    if mod is not None:
                        self._handles.append(
                            mod.register_forward_pre_hook(self._pre(i), with_kwargs=True)
                        )
                elif (mod := mods.get(name)) is not None:
                    self._handles.append(mod.register_forward_hook(self._post(i)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def start(self) -> None:
        self.on, self.seen = True, set()

    def _take(self, i: int, t: torch.Tensor | None) -> None:
        if self.on and t is not None and i not in self.seen and t.numel():
            self.seen.add(i)
            self.sink(i, t.detach())

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            hidden = first_tensor(args)
            if hidden is None:
                hidden = kwargs.get("hidden_states")
                hidden = hidden if hidden is not None else first_tensor(kwargs)
            self._take(i, hidden)

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: Any, out: Any) -> None:
            self._take(i, out if isinstance(out, torch.Tensor) else first_tensor(out))

        return hook


@dataclass
class StepsRaw:
    """Host values of the steps, before they become records (`dynamics_record`)."""

    info: OptimizerInfo
    points: list[Point]
    params: list[tuple[str, int]]  # (name, numel) of each trainable parameter
    gains: list[str]  # norm modules with a gain vector
    losses: list[float | None] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    stream: list[list[float | None]] = field(default_factory=list)  # per t ≥ 1, per point
    change: list[list[tuple[float | None, float | None, float | None]]] = field(
        default_factory=list
    )  # per t, per point: (rel, abs_mean, delta_mean)
    logits: list[LogitStats | None] = field(default_factory=list)
    attn_max: list[float | None] = field(default_factory=list)
    attn_names: list[str] = field(default_factory=list)  # attention layers, fixed at t = 0
    attn_layers: list[list[float | None]] = field(default_factory=list)  # per t, per layer
    gain_drift: list[list[float | None]] = field(default_factory=list)
    ratio: list[list[float | None]] = field(default_factory=list)  # per update, per param
    grad_rms: list[list[float | None]] = field(default_factory=list)
    probe: str | None = None


def _num(x: float) -> float | None:
    return None if x != x else x  # NaN marks "not measured"


class LocalRanks:
    """How the steps run in one process; `actscan.distributed.steps.ShardedRanks` is the
    same contract for one rank of a distributed run (FSDP2-sharded parameters, each rank
    its rows of every batch, the per-step sums and maxima reduced across ranks).

    Every per-step statistic is gathered as sums (of squares, of |x|, counts) and maxima,
    so that a distributed run adds its ranks' and gets the one-process figure exactly."""

    world_size = 1

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This process's part of a parameter, gradient or weight copy (all of it here)."""
        return t

    def counts(self, t: torch.Tensor) -> bool:
        """Whether this process's `local(t)` adds to the sums (False: a replica)."""
        return True

    def split(self, b: Batch) -> tuple[Batch, bool]:
        """(the rows of global batch `b` this process runs, whether they count)."""
        return b, True

    def grads(
        self, loss: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Gradients of the global mean `loss` (this process's share of it); `.grad` is
        never written."""
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    def reduce(self, sums: torch.Tensor, maxima: torch.Tensor) -> None:
        """Add `sums` and take the max of `maxima` over the processes, in place."""

    def settle(self, model: nn.Module) -> None:
        """Leave `model` ready for an optimizer step (FSDP: every module resharded)."""


def run_steps(
    model: nn.Module,
    spec: StepSpec,
    *,
    layout: Layout,
    source: InputSource,
    step0: tuple[torch.Tensor, Sequence[torch.Tensor | None]],
    loss_of: Callable[[Any, Batch], torch.Tensor],
    prepare: Callable[[Batch], Batch],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    loss_scale: float = 1.0,
    vocab_size: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    attention: bool = True,
    checked: Collection[str] | None = None,
    ranks: LocalRanks | None = None,
    w0: CallerWeights | None = None,
) -> StepsRaw:
    """Take `spec.steps` optimizer steps from the current weights and measure t = 0..N.

    step0: (loss, gradients of every trainable parameter in `model.parameters()` order)
    of the profile's batch 0, the t = 0 step's batch: the first update uses them. The
    caller restores the weights afterwards (`caller_state`); here they move.
    `prepare` casts a batch to the run's device/dtype; `autocast()` is the run's autocast.
    `attention`: probe transformers' attention interface for the per-layer score maxima
    (the built-in model's markers are read either way: a free read); `checked`: the layers
    whose recomputed scores the step-0 probes verified against the model's own attention
    (an interface layer outside it is not recorded); None: no such filter.
    `source` gives global batches; `ranks` (default: one process) says which rows this
    process runs and how its sums and maxima meet the other processes' (`LocalRanks`).
    In a distributed run step0 is this rank's: its local loss, the FSDP gradients.
    w0: the caller's kept copy (`caller_state`): in one process, where it still holds the
    current weights, it is W_0 of the first update ratio and the steps keep no copy of W_0
    of their own.
    """
    from actscan.measure.model_inputs import describe_batch
    from actscan.measure.prepare import call_model

    ranks = ranks or LocalRanks()
    ranks.settle(model)
    n_steps = spec.steps
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if not params:
        raise UsageError("--steps: no parameter requires grad, so there is nothing to train")
    optimizer = build_optimizer(spec, param_groups(model, spec.lr))
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    gain_mods = [
        (name, mod.weight)
        for name, mod in model.named_modules()
        if is_norm(mod) and isinstance(getattr(mod, "weight", None), torch.Tensor)
        and mod.weight.dim() == 1
    ]  # fmt: skip
    points = probe_points(layout)
    stream_idx = [i for i, p in enumerate(points) if p.kind == "stream"]
    first = source(0)
    lead = first.token_ids
    if lead is None:
        lead = first_tensor((first.args, first.kwargs))
    rows = probe_rows(model, int(lead.shape[0]) if lead is not None and lead.dim() else 1)
    global_probe = cut_batch(source(PROBE_INDEX), rows)
    probe_part, probe_counts = ranks.split(global_probe)
    probe_batch = prepare(probe_part)
    raw = StepsRaw(
        info=optimizer_info(spec, model), points=points,
        params=[(n, p.numel()) for n, p in named], gains=[n for n, _ in gain_mods],
        probe=describe_batch(global_probe),
    )  # fmt: skip
    score_probes = AttentionProbes(model, layout, scores_only=True, interface=attention)
    local_params = [ranks.local(p.detach()) for p in params]
    dev = local_params[0].device
    f64 = torch.float64
    nan = torch.full((), float("nan"), dtype=f64, device=dev)
    zero = torch.zeros((), dtype=f64, device=dev)
    param_w = [1.0 if ranks.counts(p) else 0.0 for p in params]
    param_wt = torch.tensor(param_w, dtype=f64, device=dev)
    gain_w = [1.0 if ranks.counts(w) else 0.0 for _, w in gain_mods]
    log_v = math.log(vocab_size) if vocab_size else 0.0

    # the probe: outputs at t = 0 (this process's rows, kept), and per t and point the sums
    # (Σ(x_t − x_0)², Σx_0², Σ|x_t|, Σ|x_t − x_0|, count)
    x0: dict[int, torch.Tensor] = {}
    sq0: dict[int, torch.Tensor] = {}
    change: dict[int, torch.Tensor] = {}
    t_now = [0]
    missing5 = torch.stack([nan] * 5)

    def probe_sink(i: int, x: torch.Tensor) -> None:
        # Σ|x| as ‖x‖₁: one pass, no |x| tensor; one difference tensor per point
        xf = x.float()
        n = torch.full((), float(x.numel()), dtype=f64, device=x.device)  # no host copy
        if t_now[0] == 0:
            x0[i] = x.clone()
            sq0[i] = _vnorm(xf, dtype=f64).square()
            change[i] = torch.stack([zero.to(x.device), sq0[i], _vnorm(xf, 1, dtype=f64),
                                     zero.to(x.device), n])  # fmt: skip
            return
        ref = x0.get(i)
        if ref is None or ref.shape != x.shape:
            change[i] = missing5.to(x.device)
            return
        d = xf - ref
        change[i] = torch.stack([
            _vnorm(d, dtype=f64).square(), sq0[i], _vnorm(xf, 1, dtype=f64),
            _vnorm(d, 1, dtype=f64), n,
        ])  # fmt: skip

    stream_sq: dict[int, torch.Tensor] = {}

    def stream_sink(i: int, x: torch.Tensor) -> None:
        n = torch.full((), float(x.numel()), dtype=f64, device=x.device)
        acc = f64 if x.dtype == f64 else torch.float32
        stream_sq[i] = torch.stack([_vnorm(x, dtype=acc).double().square(), n])

    # W_t (local part), for ‖W_{t+1} − W_t‖: in one process the caller's kept copy stands
    # for W_0 (read only); the steps' own copy is taken by the first update's difference
    kept = w0.of(params) if w0 is not None and type(ranks) is LocalRanks else None
    prev: list[torch.Tensor] = kept if kept is not None else [p.clone() for p in local_params]
    own = kept is None
    probe_taps = _Taps(model, [p.name for p in points])
    probe_taps.sink = probe_sink
    stream_taps = _Taps(model, [points[i].name for i in stream_idx])
    stream_taps.sink = stream_sink

    try:
        with probe_taps, stream_taps:
            for t in range(n_steps + 1):
                if progress:
                    progress("steps", t, n_steps)
                t_now[0] = t
                sums: list[torch.Tensor] = []
                maxima: list[torch.Tensor] = []
                # 1. the probe, forward only
                change.clear()
                score_probes.reset()
                probe_taps.start()
                # the attention probes are on for the probe's forward only (entered per t)
                with score_probes, torch.no_grad(), autocast():
                    out = call_model(model, probe_batch)
                probe_taps.on = False
                ranks.settle(model)
                probe_sums = [change.get(i, missing5).to(dev) for i in range(len(points))]
                lsum, lmax = _logit_sums(out, vocab_size, log_v, nan)
                del out
                layer_scores = score_probes.score_maxima()
                if t == 0:
                    raw.attn_names = [
                        name for name, (impl, _) in layer_scores.items()
                        if impl == "builtin" or checked is None or name in checked
                    ]  # fmt: skip
                per_layer = [layer_scores[n][1].to(dev, f64) if n in layer_scores else nan
                             for n in raw.attn_names]  # fmt: skip
                amax = torch.stack(per_layer) if per_layer else nan.new_empty(0)
                probe_sums += [lsum.to(dev), torch.isnan(amax).double()]  # NaN flags
                probe_max = torch.cat([lmax.to(dev).reshape(1), _nan_low(amax)])
                if not probe_counts:  # a replica of the probe's rows: rank 0 counts them
                    probe_sums = [torch.zeros_like(x) for x in probe_sums]
                    probe_max = torch.full_like(probe_max, -math.inf)
                sums += probe_sums
                maxima.append(probe_max)
                # 2. the step's batch: t = 0 is the profile's batch 0
                if t == 0:
                    loss, grads = step0
                    grads = list(grads)
                else:
                    b = prepare(ranks.split(source(t))[0])
                    stream_sq.clear()
                    stream_taps.start()
                    with torch.set_grad_enabled(t < n_steps), autocast():
                        out = call_model(model, b)
                        loss = loss_of(out, b)
                    stream_taps.on = False
                    del out
                    for i in range(len(stream_idx)):
                        sums.append(stream_sq.get(i, torch.stack([nan, nan])).to(dev))
                    grads = []
                    if t < n_steps:
                        scaled = loss.float() * loss_scale if loss_scale != 1.0 else loss
                        grads = ranks.grads(scaled, params)
                    ranks.settle(model)
                # each process's loss is the mean over its equal share of the rows
                sums.append((loss.detach().double() / ranks.world_size).reshape(1).to(dev))
                # 3. norm gains
                if gain_mods:
                    ws = [ranks.local(w.detach()) for _, w in gain_mods]
                    drift = torch._foreach_norm(torch._foreach_sub(ws, 1.0))
                    sq = [d.double().square() * k for d, k in zip(drift, gain_w, strict=True)]
                    sums.append(torch.stack(sq).to(dev))
                # 4. the update
                if t < n_steps:
                    if loss_scale != 1.0:
                        grads = [g / loss_scale if g is not None else None for g in grads]
                    sums.append(_grad_sq(grads, ranks, param_w, nan).to(dev))
                    for p, g in zip(params, grads, strict=True):
                        p.grad = g
                    factor = warmup_factor(t, spec.warmup)
                    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
                        group["lr"] = base * factor
                    raw.lrs.append(spec.lr * factor)
                    with torch.no_grad():
                        before = torch._foreach_norm(prev)
                        optimizer.step()
                        for p in params:
                            p.grad = None
                        del grads
                        if own:  # prev ← W_t − W_{t+1} in place
                            torch._foreach_sub_(prev, local_params)
                        else:  # the caller's copy is read only: the difference is ours
                            prev, own = torch._foreach_sub(prev, local_params), True
                        delta = torch._foreach_norm(prev)
                        if t + 1 < n_steps:  # W_{t+1} for the next update
                            torch._foreach_copy_(prev, local_params)
                    sums.append(torch.stack(before).double().square() * param_wt)
                    sums.append(torch.stack(delta).double().square() * param_wt)
                else:
                    raw.lrs.append(spec.lr * warmup_factor(t, spec.warmup))
                flat_sum = torch.cat([x.reshape(-1) for x in sums])
                flat_max = torch.cat([x.reshape(-1) for x in maxima])
                ranks.reduce(flat_sum, flat_max)
                host = torch.cat([flat_sum, flat_max]).cpu().tolist()  # one transfer
                _unpack(raw, host, t, n_steps, len(points), len(stream_idx),
                        [n for _, n in raw.params], [w.numel() for _, w in gain_mods],
                        log_v)  # fmt: skip
    finally:
        for p in params:
            p.grad = None
        ranks.settle(model)
    if progress:
        progress("steps", n_steps, n_steps)
    return raw


def _grad_sq(
    grads: Sequence[torch.Tensor | None], ranks: LocalRanks, weight: Sequence[float],
    nan: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Σg² of this process's part of each gradient (NaN where a parameter got none)."""
    have = [(k, ranks.local(g)) for k, g in enumerate(grads) if g is not None]
    out = nan.expand(len(grads)).clone()
    if have:
        norms = torch._foreach_norm([g for _, g in have])
        vals = torch.stack([n.double().square() * weight[k]
                            for n, (k, _) in zip(norms, have, strict=True)])  # fmt: skip
        out[torch.tensor([k for k, _ in have], device=out.device)] = vals.to(out.device)
    return out


def output_logits(output: Any) -> torch.Tensor | None:
    """The logits of a model output: `.logits` (transformers), `["logits"]`, else the first
    float tensor (the built-in model returns its logits)."""
    logits = getattr(output, "logits", None)
    if isinstance(output, dict):
        logits = output.get("logits", logits)
    return logits if isinstance(logits, torch.Tensor) else first_tensor(output)


def _logit_sums(
    out: Any, vocab_size: int | None, log_v: float, nan: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Of vocabulary logits (B, T, V): (count, Σ(log Z − log V), Σ(log Z − log V)², NaN
    flag) and the max (−inf when there are none). The shift by log V (log Z of uniform
    logits) keeps the variance from cancelling when sums from several processes meet."""
    logits = output_logits(out) if vocab_size else None
    if logits is None or logits.dim() != 3 or logits.shape[-1] != vocab_size:
        z = torch.zeros((), dtype=torch.float64, device=nan.device)
        return torch.stack([z, z, z, z]), torch.full_like(nan, -math.inf)
    lf = logits.float()
    # log Z in fp64 (the exp in fp32, summed in fp64): fp32's rounding of log Z ≈ log V
    # (~1e-7 of it) would otherwise be a visible part of its small spread over positions
    m = lf.amax(dim=-1, keepdim=True)
    lz = (lf - m).exp().sum(dim=-1, dtype=torch.float64).log() + m.squeeze(-1).double() - log_v
    mx = lf.amax().double()
    flag = torch.isnan(mx).double()
    n = torch.tensor(float(lz.numel()), dtype=torch.float64, device=lz.device)
    return torch.stack([n, lz.sum(), lz.square().sum(), flag]), _nan_low(mx)


def _nan_low(x: torch.Tensor) -> torch.Tensor:
    """NaN → −inf, so a MAX across processes ignores it (a NaN flag is summed beside)."""
    return torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x)


def _root(x: float) -> float:
    return math.sqrt(x) if x >= 0 else float("nan")  # NaN stays NaN


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return float("nan") if num == 0 or num != num or den != den else float("inf")


def _unpack(
    raw: StepsRaw, host: list[float], t: int, n_steps: int, n_points: int, n_stream: int,
    numels: Sequence[int], gain_numels: Sequence[int], log_v: float,
) -> None:  # fmt: skip
    """Turn one step's reduced sums and maxima into the step's figures."""
    pos = 0

    def take(n: int) -> list[float]:
        nonlocal pos
        out = host[pos : pos + n]
        pos += n
        return out

    changes: list[tuple[float | None, float | None, float | None]] = []
    for _ in range(n_points):
        d2, x2, ab, dab, n = take(5)
        if n != n:
            changes.append((None, None, None))
            continue
        if t == 0:
            changes.append((0.0, _num(_ratio(ab, n)), 0.0))
            continue
        rel = _ratio(_root(d2), _root(x2))
        changes.append((_num(rel), _num(_ratio(ab, n)), _num(_ratio(dab, n))))
    raw.change.append(changes)
    ln, s1, s2, lflag = take(4)
    n_attn = len(raw.attn_names)
    aflags = take(n_attn)
    stream: list[float | None] = []
    if t > 0:
        for _ in range(n_stream):
            sq, n = take(2)
            stream.append(_num(_ratio(_root(sq), math.sqrt(n))) if n == n else None)
    loss = take(1)[0]
    drift = [_num(_root(x) / math.sqrt(k)) for x, k in zip(take(len(gain_numels)), gain_numels,
                                                           strict=True)]  # fmt: skip
    grad = ratio = None
    if t < n_steps:
        grad = [_num(_root(x) / math.sqrt(k)) if k else None
                for x, k in zip(take(len(numels)), numels, strict=True)]  # fmt: skip
        before, delta = take(len(numels)), take(len(numels))
        # undefined (None) for a weight that was exactly zero (a zero-init gain)
        ratio = [_num(_root(d) / _root(b)) if b > 0 else None
                 for b, d in zip(before, delta, strict=True)]  # fmt: skip
    lmax = take(1)[0]
    amax = take(n_attn)
    if ln > 0 and s1 == s1:
        mean = s1 / ln
        var = max(s2 / ln - mean * mean, 0.0)
        raw.logits.append(
            LogitStats(max=None if lflag else _num(lmax), log_z_mean=mean + log_v,
                       log_z_std=_num(math.sqrt(var)))
        )  # fmt: skip
    else:
        raw.logits.append(None)
    layers = [None if flag or v == -math.inf else _num(v)
              for flag, v in zip(aflags, amax, strict=True)]  # fmt: skip
    raw.attn_layers.append(layers)
    raw.attn_max.append(max((x for x in layers if x is not None), default=None))
    if t > 0:
        raw.stream.append(stream)
    raw.losses.append(_num(loss))
    raw.gain_drift.append(drift)
    if grad is not None and ratio is not None:
        raw.grad_rms.append(grad)
        raw.ratio.append(ratio)


def dynamics_record(
    raw: StepsRaw, stream: Sequence[StreamPoint], params: Sequence[ParamRecord]
) -> Dynamics:
    """The report's `dynamics`: t = 0's stream is the profile's own (`stream`); parameter
    block/role/kind come from the profile's parameter records."""
    stream_points = [p for p in raw.points if p.kind == "stream"]
    steps = []
    for t, loss in enumerate(raw.losses):
        if t == 0:
            s = tuple((p.k, p.rms) for p in stream)
        else:
            s = tuple((p.k or 0, v) for p, v in zip(stream_points, raw.stream[t - 1], strict=True))
        changes = tuple(
            ChangeRecord(name=p.name, kind=p.kind, k=p.k, block=p.block, rel=c[0],
                         abs_mean=c[1], delta_mean=c[2])
            for p, c in zip(raw.points, raw.change[t], strict=True)
        )  # fmt: skip
        drift = tuple(
            (name, v) for name, v in zip(raw.gains, raw.gain_drift[t], strict=True) if v is not None
        )
        steps.append(
            StepRecord(
                t=t, loss=loss, lr=raw.lrs[t], stream=s, change=changes, logits=raw.logits[t],
                attn_max=raw.attn_max[t], gain_drift=drift,
                attn_layers=tuple(zip(raw.attn_names, raw.attn_layers[t], strict=True)),
            )
        )  # fmt: skip
    by_name: Mapping[str, ParamRecord] = {p.name: p for p in params}
    updates = []
    for j, (name, numel) in enumerate(raw.params):
        rec = by_name.get(name)
        updates.append(
            UpdateRecord(
                param=name, block=rec.block if rec else None, role=rec.role if rec else "other",
                kind=rec.kind if rec else "other", ratio=tuple(r[j] for r in raw.ratio),
                grad_rms=tuple(g[j] for g in raw.grad_rms), numel=numel,
            )
        )  # fmt: skip
    return Dynamics(
        optimizer=raw.info, steps=tuple(steps), updates=tuple(updates), probe=raw.probe,
        blocks=block_updates(updates),
    )  # fmt: skip
