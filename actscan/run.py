"""`scan()`: the one entry point the CLI and users' tests call.

It measures one model on given (or random) inputs and returns a Report, and leaves the
model exactly as it found it: train/eval mode of every module, hooks, requires_grad,
`.grad`, dtype and device (casts swap `param.data` and swap the originals back), and the
running statistics of its normalisation layers.

The run is in train mode, as training runs: BatchNorm normalises with the batch's
statistics (in eval mode at init it is the identity, which hides what training sees).
Dropout is off by default, so runs are reproducible and comparable (`dropout=True` keeps it).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from actscan.diagnose import CheckContext, evaluate
from actscan.diagnose.thresholds import DEFAULT, Thresholds
from actscan.distributed.runtime import current as dist_current
from actscan.errors import UsageError
from actscan.layout.detect import detect_layout, is_norm
from actscan.layout.probe import probe_pass
from actscan.layout.usage import Usage
from actscan.measure.attention import attention_probes
from actscan.measure.inputs import Batch, InputSource, default_loss, token_source, user_source
from actscan.measure.model_inputs import describe_batch, hf_input_source
from actscan.measure.prepare import call_model, check_positions, refuse_meta, unwrap_compiled
from actscan.measure.recorder import Recorder, iter_named, moments
from actscan.measure.stats import growth_fit, layer_record, stream_points
from actscan.measure.streams import (
    all_points,
    input_name,
    primary,
    stream_branch_records,
    stream_records,
)
from actscan.measure.streams import stream_inputs as stream_input_blocks
from actscan.measure.tokens import channel_maxima, stream_names, streams_with_views, with_views
from actscan.records import Layout, ModelInfo, ParamRecord, RunInfo, StreamRecord, Summary
from actscan.report.report import Report
from actscan.settings import Ignore, apply_ignores, parse_ignores
from actscan.steps.loop import StepSpec, StepsRaw, caller_state, dynamics_record, run_steps
from actscan.targets.stored_dtype import stored_dtype_note

# Static loss scale of fp16 runs: a steady state of GradScaler's dynamic scale (it starts
# at 2^16 and halves on every overflow) that keeps an fp16 loss gradient of 1 finite.
FP16_LOSS_SCALE = 2.0**12
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Progress = Callable[[str, int, int], None]


def dtype_name(dt: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}.get(dt, str(dt).removeprefix("torch."))


def resolve_device(device: str | torch.device | None, model: nn.Module) -> torch.device:
    if device is None:
        p = next(model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    return dev


def infer_info(model: nn.Module, source: str = "python") -> ModelInfo:
    """What can be read off an nn.Module without a resolver's help.

    A module handed over in code (the API, `module:callable`) is taken to be at init: that
    is how tests and CI build models, and init-scale is what catches a broken init there.
    Trained weights say so with `scan(at_init=False)` (`--trained`).
    """
    from actscan.models.gpt import ActscanGPT, arch_facts

    n_params = sum(p.numel() for p in model.parameters())
    if isinstance(model, ActscanGPT):
        cfg = model.config
        return ModelInfo(
            source=source, family="actscan-gpt", n_params=n_params, n_blocks=cfg.n_layers,
            d_model=cfg.d_model, vocab_size=cfg.vocab_size, task="causal-lm", at_init=True,
            arch={**arch_facts(cfg), "max_positions": cfg.seq_len},
        )  # fmt: skip
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type:
        vocab = getattr(config, "vocab_size", None)
        d = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        is_lm = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        return ModelInfo(
            source=source, family=str(model_type), n_params=n_params, d_model=d,
            vocab_size=vocab, task="causal-lm" if is_lm else "encoder", at_init=True,
        )  # fmt: skip
    return ModelInfo(source=source, family="custom", n_params=n_params, at_init=True)


def _fan(mod: nn.Module, shape: tuple[int, ...]) -> tuple[int | None, int | None]:
    if len(shape) < 2:
        return None, None
    if type(mod).__name__ == "Conv1D":  # HF GPT-2 stores (in, out)
        return shape[0], shape[1]
    rf = 1
    for s in shape[2:]:
        rf *= s
    return shape[1] * rf, shape[0] * rf


def _measured(
    usage: Usage, full: str, shape: tuple[int, ...], kind: str, of_norm: bool
) -> tuple[str, int | None, int | None]:
    """(kind, fan_in, fan_out) from how the forward pass used the parameter."""
    use = usage.role(full)
    if of_norm and use is None:
        return kind, None, None  # norm gains and biases: judged on the norm's own terms
    if use is None:
        return ("scalar" if len(shape) <= 1 and math.prod(shape) <= 1 else "structured"), None, None
    if use.op == "embedding":
        return "embedding", None, None
    if use.op == "bias":
        return "bias", None, None
    return "weight", use.fan_in, use.fan_out


def param_records(
    model: nn.Module,
    layout: Layout,
    usage: Usage | None = None,
    gains: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[ParamRecord, ...]:
    """mean/std/non-finite count of every parameter, one host transfer for all.

    With `usage` (measured at init), kind and fan-in come from how the forward pass used
    each parameter, and `gains` (norm module → effective gain mean, std) replace reading a
    norm's `weight` as its gain; without, they are guessed from module types and shapes.
    """
    seen: set[int] = set()
    entries: list[tuple[str, str, nn.Module, nn.Parameter]] = []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            entries.append((f"{mname}.{pname}" if mname else pname, mname, mod, p))
    if not entries:
        return ()
    measure = moments
    if dist_current() is not None:  # sharded parameters: local shards, merged exactly
        from actscan.distributed.merge import sharded_moments as measure
    host = measure([p for _, _, _, p in entries])  # fast passes; Welford is 10× slower
    out = []
    for (full, mname, mod, p), (mean, std, bad) in zip(entries, host, strict=True):
        shape = tuple(p.shape)
        pname = full.rsplit(".", 1)[-1]
        fan_in, fan_out = _fan(mod, shape)
        if isinstance(mod, nn.Embedding) or type(mod).__name__.endswith("Embedding"):
            kind = "embedding"
        elif is_norm(mod):
            kind = "norm-gain" if pname == "weight" else "bias"
        elif len(shape) >= 2:
            kind = "weight"
        elif pname == "bias":
            kind = "bias"
        elif len(shape) <= 1 and p.numel() <= 1:
            kind = "scalar"
        else:
            kind = "other"
        gain = (gains or {}).get(mname) if kind == "norm-gain" else None
        if usage is not None:
            kind, fan_in, fan_out = _measured(usage, full, shape, kind, is_norm(mod))
        out.append(
            ParamRecord(
                name=full, module=mname, role=layout.role(mname), block=layout.block_of.get(mname),
                shape=shape, mean=mean, std=std, fan_in=fan_in, fan_out=fan_out, kind=kind,
                nonfinite=int(bad), gain=gain[0] if gain else None,
                gain_std=gain[1] if gain else None,
            )
        )  # fmt: skip
    return tuple(out)


# Buffers a forward in train mode updates in place (BatchNorm, InstanceNorm with
# track_running_stats): their values are copied before the run and written back after.
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")
_DROP_ATTR = re.compile(r"drop", re.I)  # attention_dropout, attn_pdrop, layerdrop, drop_path_rate…


def _rates(obj: Any) -> list[tuple[Any, str, float]]:
    """(owner, name, value) of the positive float dropout rates an object holds as plain
    attributes (HF attention modules pass them to sdpa/F.dropout when `training`)."""
    items = vars(obj).items() if hasattr(obj, "__dict__") else ()
    return [
        (obj, k, v) for k, v in items
        if _DROP_ATTR.search(k) and type(v) is float and v > 0
    ]  # fmt: skip


@contextlib.contextmanager
def train_mode(model: nn.Module, dropout: bool = False) -> Iterator[None]:
    """Train mode as training runs it, with dropout off unless `dropout`; every module's
    mode, every dropout rate and every running statistic restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    running = [
        (b, b.clone()) for m in model.modules() for k, b in m._buffers.items()
        if b is not None and k in _RUNNING
    ]  # fmt: skip
    rates: list[tuple[Any, str, float]] = []
    try:
        model.train()
        if not dropout:
            for m in model.modules():
                if isinstance(m, nn.modules.dropout._DropoutNd):
                    m.eval()  # identity
                    rates.append((m, "p", m.p))
                else:
                    rates += _rates(m)
            config = getattr(model, "config", None)
            if config is not None:
                rates += _rates(config)
            for owner, name, _ in rates:
                setattr(owner, name, 0.0)
        yield
    finally:
        for owner, name, value in rates:
            setattr(owner, name, value)
        with torch.no_grad():
            for b, saved in running:
                b.copy_(saved)
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def preserved(
    model: nn.Module, device: torch.device, dtype: torch.dtype | None, *, dropout: bool = False
) -> Iterator[None]:
    """Run-time mode/dtype/device; every module's mode and tensor restored on exit."""
    params = list(model.parameters())
    saved_params = [p.data for p in params]
    saved_buffers = [
        (m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None
    ]
    with train_mode(model, dropout):
        try:
            for p in params:
                want = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
                if p.device != device or p.dtype != want:
                    p.data = p.data.to(device=device, dtype=want)
            for m, k, b in saved_buffers:
                want = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
                if b.device != device or b.dtype != want:
                    m._buffers[k] = b.to(device=device, dtype=want)
            yield
        finally:
            for p, data in zip(params, saved_params, strict=True):
                p.data = data
            for m, k, b in saved_buffers:
                m._buffers[k] = b


def cast_batch(batch: Batch, device: torch.device, dtype: torch.dtype | None) -> Batch:
    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if dtype is not None and v.is_floating_point():
            return v.to(device=device, dtype=dtype)
        return v.to(device)

    return Batch(tuple(move(a) for a in batch.args), {k: move(v) for k, v in batch.kwargs.items()})


def scan(
    model: nn.Module,
    inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    batches: int = 1,
    backward: bool = True,
    modules: str | None = None,
    thresholds: Mapping[str, float | str] | Thresholds | None = None,
    amp: str | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    batch: int = 4,
    seq_len: int | None = None,
    info: ModelInfo | None = None,
    layout: Layout | None = None,
    init: str | None = None,
    channels: bool = True,
    progress: Progress | None = None,
    ignore: Iterable[Ignore | Mapping[str, Any]] | None = None,
    at_init: bool | None = None,
    dropout: bool = False,
    steps: int = 0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup: int = 0,
    attention: bool = True,
    decode_token: Callable[[int], str] | None = None,
) -> Report:
    """Measure one forward+backward pass (× `batches`) of `model`.

    The API is in the README, "pytest".

        inputs: a tensor, a tuple of positional args, a dict of kwargs, a list of those (one
          per batch) or a callable batch_index -> one of those. None: random token ids of
          shape (batch, seq_len) for language models and encoders.
        loss_fn(output) -> scalar tensor; default: next-token cross-entropy for language
          models, a fixed random projection for encoders, else mean square of the output.
        ignore: findings you accept, as `[tool.actscan] ignore` lists them: rules
          {"check": id, "reason": why, "layers": regex (optional)} or `Ignore`s. Matching
          findings leave `report.findings`, so `assert_healthy` gates as the CLI does;
          `find_project_config().ignores` (actscan.settings) gives the project's own.
        at_init: whether the weights are an initialization (init-scale checks run). None:
          `info.at_init` when `info` is given, else True (a module built in code is taken to
          be at init); pass False for trained weights.
        dropout: keep dropout on (nn.Dropout* modules and the dropout rates attention
          modules and HF configs hold). Off by default: the run is in train mode (norms use
          batch statistics) but reproducible.
        steps: after the step-0 profile, take this many optimizer steps (`optimizer`
          "adamw" | "adam" | "sgd", `lr`, `betas`, `eps`, `weight_decay`, linear
          `warmup` steps) and measure each t = 0..N into `report.dynamics`
          (actscan.steps.loop says what and how). The report's layers, stream and
          findings stay the step-0 measurement; the model's weights, `.grad`, modes and
          buffers are restored bit for bit afterwards, also when a step raises. A model
          with `actscan_param_groups(lr) -> list[dict]` trains with its own param groups.
          As a rank of a distributed run, the optimizer steps the FSDP2 shards and every
          figure is reduced across ranks (actscan.distributed.steps); each rank restores
          its own shards.
        attention: per-head attention probes (score max/std, entropy, sink: the report's
          `attention`); False switches them off (`--no-attention`).
        decode_token: token id -> its text (the tokenizer's), for the per-token view
          (`top_values[].text`, massive-activations); None: ids only.
    """
    ignores = parse_ignores(ignore, origin="scan()") if ignore is not None else ()
    spec = StepSpec(steps, optimizer, lr, tuple(betas), eps, weight_decay, warmup).check()
    if steps and not backward:
        raise UsageError("--steps needs the backward pass: drop --no-backward")
    if batches < 1:
        raise UsageError(f"batches must be ≥ 1, got {batches}")
    if modules is not None:
        try:
            re.compile(modules)
        except re.error as err:
            raise UsageError(f"--modules: invalid regex {modules!r}: {err}") from None
    th = thresholds if isinstance(thresholds, Thresholds) else DEFAULT.with_overrides(thresholds)
    if isinstance(dtype, str):
        if dtype not in TORCH_DTYPES:
            raise UsageError(f"dtype must be one of fp32|bf16|fp16, got {dtype!r}")
        run_dtype: torch.dtype | None = TORCH_DTYPES[dtype]
    else:
        run_dtype = dtype
    if amp is not None and amp not in ("bf16", "fp16"):
        raise UsageError(f"amp must be bf16 or fp16, got {amp!r}")
    model, compiled_note = unwrap_compiled(model)
    refuse_meta(model)
    dev = resolve_device(device, model)
    info = with_at_init(info or infer_info(model), at_init)
    layout = layout or detect_layout(model, info.family)

    source: InputSource
    seq = seq_len
    if inputs is not None:
        source = user_source(inputs)
    elif (hf_source := hf_input_source(model, batch=batch, seq_len=seq_len, seed=seed)) is not None:
        source = hf_source
    elif info.vocab_size and info.task in ("causal-lm", "encoder"):
        seq = seq_len or min(64, int(info.arch.get("max_positions") or 64))
        check_positions(model, seq)
        source = token_source(
            info.vocab_size, batch, seq, seed, mask=info.task == "encoder",
            as_kwargs=info.family != "actscan-gpt",
        )  # fmt: skip
    else:
        raise UsageError(
            "cannot invent inputs for this model: pass inputs= (or --input-shape on the CLI)"
        )
    loss_default = default_loss(info.task, info.vocab_size)
    dist_run = dist_current()
    merge = None
    recorded = source  # the rows this process runs: all of them, or a rank's share
    if dist_run is not None:
        from actscan.distributed.fsdp import check_supported, local_grad, sharded_grads
        from actscan.distributed.merge import merge_recorder as merge
        from actscan.distributed.runtime import shard_source

        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        check_supported(run_dtype, model_dtype=weights or torch.float32)
        recorded = shard_source(source, dist_run, _batch_size(source))
        if steps:  # the sharded optimizer steps FSDP2's shards (distributed/steps.py)
            from actscan.distributed.steps import check_sharded

            check_sharded(model)
    rows = _batch_size(recorded) if dist_run is not None else None  # a rank's batch

    def compute_loss(out: Any, b: Batch) -> torch.Tensor:
        if loss_fn is not None:
            return loss_fn(out)
        return loss_default(out, b)

    targets = list(iter_named(model, modules))
    stream_in = (
        (f"{layout.blocks[0].name}:input", dict(model.named_modules())[layout.blocks[0].name])
        if layout.blocks
        else None
    )
    token_names = stream_names(
        [b.name for b in layout.blocks], [stream_in[0]] if stream_in else [], layout.embed
    )
    notes: list[str] = [layout.note] if layout.note else []
    if compiled_note:
        notes.append(compiled_note)
    model_dtype = next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
    )
    did_backward = backward
    grad_params = [p for p in model.parameters() if p.requires_grad]

    usage: Usage | None = None
    gains: dict[str, tuple[float, float]] | None = None
    fp16_run = run_dtype == torch.float16 or amp == "fp16"
    # fp16 training scales the loss (GradScaler) so gradients clear fp16's smallest normal;
    # the run does the same with a static scale and reports unscaled statistics.
    loss_scale = FP16_LOSS_SCALE if fp16_run and backward else 1.0
    if loss_scale != 1.0:
        notes.append(
            f"fp16 run: the backward pass scales the loss by {loss_scale:g} as loss scaling "
            "(GradScaler) does; gradient statistics are unscaled"
        )
    stored_note = stored_dtype_note(info.arch, dtype_name(run_dtype or model_dtype))
    if stored_note:
        notes.append(stored_note)
    step0: tuple[torch.Tensor, Any] | None = None
    raw_steps: StepsRaw | None = None
    restore = caller_state(model) if steps else contextlib.nullcontext()
    with restore as kept, preserved(model, dev, run_dtype, dropout=dropout):
        # Layout self-check and, at init, fan-in and norm gains: one batch-1 forward.
        first = cast_batch(source(0), dev, run_dtype)
        probe = probe_pass(
            model, layout, first, at_init=info.at_init, autocast=lambda: _autocast(dev, amp)
        )
        proof, layout, usage, gains = probe.proof, probe.proof.layout, probe.usage, probe.gains
        notes.extend(probe.notes)
        if dist_run is not None:  # the pre-passes leave FSDP's root unsharded
            from actscan.distributed.fsdp import reshard_all

            reshard_all(model)
        autocast = (
            torch.autocast(dev.type, dtype=TORCH_DTYPES[amp]) if amp else contextlib.nullcontext()
        )
        with (
            Recorder(
                targets,
                stream_input=stream_in,
                backward=backward,
                channels=channels,
                device=dev,
                underflow=fp16_run,
                loss_scale=loss_scale,
                merge=merge,
                rows=rows,
                main=dist_run is None or dist_run.is_main,
                tokens=token_names,
            ) as rec,
            _extra_inputs(model, layout, backward, dev, fp16_run, loss_scale, merge, rows) as extra,
            attention_probes(model, layout, info.family, enabled=attention) as probes,
        ):
            for i in range(batches):
                if progress:
                    progress("run", i, batches)
                b = cast_batch(recorded(i), dev, run_dtype)
                with torch.set_grad_enabled(backward), autocast:
                    out = call_model(model, b)
                    loss = compute_loss(out, b) if backward else None
                if backward and loss is not None:
                    if not loss.requires_grad or not grad_params:
                        did_backward = False
                        notes.append("no parameter requires grad: backward skipped")
                        backward = False
                    else:
                        scaled = loss.float() * loss_scale if loss_scale != 1.0 else loss
                        if dist_run is not None:  # FSDP: local shards of reduced grads
                            dgrads = sharded_grads(scaled, grad_params, dist_run.world_size)
                            local = [local_grad(g) for g in dgrads]
                            rec.add_param_grads(dict(zip(grad_params, local, strict=True)))
                            if steps and i == 0:  # the first update's (sharded) gradient
                                step0 = (loss.detach(), dgrads)
                            del dgrads, local
                        else:
                            grads = torch.autograd.grad(scaled, grad_params, allow_unused=True)
                            rec.add_param_grads(dict(zip(grad_params, grads, strict=True)))
                            if steps and i == 0:  # the first update's gradient: no second pass
                                step0 = (loss.detach(), grads)
                            del grads
                del out, loss
                rec.end_batch()
                for r in extra:
                    r.end_batch()
            raw = rec.result(batches)
            for r in extra:
                raw.update(r.result(batches))
        attn_records = probes.records(merge=dist_run is not None) if probes is not None else ()
        if probes is not None:
            notes.extend(probes.notes)
        if progress:
            progress("run", batches, batches)
        if steps:
            if step0 is None:
                raise UsageError(
                    "--steps: no parameter requires grad, so there is nothing to train"
                )
            raw_steps = run_steps(
                model, spec, layout=layout, source=source, step0=step0, loss_of=compute_loss,
                prepare=lambda b: cast_batch(b, dev, run_dtype),
                autocast=lambda: (
                    torch.autocast(dev.type, dtype=TORCH_DTYPES[amp]) if amp
                    else contextlib.nullcontext()
                ),
                loss_scale=loss_scale, vocab_size=info.vocab_size, progress=progress,
                attention=attention, checked={r.name for r in attn_records},
                ranks=_step_ranks(dist_run), w0=kept,
            )  # fmt: skip
            step0 = None

    params_before = param_records(model, layout, usage, gains)  # weights are unchanged
    mods = dict(model.named_modules())
    records = {
        name: layer_record(
            r, type_name=_type_name(mods[name]) if name in mods else "StreamInput",
            role=layout.role(name) if name in mods else "stream",
            block=layout.block_of.get(name), batches=batches, th=th,
        )
        for name, r in raw.items()
    }  # fmt: skip
    layers = tuple(records[n] for n, _ in targets if records[n].calls > 0)
    streams: tuple[StreamRecord, ...] = ()
    main = None
    if layout.streams:  # an encoder-decoder: the decoder's stream is `stream`/`summary`
        streams = stream_records(layout, records)
        main = primary(streams)
    stream = (
        main.points
        if main is not None
        else stream_points(layout, records, stream_in[0] if stream_in else None)
    )
    stream = with_views(stream, raw, source, decode_token)
    streams = streams_with_views(streams, raw, source, decode_token)
    fit = growth_fit(stream)
    run = RunInfo(
        dtype=dtype_name(run_dtype or model_dtype), amp=amp, device=dev.type,
        batch=_batch_size(source), batches=batches, seed=seed,
        seq_len=seq if seq and source(0).token_ids is not None else _seq_len(source),
        backward=did_backward, init=init, mode="train", dropout=dropout,
        inputs=describe_batch(source(0)),
        world_size=dist_run.world_size if dist_run else 1,
        backend=dist_run.backend if dist_run else None,
    )  # fmt: skip
    info = _with_blocks(info, layout)
    dynamics = dynamics_record(raw_steps, stream, params_before) if raw_steps else None
    ctx = CheckContext(
        info=info, run=run, layout=layout, layers=layers, stream=stream, fit=fit,
        params=params_before, thresholds=th, streams=streams, dynamics=dynamics,
        attention=attn_records,
    )  # fmt: skip
    summary = Summary(
        growth_exponent=fit.exponent, gain_per_block=fit.gain, growth=fit.growth,
        var_intercept=fit.var_a, var_slope=fit.var_b, grad_ratio=fit.grad_ratio,
    )  # fmt: skip
    checked, skipped = evaluate(ctx)
    findings, _ = apply_ignores(checked, ignores)
    return Report(
        model=info, run=run, layers=layers, stream=stream, findings=findings,
        summary=summary, params=params_before, notes=tuple(dict.fromkeys(notes)),
        branches=stream_branch_records(layout, layers, stream, streams), layout=proof.proofs,
        skipped=skipped, streams=streams, dynamics=dynamics, attention=attn_records,
        channel_maxima=channel_maxima(all_points(stream, streams), raw),
    )  # fmt: skip


