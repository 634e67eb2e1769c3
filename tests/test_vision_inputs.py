"""Image, video, vision-language and detection inputs invented from the model's own
description (issue 22), one mechanism per test, each on a tiny model built with
transformers' own init. The independent check is the model's forward: it raises when an
input is missing or its shape is wrong, and each test first shows the input actscan built
before the mechanism (the config's size, a flat layout, no second input) is refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from actscan.errors import UsageError  # noqa: E402
from actscan.measure.inputs import Batch  # noqa: E402
from actscan.measure.model_inputs import describe_batch, hf_input_source  # noqa: E402
from benchmarks import families  # noqa: E402

TYPES = families.model_types()


def _tiny(model_type: str, **fields: Any) -> Any:
    if not fields:
        return families.build(model_type, TYPES[model_type]).eval()
    config = families.tiny_config(model_type)
    for key, value in fields.items():
        target = config
        *path, last = key.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    torch.manual_seed(0)
    return getattr(transformers, TYPES[model_type])(config).eval()


def _kwargs(model: Any, seq_len: int | None = 8) -> dict[str, Any]:
    source = hf_input_source(model, batch=2, seq_len=seq_len, seed=0)
    assert source is not None
    return dict(source(0).kwargs)


def _raises(model: Any, **kwargs: Any) -> bool:
    try:
        with torch.no_grad():
            model(**kwargs)
    except Exception:
        return True
    return False


def test_a_backbone_too_small_at_its_config_size_gets_the_first_doubling_it_runs_on() -> None:
    """MobileViT-v2 at image_size 32 downsamples to a 1 × 1 grid its 2 × 2 unfold cannot
    cut: the config's side, then its doublings, and the smallest the forward accepts is
    fed (the header says which)."""
    model = _tiny("mobilevitv2")
    side = model.config.image_size
    assert _raises(model, pixel_values=torch.randn(1, 3, side, side))
    kw = _kwargs(model, seq_len=None)
    assert tuple(kw["pixel_values"].shape) == (2, 3, 2 * side, 2 * side)
    with torch.no_grad():
        model(**kw)
    assert describe_batch(Batch(kwargs=kw)) == f"2 images 3×{2 * side}×{2 * side}"


def test_a_video_two_tower_model_gets_the_frames_its_vision_config_names() -> None:
    """X-CLIP's vision tower mixes a message token across `num_frames` frames: the clip
    holds that many (one frame was built before, which its reshape refuses)."""
    model = _tiny("xclip")
    frames = model.config.vision_config.num_frames
    assert frames > 1
    kw = _kwargs(model)
    pixels = kw["pixel_values"]
    assert pixels.shape[:2] == (2, frames) and kw["input_ids"].shape == (2, 8)
    assert _raises(model, **{**kw, "pixel_values": pixels[:, :1]})
    with torch.no_grad():
        model(**kw)


def test_a_joint_model_without_a_vision_config_gets_images_beside_its_text() -> None:
    """ViLT names its image size at the top of its config, no vision_config and no image
    token: it gets images and ids together (ids alone are refused by its forward)."""
    model = _tiny("vilt")
    kw = _kwargs(model)
    side = model.config.image_size
    assert tuple(kw["pixel_values"].shape) == (2, 3, side, side)
    assert _raises(model, input_ids=kw["input_ids"])
    with torch.no_grad():
        model(**kw)


def test_nested_images_with_the_mask_of_which_text_sees_which_image() -> None:
    """Idefics takes (batch, images, C, H, W) and an image_attention_mask (text × image):
    the first layout its forward accepts, with every token seeing its row's image."""
    model = _tiny("idefics")
    kw = _kwargs(model)
    pixels, mask = kw["pixel_values"], kw["image_attention_mask"]
    assert pixels.dim() == 5 and mask.shape == (2, kw["input_ids"].shape[1], pixels.shape[1])
    assert _raises(model, input_ids=kw["input_ids"], pixel_values=pixels[:, 0])
    with torch.no_grad():
        model(**kw)


