"""The module as it runs: a `torch.compile`d wrapper's original, a meta-device model
materialised, the run's device and dtype, the forward call whose failure is the user's,
not actscan's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from actscan.errors import UsageError
from actscan.measure.inputs import Batch
from actscan.measure.model_inputs import describe_batch, first_shape
from actscan.measure.unset_config import missing_config_field, unset_config_fields
from actscan.measure.vision_text import runs_on

__all__ = [
    "TORCH_DTYPES",
    "call_model",
    "cast_batch",
    "dense_grads",
    "dtype_name",
    "materialize_meta",
    "model_error_line",
    "one_row_hint",
    "refuse_meta",
    "resolve_device",
    "unwrap_compiled",
]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

COMPILED_NOTE = (
    "torch.compile'd module: profiled its original module (_orig_mod) eagerly, so hooks "
    "see every layer and nothing recompiles"
)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, str | None]:
    """The module `torch.compile` wrapped, and a note saying so; else (model, None).

    Hooks on a compiled graph force recompiles (slow, warnings) and names gain an
    `_orig_mod.` prefix; the original module has the same parameters and runs eagerly.
    """
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner, COMPILED_NOTE
    return model, None


def dense_grads(
    grads: Sequence[torch.Tensor | None],
) -> tuple[torch.Tensor | None, ...]:
    """Each gradient as a strided tensor: a sparse one (`nn.Embedding(sparse=True)`,
    `EmbeddingBag(sparse=True)`) densified. Why: norms, per-row statistics and the
    steps' pieces are strided operations (torch has no sparse `vector_norm`), and a
    sparse gradient's dense equal has the same norms and moves SGD the same way; AdamW
    and Adam, which refuse sparse gradients, then take the dense step. One dense copy
    of that parameter's size, for the pass."""
    return tuple(g.to_dense() if g is not None and g.layout != torch.strided else g for g in grads)


def dtype_name(dt: torch.dtype) -> str:
    """The report's name of a dtype: fp32 | bf16 | fp16, else torch's own (float64)."""
    return {v: k for k, v in TORCH_DTYPES.items()}.get(dt, str(dt).removeprefix("torch."))


def resolve_device(device: str | torch.device | None, model: nn.Module) -> torch.device:
    """Where the run happens: None is the model's own device, "auto" CUDA when present."""
    if device is None:
        p = next(model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    return dev


def cast_batch(batch: Batch, device: torch.device, dtype: torch.dtype | None) -> Batch:
    """`batch` on `device`, its floating tensors in `dtype` (None: their own)."""

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if dtype is not None and v.is_floating_point():
            return v.to(device=device, dtype=dtype)
        return v.to(device)

    return Batch(tuple(move(a) for a in batch.args), {k: move(v) for k, v in batch.kwargs.items()})


def _meta_names(model: nn.Module) -> list[str]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in tensors if t.is_meta]


def refuse_meta(model: nn.Module) -> None:
    """scan() leaves the caller's model as it found it, so it cannot materialise one."""
    names = _meta_names(model)
    if names:
        raise UsageError(
            f"the model is on the meta device ({len(names)} tensors, e.g. {names[0]}): it has "
            "no values to measure; call model.to_empty(device='cpu') and initialise it "
            "(reset_parameters() or your own init) first"
        )


def _hf_init(model: nn.Module) -> bool:
    """transformers' own initialiser (every module, buffers such as rotary frequencies
    included), after clearing the flags that say a module was already initialised."""
    init = getattr(model, "initialize_weights", None)
    if not callable(init) or not hasattr(model, "_init_weights"):
        return False
    # transformers' own flag, set on modules and tensors alike
    flagged: list[Any] = [*model.modules(), *model.parameters(), *model.buffers()]
    for obj in flagged:
        if getattr(obj, "_is_hf_initialized", False):
            obj._is_hf_initialized = False
    init()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return True


def _own_tensors(mod: nn.Module) -> list[str]:
    return [
        n
        for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        if t is not None
    ]


