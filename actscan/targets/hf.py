"""Hugging Face targets: a model folder, a `config.json` alone, a config + bare weights.

- Folder (`config.json` + `model.safetensors` or a sharded index): the Auto class the config
  names (causal LM when the checkpoint is one, else the base model, e.g. BERT's encoder).
- `config.json` alone: the model at transformers' own initialization, so an architecture can
  be checked before training (`--init` re-initializes it, `--set key=value` edits fields).
- A Hugging Face config with a bare `.safetensors` file (`resolve_hf_checkpoint`).

Files are read by safetensors_io (pickle refused, shards cross-checked), then given to
transformers' public loader, `from_pretrained(None, config=..., state_dict=...)`, which owns
key renames, base-model prefixes, tied weights and merged (MoE) tensors; its loading info
becomes one error line instead of a log table the user may miss.

Safety: offline only, `trust_remote_code=False` on every loader and no stdin to answer
a prompt (hf_env; a model_type transformers does not
implement natively is refused; `auto_map` beside a native model_type gets the native code,
with a note). Attention is `eager` so attention probabilities exist and runs are
deterministic; weights are fp32 (`--dtype` casts for the run).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.errors import BadInputError, ConfigError, UsageError
from actscan.models.arch import read_config_file
from actscan.records import ModelInfo
from actscan.targets import safetensors_io as st
from actscan.targets.footprint import RunPlan, check_fits
from actscan.targets.hf_check import check_weights, meta_plan
from actscan.targets.hf_env import NO_REMOTE_CODE, no_prompt, offline, quiet
from actscan.targets.hf_layers import config_value, depth_of, resize_per_layer
from actscan.targets.resolved import Resolved, TargetOptions
from actscan.targets.weights import check_finite, mismatch_error

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Derived buffers, not weights, that older transformers saved and 5.x may still report.
_IGNORABLE_UNEXPECTED = re.compile(
    r"(^|\.)(position_ids|rotary_emb\.(original_)?inv_freq|masked_bias)$"
)
# Post-LN families (norm after the residual add). Others are taken as pre-LN.
_POST_LN = frozenset(
    {"bert", "roberta", "xlm-roberta", "electra", "camembert", "ernie", "mpnet", "distilbert",
     "albert", "deberta", "deberta-v2", "megatron-bert", "roberta-prelayernorm", "xmod"}
)  # fmt: skip
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_BOOLS = {"true": True, "1": True, "yes": True, "on": True,
          "false": False, "0": False, "no": False, "off": False}  # fmt: skip


# --------------------------------------------------------------------------- config


def hf_config(
    data: Mapping[str, Any],
    where: str,
    overrides: Mapping[str, str] | None = None,
    flag: str = "--set",
) -> Any:
    """A transformers config object from a parsed config.json, offline and without custom code.

    Refused with one line: no model_type, a model_type this transformers does not implement
    (custom code, or too old) and quantized models.
    """
    offline()
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f'{where}: not a Hugging Face config (no "model_type")')
    if model_type not in CONFIG_MAPPING:
        # As transformers itself with trust_remote_code=False: custom code (auto_map) is
        # only ever replaced by a native implementation of the same model_type, never run.
        classes = data.get("auto_map")
        if not (isinstance(classes, dict) and classes):
            raise BadInputError(
                f"{where}: this transformers version ({transformers.__version__}) does not "
                f"know model_type '{model_type}' (a newer transformers may; or profile your "
                "module with package.module:callable)"
            )
        raise BadInputError(
            f"{where}: model_type '{model_type}' needs trust_remote_code (custom code: "
            f"auto_map {', '.join(map(str, classes.values()))}), which actscan never runs "
            f"(not native to transformers {transformers.__version__}); profile your module "
            "with package.module:callable instead"
        )
    cls = CONFIG_MAPPING[model_type]
    check_domains(data, where)  # before transformers divides by a zero head count
    try:
        with quiet(), no_prompt():
            config = cls.from_dict(_decode_as_transformers(cls, data))
    except Exception as err:  # transformers validates fields with many error types
        raise ConfigError(f"{where}: invalid {model_type} config: {st.first_line(err)}") from None
    if overrides:
        _apply_overrides(config, overrides, model_type, flag)
    check_domains(config.to_dict(), where)  # --set values too
    if quant := getattr(config, "quantization_config", None):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise BadInputError(
            f"{where}: quantized checkpoints ({method}) are not supported: profile the "
            "unquantized model"
        )
    return config


def _decode_as_transformers(cls: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """The parsed config.json as transformers' own reader returns it: `save_pretrained`
    writes infinities and NaN as `{"__float__": "Infinity"}` (Mamba-2's `time_step_limit`),
    which its reader decodes after `json.loads`; the file itself was read bounded by
    read_config_file, so only this decoding step is transformers'."""
    decode = getattr(cls, "_decode_special_floats", None)
    return dict(decode(dict(data))) if callable(decode) else dict(data)


# The common fields of transformers configs and their domains, checked before anything is
# built: transformers accepts most of them as given, and a zero or negative one fails later
# inside torch (a negative dimension, a division by zero) or builds a model that is no model.
_SIZES = frozenset(
    [
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "num_key_value_heads",
        "head_dim",
        "n_embd",
        "n_head",
        "n_layer",
        "n_inner",
        "n_positions",
        "n_ctx",
        "d_model",
        "d_ff",
        "d_kv",
        "num_heads",
        "num_layers",
        "num_decoder_layers",
        "ffn_dim",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "word_embed_proj_dim",
    ]
)
_EPSILONS = frozenset(
    ["layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta"]
)
_PROBABILITIES = frozenset(
    [
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "attn_pdrop",
        "resid_pdrop",
        "embd_pdrop",
        "summary_first_dropout",
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "hidden_dropout",
        "dropout_rate",
        "classifier_dropout",
    ]
)


def check_domains(fields: Mapping[str, Any], where: str) -> None:
    """Every common field of a transformers config (and of its sub-configs) inside its
    domain: sizes ≥ 1, epsilons and rope_theta > 0, dropout rates in [0, 1], all finite;
    else ConfigError naming the field. Fields left None keep their model's default."""
    for key, v in fields.items():
        if isinstance(v, Mapping) and (key.endswith("_config") or key in ("encoder", "decoder")):
            check_domains(v, f"{where} {key}")
            continue
        if v is None or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if key in _SIZES and not (math.isfinite(v) and v >= 1 and v == int(v)):
            raise ConfigError(f"{where}: {key} must be a positive integer, got {v}")
        if key == "max_position_embeddings" and not (v == -1 or (math.isfinite(v) and v >= 1)):
            raise ConfigError(
                f"{where}: {key} must be a positive integer (or -1: no limit), got {v}"
            )
        if key in _EPSILONS and not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{where}: {key} must be a positive number, got {v}")
        if key in _PROBABILITIES and not 0 <= v <= 1:
            raise ConfigError(f"{where}: {key} must be a probability in [0, 1], got {v}")


def config_notes(data: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """Remarks for the report about how the config was read."""
    if "auto_map" in data:
        return (
            f"{where} names custom code (auto_map); using transformers' native "
            f"'{data.get('model_type')}' implementation instead (custom code is never run)",
        )
    return ()


def _apply_overrides(
    config: Any, overrides: Mapping[str, str], model_type: str, flag: str = "--set"
) -> None:
    """`--set key=value` on a transformers config: the value takes the field's type.
    A new depth resizes the config's per-layer lists (`layer_types`, …) unless set too."""

    known = config.to_dict()
    depth_before = depth_of(config)
    for key, raw in overrides.items():
        if key not in known and not hasattr(config, key):
            near = [k for k in sorted(known) if key.lower() in k.lower()][:5]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"{flag} {key}: unknown field for a '{model_type}' config{hint}")
        value = _coerce(getattr(config, key, None), raw, key, flag)
        try:
            setattr(config, key, value)
        except Exception as err:
            raise ConfigError(f"{flag} {key}={raw}: {st.first_line(err)}") from None
    resize_per_layer(config, depth_before, keep=set(overrides))


def _coerce(current: Any, raw: str, key: str, flag: str = "--set") -> Any:
    """String from the command line -> the type the config field already has."""
    text = raw.strip()
    try:
        if isinstance(current, bool):
            if text.lower() not in _BOOLS:
                raise ValueError("expected true or false")
            return _BOOLS[text.lower()]
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, str):
            return text
    except ValueError as err:
        raise ConfigError(
            f"{flag} {key}={raw}: expected {type(current).__name__} ({err})"
        ) from None
    if text.lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)  # numbers, lists, dicts for fields that default to None
    except ValueError:
        return text


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
        return any(a in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) for a in archs)
    mt = config.model_type
    return mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


