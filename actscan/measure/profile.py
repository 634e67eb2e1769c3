"""The recorded pass: `batches` forward(+backward) passes with every chosen module hooked.

`PassSpec` says how the pass runs (device, dtype, autocast, backward, loss scale);
`LocalPass` how it meets other processes: not at all. One rank of a distributed run
passes `actscan.distributed.ranks.ShardedPass` instead, the same contract (its rows of
every batch, FSDP's sharded backward, the recorder's sums merged across ranks), so this
loop has no distributed branch. `record_pass` returns the raw sums (`Profiled`) and, when
optimizer steps follow, batch 0's loss and gradients: the first update uses them, so the
steps need no second pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from actscan.measure import fused_casts
from actscan.measure.attention import attention_probes
from actscan.measure.hooks import HookSet
from actscan.measure.inputs import Batch, InputSource
from actscan.measure.lowprec import (
    Delayed,
    LowPrecWatch,
    MergeState,
    low_precision_records,
    lowprec_watch,
)
from actscan.measure.model_inputs import ChosenInputs, describe_batch
from actscan.measure.prepare import TORCH_DTYPES, call_model, cast_batch, dense_grads, dtype_name
from actscan.measure.recorder import RawStats, Recorder, iter_named, moments
from actscan.measure.streams import input_name, stream_inputs
from actscan.measure.tokens import stream_names
from actscan.records import AttentionRecord, Layout, LowPrecRecord, RunInfo

__all__ = ["FP16_LOSS_SCALE", "LocalPass", "PassSpec", "Profiled", "first_batch", "record_pass"]

# Static loss scale of fp16 runs: a steady state of GradScaler's dynamic scale (it starts
# at 2^16 and halves on every overflow) that keeps an fp16 loss gradient of 1 finite.
FP16_LOSS_SCALE = 2.0**12
Progress = Callable[[str, int, int], None]
StepStart = tuple[torch.Tensor, Sequence[torch.Tensor | None]]


@dataclass(frozen=True)
class PassSpec:
    """How the recorded pass runs. `dtype` None keeps the model's (`model_dtype` names
    what ran); `amp` is an autocast dtype name; `modules` a regex of the modules recorded;
    `family` the model family (which attention the probes read); `first_step`: keep batch
    0's loss and gradients for the first optimizer step; `notes` for the user."""

    device: torch.device
    dtype: torch.dtype | None
    model_dtype: torch.dtype
    amp: str | None = None
    batches: int = 1
    backward: bool = True
    channels: bool = True
    attention: bool = True
    modules: str | None = None
    family: str = ""
    first_step: bool = False
    notes: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()  # --formats: low-precision readiness of every GEMM
    gemm_error: bool = False  # --gemm-error: each GEMM's output error in those formats

    @classmethod
    def of(
        cls, model: nn.Module, device: torch.device, dtype: torch.dtype | None, **kw: Any
    ) -> PassSpec:
        """The spec for `model` (its weights' dtype is what runs when `dtype` is None); an
        fp16 run with backward says it scales the loss."""
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        spec = cls(device, dtype, weights or torch.float32, **kw)
        if spec.loss_scale == 1.0:
            return spec
        note = (
            f"fp16 run: the backward pass scales the loss by {spec.loss_scale:g} as loss "
            "scaling (GradScaler) does; gradient statistics are unscaled"
        )
        return replace(spec, notes=(note, *spec.notes))

    @property
    def fp16(self) -> bool:
        """An fp16 run: underflow is counted, and the loss is scaled."""
        return self.dtype == torch.float16 or self.amp == "fp16"

    @property
    def loss_scale(self) -> float:
        # fp16 training scales the loss (GradScaler) so gradients clear fp16's smallest
        # normal; the run does the same with a static scale and reports unscaled statistics
        return FP16_LOSS_SCALE if self.fp16 and self.backward else 1.0

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype or self.model_dtype)

    def cast(self, b: Batch) -> Batch:
        return cast_batch(b, self.device, self.dtype)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp:
            return torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.amp])
        return contextlib.nullcontext()


Grads = Sequence[torch.Tensor | None]


