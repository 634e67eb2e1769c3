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
each a named figure of `actscan.steps.figures.StepFigures`, which reach the host in one
transfer per step; norms, means and ratios are taken there.
Sums and maxima are what a distributed run adds across its ranks (`LocalRanks`; one SUM
and one MAX all-reduce per step: actscan.distributed.steps), so its figures equal the
one-process run's.
Memory: O(steps × modules) scalars, the probe's stream/branch/head outputs at t = 0, one
copy of the caller's weights (`measure.state.caller_state`: restored bit for bit, also when a
step raises; in one process, where the run did not cast the weights, it is also W_0 of the
cumulative movement, else the steps take one copy of their own), and one scratch of the
largest bucket. No copy of W_t is kept between steps: the optimizer steps bucket by bucket
(`_Loop.bucketed_step`: runs of small parameters up to 1M values, a larger one alone), each
bucket's W_t copied into the scratch just before, so ‖W_t‖, ‖W_t − W_{t+1}‖ and
‖W_{t+1} − W_0‖ read W_t, W_{t+1} and the copy from cache, chunk by chunk; the gradients
that stepped are dropped together when the next step starts. On a CPU in one process the
buckets are finer (`_Loop.piecewise_step`): the parameters are cut into pieces of at most
1M values, each run of pieces stepped by an optimizer of its own with its group's
hyperparameters (`_units`), so the optimizer's own passes run in cache as well; the same
arithmetic value by value, so the weights are those of one whole step, bit for bit.

What each figure costs per step (12 × 768, batch 4 × 64; docs/performance.md): the
probe's forward (a quarter of the batch, no gradient: ≈ 12 % of a plain step), the update
figures (one read of the weights for the copy of W_t, one of W_0 for the movement; at
t = 0 W_{t+1} − W_0 is the difference already taken), the gradients' norms (one read of
the gradients; their max-norm only where a norm is not finite, on a CPU), the
logits' log-sum-exp (two passes over the probe's logits), the probe's change sums (one
read of x_t and x_0 per point where compiled), the stream taps (one norm per stream point)
and one host transfer.

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
from actscan.measure.hooks import HookSet
from actscan.measure.inputs import Batch, InputSource
from actscan.measure.model_inputs import describe_batch
from actscan.measure.prepare import call_model, class_name, dense_grads
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
    block_updates,
)
from actscan.steps import fused_moved
from actscan.steps.figures import StepFigures, exchange, host_values

OPTIMIZERS = ("adamw", "adam", "sgd")
# The probe is batch PROBE_INDEX of the input source: for seeded sources (invented token
# ids, --input-shape) a draw no step batch uses; for a list of your batches, one of them.
PROBE_INDEX = 1_000_003
_vnorm = torch.linalg.vector_norm


@dataclass(frozen=True)
class StepSpec:
    """How to take the steps (values checked by the settings table, `actscan.settings`)."""

    steps: int
    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup: int = 0


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
        name=spec.optimizer,
        lr=float(spec.lr),
        betas=None if sgd else spec.betas,
        eps=None if sgd else float(spec.eps),
        weight_decay=float(spec.weight_decay),
        warmup=spec.warmup,
        parametrization=str(getattr(config, "parametrization", "sp")),
    )


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
            f"{class_name(model)}.actscan_param_groups(lr) must return a list of "
            'dicts with "params" (torch param groups)'
        )
    return [{**g, "params": list(g["params"])} for g in groups]