# --------------------------------------------------------------------------- build


def saved_architecture(config: Any) -> type[PreTrainedModel] | None:
    """The class `architectures` names (written by save_pretrained), when it is one of
    transformers' own classes for this config and a kind actscan runs whole: a language
    model, an encoder-decoder, speech or base model. SpeechT5's folders are its
    text-to-speech or its speech-to-text model, which share a config and differ in weights.
    A task head (…ForMaskedLM, …ForSequenceClassification) is not taken: such a checkpoint
    is profiled as its base model (`_with_weights`)."""
    import transformers
    from transformers.models.auto import modeling_auto as names

    kinds = (
        "MODEL_MAPPING_NAMES",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        "MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES",
        "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES",
    )
    runnable: set[str] = set()
    for kind in kinds:
        for value in getattr(names, kind, {}).values():
            runnable.update(value if isinstance(value, list | tuple) else (value,))
    for name in getattr(config, "architectures", None) or ():
        if not isinstance(name, str) or name not in runnable:
            continue
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and getattr(cls, "config_class", None) is type(config):
            return cls
    return None


def model_class(config: Any) -> type[PreTrainedModel]:
    """The class `architectures` names when actscan runs it whole (`saved_architecture`),
    else the concrete class the Auto mapping picks (causal LM, seq2seq LM or base model)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    if (saved := saved_architecture(config)) is not None:
        return saved
    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if wants_causal_lm(config) else MODEL_MAPPING
    mapping = _seq2seq(config)[0] or mapping
    if type(config) not in mapping:
        raise ConfigError(f"transformers has no model class for a '{config.model_type}' config")
    cls = mapping[type(config)]
    return cls[0] if isinstance(cls, tuple) else cls


def _seq2seq(config: Any) -> tuple[Any, Any]:
    """For an encoder-decoder config: (Auto mapping, Auto class) of its LM class (T5/BART
    ForConditionalGeneration, Whisper's speech one), which computes its own loss on
    labels; (None, None) otherwise."""
    if not getattr(config, "is_encoder_decoder", False):
        return None, None
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
    )

    for mapping, auto in (
        (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, AutoModelForSeq2SeqLM),
        (MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING, AutoModelForSpeechSeq2Seq),
    ):
        if type(config) in mapping:
            return mapping, auto
    return None, None


def _from_config(config: Any) -> nn.Module:
    """The Auto class's model for `config` (causal LM, seq2seq LM or base model), fp32 with
    eager attention, tied per its config; on whatever device is current (meta: hf_check)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    auto = _seq2seq(config)[1] or (AutoModelForCausalLM if wants_causal_lm(config) else AutoModel)
    saved = saved_architecture(config)
    with quiet(), no_prompt():
        if saved is not None and saved is not model_class_of_auto(auto, config):
            return saved._from_config(config, attn_implementation="eager", dtype=torch.float32)
        return auto.from_config(
            config, attn_implementation="eager", dtype=torch.float32, **NO_REMOTE_CODE
        )


def model_class_of_auto(auto: Any, config: Any) -> Any:
    """The class `auto.from_config(config)` would build, or None when it has none."""
    mapping = getattr(auto, "_model_mapping", None)
    try:
        cls = mapping[type(config)] if mapping is not None else None
    except KeyError:
        return None
    return cls[0] if isinstance(cls, tuple) else cls


def preflight(
    config: Any, where: str, plan: RunPlan, weights: Mapping[str, Any] | None = None
) -> None:
    """Before anything is built: the config against the weights' names and shapes
    (`weights`: name → tensor or header entry) and its memory against the machine
    (hf_check.py, footprint.py); one line when either cannot be."""
    meta = meta_plan(config, _from_config)
    if weights is not None:
        check_weights(meta, {n: tuple(t.shape) for n, t in weights.items()}, where)
    check_fits(meta.shape, plan, where)


def build_hf_model(config: Any, where: str, *, seed: int = 0) -> nn.Module:
    """The Auto-class model for `config` at transformers' own initialization (run under
    `seed`; the global RNG is restored), in fp32 with eager attention, tied per its config."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _from_config(config)
    except Exception as err:  # a config transformers cannot build (bad sizes, …)
        raise ConfigError(
            f"{where}: transformers cannot build a '{config.model_type}' model from this "
            f"config: {st.first_line(err)}"
        ) from None


# --------------------------------------------------------------------------- weights


def _with_weights(
    config: Any,
    config_path: Path,
    source: Path,
    tensors: Mapping[str, torch.Tensor],
    opts: TargetOptions,
    *,
    tokenizer_dir: Path | None,
    notes: tuple[str, ...],
) -> Resolved:
    """The model for `config` with `tensors` loaded by transformers' public loader.

    Missing, unexpected and mis-shaped keys (its `output_loading_info`) are listed by name in
    one BadInputError line. Tolerated: derived buffers older checkpoints carry, a task head
    that the base model lacks (a BertForMaskedLM file profiled as BertModel, noted), and a
    missing pooler (built without one, via the model's public `add_pooling_layer=False`).
    """
    import inspect

    import torch

    cls = model_class(config)
    where = f"{source} (as {cls.__name__} from {config_path.name})"
    preflight(config, where, opts.plan, tensors)  # memory-mapped: shapes, no data read
    kwargs: dict[str, Any] = {}
    if "add_pooling_layer" in inspect.signature(cls.__init__).parameters and not any(
        re.search(r"(^|\.)pooler\.", n) for n in tensors
    ):
        # Task checkpoints (BertForMaskedLM, …) have no pooler; it is off the residual
        # stream, so the encoder is profiled without it rather than half-random.
        kwargs["add_pooling_layer"] = False
        notes = (*notes, "the checkpoint has no pooler: profiling the encoder without one")
    try:
        with quiet(), no_prompt(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(opts.seed)  # anything transformers initializes is seeded
            # (model, loading info) with output_loading_info; transformers annotates the
            # model alone
            result: Any = cls.from_pretrained(
                None,
                config=config,
                state_dict=dict(tensors),
                **kwargs,
                local_files_only=True,
                **NO_REMOTE_CODE,
                attn_implementation="eager",
                dtype=torch.float32,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
    except Exception as err:
        raise BadInputError(
            f"bad checkpoint {where}: transformers could not load it: {st.first_line(err)}"
        ) from None
    model, loaded = result
    unexpected = sorted(k for k in loaded["unexpected_keys"] if not _IGNORABLE_UNEXPECTED.search(k))
    prefix = f"{model.base_model_prefix}."
    head: list[str] = []
    if model.base_model is model and any(n.startswith(prefix) for n in tensors):
        head = [k for k in unexpected if not k.startswith(prefix)]
        unexpected = [k for k in unexpected if k.startswith(prefix)]
    mismatched = [(k, list(a), list(b)) for k, a, b in sorted(loaded["mismatched_keys"])]
    error = mismatch_error(where, sorted(loaded["missing_keys"]), unexpected, mismatched)
    if error is not None:
        raise error
    note = check_finite(tensors, where, allow=opts.allow_nonfinite)
    if head:
        shown = ", ".join(repr(n) for n in head[:3]) + (" …" if len(head) > 3 else "")
        notes = (
            *notes,
            f"ignored {len(head)} tensors of a task head that {cls.__name__} "
            f"does not have: {shown}",
        )
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    info = hf_info(
        model,
        config,
        str(source.parent if source.name in (WEIGHTS_NAME, INDEX_NAME) else source),
        at_init=False,
        init=None,
        extra={"config_source": str(config_path), "checkpoint_dtypes": dtypes},
    )
    extra = {"tokenizer_dir": str(tokenizer_dir)} if tokenizer_dir is not None else {}
    notes = (*notes, note) if note else notes
    return Resolved(
        model=model, info=info, inputs=hf_inputs(opts, info, model), notes=notes, extra=extra
    )


# --------------------------------------------------------------------------- info


def _first_attr(config: Any, *names: str) -> Any:
    for name in names:
        value = config_value(config, name)
        if value is not None:
            return value
    return None


def _positive(config: Any, *names: str) -> int | None:
    """The first of `names` that is a positive int: XLNet's max_position_embeddings = -1
    means "no limit", not a length."""
    for name in names:
        value = config_value(config, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
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
    from actscan.layout.detect import is_norm

    mt = str(config.model_type)
    n_layers = _first_attr(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    d_model = _first_attr(config, "hidden_size", "n_embd", "d_model", "dim")
    n_heads = _first_attr(config, "num_attention_heads", "n_head", "n_heads")
    is_lm = type(model).__name__.endswith(_CAUSAL_SUFFIXES)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    post = mt in _POST_LN or getattr(config, "do_layer_norm_before", True) is False
    norms = {type(m).__name__ for m in model.modules() if is_norm(m)}
    attn_scale = "none" if getattr(config, "scale_attn_weights", True) is False else "1/sqrt(dk)"
    init_std = _first_attr(config, "initializer_range", "init_std")
    head_dim = _first_attr(config, "head_dim")
    if head_dim is None and isinstance(d_model, int) and isinstance(n_heads, int) and n_heads:
        head_dim = d_model // n_heads
    arch: dict[str, Any] = {
        "max_positions": _positive(
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
    return ModelInfo(
        source=source,
        family=mt,
        n_params=sum(p.numel() for p in model.parameters()),  # tied parameters count once
        n_blocks=int(n_layers) if isinstance(n_layers, int) else 0,
        d_model=int(d_model) if isinstance(d_model, int) else None,
        vocab_size=_first_attr(config, "vocab_size"),
        at_init=at_init,
        task="seq2seq" if seq2seq else "causal-lm" if is_lm else "encoder",
        arch=arch,
    )


def hf_inputs(opts: TargetOptions, info: ModelInfo, model: nn.Module | None = None):
    """Inputs from the model's main input and config (images, audio, encoder-decoders;
    --input-shape gives the main input's shape), or None: scan() invents token ids."""
    from actscan.measure.model_inputs import hf_input_source, takes_token_ids

    if model is not None and not takes_token_ids(model):
        return hf_input_source(
            model,
            batch=opts.batch or 4,
            seq_len=opts.seq_len,
            seed=opts.seed,
            input_shape=opts.input_shape,
        )
    if opts.input_shape is None:
        return None
    if info.vocab_size:
        raise UsageError(
            f"--input-shape gives a float tensor, but this {info.family} model takes token ids "
            "(use --batch and --seq-len, or --input FILE)"
        )
    from actscan.measure.inputs import tensor_source

    return tensor_source(opts.input_shape, opts.seed)


# --------------------------------------------------------------------------- targets


def resolve_hf_config(path: Path, data: dict[str, Any], opts: TargetOptions) -> Resolved:
    """A Hugging Face config alone: the model at transformers' initialization (or --init)."""
    where = str(path)
    config = hf_config(data, where, opts.overrides, opts.flag("set"))
    preflight(config, where, opts.plan)
    model = build_hf_model(config, where, seed=opts.seed)
    if opts.init is not None:
        std = _first_attr(config, "initializer_range", "init_std")
        ok = isinstance(std, int | float) and math.isfinite(std) and std > 0
        from actscan.models.reinit import reinit

        reinit(model, opts.init, float(std) if ok else 0.02, opts.seed, opts.flag("init"))
    info = hf_info(
        model, config, where, at_init=True, init=opts.init, extra={"config_source": where}
    )
    return Resolved(
        model=model, info=info, inputs=hf_inputs(opts, info, model), notes=config_notes(data, where)
    )


def _no_init_with_weights(source: str, opts: TargetOptions) -> None:
    if opts.init is not None:
        raise UsageError(
            f"{opts.flag('init')} re-initializes weights, which would discard {source}'s; "
            "profile its config.json instead to see an initialization"
        )


def resolve_folder(path: Path, opts: TargetOptions) -> Resolved:
    """A Hugging Face model folder: config.json + safetensors weights (single or sharded)."""

    if opts.config is not None:
        raise UsageError(
            f"--config is for a bare .safetensors file; the folder {path} takes its "
            "architecture from its own config.json"
        )
    config_path, weights, index = path / CONFIG_NAME, path / WEIGHTS_NAME, path / INDEX_NAME
    try:
        files = sorted(p.name for p in path.iterdir())
    except OSError as err:
        raise BadInputError(f"{path}: cannot list the folder: {err.strerror or err}") from None
    others = [f for f in files if f.endswith(".safetensors")]
    if not os.path.lexists(config_path):  # a FIFO or a broken link is read_config_file's
        hint = "; for a bare checkpoint pass the file with --config: actscan profile "
        raise BadInputError(
            f"{path}: not a Hugging Face model folder: no {CONFIG_NAME} (expected {CONFIG_NAME}"
            f" + {WEIGHTS_NAME}){f'{hint}{path / others[0]} --config CONFIG' if others else ''}"
        )
    _no_init_with_weights(str(path), opts)
    data = read_config_file(config_path)
    config = hf_config(data, str(config_path), opts.overrides, opts.flag("set"))
    pickles = sorted(
        (f for f in files if Path(f).suffix.lower() in st.PICKLE_SUFFIXES),
        key=lambda f: (not f.startswith("pytorch_model"), f),
    )
    if weights.exists():
        source, tensors = weights, st.load_tensors(weights)
    elif index.exists():
        source, tensors = index, st.load_sharded(index)
    elif pickles and opts.allow_pickle and (path / "pytorch_model.bin").is_file():
        source = path / "pytorch_model.bin"
        tensors = st.load_pickle_weights_only(source)
    elif pickles:
        raise BadInputError(st.pickle_message(path / pickles[0]))
    else:
        hint = f"to profile the architecture at initialization pass {config_path}"
        if others:
            hint = f"to use {others[0]} pass it as the target: actscan profile {path / others[0]}"
        raise BadInputError(
            f"{path}: Hugging Face folder has {CONFIG_NAME} but no weights "
            f"({WEIGHTS_NAME} or {INDEX_NAME}); {hint}"
        )
    return _with_weights(
        config,
        config_path,
        source,
        tensors,
        opts,
        tokenizer_dir=path,
        notes=config_notes(data, str(config_path)),
    )


def resolve_hf_checkpoint(
    path: Path, config_path: Path, data: dict[str, Any], opts: TargetOptions
) -> Resolved:
    """A bare .safetensors file whose architecture is a Hugging Face config (--config or
    config.json beside it). Called by targets/checkpoint.py."""
    _no_init_with_weights(str(path), opts)
    config = hf_config(data, str(config_path), opts.overrides, opts.flag("set"))
    tensors = st.load_tensors(path)
    folder = config_path.parent if config_path.name == CONFIG_NAME else None
    return _with_weights(
        config,
        config_path,
        path,
        tensors,
        opts,
        tokenizer_dir=folder,
        notes=config_notes(data, str(config_path)),
    )
