"""Inputs for models that take images and text together, from the model's own description.

Two kinds, told apart by the config alone:

- **two-tower** (CLIP, SigLIP, ALIGN): a forward that takes `input_ids` and
  `pixel_values` and a config with a `text_config` and a `vision_config`, no image token:
  random ids for the text tower, random images for the vision tower, both at once.
- **vision-language** (LLaVA, PaliGemma, Gemma 3, Qwen-VL): the config names an image
  placeholder token (`image_token_id` / `image_token_index`). The text holds as many
  placeholders as the vision tower gives features for the images; that number is read off
  the model itself (`get_image_features` on the batch's images, without gradients), not
  off a per-family formula. Qwen-VL's forward takes patches and a `image_grid_thw`: one
  grid of 2·merge × 2·merge patches per image.

A third kind reads an image as detector regions (LXMERT, VisualBERT: `region_source`).
Where the config allows several forms (a layout, an image side too small for a
hierarchical backbone at the config's own size), one forward pass of one row picks the
first the model accepts (`runs_on`); a config that names a token but leaves it None is
refused in one line.

Everything duck-types `model.config`; nothing imports transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actscan.errors import UsageError
from actscan.measure.inputs import Batch, random_tokens
from actscan.measure.state import eval_mode

__all__ = [
    "config_int",
    "deep_config_int",
    "feature_rows",
    "forward_params",
    "packed_patches",
    "patch_grid",
    "patch_sequence",
    "positioned_patches",
    "region_source",
    "text_config",
    "text_ids",
    "vision_text_source",
]

DEFAULT_IMAGE = 224
PATCH_FORMS = ("flat", "conv", "seq", "merged")  # the forms `patch_grid` gives, tried in order
LARGEST_SIDE = 512  # the largest image side tried when the config's is too small to run


def image_sides(side: int) -> list[int]:
    """The config's image side, then its doublings up to 4× it and LARGEST_SIDE: a hierarchical
    backbone needs every stage's grid at least its window (Swin: window · patch ·
    2^(stages-1) pixels) and a pyramid's last stage at least its patch (MobileViT), a
    detector more encoder tokens than its queries; a config whose image_size is smaller
    than that is fed the smallest doubling its forward accepts (the header says which)."""
    sides = [side]
    while sides[-1] * 2 <= min(4 * side, max(LARGEST_SIDE, side)):  # at most 4× the config's
        sides.append(sides[-1] * 2)
    return sides


def runs_on(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether one forward pass (eval mode, no gradients, the RNG state kept) accepts
    `kwargs`: the probe that picks among the input forms a config allows."""
    try:
        with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(**kwargs)
    except Exception:
        return False
    return True


def forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def required_params(fn: Any) -> list[str]:
    """The arguments a forward (of a module, or any callable) cannot run without."""
    call = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.default is p.empty and p.kind in kinds]


def sibling_ids(
    model: nn.Module, call: Any, rows: int, seq: int, seed: int, index: int
) -> dict[str, torch.Tensor]:
    """Token ids `call` requires beside `input_ids`, each from the vocabulary of the
    sub-config its name prefixes (InstructBLIP's `qformer_input_ids` from
    `qformer_config`), with an all-ones `<prefix>_attention_mask` where it takes one."""
    config: Any = model.config  # a transformers config: its fields vary by family
    call = call.forward if isinstance(call, nn.Module) else call
    takes = _params(call)
    out: dict[str, torch.Tensor] = {}
    for name in required_params(call):
        prefix = name.removesuffix("_input_ids")
        if prefix in (name, "", "decoder"):
            continue
        vocab = config_int(getattr(config, f"{prefix}_config", None), "vocab_size")
        if vocab is None:
            continue
        ids = random_tokens(vocab, rows, seq, seed + 3, index)
        out[name] = ids
        if f"{prefix}_attention_mask" in takes:
            out[f"{prefix}_attention_mask"] = torch.ones_like(ids)
    return out


def _params(call: Any) -> set[str]:
    try:
        return set(inspect.signature(call).parameters)
    except (TypeError, ValueError):
        return set()