def build_optimizer(spec: StepSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, weight_decay=spec.weight_decay)
    cls = torch.optim.AdamW if spec.optimizer == "adamw" else torch.optim.Adam
    return cls(
        groups,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
    )


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
    `sink(index, tensor)` while `on`; the first call per pass only (shared modules).
    `seen` keeps the pass's indices in the order their outputs came: forward order."""

    def __init__(
        self, model: nn.Module, names: Sequence[str], sink: Callable[[int, torch.Tensor], None]
    ) -> None:
        self.model, self.names, self.sink = model, list(names), sink
        self.on = False
        self.seen: dict[int, None] = {}
        self._hooks = HookSet()

    def __enter__(self) -> _Taps:
        mods = dict(self.model.named_modules())
        try:
            for i, name in enumerate(self.names):
                if name.endswith(":input"):
                    mod = mods.get(name.removesuffix(":input"))
                    if mod is not None:
                        self._hooks.forward_pre(mod, self._pre(i), with_kwargs=True)
                elif (mod := mods.get(name)) is not None:
                    self._hooks.forward(mod, self._post(i))
        except BaseException:
            self._hooks.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.remove()

    def start(self) -> None:
        self.on, self.seen = True, {}

    def _take(self, i: int, t: torch.Tensor | None) -> None:
        if self.on and t is not None and i not in self.seen and t.numel():
            self.seen[i] = None
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
    drift: list[list[float | None]] = field(default_factory=list)  # ‖W_{t+1} − W_0‖/‖W_0‖
    step_rms: list[list[float | None]] = field(default_factory=list)  # ‖W_{t+1} − W_t‖/√n
    grad_rms: list[list[float | None]] = field(default_factory=list)
    nonfinite: list[list[tuple[str, str]]] = field(default_factory=list)  # per t: (stage, name)
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
        return list(dense_grads(torch.autograd.grad(loss, params, allow_unused=True)))

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
    batch_watch: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> StepsRaw:
    """Take `spec.steps` optimizer steps from the current weights and measure t = 0..N.

    step0: (loss, gradients of every trainable parameter in `model.parameters()` order)
    of the profile's batch 0, the t = 0 step's batch: the first update uses them (a list is
    emptied as its buckets step; the gradients are dropped when the next step starts, as
    every step's are: `_Loop.spent`). The caller restores the
    weights afterwards (`caller_state`); here they move.
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
    of their own. `batch_watch()`: entered around each step t ≥ 1's forward (the delayed
    fp8 scaling of `--formats`: actscan.measure.lowprec.delayed_steps).
    """
    ranks = ranks or LocalRanks()
    ranks.settle(model)
    loop = _Loop(
        model,
        spec,
        layout=layout,
        source=source,
        loss_of=loss_of,
        prepare=prepare,
        autocast=autocast,
        loss_scale=loss_scale,
        vocab_size=vocab_size,
        attention=attention,
        checked=checked,
        ranks=ranks,
        w0=w0,
    )
    loop.batch_watch = batch_watch
    n_steps = spec.steps
    try:
        with loop.probe_taps, loop.stream_taps:
            for t in range(n_steps + 1):
                if progress:
                    progress("steps", t, n_steps)
                loop.step(t, step0)
    finally:
        loop.spent.clear()
        for p in loop.params:
            p.grad = None
        ranks.settle(model)
    if progress:
        progress("steps", n_steps, n_steps)
    return loop.raw


class _ProbeSums:
    """The probe's outputs at t = 0 (this process's rows, kept) and, per t and point, the
    sums (Σ(x_t − x_0)², Σx_0², Σ|x_t|, Σ|x_t − x_0|, count): `StepFigures.change`."""

    def __init__(self, n_points: int, nan: torch.Tensor) -> None:
        self.n_points, self.t = n_points, 0
        self.x0: dict[int, torch.Tensor] = {}
        self.sq0: dict[int, torch.Tensor] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.zero = torch.zeros_like(nan)
        self.missing = torch.stack([nan] * 5)

    def start(self, t: int) -> None:
        self.t = t
        self.sums.clear()

    def sink(self, i: int, x: torch.Tensor) -> None:
        f64 = torch.float64
        n = float(x.numel())
        if self.t == 0:
            self.x0[i] = x.clone(memory_format=torch.contiguous_format)
        ref = self.x0.get(i)
        if ref is None or ref.shape != x.shape:
            self.sums[i] = self.missing.to(x.device)
            return
        if fused_moved.fits(x, ref):  # one compiled read (at t = 0, x − x_0 = 0)
            out = torch.zeros(5, dtype=f64)
            fused_moved.change(x, ref, out)
            if self.t == 0:
                self.sq0[i] = out[1].clone()
            out[1], out[4] = self.sq0[i], n
            self.sums[i] = out
            return
        # Σ|x| as ‖x‖₁: one pass, no |x| tensor; one difference tensor per point
        xf = x.float()
        count = torch.full((), n, dtype=f64, device=x.device)  # no host copy
        if self.t == 0:
            self.sq0[i] = _vnorm(xf, dtype=f64).square()
            zero = self.zero.to(x.device)
            self.sums[i] = torch.stack([zero, self.sq0[i], _vnorm(xf, 1, dtype=f64), zero, count])
            return
        d = xf - ref
        self.sums[i] = torch.stack(
            [
                _vnorm(d, dtype=f64).square(),
                self.sq0[i],
                _vnorm(xf, 1, dtype=f64),
                _vnorm(d, 1, dtype=f64),
                count,
            ]
        )

    def rows(self, dev: torch.device) -> torch.Tensor:
        """(points, 5): a NaN row for each point the forward did not reach."""
        rows = [self.sums.get(i, self.missing).to(dev) for i in range(self.n_points)]
        return torch.stack(rows) if rows else self.missing.new_empty(0, 5)


