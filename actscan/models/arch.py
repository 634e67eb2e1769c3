"""The built-in `actscan-gpt` architecture config: parsing, validation and overrides.

A config is a small YAML/TOML/JSON file (see configs/). Unknown keys are an error, so a
typo never silently falls back to a default. No torch import here.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from actscan.errors import ConfigError
from actscan.files import CONFIG_CAP, read_text_bounded

FAMILY = "actscan-gpt"

NORMS = ("layernorm", "rmsnorm")
PLACEMENTS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
BRANCH_SCALES = ("none", "depth", "rezero", "layerscale", "deepnorm")
ATTN_SCALES = ("1/sqrt(dk)", "1/dk", "none")
INITS = ("gpt2", "xavier", "kaiming", "fan-in", "small")
POSITIONS = ("learned", "rope", "none")
PARAMETRIZATIONS = ("sp", "mup")


@dataclass(frozen=True)
class ArchConfig:
    """Every knob of the built-in decoder-only transformer.

    init schemes (weights of Linear layers, fan_in = in_features):
      gpt2    normal(0, init_std) everywhere (GPT-2's flat 0.02)
      xavier  normal(0, √(2/(fan_in+fan_out)))
      kaiming normal(0, √(2/fan_in))  (He: compensates ReLU's halving)
      fan-in  normal(0, √(1/fan_in))  (LeCun: unit gain)
      small   normal(0, init_std/10)
    Embeddings: init_std for gpt2/small, else embed_std (default 1: unit-variance stream).
    """

    n_layers: int = 12
    d_model: int = 256
    n_heads: int = 4
    d_ff: int | None = None  # default 4·d_model (⅔ of that, rounded to 8, for swiglu)
    vocab_size: int = 512
    seq_len: int = 64
    norm: str = "layernorm"
    placement: str = "pre"
    activation: str = "gelu"
    branch_scale: str = "none"
    attn_scale: str = "1/sqrt(dk)"
    # μP (Yang et al., Tensor Programs V, Table 3's Adam column, docs/checks.md#coord-check):
    # attention 1/d_head, readout ×1/width_mult, hidden matrices' init std and Adam lr
    # ×1/√width_mult and ×1/width_mult, width_mult = d_model / mup_base_width. "sp": none.
    parametrization: str = "sp"
    # The width the hyperparameters were tuned at: there μP is SP exactly, and a wider
    # model's hidden lr is lr·base/d_model. 64, the smallest width a coordinate check
    # sweeps (`--width 64,…`): no swept width runs above the lr you pass (base 256 drove
    # width 64 at 4× lr and bent μP's slopes to −0.6 at lr 1e-2; docs/checks.md#coord-check).
    mup_base_width: int = 64
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    init: str = "gpt2"
    init_std: float = 0.02
    embed_std: float | None = None
    layerscale_init: float = 1e-4
    norm_eps: float = 1e-5
    mlp_bias_init: float = 0.0  # constant for the MLP up-projection bias (planted pathologies)
    # Normalise q and k per head (the config's norm over head_dim) before the dot product,
    # as OLMo 2, Gemma 3 and Wortsman et al. 2023 do: attention scores stay bounded by
    # √d_head·|g_q||g_k| however large the weights grow, so they cannot run away in training.
    qk_norm: bool = False
    name: str | None = None
    family: str = FAMILY

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.activation == "swiglu":
            return int(8 * self.d_model / 3 + 7) // 8 * 8
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def width_mult(self) -> float:
        """d_model / mup_base_width under μP; 1 under SP (nothing is rescaled)."""
        return self.d_model / self.mup_base_width if self.parametrization == "mup" else 1.0

    @property
    def deepnorm_alpha(self) -> float:
        return (2 * self.n_layers) ** 0.25

    @property
    def deepnorm_beta(self) -> float:
        return (2 * self.n_layers) ** -0.25

    @property
    def depth_scale(self) -> float:
        return 1.0 / math.sqrt(2 * self.n_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Knobs added after checkpoints began to store their config: a saved config lists them
# only when they differ from the default, so a model that does not use them saves the
# same file as before (and reads back the same: a missing key is the default).
LATER_KNOBS = ("parametrization", "mup_base_width", "qk_norm")


def saved_config(cfg: ArchConfig) -> dict[str, Any]:
    """The config a checkpoint stores: every field but later knobs at their default."""
    data = cfg.to_dict()
    for key in LATER_KNOBS:
        if data[key] == _FIELDS[key].default:
            del data[key]
    return data


_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": NORMS,
    "placement": PLACEMENTS,
    "activation": ACTIVATIONS,
    "branch_scale": BRANCH_SCALES,
    "attn_scale": ATTN_SCALES,
    "init": INITS,
    "position": POSITIONS,
    "parametrization": PARAMETRIZATIONS,
}
_FIELDS = {f.name: f for f in fields(ArchConfig)}
_ALIASES = {"n_layer": "n_layers", "n_embd": "d_model", "n_head": "n_heads", "d-model": "d_model"}


def _coerce(key: str, value: Any, where: str) -> Any:
    """Type-check one field against the dataclass annotation (strings from --set too)."""
    tp = str(_FIELDS[key].type)
    optional = "None" in tp
    if value is None or (isinstance(value, str) and value.lower() in {"null", "none"}):
        if optional:
            return None
        if key in _CHOICES and value is not None:
            return str(value).lower()
        raise ConfigError(f"{where}: '{key}' cannot be null")
    try:
        if tp.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
                return value.lower() in {"true", "1", "yes"}
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: '{key}' must be {tp}, got {value!r}") from None
    return str(value)


def build_config(data: dict[str, Any], where: str = "config") -> ArchConfig:
    """Validate a mapping into an ArchConfig. Unknown keys and bad values raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = _ALIASES.get(str(raw_key), str(raw_key)).replace("-", "_")
        if key not in _FIELDS:
            known = ", ".join(sorted(_FIELDS))
            raise ConfigError(f"{where}: unknown key '{raw_key}' (known: {known})")
        values[key] = _coerce(key, value, where)
    cfg = ArchConfig(**values)
    validate(cfg, where)
    return cfg


_FP32_VALUES = ("init_std", "embed_std", "layerscale_init", "mlp_bias_init", "norm_eps")
_FP32_MAX = 3.4028234663852886e38


def validate(cfg: ArchConfig, where: str = "config") -> None:
    if cfg.family != FAMILY:
        raise ConfigError(f"{where}: family must be '{FAMILY}', got '{cfg.family}'")
    for key, choices in _CHOICES.items():
        val = getattr(cfg, key)
        if val not in choices:
            raise ConfigError(f"{where}: {key} must be one of {'|'.join(choices)}, got '{val}'")
    for key in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "mup_base_width"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{where}: {key} must be ≥ 1, got {getattr(cfg, key)}")
    if cfg.d_ff is not None and cfg.d_ff < 1:
        raise ConfigError(f"{where}: d_ff must be ≥ 1, got {cfg.d_ff}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"{where}: d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})"
        )
    if cfg.position == "rope" and cfg.head_dim % 2:
        raise ConfigError(f"{where}: rope needs an even head dim, got {cfg.head_dim}")
    if cfg.branch_scale == "deepnorm" and cfg.placement != "post":
        raise ConfigError(
            f"{where}: branch_scale deepnorm is a post-LN scheme: set placement: post"
        )
    if cfg.parametrization == "mup" and cfg.attn_scale != "1/sqrt(dk)":
        raise ConfigError(
            f"{where}: parametrization mup sets the attention scale itself (1/d_head): "
            f"leave attn_scale at 1/sqrt(dk), got '{cfg.attn_scale}'"
        )
    if cfg.init_std <= 0 or not math.isfinite(cfg.init_std):
        raise ConfigError(f"{where}: init_std must be a positive number, got {cfg.init_std}")
    for key in _FP32_VALUES:  # they become fp32 weights: past fp32's range is inf there
        value = getattr(cfg, key)
        if value is not None and not (math.isfinite(value) and abs(value) <= _FP32_MAX):
            raise ConfigError(f"{where}: {key} must be a finite fp32 number, got {value}")
    if cfg.embed_std is not None and cfg.embed_std < 0:
        raise ConfigError(f"{where}: embed_std must be ≥ 0, got {cfg.embed_std}")
    if cfg.norm_eps <= 0:  # it keeps a norm's zero variance from dividing by zero
        raise ConfigError(f"{where}: norm_eps must be a positive number, got {cfg.norm_eps}")