class LocalPass:
    """How the pass meets other processes: not at all (one process, all of every batch).

    `actscan.distributed.ranks.ShardedPass` is the same contract for one rank of a
    distributed run, as `ShardedRanks` is `actscan.steps.loop.LocalRanks`' for the steps."""

    world_size: int = 1
    backend: str | None = None
    is_main: bool = True
    sharded: bool = False
    merge: Callable[[Recorder], None] | None = None  # the recorder's cross-rank merge
    # the attention probes' cross-rank merge: (state, spec, device), in place
    merge_state: Callable[[Any, dict[str, str], torch.device], None] | None = None

    def check(self, model: nn.Module, spec: PassSpec, steps: int, source: InputSource) -> None:
        """Refuse, before anything runs, what this process cannot run."""

    def rows_of(self, source: InputSource) -> InputSource:
        """The rows of every global batch this process runs: all of them."""
        return source

    def rows(self, recorded: InputSource) -> int | None:
        """This process's batch size when it runs a share of each batch; None: all."""
        return None

    def grads(self, loss: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[Grads, Grads]:
        """(gradients the recorder reads, gradients the first optimizer step uses) of
        `loss`; `.grad` is never written."""
        grads = dense_grads(torch.autograd.grad(loss, params, allow_unused=True))
        return grads, grads

    def moments(self, tensors: Sequence[torch.Tensor]) -> list[tuple[float, float, int]]:
        """(mean, std, non-finite count) of each parameter."""
        return moments(tensors)

    def settle(self, model: nn.Module) -> None:
        """Leave `model` ready for the recorded pass after the pre-passes (FSDP: resharded)."""

    def step_ranks(self) -> Any:
        """How the optimizer steps meet other processes (actscan.steps.loop.LocalRanks):
        None, one process."""
        return None


class Rider(Protocol):
    """What rides on the recorded pass's first forward instead of a forward of its own
    (actscan.layout.probe.PassProbe: the layout proof and the at-init usage)."""

    def watch(self) -> contextlib.AbstractContextManager[Any]:
        """Around batch 0's forward (not its loss or backward)."""
        ...

    def layout(self) -> Layout:
        """The layout after the pass: the one the records are built on."""
        ...


@dataclass(frozen=True)
class Profiled:
    """The pass as it ran (its layout, inputs, spec and ranks) and what it measured: raw
    sums per recorded name, the modules recorded (in order), the stream's k = 0 name, the
    attention records, notes, whether the backward pass ran, and `step0` (batch 0's loss
    and gradients) for the first optimizer step."""

    layout: Layout
    chosen: ChosenInputs
    spec: PassSpec
    ranks: LocalPass
    raw: dict[str, RawStats]
    targets: tuple[str, ...]
    stream_input: str | None
    attention: tuple[AttentionRecord, ...] = ()
    notes: tuple[str, ...] = ()
    backward: bool = True
    step0: StepStart | None = field(default=None, repr=False)
    low_precision: tuple[LowPrecRecord, ...] = ()
    # --formats fp8 with --steps: the amax history the steps' delayed scaling starts from
    delayed: Delayed | None = field(default=None, repr=False)


def step0_again(model: nn.Module, profiled: Profiled) -> StepStart:
    """Batch 0's loss and the first update's gradients once more, as the pass took them
    (its cast, autocast and loss scale; hooks never change them): for a rerun of the
    steps, after the first run freed the pass's own (`Profiled.step0`) as it stepped."""
    spec, chosen, ranks = profiled.spec, profiled.chosen, profiled.ranks
    b = spec.cast(ranks.rows_of(chosen.source)(0))
    params = [p for p in model.parameters() if p.requires_grad]
    with spec.autocast():
        loss = chosen.loss_of(call_model(model, b), b)
    scale = spec.loss_scale
    _, used = ranks.grads(loss.float() * scale if scale != 1.0 else loss, params)
    return loss.detach(), list(used)


def first_batch(chosen: ChosenInputs, spec: PassSpec) -> Batch:
    """Batch 0 on the run's device and dtype: what the probe pass reads (its first sample)."""
    return spec.cast(chosen.source(0))


@contextlib.contextmanager
def _recorders(
    model: nn.Module, layout: Layout, spec: PassSpec, ranks: LocalPass, rows: int | None
) -> Iterator[tuple[Recorder, list[Recorder], list[tuple[str, nn.Module]]]]:
    """The main recorder (every chosen module and the first stream's input) and one per
    further stream's input (an encoder-decoder's decoder: k = 0 of its stream is its first
    block's input)."""
    mods = dict(model.named_modules())
    targets = list(iter_named(model, spec.modules))
    first = layout.blocks[0].name if layout.blocks else None
    stream_in = (input_name(first), mods[first]) if first is not None else None
    common: dict[str, Any] = {
        "backward": spec.backward,
        "device": spec.device,
        "underflow": spec.fp16,
        "loss_scale": spec.loss_scale,
        "merge": ranks.merge,
        "rows": rows,
        "main": ranks.is_main,
    }
    tokens = stream_names(
        [b.name for b in layout.blocks], [stream_in[0]] if stream_in else [], layout.embed
    )
    with contextlib.ExitStack() as stack:
        rec = stack.enter_context(
            Recorder(
                targets, stream_input=stream_in, channels=spec.channels, tokens=tokens, **common
            )
        )
        extra = [
            stack.enter_context(
                Recorder(
                    [],
                    stream_input=(input_name(name), mods[name]),
                    channels=False,
                    tokens=[input_name(name)],
                    **common,
                )
            )
            for name in stream_inputs(layout)[1:]
        ]
        yield rec, extra, targets


@contextlib.contextmanager
def _lowprec(
    model: nn.Module, spec: PassSpec, world: int = 1, merge: MergeState | None = None
) -> Iterator[tuple[LowPrecWatch | None, Callable[[], contextlib.AbstractContextManager[Any]]]]:
    """The low-precision watch of `--formats` (actscan.measure.lowprec); off: nothing."""
    if not spec.formats:
        yield None, contextlib.nullcontext
        return
    # fp8 delayed scaling over the steps; across ranks, its amax history is MAX-reduced
    # before each step (Delayed.sync), as data-parallel FP8 training reduces it
    delayed = (
        Delayed(merge=merge if world > 1 else None, device=spec.device)
        if spec.first_step and "fp8" in spec.formats
        else None
    )
    with (
        HookSet() as hooks,
        lowprec_watch(
            model,
            spec.formats,
            spec.backward,
            hooks,
            gemm_error=spec.gemm_error,
            delayed=delayed,
        ) as got,
    ):
        yield got


def record_pass(
    model: nn.Module,
    layout: Layout,
    chosen: ChosenInputs,
    spec: PassSpec,
    ranks: LocalPass,
    progress: Progress | None = None,
    ride: Rider | None = None,
) -> Profiled:
    """Run the recorded batches (this process's rows of each) and read the sums back once.

    `ride` watches batch 0's forward; its layout is the one the pass's records carry. A
    model whose loss needs no parameter's gradient skips the backward pass, with a note.
    """
    recorded = ranks.rows_of(chosen.source)
    grad_params = [p for p in model.parameters() if p.requires_grad]
    backward, notes = spec.backward, []
    step0: StepStart | None = None
    with (
        _recorders(model, layout, spec, ranks, ranks.rows(recorded)) as (rec, extra, targets),
        attention_probes(model, layout, spec.family, enabled=spec.attention) as probes,
        _lowprec(model, spec, ranks.world_size, ranks.merge_state) as (lowprec, lowprec_forward),
    ):
        for i in range(spec.batches):
            if progress:
                progress("run", i, spec.batches)
            b = spec.cast(recorded(i))
            riding = ride.watch() if ride is not None and i == 0 else contextlib.nullcontext()
            with torch.set_grad_enabled(backward), spec.autocast():
                with riding, lowprec_forward():
                    out = call_model(model, b)
                loss = chosen.loss_of(out, b) if backward else None
            if backward and loss is not None:
                if not loss.requires_grad or not grad_params:
                    notes.append("no parameter requires grad: backward skipped")
                    backward = False
                else:
                    scale = spec.loss_scale
                    scaled = loss.float() * scale if scale != 1.0 else loss
                    seen, used = ranks.grads(scaled, grad_params)
                    rec.add_param_grads(dict(zip(grad_params, seen, strict=True)))
                    if spec.first_step and i == 0:  # the first update's gradient: no second pass
                        step0 = (loss.detach(), list(used))  # emptied by the first step
                    del seen, used
            del out, loss
            rec.end_batch()
            for r in extra:
                r.end_batch()
        raw = rec.result(spec.batches)
        for r in extra:
            raw.update(r.result(spec.batches))
        if lowprec is not None and ranks.world_size > 1:
            merged = ranks.merge_state is not None and lowprec.merge(ranks.merge_state, spec.device)
            if not merged:
                notes.append(
                    "--formats: the ranks ran different GEMMs; the low-precision figures are "
                    "this rank's rows, not merged"
                )
        low_precision = low_precision_records(lowprec, [b.name for b in layout.blocks])
        if lowprec is not None and spec.device.type == "cpu" and not fused_casts.available():
            notes.append(
                "--formats: the casts ran as torch passes (2-3x a plain pass on CPU); "
                "pip install 'actscan[fast]' compiles them (numba): 1.3-1.4x"
            )
    if ride is not None:
        layout = ride.layout()  # before the attention records, which name roles
        if probes is not None:
            probes.layout = layout
    notes.extend(repeat_notes(model, raw, spec.batches, layout))
    attention = probes.records(merge=ranks.merge_state) if probes is not None else ()
    if probes is not None:
        notes.extend(probes.notes)
    if progress:
        progress("run", spec.batches, spec.batches)
    first = layout.blocks[0].name if layout.blocks else None
    return Profiled(
        layout=layout,
        chosen=chosen,
        spec=spec,
        ranks=ranks,
        raw=raw,
        targets=tuple(n for n, _ in targets),
        attention=attention,
        stream_input=input_name(first) if first is not None else None,
        notes=tuple(notes),
        backward=backward,
        step0=step0,
        low_precision=low_precision,
        delayed=lowprec.delayed if lowprec is not None else None,
    )


def repeated(raw: Mapping[str, RawStats], batches: int) -> dict[str, int]:
    """Modules that ran more than once per forward → how many times, outermost first: a
    shared block's children, which repeat with it, are left to the block's name."""
    counts = {n: r.calls // batches for n, r in raw.items() if r.calls > batches}
    out: dict[str, int] = {}
    for name in sorted(counts, key=lambda n: (n.count("."), n)):
        parts = name.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
        if not any(out.get(a) == counts[name] for a in ancestors):
            out[name] = counts[name]
    return out


def repeat_notes(
    model: nn.Module, raw: Mapping[str, RawStats], batches: int, layout: Layout
) -> list[str]:
    """What a module run several times per forward (weight sharing, a universal
    transformer's looped block, one embedding for encoder and decoder) does to the
    statistics: its hooks see every call, so its row merges all of them; a block's
    applications are one stream point, not one each. Said, so no depth goes unseen."""
    mods = dict(model.named_modules())
    blocks = {b.name for b in layout.blocks}
    found = [(n, k) for n, k in repeated(raw, batches).items() if n in mods]
    notes = []
    looped = [(n, k) for n, k in found if n in blocks]
    if looped:
        shown = ", ".join(f"{n} ({type(mods[n]).__name__}) ×{k}" for n, k in looped[:4])
        more = f" and {len(looped) - 4} more" if len(looped) > 4 else ""
        depth = len(blocks) + sum(k - 1 for _, k in looped)
        notes.append(
            f"blocks run more than once per forward (shared weights): {shown}{more}; the "
            "stream shows one point per block, merging all its applications, so it has "
            f"{len(blocks)} points for {depth} applied blocks"
        )
    # beyond blocks, modules with weights (a dropout or an activation used twice shares none)
    others = [
        f"{n} ({type(mods[n]).__name__}) ×{k}"
        for n, k in found
        if n not in blocks and next(mods[n].parameters(), None) is not None
    ]
    if others:
        more = f" and {len(others) - 4} more" if len(others) > 4 else ""
        notes.append(
            "modules with weights run more than once per forward (shared weights), each "
            "row merging its calls: "
            f"{', '.join(others[:4])}{more}"
        )
    return notes


def _fed(inputs: str | None, fed: str) -> str | None:
    """The header's inputs, with what the invented ones leave out."""
    return f"{inputs} ({fed})" if inputs and fed else inputs


def run_info(profiled: Profiled, *, seed: int, init: str | None, dropout: bool) -> RunInfo:
    """What ran, for the report's header."""
    spec, chosen, ranks = profiled.spec, profiled.chosen, profiled.ranks
    return RunInfo(
        dtype=spec.dtype_name,
        amp=spec.amp,
        device=spec.device.type,
        batch=chosen.batch_size(),
        batches=spec.batches,
        seed=seed,
        seq_len=chosen.seq_len(),
        backward=profiled.backward,
        init=init,
        mode="train",
        dropout=dropout,
        inputs=_fed(describe_batch(chosen.source(0)), chosen.fed),
        loss=chosen.loss,
        world_size=ranks.world_size,
        backend=ranks.backend,
    )
