"""Hugging Face targets: a model folder, a `config.json` alone, a config + bare weights.

- Folder (`config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`):
  the transformers Auto class the config names (the causal-LM class when the checkpoint is a
  language model, else the base model, e.g. BERT's encoder), with the folder's weights.
- `config.json` alone: the model at transformers' own initialization (`from_config`), so an
  architecture can be checked before training; `--init` re-initializes it with an actscan
  scheme and `--set key=value` edits config fields.
- A Hugging Face config with a bare `.safetensors` file (`resolve_hf_checkpoint`, called by
  targets/checkpoint.py).

Why actscan loads weights itself instead of `from_pretrained`: every file goes through the
strict safetensors validator (safetensors_io) and every mismatch is listed in one line
(targets/weights.py), never a multi-line warning the user may miss. The model is built with
weight initialization skipped (fast at any size), tied per its config, then filled by copy;
the copy casts to fp32 (`--dtype` casts again for the run) and never aliases the file.
Key renames transformers knows (GPT-NeoX's `embed_out`, a `bert.` prefix) are applied;
checkpoints that only fit after tensors are merged (per-expert MoE weights into fused
experts) go through transformers' own loader, after the same validation and NaN scan.

Safety: offline only (`HF_HUB_OFFLINE`), `trust_remote_code` is never set: a model_type
transformers does not implement natively is refused; an `auto_map` beside a native
model_type gets the native code (as transformers does), with a note. Pickle weights are
refused. Attention runs the `eager` implementation so attention probabilities exist as
tensors and results are deterministic.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.errors import BadInputError, ConfigError, UsageError
from actscan.targets.resolve import Resolved, TargetOptions
from actscan.types import ModelInfo

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Checkpoint entries that are derived buffers, not weights (older transformers saved them).
_IGNORABLE_UNEXPECTED = (
    r"(^|\.)position_ids$",
    r"(^|\.)rotary_emb\.(original_)?inv_freq$",
    r"(^|\.)masked_bias$",
)
# Post-LN families (norm after the residual add). Others are taken as pre-LN.
_POST_LN = frozenset(
    {"bert", "roberta", "xlm-roberta", "electra", "camembert", "ernie", "mpnet", "distilbert",
     "albert", "deberta", "deberta-v2", "megatron-bert", "roberta-prelayernorm", "xmod"}
)  # fmt: skip
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


# --------------------------------------------------------------------------- config


def _offline() -> None:
    """Never touch the network, whatever the user's environment says."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers logs config advice (token ids, is_decoder) that is noise here."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def hf_config(
    data: Mapping[str, Any], where: str, overrides: Mapping[str, str] | None = None
) -> Any:
    """A transformers config object from a parsed config.json, offline and without custom code.

    Refused with one line: no model_type, a model_type this transformers does not implement
    (custom code, or too old), encoder-decoder and quantized models.
    """
    _offline()
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f'{where}: not a Hugging Face config (no "model_type")')
    if model_type not in CONFIG_MAPPING:
        # As transformers itself with trust_remote_code=False: custom code (auto_map) is
        # only ever replaced by a native implementation of the same model_type, never run.
        classes = data.get("auto_map")
        custom = (
            f" (custom code: auto_map {', '.join(map(str, classes.values()))})"
            if isinstance(classes, dict) and classes
            else ""
        )
        raise BadInputError(
            f"{where}: model_type '{model_type}' needs trust_remote_code{custom}, which "
            f"actscan never runs (not native to transformers {transformers.__version__}); "
            "profile your module with package.module:callable instead"
        )
    try:
        with _quiet():
            config = CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as err:  # transformers validates fields with many error types
        raise ConfigError(f"{where}: invalid {model_type} config: {_first_line(err)}") from None
    if overrides:
        _apply_overrides(config, overrides, model_type)
    if getattr(config, "is_encoder_decoder", False):
        raise BadInputError(
            f"{where}: '{model_type}' is an encoder-decoder model, which actscan does not "
            "profile yet (decoder-only and encoder-only models are supported)"
        )
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise BadInputError(
            f"{where}: quantized checkpoints ({method}) are not supported: profile the "
            "unquantized model"
        )
    return config