class _StreamSums:
    """Per stream point of a step's batch (t ≥ 1): Σx² and the count, `StepFigures.stream`,
    and whether it holds an inf/nan, `StepFigures.stream_bad` (Σx² in fp32 can overflow where
    every value is finite, so it cannot say that itself)."""

    def __init__(self, n_points: int, nan: torch.Tensor) -> None:
        self.n_points = n_points
        self.sums: dict[int, torch.Tensor] = {}
        self.bad: dict[int, torch.Tensor] = {}
        self.missing = torch.stack([nan, nan])
        self.zero = torch.zeros_like(nan)

    def start(self) -> None:
        self.sums.clear()
        self.bad.clear()

    def sink(self, i: int, x: torch.Tensor) -> None:
        f64 = torch.float64
        n = torch.full((), float(x.numel()), dtype=f64, device=x.device)
        acc = f64 if x.dtype == f64 else torch.float32
        self.sums[i] = torch.stack([_vnorm(x, dtype=acc).double().square(), n])
        # one pass: an inf/nan anywhere makes the min or the max non-finite
        self.bad[i] = torch.isfinite(torch.stack(torch.aminmax(x))).logical_not().sum(dtype=f64)

    def rows(self, dev: torch.device) -> torch.Tensor:
        """(points, 2): a NaN row for each point the forward did not reach."""
        rows = [self.sums.get(i, self.missing).to(dev) for i in range(self.n_points)]
        return torch.stack(rows) if rows else self.missing.new_empty(0, 2)

    def bad_rows(self, dev: torch.device) -> torch.Tensor:
        """(points,): the non-finite values per point (0 where the forward did not reach)."""
        bad = [self.bad.get(i, self.zero).to(dev) for i in range(self.n_points)]
        return torch.stack(bad) if bad else self.zero.new_empty(0)