def test_a_required_second_text_gets_ids_from_the_sub_config_it_names() -> None:
    """InstructBLIP requires `qformer_input_ids` beside its prompt: random ids of the
    `qformer_config` vocabulary, with their mask, given to the image path too (so the
    placeholders match its query tokens: `num_query_tokens` per image)."""
    model = _tiny("instructblip", image_token_index=500, **{"text_config.word_embed_proj_dim": 64})
    kw = _kwargs(model)
    q = kw["qformer_input_ids"]
    assert q.shape == (2, 8) and int(q.max()) < model.config.qformer_config.vocab_size
    assert kw["qformer_attention_mask"].shape == q.shape
    per_row = (kw["input_ids"] == 500).sum(dim=1)
    assert (per_row == model.config.num_query_tokens).all()
    with torch.no_grad():
        model(**kw)  # raises when placeholders and query features disagree


def test_a_vision_language_config_without_its_image_token_is_refused_in_one_line() -> None:
    """BLIP-2's library default leaves image_token_index None, and its forward scatters
    the image features at that token: one line naming the field to set."""
    model = _tiny("blip-2")
    model.config.image_token_index = None  # the library default (the matrix sets one)
    with pytest.raises(UsageError) as err:
        hf_input_source(model, batch=2, seq_len=8, seed=0)
    line = str(err.value)
    assert "\n" not in line and "image_token_index = None" in line and "config.json" in line


def test_a_forward_that_needs_a_session_object_is_refused_naming_its_class() -> None:
    """SAM 2 video's forward requires an `inference_session`, an object its processor
    builds from a video, not a tensor: the line names the class and how to pass it, and
    offers no --input-shape (a shape cannot make one)."""
    model = _tiny("sam2_video")
    with pytest.raises(UsageError) as err:
        hf_input_source(model, batch=2, seq_len=8, seed=0)
    line = str(err.value)
    assert "\n" not in line and "--input-shape" not in line
    assert "inference_session (an object of class Sam2VideoInferenceSession" in line
    assert "inputs={'inference_session': <Sam2VideoInferenceSession>}" in line


def test_patches_with_an_hw_grid_fill_the_placeholders_the_model_counts() -> None:
    """Nemotron-H Omni takes flattened patches with an (h, w) `image_grid_hw` per image
    (not Qwen-VL's (t, h, w)): the grid's patches are the rows given, and the text holds
    one placeholder per feature its own image path gives."""
    model = _tiny("nemotron_h_omni", image_token_id=500)
    kw = _kwargs(model)
    grid = kw["image_grid_hw"]
    assert grid.shape == (2, 2) and int(grid.prod(dim=1).sum()) == kw["pixel_values"].shape[0]
    assert "image_grid_thw" not in kw
    with torch.no_grad():
        model(**kw)  # raises if placeholders and features disagree
    text = describe_batch(Batch(kwargs=kw))
    assert text is not None and text.startswith(f"2 images as {int(grid.prod(1).sum())} patches")


def test_a_patch_sequence_with_each_patchs_position() -> None:
    """Gemma 4's vision tower requires `pixel_position_ids` (x, y of each patch) beside a
    patch sequence, on a grid its k × k pooling divides."""
    model = _tiny("gemma4_vision")
    kw = _kwargs(model)
    pixels, positions = kw["pixel_values"], kw["pixel_position_ids"]
    k = model.config.pooling_kernel_size
    n = pixels.shape[1]
    assert positions.shape == (2, n, 2) and n % (k * k) == 0
    p, c = model.config.patch_size, 3  # RGB: the config names no channels
    assert pixels.shape[2] == c * p * p
    assert positions[0].unique(dim=0).shape[0] == n  # every patch its own place
    with torch.no_grad():
        model(**kw)
    assert describe_batch(Batch(kwargs=kw)) == f"2 images as {n} patches of {c * p * p}"


def test_packed_patches_with_each_images_grid() -> None:
    """MiniCPM-V's tower takes every image's patches packed in one row and each image's
    (h, w) grid in `target_sizes` (a plain image batch is refused: its positions are
    counted over the packed row)."""
    model = _tiny("minicpm_ocr_vision")
    kw = _kwargs(model)
    pixels, sizes = kw["pixel_values"], kw["target_sizes"]
    p = model.config.patch_size
    assert pixels.shape[0] == 1 and pixels.shape[2] == p
    assert pixels.shape[3] == int(sizes.prod(dim=1).sum()) * p and sizes.shape == (2, 2)
    side = int(sizes[0, 0]) * p
    plain = torch.randn(2, 3, side, side)
    assert _raises(model, pixel_values=plain, target_sizes=sizes)
    with torch.no_grad():
        model(**kw)
    assert (
        describe_batch(Batch(kwargs=kw))
        == f"2 images as {int(sizes.prod(1).sum())} patches, packed"
    )