def config_notes(data: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """Remarks for the report about how the config was read."""
    if "auto_map" in data:
        return (
            f"{where} names custom code (auto_map); using transformers' native "
            f"'{data.get('model_type')}' implementation instead (custom code is never run)",
        )
    return ()


def _apply_overrides(config: Any, overrides: Mapping[str, str], model_type: str) -> None:
    """`--set key=value` on a transformers config: the value takes the field's type."""
    known = config.to_dict()
    for key, raw in overrides.items():
        if key not in known and not hasattr(config, key):
            near = [k for k in sorted(known) if key.lower() in k.lower()][:5]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"--set {key}: unknown field for a '{model_type}' config{hint}")
        value = _coerce(getattr(config, key, None), raw, key)
        try:
            setattr(config, key, value)
        except Exception as err:
            raise ConfigError(f"--set {key}={raw}: {_first_line(err)}") from None


def _coerce(current: Any, raw: str, key: str) -> Any:
    """String from the command line -> the type the config field already has."""
    text = raw.strip()
    try:
        if isinstance(current, bool):
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, str):
            return text
    except ValueError as err:
        kind = type(current).__name__
        raise ConfigError(f"--set {key}={raw}: expected {kind} ({err})") from None
    if text.lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)  # numbers, lists, dicts for fields that default to None
    except ValueError:
        return text


def _causal_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        out.update([v] if isinstance(v, str) else v)
    return out


def wants_causal_lm(config: Any) -> bool:
    """Causal-LM class when the checkpoint is one, else the base model.

    `architectures` (written by save_pretrained) decides when present: GPT2LMHeadModel and
    LlamaForCausalLM are language models, BertModel/BertForMaskedLM are encoders (BERT also
    has a causal-LM class, BertLMHeadModel, but that is not what its checkpoints are).
    Without it: causal when transformers has a causal-LM class and no masked-LM class.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if archs:
        names = _causal_names()
        return any(a in names for a in archs)
    mt = config.model_type
    return mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


# --------------------------------------------------------------------------- build


def _transformers_major() -> int:
    import transformers

    m = re.match(r"(\d+)", transformers.__version__)
    return int(m.group(1)) if m else 0


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip weight initialization (the checkpoint overwrites every weight)."""
    try:
        from transformers.initialization import no_init_weights  # transformers ≥ 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # transformers 4.x
    with no_init_weights():
        yield