def _step_ranks(run: Any) -> Any:
    """How the steps meet other processes: not at all (None), or as a rank of `run`."""
    if run is None:
        return None
    from actscan.distributed.steps import ShardedRanks

    return ShardedRanks(run)


@contextlib.contextmanager
def _extra_inputs(
    model: nn.Module,
    layout: Layout,
    backward: bool,
    dev: torch.device,
    underflow: bool,
    loss_scale: float,
    merge: Callable[[Recorder], None] | None = None,
    rows: int | None = None,
) -> Iterator[list[Recorder]]:
    """One recorder per further stream's input (an encoder-decoder's decoder: k = 0 of its
    stream is its first block's input), beside the main recorder's own stream input."""
    mods = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                Recorder(
                    [], stream_input=(input_name(name), mods[name]), backward=backward,
                    channels=False, device=dev, underflow=underflow, loss_scale=loss_scale,
                    merge=merge, rows=rows, main=rows is None or dist_current().is_main,
                    tokens=[input_name(name)],
                )
            )
            for name in stream_input_blocks(layout)[1:]
        ]  # fmt: skip


def _autocast(dev: torch.device, amp: str | None) -> contextlib.AbstractContextManager[Any]:
    """The run's autocast (a fresh one per use), or nothing without --amp."""
    if amp:
        return torch.autocast(dev.type, dtype=TORCH_DTYPES[amp])
    return contextlib.nullcontext()