# A YAML alias repeats a whole subtree; nested aliases repeat it exponentially (the
# "billion laughs"). No config needs more than a few hundred nodes once expanded.
MAX_YAML_NODES = 100_000


def parse_text(text: str, suffix: str, where: str) -> Any:
    """Parse YAML/TOML/JSON text; any syntax error becomes one ConfigError line, and so do
    nesting past the parser's recursion limit and YAML aliases expanding past
    MAX_YAML_NODES nodes."""
    fmt = suffix.lstrip(".").upper()
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        return _load_yaml(text, where)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"{where}: malformed {fmt}: nested too deeply") from None
    except Exception as err:  # the parsers raise many types; all mean "malformed"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{where}: malformed {fmt}: {reason}") from None


def _load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load with aliases counted: the nodes an alias stands for add to the
    document's size, and a document that expands past MAX_YAML_NODES is refused while it
    is being composed, before anything is built from it."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        nodes = 0
        sizes: dict[int, int]

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                target = self.anchors.get(self.peek_event().anchor)
                self._count(_expanded(target, self.sizes) if target is not None else 1)
            else:
                self._count(1)
            return super().compose_node(parent, index)

        def _count(self, n: int) -> None:
            self.nodes += n
            if self.nodes > MAX_YAML_NODES:
                raise ConfigError(
                    f"{where}: YAML of more than {MAX_YAML_NODES} nodes once its aliases "
                    "are expanded (an alias bomb?): refused"
                )

    loader = BoundedLoader(text)
    loader.sizes = {}
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _expanded(node: Any, sizes: dict[int, int]) -> int:
    """How many nodes `node` stands for with every alias in it expanded (memoised: an
    aliased subtree is one object, measured once)."""
    key = id(node)
    if key not in sizes:
        value = node.value
        if isinstance(value, list):
            pairs = bool(value) and isinstance(value[0], tuple)  # a mapping: (key, value)
            items = [x for pair in value for x in pair] if pairs else value
            sizes[key] = 1 + sum(_expanded(x, sizes) for x in items)
        else:
            sizes[key] = 1
    return sizes[key]


