"""A Hugging Face config, checked before its model is built: against the weights beside it
(tensor names and shapes from the safetensors headers) and its memory against the machine.

A `config.json` that says 20,000 layers beside 2-layer weights used to be found out only
after transformers had built (and initialised) the 20,000 layers, minutes later. Here the
model is built on the meta device at depth 1 and 2 (no storage, no init, a few tens of
milliseconds for any family): the names the second layer adds are the per-layer names
(`model.layers.{i}.mlp.up_proj.weight`), the rest are the model's own, and their shapes
are the config's. The weights are then held to that, names compared after the base-model
prefix (`model.`, `transformer.`) is taken off both sides, as transformers' loader does:

* a layer stack that the config makes deeper than the weights' (their highest layer index
  + 1) is refused, naming the first layer the weights lack;
* a tensor whose name the config implies with another shape is refused, naming it.

Inconclusive cases are left to transformers' loader after the build (it lists every
missing, unexpected and mis-shaped key): weights named in a way the meta model does not
use (renamed or fused tensors), a config that cannot be built at depth 1 or 2. The same
two builds give the parameter count of the memory estimate (footprint.py).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actscan.errors import BadInputError
from actscan.targets.footprint import Shape, elements, safe_int
from actscan.targets.hf_layers import DEPTH_KEYS, config_value, depth_of, resize_per_layer
from actscan.targets.weights import mismatch_error

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MetaPlan", "check_weights", "meta_plan"]

_INDEX = re.compile(r"^\d{1,9}$")


@dataclass(frozen=True)
class MetaPlan:
    """What a config implies, read off meta builds at depth 1 and 2.

    `shapes`: the depth-2 model's tensors (its own and layers 0 and 1), by name without
    the base-model prefix; `stacks`: each layer stack's path ("layers", "encoder.block")
    → the position of its index in a dotted name; `depth`: the config's layer count and
    `depth_key` the field that says it. Empty when the config could not be built small.
    """

    shape: Shape
    depth: int | None = None
    depth_key: str | None = None
    prefix: str = ""
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    stacks: Mapping[str, int] = field(default_factory=dict)


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name


def _at_depth(config: Any, key: str, depth: int) -> Any:
    small = copy.deepcopy(config)
    before = depth_of(small)
    setattr(small, key, depth)
    resize_per_layer(small, before, keep=set())
    return small


def _stacks(one: Sequence[str], two: Sequence[str]) -> dict[str, int]:
    """Layer stacks: a name of the depth-2 model that is new, with a "1" component that
    reads as a depth-1 name with "0" there, marks a stack (its path up to the index)."""
    known = set(one)
    out: dict[str, int] = {}
    for name in sorted(set(two) - known):
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part == "1" and ".".join([*parts[:i], "0", *parts[i + 1 :]]) in known:
                out.setdefault(".".join(parts[:i]), i)
                break
    return out


def _facts(config: Any) -> dict[str, int | None]:
    def first(*names: str) -> int | None:
        return next((v for n in names if (v := safe_int(config_value(config, n)))), None)

    return {
        "d_model": first("hidden_size", "n_embd", "d_model", "dim"),
        "d_ff": first("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim"),
        "n_heads": first("num_attention_heads", "n_head", "num_heads"),
        "vocab": first("vocab_size"),
        "max_positions": first("max_position_embeddings", "n_positions", "max_seq_len"),
    }


def _rough_numel(depth: int, facts: Mapping[str, int | None]) -> int:
    """Without a meta build: attention (4d²) and MLP (3·d·ff) per layer, embeddings."""
    d = facts["d_model"] or 0
    ff = facts["d_ff"] or 4 * d
    return depth * (4 * d * d + 3 * d * ff) + 2 * (facts["vocab"] or 0) * d


def meta_plan(config: Any, build: Callable[[Any], nn.Module]) -> MetaPlan:
    """The config's size and naming from `build` (the Auto class's from_config) run on the
    meta device at depth 1 and 2. A config that cannot be built that small gives a
    plan with the size from its fields alone and nothing to hold the weights to."""
    import torch

    facts = _facts(config)
    depth = depth_of(config)
    own = config.to_dict()  # the key the file spells (gpt2: n_layer), else an alias
    keys = [k for k in DEPTH_KEYS if safe_int(getattr(config, k, None)) == depth]
    key = next((k for k in keys if k in own), keys[0] if keys else None)
    n_layers = depth if depth is not None and depth > 0 else 1
    if key is None or depth is None or depth < 1:
        return MetaPlan(Shape(_rough_numel(n_layers, facts), n_layers, **facts))
    try:
        with torch.device("meta"):
            one = build(_at_depth(config, key, 1))
            two = build(_at_depth(config, key, 2))
    except Exception:  # a config valid only at its own depth: the loader will judge it
        return MetaPlan(Shape(_rough_numel(depth, facts), depth, **facts), depth, key)
    n1, n2 = elements(one), elements(two)
    numel = n1 + (depth - 1) * max(n2 - n1, 0) if depth > 1 else n1
    prefix = str(getattr(two, "base_model_prefix", "") or "")
    shapes1 = {_strip(n, prefix): tuple(t.shape) for n, t in one.state_dict().items()}
    names1 = list(shapes1)
    # a tensor outside the layers whose shape follows the depth (Gemma 4's per-layer
    # embeddings, layers × width; ESM's contact head, layers × heads) is not the depth-2
    # model's shape in the real one: left to the loader, not held to the meta build
    shapes = {
        name: shape
        for n, t in two.state_dict().items()
        if shapes1.get(name := _strip(n, prefix), shape := tuple(t.shape)) == shape
    }
    return MetaPlan(
        Shape(numel, depth, **facts),
        depth,
        key,
        prefix,
        shapes,
        _stacks(names1, list(shapes)),
    )


def check_weights(plan: MetaPlan, weights: Mapping[str, Sequence[int]], where: str) -> None:
    """Refuse weights that cannot be what the config describes (module docstring), one
    line naming the first difference; silent when the names do not say."""
    if plan.depth is None or not plan.shapes:
        return
    names = {_strip(n, plan.prefix): tuple(s) for n, s in weights.items()}
    spelled = {_strip(n, plan.prefix): n for n in weights}  # as the file names them
    for stack, pos in sorted(plan.stacks.items()):
        head = stack.split(".") if stack else []
        found = {
            int(parts[pos])
            for name in names
            if len(parts := name.split(".")) > pos
            and parts[:pos] == head
            and _INDEX.match(parts[pos])
        }
        if found and plan.depth > max(found) + 1:
            missing = min(set(range(max(found) + 2)) - found)
            where_in = ".".join(p for p in (plan.prefix, stack, str(missing)) if p)
            raise BadInputError(
                f"bad checkpoint {where}: the config says {plan.depth_key}={plan.depth} but "
                f"the weights hold layers up to {max(found)} only (no tensors under "
                f"'{where_in}.') — wrong config.json?"
            )
    misshaped = [
        (spelled[name], list(shape), list(implied))
        for name, shape in sorted(names.items())
        if (implied := plan.shapes.get(name)) is not None and implied != shape
    ]
    error = mismatch_error(where, [], [], misshaped)  # the loader's own wording, earlier
    if error is not None:
        raise error
