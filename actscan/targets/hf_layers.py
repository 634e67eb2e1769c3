"""A transformers config at a new depth: its per-layer lists follow the layer count.

Configs list one entry per layer (`layer_types` in qwen3, qwen2_moe, gemma2/3, modernbert,
…; `mlp_layer_types`, `no_rope_layers`, `layers_block_type`, …), and transformers 5
requires `len(layer_types) == num_hidden_layers` (`validate_layer_type`) and indexes them
by layer. `--set num_hidden_layers=N` and `sweep --depth` change the count alone, so a
deeper model would index past the list (IndexError). `resize_per_layer` regenerates such
a list with the config's own rule when the list is what that rule gives (gemma's
sliding/full alternation, modernbert's global_attn_every_n_layers), and otherwise repeats
the list's shortest period (a hand-written pattern) or cuts it.

Lists of layer *indices* (`mlp_only_layers`, `moe_layers`) are not per-layer lists: an
index stays valid in a deeper model, so they are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actscan.targets.hf_env import quiet

__all__ = ["DEPTH_KEYS", "config_value", "depth_of", "resize_per_layer"]

DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Index lists: a layer number per entry, not an entry per layer.
_INDEX_LISTS = frozenset(
    {
        "mlp_only_layers",
        "moe_layers",
        "subsample_layers",
        "rope_scaling_layers",
        "window_block_indexes",
        "window_block_indices",
        "deepstack_visual_indexes",
        "full_attn_idxs",
        "global_attn_indexes",
        "out_indices",
        "out_features",
    }
)
# Per-layer lists whose name does not say "layer".
_PER_LAYER = frozenset(
    {
        "kv_sharing_modes",
        "indexer_types",
        "sliding_windows",
        "swiglu_limits",
        "swiglu_limits_shared",
        "activation_sparsity_pattern",
        "moe_topk",
        "per_layer_config",
    }
)


def config_value(config: Any, name: str) -> Any:
    """`getattr(config, name, None)` that a heterogeneous config (transformers 5's
    `per_layer_config`: Gemma 4's wider full-attention heads, Dots3's per-layer head
    counts) answers too: reading a per-layer field there raises
    AmbiguousGlobalPerLayerAttributeError, so the value is the one every layer shares,
    or None when the layers differ (no single value to report)."""
    varying = getattr(config, "per_layer_attributes", None)
    if not (isinstance(varying, set | frozenset) and name in varying):
        return getattr(config, name, None)
    try:
        values = [getattr(layer, name, None) for layer in config.per_layer_config]
    except Exception:  # a view this transformers builds differently: no single value
        return None
    first = values[0] if values else None
    return first if all(v == first for v in values) else None


def depth_of(config: Any) -> int | None:
    """The config's layer count, by the first depth key it has."""
    for key in DEPTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _per_layer_keys(values: dict[str, Any], depth: int) -> list[str]:
    return [
        key
        for key, value in values.items()
        if isinstance(value, list | tuple)
        and len(value) == depth
        and key not in _INDEX_LISTS
        and ("layer" in key or key in _PER_LAYER)
    ]


def _period(items: Sequence[Any]) -> int:
    """Length of the shortest prefix that, repeated, gives `items`."""
    n = len(items)
    for p in range(1, n + 1):
        if all(items[i] == items[i % p] for i in range(n)):
            return p
    return n


def _repeat(items: Sequence[Any], depth: int) -> list[Any]:
    p = _period(items)
    return [items[i % p] for i in range(depth)]


def _rule(config: Any, keys: Sequence[str], depth: int) -> dict[str, Any] | None:
    """What the config class itself puts in `keys` at `depth` when they are not given
    (its __post_init__ rule), or None if it cannot say."""
    data = config.to_dict()
    key = next((k for k in DEPTH_KEYS if k in data), None)
    if key is None:
        return None
    data[key] = depth
    for k in keys:
        data.pop(k, None)
    try:
        with quiet():
            fresh = type(config).from_dict(data)
    except Exception:  # a config that only validates at its own depth: fall back
        return None
    out = {k: getattr(fresh, k, None) for k in keys}
    ok = all(isinstance(v, list | tuple) and len(v) == depth for v in out.values())
    return out if ok else None


def resize_per_layer(config: Any, depth_before: int | None, keep: set[str]) -> list[str]:
    """Give every per-layer list of `config` the config's current depth (in place).

    `keep`: fields the user set themselves (left alone: a wrong length is then theirs,
    and transformers says so). Returns the names of the lists that were resized.
    """
    depth = depth_of(config)
    if depth is None or depth_before is None or depth == depth_before or depth < 1:
        return []
    values: dict[str, Any] = {k: getattr(config, k, None) for k in config.to_dict()}
    keys = [k for k in _per_layer_keys(values, depth_before) if k not in keep]
    if not keys:
        return []
    before = _rule(config, keys, depth_before)
    after = _rule(config, keys, depth) if before is not None else None
    for key in keys:
        old = list(values[key])
        if after is not None and before is not None and list(before[key]) == old:
            new = list(after[key])  # the config's own rule (e.g. gemma3's 5:1 pattern)
        else:
            new = _repeat(old, depth)
        setattr(config, key, type(values[key])(new) if isinstance(values[key], tuple) else new)
    return keys