def with_at_init(info: ModelInfo, at_init: bool | None) -> ModelInfo:
    """`info` with the caller's at-init judgement (`--at-init/--trained`, `scan(at_init=)`);
    None keeps the resolver's."""

    return info if at_init is None or at_init == info.at_init else replace(info, at_init=at_init)


def _type_name(mod: nn.Module) -> str:
    """The module's class name; FSDP2's wrapper class (`FSDPBlock`) reads as `Block`."""
    cls = type(mod)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)).__name__
    return cls.__name__


def _with_blocks(info: ModelInfo, layout: Layout) -> ModelInfo:

    return replace(info, n_blocks=len(layout.blocks)) if layout.blocks else info


def _first_shape(source: InputSource) -> tuple[int, ...]:
    b = source(0)
    t = b.token_ids
    if t is None:
        from actscan.measure.recorder import first_tensor

        t = first_tensor((b.args, b.kwargs))
    return tuple(t.shape) if t is not None else ()


def _batch_size(source: InputSource) -> int:
    shape = _first_shape(source)
    return shape[0] if shape else 0


def _seq_len(source: InputSource) -> int:
    if source(0).token_ids is None and {"pixel_values", "input_values", "input_features"} & set(
        source(0).kwargs
    ):
        return 0  # images and audio have no sequence of tokens; RunInfo.inputs says what
    shape = _first_shape(source)
    return shape[1] if len(shape) >= 2 else 0