def read_config_file(path: Path) -> dict[str, Any]:
    """Read any supported config file into a dict (actscan or Hugging Face): a regular
    file of at most CONFIG_CAP bytes (actscan/files.py), parsed with the bounds above."""
    suffix = path.suffix.lower()
    if suffix == ".yml":
        suffix = ".yaml"
    if suffix not in {".yaml", ".toml", ".json"}:
        raise ConfigError(f"{path}: unsupported config type '{path.suffix}' (.yaml, .toml, .json)")
    text = read_text_bounded(path, cap=CONFIG_CAP, what="config file", error=ConfigError)
    data = parse_text(text, suffix, str(path))
    if data is None:
        raise ConfigError(f"{path}: empty config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def is_actscan_config(data: dict[str, Any]) -> bool:
    return data.get("family") == FAMILY or ("model_type" not in data and "n_layers" in data)


def parse_set(items: list[str] | None, flag: str = "--set") -> dict[str, str]:
    """`--set key=value` pairs (repeatable) into a dict; values stay strings until coerced."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} expects key=value, got '{item}'")
        out[key.strip()] = value.strip()
    return out


def apply_overrides(cfg: ArchConfig, overrides: dict[str, Any], where: str = "--set") -> ArchConfig:
    merged = {**cfg.to_dict(), **overrides}
    return build_config(merged, where)


def with_init(cfg: ArchConfig, init: str | None, flag: str = "--init") -> ArchConfig:
    if init is None:
        return cfg
    if init not in INITS:
        raise ConfigError(f"{flag} must be one of {'|'.join(INITS)}, got '{init}'")
    return replace(cfg, init=init)