def materialize_meta(model: nn.Module, where: str, seed: int = 0) -> str | None:
    """A model built under `torch.device("meta")` gets real storage on the CPU and each
    module's own initialiser (transformers' `_init_weights`, else `reset_parameters()`).

    Returns a note, or None when nothing was on the meta device. A module with parameters
    or buffers but no initialiser cannot be filled in truthfully: UsageError naming it.
    """
    names = _meta_names(model)
    if not names:
        return None
    if len(names) != len([*model.parameters(), *model.buffers()]):
        raise UsageError(
            f"{where}: part of the model is on the meta device ({names[0]}, …): build it "
            "entirely on one real device"
        )
    lacking = [
        (name or "the root module", mod)
        for name, mod in model.named_modules()
        if _own_tensors(mod)
        and not callable(getattr(mod, "reset_parameters", None))
        and not callable(getattr(mod, "_reset_parameters", None))
    ]
    is_hf = hasattr(model, "_init_weights") and hasattr(model, "config")
    if lacking and not is_hf:
        name, mod = lacking[0]
        raise UsageError(
            f"{where}: the model was built on the meta device and {name} "
            f"({type(mod).__name__}) has no reset_parameters() to initialise it; build the "
            "model on a real device, or call to_empty() and your own init before returning it"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.to_empty(device="cpu")
        with torch.no_grad():
            if not (is_hf and _hf_init(model)):
                for mod in model.modules():
                    reset = getattr(mod, "reset_parameters", None) or getattr(
                        mod, "_reset_parameters", None
                    )
                    if callable(reset) and _own_tensors(mod):
                        reset()
    how = "transformers' _init_weights" if is_hf else "each module's reset_parameters()"
    return f"built on the meta device: materialised on the CPU with {how}"


def _first_line(err: BaseException) -> str:
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


MODEL_ERROR_ATTR = "actscan_model_error"


def model_error_line(err: BaseException) -> str | None:
    """The one line for an error the user's model raised (call_model marked it), else None."""
    line = getattr(err, MODEL_ERROR_ATTR, None)
    return line if isinstance(line, str) else None


def class_name(model: nn.Module) -> str:
    """The model's own class name. FSDP2's `fully_shard` swaps the module's class for a
    subclass it makes on the fly (`FSDPActscanGPT` of `ActscanGPT`): the first class of
    the MRO that is not torch.distributed's is the user's."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(model).__name__


_BATCH_ATTR = "actscan_failed_batch"


@contextlib.contextmanager
def one_row_hint(model: nn.Module) -> Iterator[None]:
    """Around the whole run: when the model raised on a batch of several rows and its
    first row alone runs where the whole batch does not (eval mode, no gradients, both),
    the error's line says so and asks for --batch 1 (TVP views its position embeddings
    with the batch size). Outermost, so the run's hooks, modes and kept state have all
    unwound before the row runs."""
    try:
        yield
    except Exception as err:
        batch = getattr(err, _BATCH_ATTR, None)
        line = model_error_line(err)
        if isinstance(batch, Batch) and line is not None:
            with contextlib.suppress(AttributeError, TypeError):
                delattr(err, _BATCH_ATTR)
            rows = _rows(batch)
            one = _first_row(batch, rows) if rows > 1 else None
            # the whole batch fails under the same probe (eval mode: a model that fails
            # only in training, FastSpeech2's labels, is no batching bug)
            if one is not None and runs_on(model, one) and not runs_on(model, dict(batch.kwargs)):
                line += (
                    f"; it runs on one row, not on {rows}: its forward breaks on a batch (a "
                    "bug of the model's), so scan with --batch 1 (batch=1 in Python)"
                )
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(err, MODEL_ERROR_ATTR, line)
                err.add_note(f"actscan: {line}")
        raise


def _rows(batch: Batch) -> int:
    """The batch's rows: its token ids', else its first tensor's leading size; 0 in a
    process group (a rank must not rerun alone: its collectives would wait forever)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 0
    shape = first_shape(batch)
    return shape[0] if shape else 0


def _first_row(batch: Batch, rows: int) -> dict[str, Any] | None:
    """The batch's first row as keyword arguments: every tensor of `rows` rows sliced;
    None for positional inputs."""
    if batch.args:
        return None

    def first(v: Any) -> Any:
        return v[:1] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v

    return {k: first(v) for k, v in batch.kwargs.items()}


def call_model(model: nn.Module, batch: Batch) -> Any:
    """`model(*args, **kwargs)`. An error the model raises keeps its type for Python
    callers (with a note saying on what inputs), and is marked as the user's, so the CLI
    gives its first line with exit 2 rather than an internal error. The line names the
    config fields left None that the failing code read (`unset_config_fields`), or the
    one it lacks (`missing_config_field`); else it keeps the batch for `one_row_hint`."""
    try:
        return model(*batch.args, **batch.kwargs)
    except Exception as err:
        what = describe_batch(batch) or "its inputs"
        line = f"{class_name(model)} failed on {what}: {_first_line(err)}"
        unset = unset_config_fields(err, model)
        if unset:  # a field its checkpoints set and this config leaves None
            fields = ", ".join(f"{f} = None" for f in unset)
            line = (
                line.rstrip(":")
                + f"; the failing code reads its config's {fields}: set it in config.json"
            )
        missing = missing_config_field(err, model)
        if missing:  # a field its config class no longer declares (older checkpoints carry it)
            line += f"; its config has no {missing}: set it in config.json"
        if not unset and not missing:  # `one_row_hint` tries one row once the run unwound
            with contextlib.suppress(AttributeError, TypeError):
                setattr(err, _BATCH_ATTR, batch)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(err, MODEL_ERROR_ATTR, line)
        err.add_note(f"actscan: raised by the model: {line}")
        raise