class _Loop:
    """One run of the steps: what stays between steps, and a step's stages in order (the
    probe, the step's batch, the norm gains, the update, the host's figures)."""

    def __init__(
        self,
        model: nn.Module,
        spec: StepSpec,
        *,
        layout: Layout,
        source: InputSource,
        loss_of: Callable[[Any, Batch], torch.Tensor],
        prepare: Callable[[Batch], Batch],
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
        loss_scale: float,
        vocab_size: int | None,
        attention: bool,
        checked: Collection[str] | None,
        ranks: LocalRanks,
        w0: CallerWeights | None,
    ) -> None:
        self.model, self.spec, self.ranks, self.n_steps = model, spec, ranks, spec.steps
        self.source, self.loss_of, self.prepare, self.autocast = source, loss_of, prepare, autocast
        self.loss_scale, self.vocab_size, self.checked = loss_scale, vocab_size, checked
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if not self.params:
            raise UsageError("--steps: no parameter requires grad, so there is nothing to train")
        self.optimizer = build_optimizer(spec, param_groups(model, spec.lr))
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.gain_mods = [
            (name, mod.weight)
            for name, mod in model.named_modules()
            if is_norm(mod)
            and isinstance(getattr(mod, "weight", None), torch.Tensor)
            and mod.weight.dim() == 1
        ]
        points = probe_points(layout)
        stream_idx = [i for i, p in enumerate(points) if p.kind == "stream"]
        first = source(0)
        lead = first.token_ids
        if lead is None:
            lead = first_tensor((first.args, first.kwargs))
        rows = probe_rows(model, int(lead.shape[0]) if lead is not None and lead.dim() else 1)
        global_probe = cut_batch(source(PROBE_INDEX), rows)
        probe_part, self.probe_counts = ranks.split(global_probe)
        self.probe_batch = prepare(probe_part)
        self.raw = StepsRaw(
            info=optimizer_info(spec, model),
            points=points,
            params=[(n, p.numel()) for n, p in named],
            gains=[n for n, _ in self.gain_mods],
            probe=describe_batch(global_probe),
        )
        self.score_probes = AttentionProbes(model, layout, scores_only=True, interface=attention)
        self.local_params = [ranks.local(p.detach()) for p in self.params]
        self.dev = dev = self.local_params[0].device
        f64 = torch.float64
        self.nan = torch.full((), float("nan"), dtype=f64, device=dev)
        self.param_w = [1.0 if ranks.counts(p) else 0.0 for p in self.params]
        self.param_wt = torch.tensor(self.param_w, dtype=f64, device=dev)
        self.gain_w = [1.0 if ranks.counts(w) else 0.0 for _, w in self.gain_mods]
        self.log_v = math.log(vocab_size) if vocab_size else 0.0
        self.numels = [p.numel() for p in self.params]
        self.gain_numels = [w.numel() for _, w in self.gain_mods]
        self.probe = _ProbeSums(len(points), self.nan)
        self.stream = _StreamSums(len(stream_idx), self.nan)
        self.stream_idx = stream_idx
        self.order = list(range(len(points)))  # the probe's points in forward order (t = 0)
        self.probe_taps = _Taps(model, [p.name for p in points], self.probe.sink)
        self.stream_taps = _Taps(model, [points[i].name for i in stream_idx], self.stream.sink)
        # W_0 for the cumulative movement: in one process the caller's kept copy (read
        # only), else one of our own; ‖W_0‖² per tensor, from the first update's sums.
        # W_t is not kept: each bucket's is copied into a scratch just before its step.
        kept = w0.of(self.params) if w0 is not None and type(ranks) is LocalRanks else None
        self.w0 = kept if kept is not None else [p.clone() for p in self.local_params]
        self.w0_sq: list[float] = []
        self.batch_watch: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )
        self.buckets = _buckets(self.local_params)
        self.scratch = _Scratch()
        # on a CPU in one process the optimizer's arithmetic runs piece by piece (`_units`)
        cpu = all(p.device.type == "cpu" for p in self.local_params)
        self.units = (
            _units(self.optimizer, self.params) if cpu and type(ranks) is LocalRanks else None
        )
        # Gradients that stepped, dropped when the next step starts, not bucket by bucket
        # as they step: freed in the middle of the update, their pages went back to the
        # OS and the next backward faulted fresh ones in (on the 2-core VM ~100k more page
        # faults a step, ~1 s of a 3 s step). Held no longer: through the next forward
        # they would be one more weights' worth of memory at its peak.
        self.spent: list[torch.Tensor] = []

    def step(self, t: int, step0: tuple[torch.Tensor, Sequence[torch.Tensor | None]]) -> None:
        """Measure t and, before the last t, take the update after it."""
        figures = StepFigures()
        self.spent.clear()  # the last update's gradients (see `spent`)
        self.run_probe(t, figures)
        if t == 0:  # the profile's batch 0; a list of its gradients is emptied as they step
            loss, grads = step0[0], step0[1] if isinstance(step0[1], list) else list(step0[1])
        else:
            loss, grads = self.run_batch(t, figures)
        # each process's loss is the mean over its equal share of the rows
        figures.loss = (loss.detach().double() / self.ranks.world_size).reshape(1)
        if self.gain_mods:
            ws = [self.ranks.local(w.detach()) for _, w in self.gain_mods]
            drift = torch._foreach_norm(torch._foreach_sub(ws, 1.0))
            sq = [d.double().square() * k for d, k in zip(drift, self.gain_w, strict=True)]
            figures.gain_sq = torch.stack(sq)
        if t < self.n_steps:
            self.update(t, grads, figures)
        else:
            self.raw.lrs.append(self.spec.lr * warmup_factor(t, self.spec.warmup))
        self.read(t, exchange(figures, self.dev, self.ranks.reduce))

    def run_probe(self, t: int, figures: StepFigures) -> None:
        """The probe batch, forward only: the change per point, logits, attention scores."""
        self.probe.start(t)
        self.score_probes.reset()
        self.probe_taps.start()
        # the attention probes are on for the probe's forward only (entered per t)
        with self.score_probes, torch.no_grad(), self.autocast():
            out = call_model(self.model, self.probe_batch)
        self.probe_taps.on = False
        if t == 0:
            fired = list(self.probe_taps.seen)
            self.order = fired + [i for i in self.order if i not in self.probe_taps.seen]
        self.ranks.settle(self.model)
        figures.change = self.probe.rows(self.dev)
        lsum, lmax = _logit_sums(out, self.vocab_size, self.log_v, self.nan)
        del out
        layer_scores = self.score_probes.score_maxima()
        if t == 0:
            self.raw.attn_names = [
                name
                for name, (impl, _) in layer_scores.items()
                if impl == "builtin" or self.checked is None or name in self.checked
            ]
        nan = self.nan
        per_layer = [
            layer_scores[n][1].to(self.dev, torch.float64) if n in layer_scores else nan
            for n in self.raw.attn_names
        ]
        amax = torch.stack(per_layer) if per_layer else nan.new_empty(0)
        figures.logits, figures.logit_max = lsum, lmax.reshape(1)
        figures.attn_nan, figures.attn_max = torch.isnan(amax).double(), _nan_low(amax)
        if not self.probe_counts:  # a replica of the probe's rows: rank 0 counts them
            figures.uncount()  # the probe is the step's first stage: all figures are its

    def run_batch(
        self, t: int, figures: StepFigures
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Step t's batch: its stream sums, its loss and (before the last t) gradients."""
        b = self.prepare(self.ranks.split(self.source(t))[0])
        self.stream.start()
        self.stream_taps.start()
        with torch.set_grad_enabled(t < self.n_steps), self.autocast(), self.batch_watch():
            out = call_model(self.model, b)
            loss = self.loss_of(out, b)
        self.stream_taps.on = False
        del out
        figures.stream = self.stream.rows(self.dev)
        figures.stream_bad = self.stream.bad_rows(self.dev)
        grads: list[torch.Tensor | None] = []
        if t < self.n_steps:
            scale = self.loss_scale
            scaled = loss.float() * scale if scale != 1.0 else loss
            grads = self.ranks.grads(scaled, self.params)
        self.ranks.settle(self.model)
        return loss, grads

    def update(self, t: int, grads: list[torch.Tensor | None], figures: StepFigures) -> None:
        """The optimizer step after measurement t, and its gradient and update sums.
        Empties `grads` (each gradient leaves it as soon as its bucket stepped)."""
        scale = self.loss_scale
        if scale != 1.0:
            grads[:] = [g / scale if g is not None else None for g in grads]
        if self.units is None:  # else the pieces' norms, read while in cache
            figures.grad_sq, figures.grad_bad = _grad_sq(grads, self.ranks, self.param_w, self.nan)
        factor = warmup_factor(t, self.spec.warmup)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        for unit in self.units or ():
            if unit.optimizer is not None:
                unit.optimizer.param_groups[0]["lr"] = self.base_lrs[unit.group] * factor
        self.raw.lrs.append(self.spec.lr * factor)
        with torch.no_grad():
            if self.units is not None:
                w_sq, dw_sq, drift_sq, bad, gsq, gbad = self.piecewise_step(t, grads)
                figures.grad_sq, figures.grad_bad = gsq, gbad
            else:
                w_sq, dw_sq, drift_sq, bad = self.bucketed_step(t, grads)
        figures.w_sq = w_sq * self.param_wt
        figures.dw_sq = dw_sq * self.param_wt
        figures.drift_sq = drift_sq * self.param_wt
        figures.update_bad = bad * self.param_wt

    def piecewise_step(self, t: int, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        """`bucketed_step`'s step and figures, unit by unit (`_units`): each unit's W_t
        copied into the scratch, its optimizer's step on the pieces (the parameters'
        own memory: the same arithmetic, value by value, as the whole optimizer's step),
        then the pieces' figures and their gradients' norms, all while the unit's W_t,
        W_{t+1}, gradient and state are in cache; each parameter's sums are its pieces'
        sums. Also returns `_grad_sq`'s two (Σg², 1 where it holds an inf/nan; NaN and 0
        for a parameter without a gradient). Empties `grads`."""
        n = len(self.params)
        parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        gparts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        gbad = torch.zeros(n, dtype=torch.float64)
        for unit in self.units or ():
            held = self.scratch.hold([pc.view for pc in unit.pieces])
            stepped: list[tuple[int, torch.Tensor]] = []
            for pc in unit.pieces:
                g = grads[pc.k]
                if g is not None:
                    pc.view.grad = g.reshape(-1)[pc.lo : pc.hi] if pc.flat else g
                    stepped.append((pc.k, pc.view.grad))
            if unit.optimizer is not None:
                unit.optimizer.step()
            if stepped:
                ones = [1.0] * len(stepped)
                sq, flags = _grad_sq([g for _, g in stepped], self.ranks, ones, self.nan)
                for (k, _), v, f in zip(stepped, sq, flags, strict=True):
                    gparts[k].append(v)
                    gbad[k] = torch.maximum(gbad[k], f)
            for pc, old in zip(unit.pieces, held, strict=True):
                pc.view.grad = None
                w0 = None
                if t > 0:
                    w0 = self.w0[pc.k].reshape(-1)[pc.lo : pc.hi] if pc.flat else self.w0[pc.k]
                parts[pc.k].append(torch.stack(_moved(old, pc.view, w0)))
        self.spent += [g for g in grads if g is not None]
        grads.clear()
        sums = torch.stack([torch.stack(p).sum(0) if len(p) > 1 else p[0] for p in parts])
        w_sq, dw_sq, drift_sq, bad = sums.unbind(1)
        gsq = torch.stack([torch.stack(p).sum() if p else self.nan for p in gparts])
        return w_sq, dw_sq, drift_sq, (bad > 0).double(), gsq, gbad

    def bucketed_step(
        self, t: int, grads: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The optimizer step, bucket by bucket (`_buckets`), and per parameter (fp64)
        ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² and 1 where W_t − W_{t+1} holds an
        inf/nan. Each bucket's W_t is copied into a scratch right before its step, so the
        step and the figures find W_t, W_{t+1} and the copy in cache: one pass over the
        weights and W_0 beyond the step's own, and no copy of W_t kept between steps.
        A step of some parameters only is the same step: each optimizer here updates each
        parameter from its own gradient and state alone, and skips one without a gradient.
        Each gradient leaves `grads` once its bucket stepped (`grads` ends empty) and is
        dropped when the next step starts (`spent`)."""
        n = len(self.params)
        w_sq: list[torch.Tensor | None] = [None] * n
        dw_sq: list[torch.Tensor | None] = [None] * n
        drift_sq: list[torch.Tensor | None] = [None] * n
        bad: list[torch.Tensor | None] = [None] * n
        for bucket in self.buckets:
            held = self.scratch.hold([self.local_params[k] for k in bucket])
            for k in bucket:
                self.params[k].grad, grads[k] = grads[k], None
            self.optimizer.step()
            for k, old in zip(bucket, held, strict=True):
                spent = self.params[k].grad
                if spent is not None:
                    self.spent.append(spent)
                self.params[k].grad = None
                now = self.local_params[k]
                w0 = self.w0[k] if t > 0 else None
                w_sq[k], dw_sq[k], drift_sq[k], bad[k] = _moved(old, now, w0)
        grads.clear()
        dev = self.dev

        def stack(xs: list[torch.Tensor | None]) -> torch.Tensor:
            got = [x for x in xs if x is not None]
            return torch.stack(got) if got else torch.zeros(0, dtype=torch.float64, device=dev)

        return stack(w_sq), stack(dw_sq), stack(drift_sq), stack(bad)

    def read(self, t: int, h: StepFigures) -> None:
        """Step t's reduced figures, on the host → its norms, means and ratios."""
        raw = self.raw
        raw.change.append([_change(row, t) for row in host_values(h.change)])
        raw.logits.append(_logit_stats(host_values(h.logits), host_values(h.logit_max), self.log_v))
        flags = zip(host_values(h.attn_nan), host_values(h.attn_max), strict=True)
        layers = [None if flag or v == -math.inf else _num(v) for flag, v in flags]
        raw.attn_layers.append(layers)
        raw.attn_max.append(max((x for x in layers if x is not None), default=None))
        if t > 0:
            stream = host_values(h.stream)
            raw.stream.append(
                [_num(_ratio(_root(sq), math.sqrt(n))) if n == n else None for sq, n in stream]
            )
        (loss,) = host_values(h.loss)
        raw.losses.append(_num(loss))
        gains = zip(host_values(h.gain_sq), self.gain_numels, strict=True)
        raw.gain_drift.append([_num(_root(x) / math.sqrt(k)) for x, k in gains])
        if t < self.n_steps:
            grads = zip(host_values(h.grad_sq), self.numels, strict=True)
            raw.grad_rms.append([_num(_root(x) / math.sqrt(k)) if k else None for x, k in grads])
            # undefined (None) for a weight that was exactly zero (a zero-init gain)
            moved = zip(host_values(h.w_sq), host_values(h.dw_sq), strict=True)
            raw.ratio.append([_num(_root(d) / _root(b)) if b > 0 else None for b, d in moved])
            if t == 0:
                self.w0_sq = host_values(h.w_sq)
            drift = zip(host_values(h.drift_sq), self.w0_sq, strict=True)
            raw.drift.append([_num(_root(d) / _root(b)) if b > 0 else None for d, b in drift])
            steps = zip(host_values(h.dw_sq), self.numels, strict=True)
            raw.step_rms.append([_num(_root(d) / math.sqrt(k)) if k else None for d, k in steps])
        raw.nonfinite.append(self.nonfinite(t, h, flags=host_values(h.attn_nan), loss=loss))

    def nonfinite(
        self, t: int, h: StepFigures, flags: list[Any], loss: float
    ) -> list[tuple[str, str]]:
        """Step t's non-finite values as (stage, name), in the order the step met them:
        the probe's outputs (forward order), the batch's stream, attention scores, the
        loss, the update's gradients and the weights it wrote (parameter order)."""
        points, out = self.raw.points, []
        change = host_values(h.change)
        for i in self.order:  # Σ|x_t| in fp64 is finite exactly where every x_t is
            _, _, ab, _, n = change[i]
            if n == n and not math.isfinite(ab):
                out.append(("activation", points[i].name))
        listed = {name for _, name in out}
        for j, bad in enumerate(host_values(h.stream_bad)):
            name = points[self.stream_idx[j]].name
            if bad > 0 and name not in listed:
                out.append(("activation", name))
        maxima = host_values(h.attn_max)
        for name, flag, v in zip(self.raw.attn_names, flags, maxima, strict=True):
            if flag or v == math.inf:
                out.append(("attention", name))
        if not math.isfinite(loss):
            out.append(("loss", "loss"))
        params = [name for name, _ in self.raw.params]
        for stage, bad in (("gradient", h.grad_bad), ("update", h.update_bad)):
            if bad is not None:  # t < N: an update followed
                out += [(stage, p) for p, b in zip(params, host_values(bad), strict=True) if b > 0]
        return out


def _logit_stats(sums: Sequence[float], maxima: Sequence[float], log_v: float) -> LogitStats | None:
    """The probe's logit max and log Z mean/std from their reduced sums (None: no logits)."""
    ln, s1, s2, flag = sums
    (lmax,) = maxima
    if not (ln > 0 and s1 == s1):
        return None
    mean = s1 / ln
    var = max(s2 / ln - mean * mean, 0.0)
    return LogitStats(
        max=None if flag else _num(lmax), log_z_mean=mean + log_v, log_z_std=_num(math.sqrt(var))
    )


def _change(sums: Sequence[float], t: int) -> tuple[float | None, float | None, float | None]:
    """(rel, abs_mean, delta_mean) of one probe point from its reduced sums."""
    d2, x2, ab, dab, n = sums
    if n != n:
        return (None, None, None)
    if t == 0:
        return (0.0, _num(_ratio(ab, n)), 0.0)
    rel = _ratio(_root(d2), _root(x2))
    return (_num(rel), _num(_ratio(ab, n)), _num(_ratio(dab, n)))


def _grad_sq(
    grads: Sequence[torch.Tensor | None],
    ranks: LocalRanks,
    weight: Sequence[float],
    nan: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σg² of this process's part of each gradient (NaN where a parameter got none), and
    1 where that part holds an inf/nan (0 where there is none)."""
    have = [(k, ranks.local(g)) for k, g in enumerate(grads) if g is not None]
    out = nan.expand(len(grads)).clone()
    bad = torch.zeros_like(out)
    if have:
        gs = [g for _, g in have]
        norms = torch._foreach_norm(gs)
        vals = torch.stack(
            [n.double().square() * weight[k] for n, (k, _) in zip(norms, have, strict=True)]
        )
        at = torch.tensor([k for k, _ in have], device=out.device)
        out[at] = vals.to(out.device)
        w = torch.tensor([weight[k] for k, _ in have], dtype=out.dtype, device=out.device)
        if gs[0].device.type == "cpu" and math.isfinite(float(vals.sum())):
            return out, bad  # every norm finite: no inf/nan (read at no cost on a CPU)
        bad[at] = (_nonfinite(norms, torch._foreach_norm(gs, math.inf)) * w).to(out.device)
    return out, bad


# Values per chunk of the update's figures, and the most values of a bucket of small
# parameters stepped together: a chunk of W_t's copy, of W_{t+1} and of the optimizer's
# state for it (4 MiB each in fp32) stay in cache while the step and the figures read them.
_CHUNK = 1 << 20


def _buckets(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Runs of consecutive parameters (indices) of one dtype and device, each at most
    `_CHUNK` values unless it is one parameter larger than that."""
    out: list[list[int]] = []
    size, key = 0, None
    for k, p in enumerate(params):
        n, kk = p.numel(), (p.dtype, p.device)
        if not out or kk != key or size + n > _CHUNK:
            out.append([])
            size, key = 0, kk
        out[-1].append(k)
        size += n
    return out


@dataclass(frozen=True)
class _Piece:
    """Values lo:hi of parameter k (flat), as a leaf tensor on the parameter's memory: what
    an optimizer steps in place of the parameter (`flat` False: the whole parameter, for
    one whose memory is not contiguous)."""

    k: int
    lo: int
    hi: int
    view: torch.Tensor
    flat: bool = True


@dataclass(frozen=True)
class _Unit:
    """Pieces of one param group stepped together by an optimizer of their own (its
    hyperparameters the group's, `group` its index in the whole optimizer's groups)."""

    optimizer: torch.optim.Optimizer | None  # None: in no group, so never stepped
    group: int
    pieces: tuple[_Piece, ...]


def _units(whole: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[_Unit]:
    """The parameters cut into pieces of at most `_CHUNK` values, and consecutive pieces
    of one group into units of at most `_CHUNK` values, each unit with an optimizer of
    `whole`'s class and its group's hyperparameters.

    Why: torch's CPU AdamW (its for-loop implementation, the default there) makes ~10
    passes over each parameter, its gradient and its state; a 50257 × 768 embedding's
    passes stream from memory, a 4 MiB piece's stay in cache (on the 2-core Xeon of
    docs/performance.md the whole step 0.93 → 0.56 s at 124M). The three optimizers
    here are elementwise (each value from its own gradient and state, and the step
    count each unit keeps alike), so the weights are the same bit for bit; W_t's copy
    and the update figures then read the piece from cache too."""
    group_of = {id(p): gi for gi, g in enumerate(whole.param_groups) for p in g["params"]}
    out: list[_Unit] = []
    cur: list[_Piece] = []
    size, cur_group = 0, -1

    def close() -> None:
        if cur:
            opt = None
            if cur_group >= 0:
                hyper = {k: v for k, v in whole.param_groups[cur_group].items() if k != "params"}
                cls: Any = type(whole)
                opt = cls([{"params": [pc.view for pc in cur], **hyper}], lr=hyper["lr"])
            out.append(_Unit(opt, cur_group, tuple(cur)))
            cur.clear()

    for k, p in enumerate(params):
        gi, n = group_of.get(id(p), -1), p.numel()  # -1: a model's groups left it out
        if p.is_contiguous():
            flat = p.detach().view(-1)
            pieces = [
                _Piece(k, lo, min(lo + _CHUNK, n), flat[lo : lo + _CHUNK])
                for lo in range(0, n, _CHUNK)
            ]
        else:
            pieces = [_Piece(k, 0, n, p.detach(), flat=False)]
        for pc in pieces:
            m = pc.hi - pc.lo
            if gi != cur_group or size + m > _CHUNK:
                close()
                size, cur_group = 0, gi
            cur.append(pc)
            size += m
    close()
    return out


class _Scratch:
    """One reused buffer per dtype and device for a bucket's copy of W_t (grown to the
    largest bucket: at most one parameter's size beyond `_CHUNK`)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def hold(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A flat copy of each of `params` (all of one dtype and device), in the buffer."""
        total = sum(p.numel() for p in params)
        key = (params[0].dtype, params[0].device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < total:
            buf = self._bufs[key] = torch.empty(total, dtype=key[0], device=key[1])
        out, lo = [], 0
        for p in params:
            view = buf[lo : lo + p.numel()]
            view.copy_(p.reshape(-1))
            out.append(view)
            lo += p.numel()
        return out


def _acc(t: torch.Tensor) -> torch.dtype | None:
    """The dtype a 2-norm of t is taken in: fp32 at least."""
    return None if t.dtype in (torch.float32, torch.float64) else torch.float32


def _moved(
    old: torch.Tensor, now: torch.Tensor, w0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp64) ‖W_t‖², ‖W_t − W_{t+1}‖², ‖W_{t+1} − W_0‖² and 1 where W_t − W_{t+1} holds an
    inf/nan, of W_t's flat copy `old` (overwritten), the parameter `now` (W_{t+1}) and
    `w0` (None at t = 0, where W_{t+1} − W_0 is −(W_t − W_{t+1}) bit for bit).
    Chunk by chunk, so every pass after the first read of a chunk finds it in cache: each
    chunk's 2-norm taken in fp32 at least, squared and summed in fp64."""
    if fused_moved.supports(old, now):  # one compiled read of the three
        return fused_moved.moved(old, now, w0)
    b, acc = now.reshape(-1), _acc(now)
    w0f = w0.reshape(-1) if w0 is not None else None
    cpu = b.device.type == "cpu"
    ws, ds, drs, ms = [], [], [], []
    for lo in range(0, b.numel(), _CHUNK):
        x, y = old[lo : lo + _CHUNK], b[lo : lo + _CHUNK]
        ws.append(_vnorm(x, dtype=acc))
        d = torch.sub(x, y, out=x)
        ds.append(_vnorm(d, dtype=acc))
        # an inf tells itself apart from an overflowing Σ of squares by the max-norm: on
        # a GPU always (a host read would sync), on a CPU only where the norm is not finite
        if not cpu or not math.isfinite(float(ds[-1])):
            ms.append(_vnorm(d, math.inf))
        if w0f is not None:
            drs.append(_vnorm(torch.sub(y, w0f[lo : lo + _CHUNK], out=x), dtype=acc))
    zero = torch.zeros((), dtype=torch.float64, device=b.device)

    def sq(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).double().square().sum() if xs else zero

    w2, d2 = sq(ws), sq(ds)
    drift = sq(drs) if w0f is not None else d2
    bad = _nonfinite([d2], [torch.stack(ms).double().amax()])[0] if ms else zero
    return w2, d2, drift, bad


def _nonfinite(l2: Sequence[torch.Tensor], top: Sequence[torch.Tensor]) -> torch.Tensor:
    """1 per tensor that holds an inf/nan, from its 2-norm and its max-norm (fp64): a NaN
    makes the 2-norm NaN; an inf makes the max-norm inf, which finite values never do
    (their 2-norm can overflow in half precision, so it alone cannot tell)."""
    nan = torch.isnan(torch.stack(list(l2)))
    inf = torch.isinf(torch.stack(list(top)))
    return (nan | inf).double()


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
    mx = m.amax().double()  # the largest row max: no second pass over the logits
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
            ChangeRecord(
                name=p.name,
                kind=p.kind,
                k=p.k,
                block=p.block,
                rel=c[0],
                abs_mean=c[1],
                delta_mean=c[2],
            )
            for p, c in zip(raw.points, raw.change[t], strict=True)
        )
        drift = tuple(
            (name, v) for name, v in zip(raw.gains, raw.gain_drift[t], strict=True) if v is not None
        )
        steps.append(
            StepRecord(
                t=t,
                loss=loss,
                lr=raw.lrs[t],
                stream=s,
                change=changes,
                logits=raw.logits[t],
                attn_max=raw.attn_max[t],
                gain_drift=drift,
                attn_layers=tuple(zip(raw.attn_names, raw.attn_layers[t], strict=True)),
                nonfinite=tuple(raw.nonfinite[t]),
            )
        )
    by_name: Mapping[str, ParamRecord] = {p.name: p for p in params}
    updates = []
    for j, (name, numel) in enumerate(raw.params):
        rec = by_name.get(name)
        updates.append(
            UpdateRecord(
                param=name,
                block=rec.block if rec else None,
                role=rec.role if rec else "other",
                kind=rec.kind if rec else "other",
                ratio=tuple(r[j] for r in raw.ratio),
                grad_rms=tuple(g[j] for g in raw.grad_rms),
                numel=numel,
                drift=tuple(d[j] for d in raw.drift),
                step_rms=tuple(s[j] for s in raw.step_rms),
            )
        )
    return Dynamics(
        optimizer=raw.info,
        steps=tuple(steps),
        updates=tuple(updates),
        probe=raw.probe,
        blocks=block_updates(updates),
    )