def build_hf_model(config: Any, where: str, *, empty: bool, seed: int = 0) -> nn.Module:
    """The Auto-class model for `config`, in fp32, eager attention, tied per its config.

    empty=True skips initialization (weights are loaded next); else transformers' own
    initialization runs under `seed` (the global RNG is restored afterwards).
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if wants_causal_lm(config) else AutoModel
    dtype_kw = "dtype" if _transformers_major() >= 5 else "torch_dtype"
    kwargs = {"attn_implementation": "eager", dtype_kw: torch.float32}
    try:
        with _quiet(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if empty:
                with _no_init():
                    model = auto.from_config(config, **kwargs)
                model.tie_weights()  # post_init's tying is skipped with init
            else:
                model = auto.from_config(config, **kwargs)
    except (BadInputError, UsageError):
        raise
    except Exception as err:  # a config transformers cannot build (bad sizes, …)
        raise ConfigError(
            f"{where}: transformers cannot build a '{config.model_type}' model from this "
            f"config: {_first_line(err)}"
        ) from None
    return model


def reinit(model: nn.Module, scheme: str, init_std: float, seed: int) -> None:
    """`--init SCHEME` on a transformers model, with the built-in family's std rules.

    Linear (and GPT-2's transposed Conv1D) weights ~ N(0, std(scheme, fan_in, fan_out)),
    biases 0; embeddings N(0, init_std) for gpt2 (init_std/10 for small), else N(0, 1);
    norm gains 1 and biases 0. A tied head is the embedding's tensor and is left to it.
    Measured, not guessed (actscan/models/reinit.py): a norm's gain is 1 as the norm applies
    it (w = 0 for (1 + w) norms); other matmul weights (fused 3-D MoE experts) get the same
    rule with the fan-in the forward pass contracts over; structured biases are kept.
    """
    import torch
    from torch import nn

    from actscan.measure.structure import is_norm
    from actscan.models.arch import INITS, ArchConfig
    from actscan.models.gpt import _linear_std
    from actscan.models.reinit import init_unhandled_, is_linear_bias, token_usage, unit_gain_

    if scheme not in INITS:
        raise ConfigError(f"--init must be one of {'|'.join(INITS)}, got '{scheme}'")
    rule = ArchConfig(init=scheme, init_std=init_std)
    emb_std = {"gpt2": init_std, "small": init_std / 10}.get(scheme, 1.0)
    done: set[int] = set()
    usage = token_usage(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in model.modules():
            weight = getattr(mod, "weight", None)
            if not isinstance(weight, nn.Parameter) or id(weight) in done:
                continue
            bias = getattr(mod, "bias", None)
            if isinstance(mod, nn.Embedding):
                nn.init.normal_(weight, 0.0, emb_std)
            elif isinstance(mod, nn.Linear) or (
                type(mod).__name__ == "Conv1D" and weight.dim() == 2
            ):
                fan_in, fan_out = (
                    weight.shape if type(mod).__name__ == "Conv1D" else weight.shape[::-1]
                )
                nn.init.normal_(weight, 0.0, _linear_std(rule, int(fan_in), int(fan_out)))
            elif is_norm(mod):
                unit_gain_(mod, weight)
            else:
                continue
            done.add(id(weight))
            if (
                isinstance(bias, nn.Parameter)
                and id(bias) not in done
                and is_linear_bias(usage, model, bias)
            ):
                nn.init.zeros_(bias)
                done.add(id(bias))
        init_unhandled_(model, usage, lambda fi, fo: _linear_std(rule, fi, fo), done)


# --------------------------------------------------------------------------- weights


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers ≥ 5's checkpoint conversions for this model: (renamings, converters).

    Renamings are plain key renames (GPT-NeoX's `embed_out` → `lm_head`, `LayerNorm.gamma`);
    converters merge tensors (per-expert MoE weights into fused ones). Internal API: any
    failure means "no conversions" (transformers 4.x had none).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
    except Exception:
        return [], []
    return renamings, converters


def _renamer(model: nn.Module):
    renamings, _ = _conversions(model)
    if not renamings:
        return lambda key: key
    from transformers.core_model_loading import rename_source_key

    def rename(key: str) -> str:
        try:
            return rename_source_key(key, renamings, [])[0]
        except Exception:
            return key

    return rename


def needs_conversion(model: nn.Module, names: Iterable[str]) -> bool:
    """True when checkpoint names only fit this model after transformers merges tensors."""
    _, converters = _conversions(model)
    if not converters:
        return False
    try:
        from transformers.core_model_loading import rename_source_key

        return any(rename_source_key(n, [], converters)[1] is not None for n in names)
    except Exception:
        return False


def _map_names(
    model: nn.Module, names: list[str], expected: Mapping[str, Any]
) -> tuple[dict[str, str], list[str]]:
    """file name -> model name, plus file names of another task's head to ignore.

    A checkpoint may carry the base-model prefix (`bert.`, `model.`) relative to the model
    built (a BertForMaskedLM file into BertModel: strip it, ignore `cls.*`), or lack it
    (a GPT2Model-style file into GPT2LMHeadModel: add it). The reading that matches the most
    names wins; names that match nothing stay as they are and are reported unexpected.
    """
    rename = _renamer(model)
    renamed = {n: rename(n) for n in names}
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates: list[tuple[str, dict[str, str]]] = [("same", renamed)]
    if prefix:
        dot = prefix + "."
        if hasattr(model, prefix):  # a model with a head around the base model: add prefix
            candidates.append(
                ("add", {n: r if r in expected else dot + r for n, r in renamed.items()})
            )
        else:  # the base model itself: strip the prefix
            candidates.append(("strip", {n: r.removeprefix(dot) for n, r in renamed.items()}))
    best_kind, best = max(
        candidates, key=lambda kv: sum(1 for m in kv[1].values() if m in expected)
    )
    mapping = {n: (m if m in expected else n) for n, m in best.items()}
    ignored: list[str] = []
    if best_kind == "strip":
        dot = prefix + "."
        ignored = [n for n in names if not n.startswith(dot) and n not in expected]
    return mapping, ignored


def _patterns(model: nn.Module, attr: str, defaults: tuple[str, ...] = ()) -> list[re.Pattern]:
    found = getattr(model, attr, None) or ()
    return [re.compile(p) for p in (*defaults, *found) if isinstance(p, str)]


def _drop_pooler(model: nn.Module, names: Iterable[str]) -> bool:
    """Remove a base model's pooler that the checkpoint has no weights for.

    Only for models whose forward skips a None pooler (BERT-family encoders).
    """
    import inspect

    pooler = getattr(model, "pooler", None)
    if pooler is None or any(n.startswith("pooler.") for n in names):
        return False
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    if "self.pooler is not None" not in source:
        return False
    model.pooler = None
    return True


def load_hf_weights(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
    allow_nonfinite: bool = False,
) -> tuple[str, ...]:
    """Check `tensors` against a transformers model, then copy them in; returns notes.

    Call with a model from `build_hf_model(config, where, empty=True)`. Missing, unexpected
    and mis-shaped tensors are listed by name in one BadInputError line; tied weights
    (lm_head ↔ embeddings) may be stored under either name; derived buffers (position_ids,
    rotary inv_freq) and a base-model prefix difference are tolerated; NaN/Inf weights are
    refused unless `allow_nonfinite`. Values are copied (cast to the model's dtype), so the
    file's memory map is never written and tied parameters stay tied.
    """
    import torch

    from actscan.targets.weights import check_finite, check_shapes, expected_shapes, tied_aliases

    notes: list[str] = []
    expected = expected_shapes(model)
    mapping, head = _map_names(model, list(tensors), expected)
    if _drop_pooler(model, mapping.values()):
        # Task checkpoints (BertForMaskedLM, …) have no pooler; the pooler is off the
        # residual stream, so the encoder is profiled without it rather than half-random.
        notes.append("the checkpoint has no pooler: profiling the encoder without one")
        expected = expected_shapes(model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    skip_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected", _IGNORABLE_UNEXPECTED)
    skip_missing = _patterns(model, "_keys_to_ignore_on_load_missing")

    skipped = set(head) | {
        n
        for n in tensors
        if mapping[n] not in expected and any(p.search(mapping[n]) for p in skip_unexpected)
    }
    used: dict[str, str] = {}  # model name -> file name
    for n in tensors:
        if n in skipped:
            continue
        if mapping[n] in used:
            raise BadInputError(
                f"bad checkpoint {where}: tensors {used[mapping[n]]!r} and {n!r} are both "
                f"{mapping[n]!r} for this model"
            )
        used[mapping[n]] = n
    # Buffers are built by the model itself; they are checked only when the file has them.
    want = {
        n: s
        for n, s in expected.items()
        if (n in params or n in used) and not any(p.search(n) for p in skip_missing)
    }
    check_shapes(want, {m: tuple(tensors[f].shape) for m, f in used.items()},
                 tied_aliases(model), where)  # fmt: skip
    note = check_finite({f: tensors[f] for f in used.values()}, where, allow=allow_nonfinite)
    if note:
        notes.append(note)
    aliases = tied_aliases(model)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for model_name, file_name in used.items():
            if aliases.get(model_name) in used:
                continue  # a tied alias stored twice: the canonical copy wins
            state[model_name].copy_(tensors[file_name])
    if head:
        shown = ", ".join(repr(n) for n in head[:3]) + (" …" if len(head) > 3 else "")
        notes.append(
            f"ignored {len(head)} tensors of a task head that {type(model).__name__} "
            f"does not have: {shown}"
        )
    return tuple(notes)


# --------------------------------------------------------------------------- info


def _first_attr(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def hf_info(
    model: nn.Module,
    config: Any,
    source: str,
    *,
    at_init: bool,
    init: str | None,
    extra: Mapping[str, Any] | None = None,
) -> ModelInfo:
    """ModelInfo for a transformers model; `arch` keys mirror the built-in family's facts."""
    from actscan.measure.structure import is_norm

    mt = str(config.model_type)
    n_layers = _first_attr(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    d_model = _first_attr(config, "hidden_size", "n_embd", "d_model", "dim")
    n_heads = _first_attr(config, "num_attention_heads", "n_head", "n_heads")
    is_lm = type(model).__name__.endswith(_CAUSAL_SUFFIXES)
    post = mt in _POST_LN or getattr(config, "do_layer_norm_before", True) is False
    norms = {type(m).__name__ for m in model.modules() if is_norm(m)}
    attn_scale = "none" if getattr(config, "scale_attn_weights", True) is False else "1/sqrt(dk)"
    init_std = _first_attr(config, "initializer_range", "init_std")
    head_dim = _first_attr(config, "head_dim")
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads:
        head_dim = d_model // n_heads
    arch: dict[str, Any] = {
        "max_positions": _first_attr(
            config, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length"
        ),
        "n_layers": n_layers,
        "placement": "post" if post else "pre",
        "norm": "rmsnorm" if any("RMS" in n.upper() for n in norms) else "layernorm",
        "attn_scale": attn_scale,
        "head_dim": head_dim,
        "tie_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "hf_class": type(model).__name__,
    }
    if at_init:
        arch["init"] = init or "transformers"
        arch["init_std"] = init_std
        # GPT-2's own init scales residual output projections by 1/√(2L).
        arch["branch_scale"] = "depth" if init is None and mt == "gpt2" else "none"
    if extra:
        arch.update(extra)
    seen: set[int] = set()
    n_params = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n_params += p.numel()
    return ModelInfo(
        source=source,
        family=mt,
        n_params=n_params,
        n_blocks=int(n_layers) if isinstance(n_layers, int) else 0,
        d_model=int(d_model) if isinstance(d_model, int) else None,
        vocab_size=_first_attr(config, "vocab_size"),
        at_init=at_init,
        task="causal-lm" if is_lm else "encoder",
        arch=arch,
    )


def _inputs(opts: TargetOptions, info: ModelInfo):
    """--input-shape: random float input, for models that do not take token ids (vision)."""
    if opts.input_shape is None:
        return None
    if info.vocab_size:
        raise UsageError(
            f"--input-shape gives a float tensor, but this {info.family} model takes token ids "
            "(use --batch and --seq-len, or --input FILE)"
        )
    from actscan.measure.inputs import tensor_source

    return tensor_source(opts.input_shape, opts.seed)


def _checkpoint_dtypes(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})


# --------------------------------------------------------------------------- targets


def resolve_hf_config(path: Path, data: dict[str, Any], opts: TargetOptions) -> Resolved:
    """A Hugging Face config alone: the model at transformers' initialization (or --init)."""
    where = str(path)
    config = hf_config(data, where, opts.overrides)
    model = build_hf_model(config, where, empty=False, seed=opts.seed)
    if opts.init is not None:
        init_std = _first_attr(config, "initializer_range", "init_std") or 0.02
        if not (isinstance(init_std, int | float) and math.isfinite(init_std) and init_std > 0):
            init_std = 0.02
        reinit(model, opts.init, float(init_std), opts.seed)
    info = hf_info(model, config, where, at_init=True, init=opts.init,
                   extra={"config_source": where})  # fmt: skip
    return Resolved(
        model=model, info=info, inputs=_inputs(opts, info), notes=config_notes(data, where)
    )


def _no_init_with_weights(source: str, opts: TargetOptions) -> None:
    if opts.init is not None:
        raise UsageError(
            f"--init re-initializes weights, which would discard {source}'s; "
            "profile its config.json instead to see an initialization"
        )


def resolve_folder(path: Path, opts: TargetOptions) -> Resolved:
    """A Hugging Face model folder: config.json + safetensors weights (single or sharded)."""
    from actscan.models.arch import read_config_file
    from actscan.targets.safetensors_io import (
        PICKLE_SUFFIXES,
        load_pickle_weights_only,
        load_sharded,
        load_tensors,
        refuse_pickle,
    )

    if opts.config is not None:
        raise UsageError(
            f"--config is for a bare .safetensors file; the folder {path} takes its "
            "architecture from its own config.json"
        )
    config_path = path / CONFIG_NAME
    try:
        files = sorted(p.name for p in path.iterdir())
    except OSError as err:
        raise BadInputError(f"{path}: cannot list the folder: {err.strerror or err}") from None
    if not config_path.is_file():
        found = [f for f in files if f.endswith(".safetensors")]
        hint = (
            f"; for a bare checkpoint pass the file with --config: actscan profile "
            f"{path / found[0]} --config CONFIG"
            if found
            else ""
        )
        raise BadInputError(
            f"{path}: not a Hugging Face model folder: no {CONFIG_NAME} "
            f"(expected {CONFIG_NAME} + {WEIGHTS_NAME}){hint}"
        )
    _no_init_with_weights(str(path), opts)
    data = read_config_file(config_path)
    config = hf_config(data, str(config_path), opts.overrides)

    weights = path / WEIGHTS_NAME
    index = path / INDEX_NAME
    if weights.exists():
        source = weights
        tensors = load_tensors(weights)
    elif index.exists():
        source = index
        tensors = load_sharded(index)
    else:
        pickles = [f for f in files if Path(f).suffix.lower() in PICKLE_SUFFIXES]
        if pickles and opts.allow_pickle and (path / "pytorch_model.bin").is_file():
            source = path / "pytorch_model.bin"
            tensors = load_pickle_weights_only(source)
        elif pickles:
            first = min(pickles, key=lambda f: (not f.startswith("pytorch_model"), f))
            refuse_pickle(path / first)  # raises, with the convert-to-safetensors hint
            raise BadInputError(f"{path / first}: pickle weights are not supported")
        else:
            others = [f for f in files if f.endswith(".safetensors")]
            hint = (
                f"; to use {others[0]} pass it as the target: actscan profile {path / others[0]}"
                if others
                else f"; to profile the architecture at initialization pass {config_path}"
            )
            raise BadInputError(
                f"{path}: Hugging Face folder has {CONFIG_NAME} but no weights "
                f"({WEIGHTS_NAME} or {INDEX_NAME}){hint}"
            )
    return _with_weights(
        config, config_path, source, tensors, opts,
        tokenizer_dir=path, notes=config_notes(data, str(config_path)),
    )  # fmt: skip


def resolve_hf_checkpoint(
    path: Path, config_path: Path, data: dict[str, Any], opts: TargetOptions
) -> Resolved:
    """A bare .safetensors file whose architecture is a Hugging Face config (--config or
    config.json beside it). Called by targets/checkpoint.py."""
    from actscan.targets.safetensors_io import load_tensors

    _no_init_with_weights(str(path), opts)
    config = hf_config(data, str(config_path), opts.overrides)
    tensors = load_tensors(path)
    folder = config_path.parent if config_path.name == CONFIG_NAME else None
    return _with_weights(
        config, config_path, path, tensors, opts,
        tokenizer_dir=folder, notes=config_notes(data, str(config_path)),
    )  # fmt: skip


def _with_weights(
    config: Any,
    config_path: Path,
    source: Path,
    tensors: Mapping[str, torch.Tensor],
    opts: TargetOptions,
    *,
    tokenizer_dir: Path | None,
    notes: tuple[str, ...] = (),
) -> Resolved:
    model = build_hf_model(config, str(config_path), empty=True, seed=opts.seed)
    where = f"{source} (as {type(model).__name__} from {config_path.name})"
    if needs_conversion(model, tensors):
        model, loaded = _load_converted(type(model), config, source, tensors, where, opts)
    else:
        loaded = load_hf_weights(model, tensors, where=where, allow_nonfinite=opts.allow_nonfinite)
    notes = (*notes, *loaded)
    info = hf_info(
        model, config, str(source.parent if source.name in (WEIGHTS_NAME, INDEX_NAME) else source),
        at_init=False, init=None,
        extra={"config_source": str(config_path), "checkpoint_dtypes": _checkpoint_dtypes(tensors)},
    )  # fmt: skip
    extra = {"tokenizer_dir": str(tokenizer_dir)} if tokenizer_dir is not None else {}
    return Resolved(model=model, info=info, inputs=_inputs(opts, info), notes=notes, extra=extra)


def _load_converted(
    cls: type,
    config: Any,
    source: Path,
    tensors: Mapping[str, torch.Tensor],
    where: str,
    opts: TargetOptions,
) -> tuple[nn.Module, tuple[str, ...]]:
    """Checkpoints that need tensors merged (per-expert MoE weights → fused experts):
    transformers' own loader does the merge. The files were already validated by
    safetensors_io and scanned for NaN/Inf; mismatches still end in one line."""
    import tempfile

    import torch

    from actscan.targets.weights import check_finite

    note = check_finite(tensors, where, allow=opts.allow_nonfinite)
    kwargs = {
        "config": config, "local_files_only": True, "use_safetensors": True,
        "trust_remote_code": False, "attn_implementation": "eager", "dtype": torch.float32,
        "output_loading_info": True, "ignore_mismatched_sizes": True,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        if source.name in (WEIGHTS_NAME, INDEX_NAME):
            folder = source.parent
        else:  # a bare file: give transformers the folder layout it expects
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="actscan-")))
            (folder / WEIGHTS_NAME).symlink_to(source.resolve())
        try:
            with _quiet(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(opts.seed)
                model, info = cls.from_pretrained(folder, **kwargs)
        except Exception as err:
            raise BadInputError(
                f"bad checkpoint {where}: transformers could not convert it: {_first_line(err)}"
            ) from None
    parts = []
    for label, key in (("missing", "missing_keys"), ("unexpected", "unexpected_keys")):
        names = sorted(info.get(key) or ())
        if names:
            parts.append(f"{label} {len(names)} ({_listing(repr(n) for n in names)})")
    mismatched = [
        f"{m[0]!r} file {list(m[1])} vs model {list(m[2])}" if len(m) == 3 else repr(m)
        for m in info.get("mismatched_keys") or ()
    ]
    if mismatched:
        parts.append(f"mis-shaped {len(mismatched)} ({_listing(mismatched)})")
    if parts:
        raise BadInputError(
            f"bad checkpoint {where}: tensors do not match the model: {'; '.join(parts)}"
        )
    notes = ["weights converted by transformers' loader (fused tensors)"]
    return model, tuple([note, *notes] if note else notes)


def _listing(items: Iterable[str], show: int = 4) -> str:
    items = list(items)
    more = f", … ({len(items) - show} more)" if len(items) > show else ""
    return ", ".join(items[:show]) + more