def test_a_required_prompt_image_and_mask_of_the_images_shape() -> None:
    """SegGPT requires a prompt image and its mask beside the image, each of its shape,
    and stacks image over prompt: the image is half the height its config names."""
    model = _tiny("seggpt")
    kw = _kwargs(model, seq_len=None)
    h, w = model.config.image_size
    assert tuple(kw["pixel_values"].shape) == (2, 3, h // 2, w)
    assert kw["prompt_pixel_values"].shape == kw["prompt_masks"].shape == kw["pixel_values"].shape
    mask = kw["prompt_masks"]
    assert float(mask.min()) >= 0.0 and float(mask.max()) <= 1.0
    with torch.no_grad():
        model(**kw)


def test_region_features_with_their_boxes_beside_the_text() -> None:
    """LXMERT reads an image as detector regions: features of the config's
    visual_feat_dim and boxes (x0 ≤ x1, y0 ≤ y1 in [0, 1]) of its visual_pos_dim; ids
    alone are refused by its forward."""
    model = _tiny("lxmert")
    kw = _kwargs(model)
    feats, boxes = kw["visual_feats"], kw["visual_pos"]
    assert feats.shape[::2] == (2, model.config.visual_feat_dim)
    assert boxes.shape == (*feats.shape[:2], model.config.visual_pos_dim)
    assert (boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all()
    assert float(boxes.min()) >= 0.0 and float(boxes.max()) <= 1.0
    assert _raises(model, input_ids=kw["input_ids"])
    with torch.no_grad():
        model(**kw)
    r = feats.shape[1]
    assert describe_batch(Batch(kwargs=kw)) == (
        f"2 images as {r} regions of {model.config.visual_feat_dim} features + 2×8 tokens"
    )


def test_flattened_patches_carry_their_row_and_column() -> None:
    """Pix2Struct's patches hold their 1-based row and column first (embedded by
    position, so random values there would index out of its tables), then the
    patch_embed_hidden_size values; its decoder gets ids and labels."""
    model = _tiny("pix2struct")
    kw = _kwargs(model)
    flat = kw["flattened_patches"]
    width = model.config.vision_config.patch_embed_hidden_size
    assert flat.shape[2] == 2 + width
    places = flat[0, :, :2].long()
    side = int(places.max())
    assert places.unique(dim=0).shape[0] == flat.shape[1] == side * side
    assert int(places.min()) == 1 and "labels" in kw
    with torch.no_grad():
        out = model(**kw)
    assert out.loss is not None and torch.isfinite(out.loss)


def test_a_keypoint_matcher_gets_an_image_pair() -> None:
    """LightGlue matches two images: a plain batch is refused, the pair (batch, 2, C, H, W)
    is the form its forward accepts."""
    model = _tiny("lightglue")
    kw = _kwargs(model, seq_len=None)
    pixels = kw["pixel_values"]
    assert pixels.dim() == 5 and pixels.shape[:2] == (2, 2)
    assert _raises(model, pixel_values=pixels[:, 0])
    with torch.no_grad():
        model(**kw)


def test_placeholders_marked_by_a_mask_instead_of_a_token() -> None:
    """Kosmos-2 names no image token: its `image_embeds_position_mask` marks the text
    positions its image features replace, as many as its own image path gives (the
    latent queries); without the mask its forward raises."""
    model = _tiny("kosmos-2")
    kw = _kwargs(model)
    mask = kw["image_embeds_position_mask"]
    assert mask.shape == kw["input_ids"].shape
    assert (mask.sum(dim=1) == model.config.latent_query_num).all()
    assert _raises(model, **{k: v for k, v in kw.items() if k != "image_embeds_position_mask"})
    with torch.no_grad():
        model(**kw)


def test_a_second_view_for_a_second_vision_tower() -> None:
    """DeepSeek-VL hybrid's image path requires a high-resolution view beside the image:
    `high_res_pixel_values` at the side of its `high_res_vision_config`."""
    model = _tiny("deepseek_vl_hybrid")
    kw = _kwargs(model)
    side = model.config.high_res_vision_config.image_size
    assert tuple(kw["high_res_pixel_values"].shape) == (2, 3, side, side)
    assert _raises(model, **{k: v for k, v in kw.items() if k != "high_res_pixel_values"})
    with torch.no_grad():
        model(**kw)


def test_a_video_text_two_tower_gets_its_clip_and_its_text() -> None:
    """VideoPrism's CLIP model requires token ids beside its videos: a clip of the frames
    its video tower's config names (read off `vision_config`) and ids of its text
    config's vocabulary, the header naming both."""
    model = _tiny("videoprism")
    kw = _kwargs(model)
    video, ids = kw["pixel_values_videos"], kw["input_ids"]
    vision = model.config.vision_config
    assert video.shape[0] == 2 and video.shape[-1] == vision.image_size
    assert ids.shape == (2, 8) and int(ids.max()) < model.config.text_config.vocab_size
    with torch.no_grad():
        model(**kw)
    text = describe_batch(Batch(kwargs=kw))
    assert text is not None and text.startswith("2 videos") and text.endswith("2×8 tokens")


def test_a_task_prompt_of_the_length_its_config_names_beside_the_image() -> None:
    """OneFormer's main inputs are a list (images, then a tokenised task): task_inputs of
    the config's task_seq_len beside the image (its task MLP takes exactly that many)."""
    model = _tiny("oneformer")
    assert model.main_input_name == ["pixel_values", "task_inputs"]
    kw = _kwargs(model, seq_len=None)
    task = kw["task_inputs"]
    assert task.shape == (2, model.config.task_seq_len) and not task.is_floating_point()
    assert kw["pixel_values"].shape[:2] == (2, 3)
    with torch.no_grad():
        model(**kw)


def test_a_main_input_name_the_forward_does_not_take_falls_back_to_its_ids() -> None:
    """SAM 3 Lite's text tower inherits main_input_name = "pixel_values" but its forward
    takes token ids: it is a token model (no invented images it would ignore)."""
    from actscan.measure.model_inputs import takes_token_ids

    model = _tiny("sam3_lite_text_text_model")
    assert model.main_input_name == "pixel_values"
    assert takes_token_ids(model)
    assert hf_input_source(model, batch=2, seq_len=8, seed=0) is None  # scan() invents ids


def test_patches_merged_into_language_tokens_with_a_grid_counted_in_them() -> None:
    """Inkling 2's tower takes one row per language token (merge × merge patches, each
    pixel's channels last) and an image_grid_thw counted in those tokens: the form its
    forward accepts after Qwen-VL's per-patch rows are refused."""
    model = _tiny("inkling2_vision")
    kw = _kwargs(model)
    pixels, grid = kw["pixel_values"], kw["image_grid_thw"]
    m, p = model.config.spatial_merge_size, model.config.patch_size
    assert pixels.shape[1:] == (m * m * p * p, 3)
    assert int(grid.prod(dim=1).sum()) == pixels.shape[0]
    assert _raises(model, pixel_values=pixels.reshape(-1, 3 * p * p), image_grid_thw=grid * m)
    with torch.no_grad():
        model(**kw)


def test_images_as_flattened_patches_for_a_model_without_a_vision_tower() -> None:
    """Fuyu embeds each image's flattened patches with one linear layer (no vision tower):
    (batch, N, C · P · P) of the config's patch size, one placeholder per patch."""
    model = _tiny("fuyu")
    kw = _kwargs(model)
    pixels = kw["pixel_values"]
    p, c = model.config.patch_size, model.config.num_channels
    n = (model.config.image_size // p) ** 2
    assert tuple(pixels.shape) == (2, n, c * p * p)
    assert ((kw["input_ids"] == model.config.image_token_id).sum(dim=1) == n).all()
    with torch.no_grad():
        model(**kw)
    assert (
        describe_batch(Batch(kwargs=kw))
        == f"2 images as {n} patches of {c * p * p} + 2×{n + 8} tokens"
    )