def config_int(config: Any, *names: str) -> int | None:
    """The first of `names` the config holds as a positive int."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def deep_config_int(config: Any, names: tuple[str, ...], depth: int = 3) -> int | None:
    """The first of `names` the config or a sub-config of it (depth first) holds: an ASR
    model keeps its mel bins in `encoder_config`, a speech LM deeper still."""
    found = config_int(config, *names)
    if found is not None or depth == 0:
        return found
    for key, sub in vars(config).items():
        if key.endswith("_config") and hasattr(sub, "to_dict"):
            found = deep_config_int(sub, names, depth - 1)
            if found is not None:
                return found
    return None


def text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get()
        except (TypeError, ValueError, AttributeError):
            pass
    return getattr(config, "text_config", None) or config


def _special_ids(config: Any, vocab: int) -> set[int]:
    """Every token id the configs name (image, video, audio, boi/eoi, pad...): random text
    must not hit one, or it would read as a placeholder."""
    ids: set[int] = set()
    for cfg in (config, text_config(config)):
        for key, value in vars(cfg).items():
            named = "token" in key or key.endswith("_id")
            if named and isinstance(value, int) and not isinstance(value, bool) and value < vocab:
                ids.add(value)
    return ids


def text_ids(config: Any, batch: int, seq: int, seed: int, index: int) -> torch.Tensor | None:
    text = text_config(config)
    vocab = config_int(text, "vocab_size") or config_int(config, "vocab_size")
    if vocab is None:
        return None
    ids = random_tokens(vocab, batch, seq, seed, index)
    special = _special_ids(config, vocab)
    safe = next((t for t in range(vocab) if t not in special), 0)
    for s in special:
        ids[ids == s] = safe
    return ids


def placeholder_token(config: Any, kind: str) -> int | None:
    """The id of the `kind` ("image", "audio") placeholder the text carries, from the
    config or its text config (`<kind>_token_id` or `<kind>_token_index`)."""
    for cfg in (config, text_config(config)):
        for name in (f"{kind}_token_id", f"{kind}_token_index"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return None


def _vision_config(config: Any) -> Any:
    for name in ("vision_config", "image_config", "vision_tower_config", "backbone_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    return None


def _square(value: Any) -> int | None:
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, list | tuple) and value and isinstance(value[0], int):
        return int(value[0])
    return None


def patch_grid(
    vision: Any, batch: int, gen: torch.Generator, form: str = "flat"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-VL-style patches for `batch` images and their (t, h, w) grid: one frame of
    2·merge × 2·merge patches each, every patch C × T × P × P values (the channels, the
    temporal patch and the patch side the vision config names). `form`: "flat" (one row
    per patch), "conv" (each patch C × P × P, for a tower whose first layer is a conv
    over patches), "seq" (one sequence of every patch, 1 × N × C × P × P), "merged"
    (a row per merge × merge patches, each pixel's C channels last, the grid counted in
    those rows: Inkling 2's language tokens)."""
    channels = config_int(vision, "num_channels", "in_channels", "in_chans") or 3
    patch = config_int(vision, "patch_size", "spatial_patch_size") or 14
    temporal = config_int(vision, "temporal_patch_size", "patch_temporal") or 1  # one frame
    merge = config_int(vision, "spatial_merge_size", "merge_size") or _first(
        getattr(vision, "merge_kernel_size", None)
    )
    side = 2 * (merge or 2)
    grid = torch.tensor([[1, side, side]] * batch)
    n = batch * side * side
    flat = torch.randn(n, channels * temporal * patch * patch, generator=gen)
    if form == "conv":
        flat = flat.view(n, channels * temporal, patch, patch)
    elif form == "seq":
        flat = flat.view(1, n, channels * temporal, patch, patch)
    elif form == "merged":  # channels last, the grid counted in merged tokens
        m = merge or 2
        flat = flat.view(n // (m * m), -1, channels)
        grid = torch.tensor([[1, side // m, side // m]] * batch)
    return flat, grid


def _first(value: Any) -> int | None:
    if isinstance(value, list | tuple) and value and isinstance(value[0], int):
        return int(value[0])
    return None


def patch_sequence(vision: Any, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """SigLIP 2 (NaFlex)-style inputs: each image a sequence of flattened C × P × P
    patches with its (h, w) patch grid and a mask of every patch (none is padding); a
    4 × 4 grid, even for a 2 × 2 pixel unshuffle behind the tower."""
    channels = config_int(vision, "num_channels", "in_channels", "in_chans") or 3
    patch = config_int(vision, "patch_size") or 16
    side = 4
    flat = torch.randn(batch, side * side, channels * patch * patch, generator=gen)
    return {
        "pixel_values": flat,
        "spatial_shapes": torch.tensor([[side, side]] * batch),
        "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.long),
    }


def positioned_patches(vision: Any, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Gemma 4-style inputs: each image a sequence of flattened C × P × P patches and
    each patch's (x, y) position on its grid (`pixel_position_ids`), a square grid of a
    whole number of the config's pooling kernel on a side (the tower pools k × k
    patches into one)."""
    channels = config_int(vision, "num_channels", "in_channels", "in_chans") or 3
    patch = config_int(vision, "patch_size") or 16
    kernel = config_int(vision, "pooling_kernel_size") or 1
    side = kernel * max(1, 4 // kernel)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return {
        "pixel_values": torch.rand(batch, side * side, channels * patch * patch, generator=gen),
        "pixel_position_ids": positions.expand(batch, -1, -1).clone(),
    }


def packed_patches(vision: Any, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """NaViT-style packing (MiniCPM-V's tower): every image's P × P patches side by side
    in one row, (1, C, P, N · P), with each image's (h, w) patch grid in `target_sizes`
    (a 4 × 4 grid each, a whole number of a 2 × 2 merge)."""
    channels = config_int(vision, "num_channels", "in_channels", "in_chans") or 3
    patch = config_int(vision, "patch_size") or 14
    side = 4
    pixels = torch.randn(1, channels, patch, batch * side * side * patch, generator=gen)
    sizes = torch.tensor([[side, side]] * batch, dtype=torch.int32)
    return {"pixel_values": pixels, "target_sizes": sizes}


def _pinpoint(config: Any, size: int) -> tuple[int, int] | None:
    """LLaVA-NeXT's "anyres": the smallest of the config's `image_grid_pinpoints` that
    tiles whole images of the tower's side (an image of that size is cut into those
    tiles plus one resized base view)."""
    points = getattr(config, "image_grid_pinpoints", None)
    if not isinstance(points, list | tuple):
        return None
    fits = [
        (int(p[0]), int(p[1]))
        for p in points
        if isinstance(p, list | tuple)
        and len(p) == 2
        and all(isinstance(v, int) and v > 0 and v % size == 0 for v in p)
    ]
    return min(fits, key=lambda p: p[0] * p[1]) if fits else None


def _grid_key(params: set[str]) -> str | None:
    """The forward's per-image patch grid: Qwen-VL's (t, h, w) `image_grid_thw`, or an
    (h, w) `image_grid_hw` (Nemotron-H Omni) for still images."""
    return next((k for k in ("image_grid_thw", "image_grid_hw") if k in params), None)


def _layouts(model: nn.Module) -> tuple[str, ...]:
    """The image layouts to try, in order, for the model's forward."""
    params = forward_params(model)
    if _grid_key(params):
        return PATCH_FORMS
    if "spatial_shapes" in params:
        return ("naflex",)
    if "image_sizes" in params and _pinpoint(model.config, _image_side(model)):
        return ("anyres", "plain", "nested")
    vision = _vision_config(model.config) or model.config
    if config_int(vision, "num_frames") or config_int(model.config, "num_frames"):
        return ("video", "plain", "nested")
    return ("plain", "nested", "sizes", "nested+sizes", "tiles", "patches", "patch_rows")


def _image_side(model: nn.Module) -> int:
    config: Any = model.config  # a transformers config: its fields vary by family
    vision = _vision_config(config) or config
    return (
        _square(getattr(vision, "image_size", None))
        or _square(getattr(config, "image_size", None))
        or _square(getattr(config, "max_img_size", None))  # TVP pads frames to this side
        or DEFAULT_IMAGE
    )


def _images(
    model: nn.Module,
    batch: int,
    seed: int,
    index: int,
    layout: str = "plain",
    side: int | None = None,
) -> dict[str, torch.Tensor]:
    """`pixel_values` (and what goes with them) for `batch` images in `layout`: "plain"
    (batch, C, H, W); "nested": one image per sample as (batch, 1, C, H, W), the layout
    Idefics-like models take; "video": (batch, frames, C, H, W); "tiles": nested with a
    mask per tile (Granite Docling), not per pixel; "sizes": with `image_sizes`;
    "anyres": LLaVA-NeXT's tiles of a pinpoint-sized image and its base view; "patches":
    each image's patches flattened, (batch, N, C · P · P); "patch_rows": those of every
    image in one list, (batch · N, C · P · P); Qwen-VL's
    patches with their `image_grid_thw` ("flat", "conv", "seq", `patch_grid`);
    "naflex": `patch_sequence`."""
    config: Any = model.config  # a transformers config: its fields vary by family
    params = forward_params(model)
    vision = _vision_config(config) or config
    channels = config_int(vision, "num_channels", "in_channels", "in_chans") or 3
    gen = torch.Generator().manual_seed(seed * 100_003 + index + 7)
    if layout in PATCH_FORMS:
        flat, grid = patch_grid(vision, batch, gen, layout)
        key = _grid_key(params) or "image_grid_thw"
        out = {"pixel_values": flat, key: grid if key.endswith("thw") else grid[:, 1:]}
        if "image_merge_sizes" in params:
            merge = int(grid[0, 1]) // 2
            out["image_merge_sizes"] = torch.full((batch,), merge, dtype=torch.long)
        return out
    if layout == "naflex":
        return patch_sequence(vision, batch, gen)
    if layout in ("patches", "patch_rows"):  # Fuyu: each image its patches, raster order
        patch = config_int(vision, "patch_size") or 16
        side = _image_side(model) // patch
        flat = torch.randn(batch, side * side, channels * patch * patch, generator=gen)
        # NeoMME: every image's patches one after another, a row each
        return {"pixel_values": flat.flatten(0, 1) if layout == "patch_rows" else flat}
    size = side or _image_side(model)
    views = 1
    point = _pinpoint(config, size) if layout == "anyres" else None
    if point is not None:
        views = 1 + (point[0] // size) * (point[1] // size)
    if layout == "video":  # X-CLIP: a clip of the frames the vision config names
        views = config_int(vision, "num_frames") or config_int(config, "num_frames") or 1
    pixels = torch.randn(batch, views, channels, size, size, generator=gen)
    nested = layout in ("nested", "nested+sizes", "anyres", "tiles", "video")
    out = {"pixel_values": pixels if nested else pixels[:, 0]}
    out.update(_sibling_images(model, batch, gen))
    if "pixel_attention_mask" in params:  # every pixel (or tile) is real: no padding
        rows = out["pixel_values"].shape[:-3]
        pixel = () if layout == "tiles" else (size, size)
        out["pixel_attention_mask"] = torch.ones((*rows, *pixel), dtype=torch.bool)
    if layout in ("sizes", "nested+sizes") or point is not None:
        out["image_sizes"] = torch.tensor([list(point or (size, size))] * batch)
    return out


def _refuse_unset_placeholder(model: nn.Module) -> None:
    """A vision-language model whose config declares its image (or video) token but leaves
    it None (BLIP-2's and InstructBLIP's library defaults): its forward places the
    features at that token, so no text can be written for it; one line naming the field."""
    config: Any = model.config  # a transformers config: its fields vary by family
    kinds = [k for k in ("image", "video") if callable(getattr(model, f"get_{k}_features", None))]
    for name in (f"{k}_token_{suffix}" for k in kinds for suffix in ("id", "index")):
        if name in vars(config) and getattr(config, name) is None:
            raise UsageError(
                f"{type(model).__name__}'s config sets no {name.split('_')[0]} token "
                f"({name} = None), but its forward puts the features at that token: set it "
                "in config.json to the tokenizer's id for it"
            )


def _text_sees_images(
    params: set[str], ids: torch.Tensor, pixels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Idefics' `image_attention_mask` (text position × image): every token of a row
    attends to every image of its row, when the forward takes nested images."""
    if "image_attention_mask" not in params or pixels.dim() != 5:
        return {}
    return {"image_attention_mask": torch.ones(*ids.shape, pixels.shape[1], dtype=torch.long)}


def _first_form(
    model: nn.Module, kwargs_for: Callable[[str, int], dict[str, Any]]
) -> tuple[str, int]:
    """The first (layout, image side) of `_layouts` × `image_sides` whose one-row batch
    the model's forward accepts (Idefics takes nested images, a detector more pixels
    than its config's image_size gives queries for); the first when none runs, so the
    model's own error says why."""
    forms = [
        (layout, side) for side in image_sides(_image_side(model)) for layout in _layouts(model)
    ]
    return next((f for f in forms if runs_on(model, kwargs_for(*f))), forms[0])


def _sibling_images(model: nn.Module, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A second view of each image the forward takes, `<prefix>_pixel_values` at the side
    of the `<prefix>_vision_config` (DeepSeek-VL hybrid's high-resolution tower)."""
    config: Any = model.config  # a transformers config: its fields vary by family
    out: dict[str, torch.Tensor] = {}
    for name in sorted(forward_params(model)):
        prefix = name.removesuffix("_pixel_values")
        if prefix in (name, "", "prompt"):
            continue
        sub = getattr(config, f"{prefix}_vision_config", None)
        side = _square(getattr(sub, "image_size", None))
        if side is None:
            continue
        channels = config_int(sub, "num_channels", "in_channels", "in_chans") or 3
        out[name] = torch.randn(batch, channels, side, side, generator=gen)
    return out


def feature_rows(out: Any, width: int | None) -> int | None:
    """How many text positions `get_image_features`' output fills: its rows of the text
    width (the check transformers' placeholder mask makes)."""
    pooled = getattr(out, "pooler_output", None)
    feats = pooled if pooled is not None else out
    if isinstance(feats, dict):
        feats = feats.get("pooler_output", feats.get("last_hidden_state"))
    tensors: list[torch.Tensor] = []
    if isinstance(feats, torch.Tensor):
        tensors = [feats]
    elif isinstance(feats, list | tuple):
        tensors = [t for t in feats if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    numel = sum(t.numel() for t in tensors)
    if width and numel % width == 0:
        return numel // width
    return sum(t.numel() // t.shape[-1] for t in tensors if t.dim() >= 1)


def _count_image_tokens(model: nn.Module, batch: int, seed: int) -> list[tuple[int, str]]:
    """Placeholders the batch's images fill, from the model's own vision path, for each
    layout (`_images`) it runs on, in `_layouts` order; [] when none runs."""
    get = getattr(model, "get_image_features", None)
    if not callable(get):  # some keep it on the inner model (DeepSeek-VL's `model`)
        get = getattr(getattr(model, "model", None), "get_image_features", None)
    if not callable(get):
        return []
    width = config_int(text_config(model.config), "hidden_size")
    siblings = sibling_ids(model, get, batch, 8, seed, 0)
    counted: list[tuple[int, str]] = []
    for layout in _layouts(model):
        images = _images(model, batch, seed, 0, layout)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = get(**images, **siblings)
        except Exception:
            continue
        rows = feature_rows(out, width)
        if rows is not None:
            counted.append((rows, layout))
    return counted


_POSITION_MASK = "image_embeds_position_mask"


def vision_text_source(
    model: nn.Module, *, batch: int, seq_len: int | None, seed: int, default_seq: int
) -> Callable[[int], Batch] | None:
    """Images and token ids for a two-tower or vision-language model, or None when the
    model is neither (its forward takes no `pixel_values` beside `input_ids`)."""
    config: Any = getattr(model, "config", None)
    params = forward_params(model)
    if config is None or not {"input_ids", "pixel_values"} <= params:
        return None
    text = text_config(config)
    limit = config_int(text, "max_position_embeddings")
    seq = seq_len or min(default_seq, limit or default_seq)
    image_token = placeholder_token(config, "image")
    marked = image_token is None and _POSITION_MASK in params  # Kosmos-2: a mask, no token
    if image_token is None and not marked:
        _refuse_unset_placeholder(model)
        if _vision_config(config) is None and _square(getattr(config, "image_size", None)) is None:
            return None  # neither a vision tower's config nor an image size (ViLT's)
        if text_ids(config, 1, 1, seed, 0) is None:
            return None

        def two_tower_at(rows: int, i: int, layout: str, side: int) -> Batch:
            ids = text_ids(config, rows, seq, seed, i)
            assert ids is not None  # checked above
            kw: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            kw.update(_images(model, rows, seed, i, layout, side))
            kw.update(_text_sees_images(params, ids, kw["pixel_values"]))
            kw.update(sibling_ids(model, model, rows, seq, seed, i))
            if "return_loss" in params:
                kw["return_loss"] = False
            return Batch(kwargs=kw)

        form = _first_form(model, lambda layout, side: two_tower_at(1, 0, layout, side).kwargs)
        return lambda i: two_tower_at(batch, i, *form)

    counted = _count_image_tokens(model, batch, seed)
    forms = [(n // batch, layout) for n, layout in counted if not n % batch]
    if not forms or text_ids(config, 1, 1, seed, 0) is None:
        return None

    def vlm_at(rows: int, i: int, per_image: int, layout: str) -> Batch:
        ids = text_ids(config, rows, seq, seed, i)
        assert ids is not None
        fill = image_token if image_token is not None else int(ids[0, 0])
        ids = torch.cat([torch.full((rows, per_image), fill), ids], dim=1)
        kw: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if marked:  # the positions the image features replace, marked by a mask
            kw[_POSITION_MASK] = torch.zeros_like(ids)
            kw[_POSITION_MASK][:, :per_image] = 1
        if "mm_token_type_ids" in params:  # Qwen-VL's M-RoPE: 1 on image tokens
            kw["mm_token_type_ids"] = torch.zeros_like(ids)
            kw["mm_token_type_ids"][:, :per_image] = 1
        kw.update(_images(model, rows, seed, i, layout))
        kw.update(sibling_ids(model, model, rows, seq, seed, i))
        if "token_type_ids" in params:  # PaliGemma/Gemma 3: 0 on image and prompt tokens
            kw["token_type_ids"] = torch.zeros_like(ids)
        return Batch(kwargs=kw)

    # the first layout the whole forward takes, one row (a vision path may accept a
    # layout whose features the placeholder check then counts otherwise: NeoMME's rows
    # of patches); the first counted when none runs, so the model's own error says why
    per, layout = next((f for f in forms if runs_on(model, vlm_at(1, 0, *f).kwargs)), forms[0])
    return lambda i: vlm_at(batch, i, per, layout)


# region features a detector gives a two-stream model, and the config field of their width
REGION_INPUTS = (("visual_feats", "visual_feat_dim"), ("visual_embeds", "visual_embedding_dim"))
REGIONS = 8  # regions per image (a detector's boxes)


def region_source(
    model: nn.Module, *, batch: int, seq_len: int | None, seed: int, default_seq: int
) -> Callable[[int], Batch] | None:
    """Token ids with an image as detector regions (LXMERT, VisualBERT): REGIONS feature
    vectors of the width the config names, their boxes (x0, y0, x1, y1 in [0, 1], each
    corner pair ordered) where the forward takes `visual_pos`, and a mask of every region;
    None when the forward takes no region features."""
    config: Any = getattr(model, "config", None)
    params = forward_params(model)
    if config is None or "input_ids" not in params:
        return None
    found = next(
        ((arg, config_int(config, dim)) for arg, dim in REGION_INPUTS if arg in params),
        None,
    )
    vocab = config_int(config, "vocab_size")
    if found is None or found[1] is None or vocab is None:
        return None
    arg, width = found[0], found[1]
    seq = seq_len or min(default_seq, config_int(config, "max_position_embeddings") or default_seq)
    box_dim = config_int(config, "visual_pos_dim") or 4

    def regions(i: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 100_003 + i + 11)
        ids = random_tokens(vocab, batch, seq, seed, i)
        kw: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kw[arg] = torch.randn(batch, REGIONS, width, generator=gen)
        if "visual_pos" in params:
            # (corner, coordinate), each coordinate's smaller value first: x0, y0, x1, y1
            corners = torch.rand(batch, REGIONS, 2, 2, generator=gen).sort(dim=2).values
            boxes = corners.flatten(2)
            kw["visual_pos"] = boxes[..., :box_dim] if box_dim <= 4 else boxes
        if "visual_attention_mask" in params:
            kw["visual_attention_mask"] = torch.ones(batch, REGIONS, dtype=torch.long)
        return Batch(kwargs=kw)

    return regions
