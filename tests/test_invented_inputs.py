"""Inputs invented from a model's own description (issue 22), one mechanism per test, each
on a tiny model built with transformers' own init: the model's forward accepting the
batch is the independent check (transformers raises when placeholders and features
disagree, or a shape is wrong). The tiny configs come from the breadth matrix's generic
shrink (benchmarks/families.py), not from per-model tables."""

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


def _tiny(model_type: str) -> Any:
    model = families.build(model_type, TYPES[model_type])
    return model.eval()


def _batch(model: Any, batch: int = 2, seq_len: int | None = 8) -> dict[str, Any]:
    source = hf_input_source(model, batch=batch, seq_len=seq_len, seed=0)
    assert source is not None
    return dict(source(0).kwargs)


@pytest.mark.parametrize(
    "model_type", [pytest.param("glmasr", marks=pytest.mark.slow), "qwen3_asr"]
)
def test_an_audio_language_model_gets_as_many_audio_tokens_as_its_clips_fill(
    model_type: str,
) -> None:
    """GLM-ASR and Qwen3-ASR name an audio placeholder: the text holds one per feature
    their own get_audio_features gives for the clips, of the audio config's mel bins
    (GLM-ASR is Whisper-like: 2 × max_source_positions frames)."""
    model = _tiny(model_type)
    kw = _batch(model)
    audio = model.config.audio_config
    feats = kw["input_features"]
    assert feats.shape[0] == 2 and feats.shape[1] == audio.num_mel_bins
    if model_type == "glmasr":
        assert feats.shape[2] == 2 * audio.max_position_embeddings
    with torch.no_grad():
        rows = model.get_audio_features(feats, kw["input_features_mask"]).pooler_output
    n = rows.numel() // model.config.text_config.hidden_size  # transformers checks numel
    per_clip = (kw["input_ids"] == model.config.audio_token_id).sum(dim=1)
    assert (per_clip == n // 2).all() and per_clip[0] > 0
    assert kw["input_ids"].shape[1] == per_clip[0] + 8
    with torch.no_grad():
        out = model(**kw)  # raises if placeholders and features disagree
    assert out.logits.shape[:2] == kw["input_ids"].shape
    frames = "×".join(str(d) for d in feats.shape[1:])
    assert describe_batch(Batch(kwargs=kw)) == (
        f"2 clips of {frames} features + 2×{8 + n // 2} tokens"
    )


def test_an_audio_path_that_masks_its_own_output_gets_no_frame_mask() -> None:
    """Granite Speech's `input_features_mask` selects projected features, not frames:
    its get_audio_features names no mask, so none is given and every feature counts;
    frames × mels is the layout its encoder runs on."""
    model = _tiny("granite_speech")
    kw = _batch(model)
    assert "input_features_mask" not in kw
    assert kw["input_features"].shape[-1] == model.config.encoder_config.input_dim
    with torch.no_grad():
        model(**kw)


def test_a_two_tower_audio_model_gets_text_and_a_waveform() -> None:
    """PE-Audio takes token ids and a waveform, no placeholder token: both towers' inputs,
    the waveform's layout (a channel axis) the first its forward runs on."""
    model = _tiny("pe_audio")
    kw = _batch(model)
    assert kw["input_ids"].shape == (2, 8)
    assert kw["input_values"].shape[0] == 2 and kw["input_values"].shape[-1] == 16_000
    with torch.no_grad():
        model(**kw)


@pytest.mark.parametrize(("model_type", "dims"), [("qwen2_5_vl_vision", 2), ("kimi_k25_vision", 4)])
def test_a_vision_tower_that_inherits_input_ids_gets_its_patches(
    model_type: str, dims: int
) -> None:
    """Qwen-VL-style towers say `main_input_name = "input_ids"` (their parent's) but
    require patches and their grid: flattened rows (Qwen2.5-VL) or C × P × P patches for a
    conv patch embedding (Kimi-K2.5), whichever the tower runs on."""
    model = _tiny(model_type)
    kw = _batch(model)
    patches = kw.get("hidden_states", kw.get("pixel_values"))
    assert patches is not None and patches.dim() == dims
    grid = kw["grid_thw"]
    assert grid.shape == (2, 3) and int(grid.prod(dim=1).sum()) == patches.shape[0]
    with torch.no_grad():
        model(**kw)
    text = describe_batch(Batch(kwargs=kw))
    assert text is not None and text.startswith("2 images as 32 patches")


def test_naflex_patch_sequences_with_their_spatial_shapes() -> None:
    """SigLIP 2's forward takes `spatial_shapes`: each image a sequence of C × P × P
    patches with its (h, w) grid and a mask of every patch."""
    model = _tiny("siglip2_vision_model")
    kw = _batch(model)
    c, p = model.config.num_channels, model.config.patch_size
    assert tuple(kw["pixel_values"].shape) == (2, 16, c * p * p)
    assert kw["spatial_shapes"].tolist() == [[4, 4], [4, 4]]
    assert kw["pixel_attention_mask"].shape == (2, 16)
    with torch.no_grad():
        model(**kw)


def test_llava_next_gets_the_tiles_its_pinpoints_cut_an_image_into() -> None:
    """LLaVA-NeXT's "anyres": an image the size of the smallest pinpoint is cut into
    tiles of the tower's side plus one base view; image_sizes says the size."""
    model = _tiny("llava_next")
    side = model.config.vision_config.image_size
    kw = _batch(model)
    h, w = kw["image_sizes"][0].tolist()
    assert [h, w] in [list(p) for p in model.config.image_grid_pinpoints]
    assert tuple(kw["pixel_values"].shape) == (2, 1 + (h // side) * (w // side), 3, side, side)
    with torch.no_grad():
        model(**kw)  # raises if the placeholders do not match the tiles' features


@pytest.mark.parametrize(
    ("model_type", "name", "rank"),
    [
        ("parakeet_ctc", "input_features", 3),
        ("patchtst", "past_values", 3),
        ("vjepa2", "pixel_values_videos", 5),
    ],
)
def test_the_main_input_shape_comes_from_the_config_and_a_probe(
    model_type: str, name: str, rank: int
) -> None:
    """Mel bins kept in a sub-config (Parakeet's encoder_config), a time series' context
    and channels, a video's frames (two tubelets): the candidates the config allows, the
    first one the model runs on."""
    model = _tiny(model_type)
    kw = _batch(model, seq_len=None)
    assert kw[name].dim() == rank
    with torch.no_grad():
        model(**kw)


def test_a_detector_that_says_encoder_decoder_gets_no_decoder_ids() -> None:
    """RT-DETR's config says is_encoder_decoder, but its decoder runs on learned queries:
    it gets images only, not decoder token ids it has no vocabulary for."""
    model = _tiny("rt_detr")
    kw = _batch(model)
    assert set(kw) == {"pixel_values"}


def test_a_refusal_names_what_the_forward_takes_and_what_to_pass() -> None:
    """X-Codec 2 requires a waveform and its own semantic features together, in a
    relation no config states: one --input-shape cannot give them, so the line names
    them and the CLI's way to pass inputs."""
    model = _tiny("xcodec2")
    with pytest.raises(UsageError) as err:
        hf_input_source(model, batch=2, seq_len=None, seed=0)
    line = str(err.value)
    assert "\n" not in line
    assert "Xcodec2Model" in line and "input_values, input_features" in line
    assert "inputs=" in line and "module:function" in line


def test_a_time_series_gets_its_padding_and_frequency_class() -> None:
    """TimesFM requires padding and a frequency beside its series: zeros (every value
    real) and class 0 of the config's freq_size, and the header names the class; its
    attention (TimesFM's own simple_eager_attention_forward) is probed."""
    from actscan import scan

    model = _tiny("timesfm")
    kw = _batch(model, seq_len=None)
    series = kw["past_values"]
    assert series.shape == (2, model.config.context_length)
    pads = kw["past_values_padding"]
    assert (pads == 0).all() and pads.shape == series.shape
    assert kw["freq"].tolist() == [[0], [0]]
    report = scan(model, batch=2)
    assert report.run.inputs == f"2 series of {model.config.context_length} values at frequency 0"
    assert len(report.attention) == model.config.num_hidden_layers


def test_a_lagged_forecaster_gets_its_history_time_features_and_future() -> None:
    """The Time Series Transformer requires time features and an observed mask beside
    its series, which must span the context plus the longest lag; its decoder runs on
    the future (`prediction_length` steps). Every shape comes from the config, and the
    model's own lag slicing (which raises on a short history) accepts the batch."""
    from actscan import scan

    model = _tiny("time_series_transformer")
    config = model.config
    kw = _batch(model, seq_len=None)
    past = config.context_length + max(config.lags_sequence)
    assert kw["past_values"].shape == (2, past)
    features = config.num_time_features + config.num_dynamic_real_features
    assert kw["past_time_features"].shape == (2, past, features)
    assert (kw["past_observed_mask"] == 1).all()
    assert kw["future_values"].shape == (2, config.prediction_length)
    assert kw["future_time_features"].shape == (2, config.prediction_length, features)
    with torch.no_grad():
        out = model(**kw)
    assert out.last_hidden_state.shape[1] == config.prediction_length
    report = scan(model, batch=2)
    assert report.run.inputs == (
        f"2 series of {past} values, {config.prediction_length} future values and their "
        "time features"
    )


def test_a_codecs_decoder_gets_latents_of_a_width_its_config_names() -> None:
    """PocketTTS's audio decoder takes `latents` (batch, width, frames): its config names
    two widths (hidden_size 64, latent_dim 32), and the one its forward runs on is fed;
    the decoder's output is a waveform, and the header says latents were fed."""
    from actscan import scan

    model = _tiny("pocket_tts_audio_tokenizer_decoder")
    kw = _batch(model, seq_len=None)
    latents = kw["latents"]
    assert latents.shape[1] in (model.config.hidden_size, model.config.latent_dim)
    with torch.no_grad():
        audio = model(**kw).audio_values
    assert audio.shape[0] == 2 and audio.shape[-1] > latents.shape[-1]
    report = scan(model, batch=2)
    assert report.run.inputs == f"2 clips of {latents.shape[1]}×{latents.shape[2]} latents"


def test_a_multimodal_model_with_optional_media_gets_ids_alone_and_says_so() -> None:
    """Gemma 4's forward takes images, videos and audio, all optional, and its
    vocabulary lives in its text config: it gets token ids alone that hit no id the
    configs name (a placeholder without its features would make the forward raise),
    and the header says which inputs were not fed."""
    from actscan import scan
    from actscan.measure.vision_text import _special_ids

    model = _tiny("gemma4")
    kw = _batch(model, seq_len=16)
    assert set(kw) == {"input_ids", "attention_mask", "mm_token_type_ids"}
    assert (kw["mm_token_type_ids"] == 0).all()  # every token is text
    vocab = model.config.get_text_config().vocab_size
    special = _special_ids(model.config, vocab)
    assert special and not set(kw["input_ids"].flatten().tolist()) & special
    report = scan(model, batch=2, seq_len=16)
    assert report.run.inputs == (
        "2×16 tokens (token ids alone; not fed: input_features, pixel_values, pixel_values_videos)"
    )


def test_an_audio_mel_input_gets_the_configs_bins_and_a_mask_of_no_padding() -> None:
    """Gemma 3n's audio tower requires `audio_mel` (frames × `input_feat_size` bins) and
    `audio_mel_mask`, True on padded frames (it keeps ~mask as valid): no frame is
    padded, so every frame reaches its attention and convolutions."""
    from actscan import scan

    model = _tiny("gemma3n_audio")
    kw = _batch(model, seq_len=None)
    mel = kw["audio_mel"]
    assert mel.shape[0] == 2 and mel.shape[2] == model.config.input_feat_size
    mask = kw["audio_mel_mask"]
    assert mask.dtype == torch.bool and mask.shape == mel.shape[:2] and not mask.any()
    with torch.no_grad():
        out = model(**kw)
    assert not out.audio_mel_mask.any()  # every subsampled frame still valid
    report = scan(model, batch=2)
    assert report.run.inputs == f"2 clips of {mel.shape[1]}×{mel.shape[2]} features"


def test_a_trajectory_model_gets_states_actions_returns_and_timesteps() -> None:
    """The Decision Transformer embeds a return, a state and an action per step, each at
    its timestep: states of `state_dim`, actions of `act_dim`, timesteps 0… below
    `max_ep_len`, and no more steps than its positions hold at 3 tokens a step."""
    from actscan import scan

    model = _tiny("decision_transformer")
    config = model.config
    kw = _batch(model, seq_len=None)
    states, steps = kw["states"], kw["states"].shape[1]
    assert states.shape == (2, steps, config.state_dim)
    assert kw["actions"].shape == (2, steps, config.act_dim)
    assert kw["returns_to_go"].shape == kw["rewards"].shape == (2, steps, 1)
    assert kw["timesteps"][0].tolist() == list(range(steps)) and steps < config.max_ep_len
    assert 3 * steps <= config.n_positions
    with torch.no_grad():
        out = model(**kw)
    assert out.action_preds.shape == (2, steps, config.act_dim)
    report = scan(model, batch=2)
    assert report.run.inputs == (
        f"2 trajectories of {steps} steps (state {config.state_dim}, action, reward, return-to-go)"
    )


def test_a_composites_generic_input_is_its_encoders_and_embeddings_are_invented() -> None:
    """SpeechEncoderDecoder's main input is `inputs`: the encoder's own (a wav2vec2
    waveform, as long as its conv stack needs for the frames asked). A model fed
    embeddings only (Nemotron's word-timestamp head) gets rows of its width."""
    model = _tiny("speech-encoder-decoder")
    kw = _batch(model)
    assert set(kw) >= {"input_values", "decoder_input_ids", "labels"}
    with torch.no_grad():
        hidden = model.encoder(kw["input_values"]).last_hidden_state
    assert hidden.shape[1] == 8  # --seq-len 8: 8 frames out of the conv feature extractor
    with torch.no_grad():
        assert torch.isfinite(model(**kw).loss)
    head = _tiny("nemotron3_5_transcribe_word_timestamp")
    kw = _batch(head)
    assert kw["inputs_embeds"].shape == (2, 8, head.config.hidden_size)
    assert describe_batch(Batch(kwargs=kw)) == f"2×8 embeddings of width {head.config.hidden_size}"


def test_an_input_the_forward_names_otherwise_goes_under_its_name() -> None:
    """VibeVoice's acoustic decoder inherits `main_input_name = "input_values"` but
    requires `hidden_states`: latents of the config's width (channels first), the first
    candidate its forward runs on."""
    model = _tiny("vibevoice_acoustic_tokenizer_decoder")
    kw = _batch(model)
    assert set(kw) == {"hidden_states"}
    assert kw["hidden_states"].shape == (2, model.config.hidden_size, 8)
    with torch.no_grad():
        model(**kw)


def test_a_gridded_tower_gets_its_merge_sizes_and_a_required_frame_mask() -> None:
    """VideoLLaMA 3's tower requires patches, their grid and the merge size; Qwen3-ASR's
    encoder requires a frame mask beside its features and a whole number of its
    100-frame windows: all from the forward's required arguments and the config."""
    tower = _tiny("video_llama_3_vision")
    kw = _batch(tower)
    assert set(kw) == {"pixel_values", "grid_thw", "merge_sizes"}
    assert (kw["grid_thw"][:, 1] == 2 * kw["merge_sizes"]).all()
    with torch.no_grad():
        tower(**kw)
    encoder = _tiny("qwen3_asr_encoder")
    kw = _batch(encoder)
    feats, mask = kw["input_features"], kw["input_features_mask"]
    assert feats.shape[-1] % 100 == 0 and mask.shape == (2, feats.shape[-1])
    with torch.no_grad():
        encoder(**kw)


def test_the_matrix_keeps_what_configs_validate_when_it_shrinks_them() -> None:
    """The generic shrink keeps each relation a config checks: Mamba heads × head dim =
    expand × hidden under a prefix (Bamba), a head dim the config leaves None derived
    (Ministral), GPT-Neo's attention pattern over the new depth, per-stage heads that
    divide each stage width (Swin), LLaVA-NeXT's pinpoints as multiples of the shrunk
    tower side, and VipLLaVA's feature layers inside the shrunk tower."""
    bamba = families.tiny_config("bamba")
    assert bamba.mamba_n_heads * bamba.mamba_d_head == bamba.mamba_expand * bamba.hidden_size
    ministral = families.tiny_config("ministral")
    assert ministral.head_dim * ministral.num_attention_heads == ministral.hidden_size
    neo = families.tiny_config("gpt_neo")
    assert len(neo.attention_layers) == neo.num_layers == families.LAYERS
    swin = families.tiny_config("swin")
    widths = [swin.embed_dim * 2**i for i in range(len(swin.depths))]
    assert all(w % h == 0 for w, h in zip(widths, swin.num_heads, strict=True))
    nxt = families.tiny_config("llava_next")
    side = nxt.vision_config.image_size
    assert all(v % side == 0 for p in nxt.image_grid_pinpoints for v in p)
    vip = families.tiny_config("vipllava")
    states = vip.vision_config.num_hidden_layers + 1
    assert all(-states <= i < states for i in vip.vision_feature_layers)


def test_invented_batches_ask_for_no_cache_and_a_hybrid_runs() -> None:
    """A profiled pass is a training pass: invented batches carry use_cache=False, and
    Bamba (all Mamba layers at this depth, whose cache holds no attention layer and so
    cannot be built) runs instead of raising."""
    from actscan import scan
    from actscan.measure.model_inputs import choose_inputs
    from actscan.targets.hf import hf_info

    model = _tiny("bamba")
    info = hf_info(model, model.config, "bamba", at_init=True, init=None)
    chosen = choose_inputs(model, info, None, None, batch=2, seq_len=8, seed=0)
    assert chosen.source(0).kwargs.get("use_cache") is False
    report = scan(model, batch=2, seq_len=8)
    assert report.run.inputs == "2×8 tokens"
    own = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    mine = choose_inputs(model, info, own, None, batch=2, seq_len=8, seed=0)
    assert "use_cache" not in mine.source(0).kwargs  # the caller's inputs go as given


def test_the_shrink_keeps_routing_groups_and_every_kind_of_layer() -> None:
    """DeepSeek-V3 routes among expert groups: as many groups as the shrunk experts
    allow, top-k within the picked groups; a hybrid's per-layer kinds (Kimi-Linear's one
    full-attention layer in four) survive the cut to four layers; Jamba's attention
    period fits inside the new depth."""
    ds = families.tiny_config("deepseek_v3")
    assert ds.n_routed_experts % ds.n_group == 0
    assert ds.topk_group * ds.n_routed_experts // ds.n_group >= ds.num_experts_per_tok
    kimi = families.tiny_config("kimi_linear")
    full = transformers.AutoConfig.for_model("kimi_linear")
    assert set(kimi.layer_types) == set(full.layer_types)
    assert len(kimi.layer_types) == kimi.num_hidden_layers
    jamba = families.tiny_config("jamba")
    assert any(
        i % jamba.attn_layer_period == jamba.attn_layer_offset
        for i in range(jamba.num_hidden_layers)
    )


@pytest.mark.parametrize(("model_type", "floating"), [("bros", True), ("layoutlmv3", False)])
def test_a_document_model_gets_a_box_per_token_in_the_form_it_runs_on(
    model_type: str, floating: bool
) -> None:
    """BROS refuses ids without boxes and embeds normalised floats; LayoutLMv3 looks its
    integer coordinates up in tables of max_2d_position_embeddings rows (a float box
    raises there): each gets one valid box per token (x0 ≤ x1, y0 ≤ y1), and the header
    says so."""
    from actscan import scan

    model = _tiny(model_type)
    report = scan(model, batch=2, seq_len=8)
    kind = "normalised" if floating else "integer"
    assert report.run.inputs == f"2×8 tokens + 2×8 {kind} boxes"
    from actscan.measure.side_inputs import boxes

    box = boxes(model.config, 2, 8, 0, 0, grid=not floating)
    assert box.is_floating_point() is floating
    assert box.shape[-1] == (8 if model.config.to_dict().get("dim_bbox") == 8 else 4)
    if box.shape[-1] == 4:
        assert (box[..., 0] <= box[..., 2]).all() and (box[..., 1] <= box[..., 3]).all()
    if not floating:
        assert int(box.min()) >= 0 and int(box.max()) < model.config.max_2d_position_embeddings


def test_a_language_adapter_model_gets_its_first_language() -> None:
    """X-MOD routes every token through a per-language adapter and raises when the
    config sets no default language: the batch names the first of its `languages`."""
    from actscan import scan

    model = _tiny("xmod")
    assert model.config.default_language is None
    report = scan(model, batch=2, seq_len=8)
    assert report.run.inputs == "2×8 tokens + language id 0"


def test_a_hashing_character_model_gets_ids_below_its_buckets_and_a_hybrid_no_cache() -> None:
    """CANINE names no vocab_size (it hashes Unicode code points into num_hash_buckets):
    ids below the bucket count. Granite-MoE-Hybrid's forward names `cache` and passes
    use_cache on through **kwargs to its base model; at the default all-linear layer
    types its cache cannot be built, so the invented batches say use_cache=False. Mimi's
    encoder names a cache too, but its **kwargs reach an inner transformer that is given
    use_cache already: nothing is added there."""
    from actscan import scan
    from actscan.measure.model_inputs import asks_cache, hashed_vocab

    canine = _tiny("canine")
    assert hashed_vocab(canine) == canine.config.num_hash_buckets
    assert scan(canine, batch=2, seq_len=8).run.inputs == "2×8 tokens"
    hybrid = _tiny("granitemoehybrid")
    assert asks_cache(hybrid) and "use_cache" not in inspect_params(hybrid)
    assert scan(hybrid, batch=2, seq_len=8).run.inputs == "2×8 tokens"
    mimi = _tiny("mimi_encoder")  # its **kwargs reach a transformer given use_cache itself
    assert not asks_cache(mimi) and "cache" in inspect_params(mimi)


def inspect_params(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def test_a_transducer_gets_one_decoder_position_more_than_its_labels() -> None:
    """Parakeet-TDT's decoder reads the start token, then every label (U + 1 positions
    for U labels): the seq2seq shift (as many ids as labels) makes its own loss index
    past the logits; the transducer form is the first its loss runs on."""
    model = _tiny("parakeet_tdt")
    kw = _batch(model)
    labels, ids = kw["labels"], kw["decoder_input_ids"]
    assert ids.shape[1] == labels.shape[1] + 1
    assert (ids[:, 1:] == labels).all()
    with torch.no_grad():
        out = model(**kw)
    assert out.loss is not None and torch.isfinite(out.loss)


def test_labels_are_left_out_with_the_reason_when_the_models_own_loss_cannot_run() -> None:
    """An RNN-T loss that needs a package not installed (torchaudio's rnnt_loss): the
    batches carry decoder ids but no labels, and run.loss says which loss was used
    instead and the model's own error, in one line."""
    from actscan import scan

    base = type(_tiny("parakeet_tdt"))

    class NoBackend(base):  # type: ignore[misc, valid-type]
        @property
        def loss_function(self) -> Any:
            def missing(*args: Any, **kwargs: Any) -> Any:
                raise ImportError("rnnt_loss requires the torchaudio library")

            return missing

    torch.manual_seed(0)
    model = NoBackend(families.tiny_config("parakeet_tdt")).eval()
    kw = _batch(model)
    assert "labels" not in kw and "decoder_input_ids" in kw
    report = scan(model, batch=2, seq_len=8)
    loss = report.run.loss or ""
    assert "\n" not in loss
    assert "own loss raised on random labels (ImportError: rnnt_loss requires" in loss


def test_an_audio_language_model_without_get_audio_features_counts_its_towers_output() -> None:
    """Qwen2-Audio has no get_audio_features: the placeholders are its audio tower's
    output positions for the clip (checked by its own forward, which raises when tokens
    and features disagree), the frame mask its forward requires given."""
    model = _tiny("qwen2_audio")
    assert not hasattr(model, "get_audio_features")
    kw = _batch(model)
    feats = kw["input_features"]
    with torch.no_grad():
        rows = model.model.audio_tower(feats).last_hidden_state.shape[1]
    per_clip = (kw["input_ids"] == model.config.audio_token_id).sum(dim=1)
    assert (per_clip == rows).all() and kw["input_ids"].shape[1] == rows + 8
    assert kw["feature_attention_mask"].shape == (2, feats.shape[-1])
    with torch.no_grad():
        model(**kw)


def test_an_audio_path_that_passes_kwargs_on_gets_the_forwards_masks() -> None:
    """MOSS's get_audio_features names the frame mask and passes **kwargs on to an inner
    path that also requires `padding_mask`: when its own masks fail, the forward's masks
    go along, and the placeholders match the features they give."""
    model = _tiny("moss_transcribe_diarize")
    kw = _batch(model)
    assert {"input_features_mask", "padding_mask"} <= set(kw)
    with torch.no_grad():
        model(**kw)


def test_feature_widths_from_stacking_and_the_common_mel_counts() -> None:
    """Fun-ASR's low-frame-rate front end stacks num_stacked_frames mel frames into one
    (80 × 7 = 560 per frame); Gemma 4's audio tower names no mel bins at all, and runs
    on 128, one of the two counts speech feature extractors use."""
    from actscan.measure.model_inputs import feature_widths

    fun = _tiny("fun_asr_nano_encoder")
    c = fun.config
    assert feature_widths(c)[0] == c.num_mel_bins * c.num_stacked_frames
    kw = _batch(fun)
    assert kw["input_features"].shape == (2, 8, c.num_mel_bins * c.num_stacked_frames)
    with torch.no_grad():
        fun(**kw)
    gemma = _tiny("gemma4_audio")
    assert feature_widths(gemma.config) == [80, 128]
    kw = _batch(gemma)
    assert kw["input_features"].shape == (2, 8, 128)
    with torch.no_grad():
        gemma(**kw)


def test_an_output_of_integer_codes_is_refused_with_what_to_do() -> None:
    """WavTokenizer's encoder returns only integer codes: nothing to take a gradient of.
    The line names what it returned and the two ways to scan it; the forward alone
    runs."""
    from actscan import scan

    model = _tiny("wavtokenizer_encoder")
    with pytest.raises(UsageError) as err:
        scan(model, batch=2, seq_len=8)
    line = str(err.value)
    assert "\n" not in line and "audio_codes int64" in line
    assert "--no-backward" in line and "loss_fn=" in line
    assert scan(model, batch=2, seq_len=8, backward=False).run.inputs is not None


def test_a_decoder_over_several_codebooks_gets_ids_per_codebook() -> None:
    """Dia's decoder reads batch × seq × codebooks ids (its decoder config's
    num_channels) and flattens its logits to one row per (sample, codebook): 2-D ids
    cannot be reshaped, the codebook form runs its own loss, and the header says it."""
    from actscan import scan

    model = _tiny("dia")
    c = model.config.decoder_config.num_channels
    kw = _batch(model)
    assert kw["decoder_input_ids"].shape == (2, 8, c)
    assert kw["labels"].shape == (2 * c, 8)
    with torch.no_grad():
        assert torch.isfinite(model(**kw).loss)
    report = scan(model, batch=2, seq_len=8)
    assert report.run.inputs == f"2×8 tokens + 2×8 decoder tokens of {c} codebooks"
    assert report.run.loss == "the model's own loss on random labels"


def test_refusals_for_a_generate_only_composite_and_a_policy_with_a_prefix() -> None:
    """Bark has no forward of its own (nn.Module's unimplemented one): the line names its
    sub-models to scan. PI0's main input `state` goes with token ids and images that one
    --input-shape cannot give: the line says so instead of asking for a shape."""
    from actscan import scan

    with pytest.raises(UsageError) as err:
        scan(_tiny("bark"), batch=2, seq_len=8)
    line = str(err.value)
    assert "no forward pass of its own" in line and "semantic, coarse_acoustics" in line
    with pytest.raises(UsageError) as err:
        hf_input_source(_tiny("pi0"), batch=2, seq_len=None, seed=0)
    line = str(err.value)
    assert "'state' goes with input_ids, pixel_values" in line and "--input-shape" not in line


def test_a_front_end_that_widens_frames_gets_the_width_its_first_layer_takes() -> None:
    """Granite Speech 5 appends deltas to its 80 mel bins and stacks frame pairs: its
    input layer takes 4 × 80 = 320 per frame, which no config field says. The width
    comes off the model (a linear layer's input, a small multiple of the mel bins),
    probed after the mel bins themselves; the frame mask is laid on the frames."""
    model = _tiny("granite_speech5_encoder")
    mels = model.config.num_mel_bins
    kw = _batch(model)
    assert kw["input_features"].shape == (2, 8, 4 * mels)
    assert kw["attention_mask"].shape == (2, 8)
    with torch.no_grad():
        model(**kw)


def test_an_encoder_decoder_document_model_gets_boxes_from_the_source_the_cli_passes() -> None:
    """The CLI passes hf_input_source's batches as the caller's inputs: UDOP (an
    encoder-decoder that raises without boxes) gets its boxes there, normalised floats
    beside its ids and decoder ids, and runs its own loss on them."""
    model = _tiny("udop")
    kw = _batch(model)
    assert kw["bbox"].shape == (*kw["input_ids"].shape, 4) and kw["bbox"].is_floating_point()
    with torch.no_grad():
        assert torch.isfinite(model(**kw).loss)


def test_an_optional_mask_the_forward_runs_only_without_is_left_out() -> None:
    """Voxtral-Realtime's encoder masks its positions after a stride-2 conv, not its
    frames: a frame mask does not fit without a cache (which slices it to its length),
    and the scan runs with use_cache=False. The layout and the masks are probed as the
    scan calls the model: the mask is left out, and the encoder runs."""
    model = _tiny("voxtral_realtime_encoder")
    kw = _batch(model)
    assert set(kw) == {"input_features"}
    assert kw["input_features"].shape[1] == model.config.num_mel_bins
    with torch.no_grad():
        model(**kw, use_cache=False)
        with pytest.raises(RuntimeError):  # the frame mask it would have had
            frames = kw["input_features"].shape[-1]
            model(**kw, attention_mask=torch.ones(2, frames, dtype=torch.long), use_cache=False)


def test_a_streaming_audio_model_gets_one_text_token_per_audio_position() -> None:
    """Voxtral-Realtime names no audio placeholder: it adds each audio feature to one
    text position, so the text is as long as its get_audio_features gives rows per clip
    (its forward raises on any other length)."""
    model = _tiny("voxtral_realtime")
    kw = _batch(model)
    with torch.no_grad():
        rows = model.get_audio_features(kw["input_features"]).pooler_output
    per_clip = rows.numel() // model.config.text_config.hidden_size // 2
    assert kw["input_ids"].shape == (2, per_clip) and per_clip != 8
    with torch.no_grad():
        model(**kw)


def test_a_module_taking_embeddings_for_inherited_ids_gets_them_by_name() -> None:
    """BLIP-2's Q-Former inherits `main_input_name = "input_ids"` but requires
    `query_embeds` (rows of its width) and cross-attends every other layer to an image
    encoder of `encoder_hidden_size`: both are given, and its forward runs on them."""
    config = families.tiny_config("blip_2_qformer")
    config.encoder_hidden_size = 48  # the image encoder's own width, not the Q-Former's
    model = transformers.Blip2QFormerModel(config).eval()
    kw = _batch(model)
    assert "input_ids" not in kw
    assert kw["query_embeds"].shape == (2, 8, config.hidden_size)
    assert kw["encoder_hidden_states"].shape == (2, 8, 48)
    with torch.no_grad():
        model(**kw)
    described = describe_batch(Batch(kwargs=kw))
    assert described is not None and "× query_embeds" in described
    assert "× encoder_hidden_states" in described


def test_patches_given_as_one_row_each_when_the_forward_counts_rows() -> None:
    """NeoMME's vision path takes patches batched or not, but its placeholder check
    counts the features' rows: the layout is the first whole forward takes, every
    image's C·P·P patches one row each, one placeholder per patch."""
    model = _tiny("neomme")
    kw = _batch(model)
    pixels = kw["pixel_values"]
    assert pixels.dim() == 2 and pixels.shape[1] == model.config.patch_dim
    placeholders = int((kw["input_ids"] == model.config.image_token_id).sum())
    assert placeholders == pixels.shape[0]
    with torch.no_grad():
        model(**kw)
    assert describe_batch(Batch(kwargs=kw)).startswith(f"{pixels.shape[0]} image patches of")


def test_an_image_side_only_the_backbone_config_names() -> None:
    """SAM 2 names its image side only in its vision config's Hiera backbone config: the
    images have that side (not the 224 of CNN backbones), and its forward runs."""
    model = _tiny("sam2")
    side = model.config.vision_config.backbone_config.image_size
    kw = _batch(model)
    assert list(kw["pixel_values"].shape[-2:]) == list(side) and side[0] != 224
    with torch.no_grad():
        model(**kw)


def test_named_float_inputs_take_the_widths_the_forward_runs_on() -> None:
    """A drafter's required float inputs (MuseGlimmer's assistant: `noise_embeds` of the
    hidden width, `context_hidden_states` of several target layers concatenated) get
    random normal tensors, each width the first the forward runs on: the context's is
    the input width of its projection, not the config's hidden size; the header names
    both and says they are random."""
    model = _tiny("muse_glimmer_assistant")
    source = hf_input_source(model, batch=2, seq_len=8, seed=0)
    assert source is not None
    kw = source(0).kwargs
    hidden = model.config.hidden_size
    assert kw["noise_embeds"].shape == (2, 8, hidden)
    wide = hidden * len(model.config.target_layer_ids)
    assert kw["context_hidden_states"].shape == (2, 8, wide)
    with torch.no_grad():
        model(**kw)
    assert describe_batch(source(0)) == (
        f"2 × noise_embeds 8×{hidden} + 2 × context_hidden_states 8×{wide}"
    )
    assert "random normal" in getattr(source, "fed", "")


def test_named_float_widths_come_from_the_config_then_the_model() -> None:
    """The width rule on a planted module: a field named after the argument first
    (`state` → `max_state_dim`), the hidden width next, then its linear layers' inputs;
    a singular `state` is one vector per row."""
    from actscan.measure.named_inputs import named_float_source, widths_for

    class Cfg:
        def __init__(self) -> None:
            self.hidden_size, self.max_state_dim = 8, 5

    class Policy(torch.nn.Module):
        config = Cfg()

        def __init__(self) -> None:
            super().__init__()
            self.state_in = torch.nn.Linear(5, 8)
            self.ctx_in = torch.nn.Linear(24, 8)

        def forward(self, state: torch.Tensor, context_hidden_states: torch.Tensor) -> Any:
            return self.state_in(state)[:, None] + self.ctx_in(context_hidden_states)

    model = Policy()
    assert widths_for(model, "state")[:2] == [5, 8]
    assert widths_for(model, "context_hidden_states") == [8, 5, 24]
    found = named_float_source(model, batch=3, seq_len=4, seed=0, runs=lambda kw: _runs(model, kw))
    assert found is not None
    kw = found[0](0).kwargs
    assert kw["state"].shape == (3, 5) and kw["context_hidden_states"].shape == (3, 4, 24)


def _runs(model: Any, kw: dict[str, Any]) -> bool:
    try:
        model(**kw)
    except RuntimeError:
        return False
    return True


def test_ids_from_a_sub_config_with_a_canvas() -> None:
    """Diffusion Gemma's vocabulary lies in its text config and its forward refines a
    canvas beside the prompt: token ids for both (the canvas seeded, not drawn inside the
    forward), and the forward runs on them."""
    model = _tiny("diffusion_gemma")
    kw = _batch(model)
    vocab = model.config.get_text_config().vocab_size
    assert kw["input_ids"].shape == kw["decoder_input_ids"].shape == (2, 8)
    assert int(kw["decoder_input_ids"].max()) < vocab
    assert not torch.equal(kw["input_ids"], kw["decoder_input_ids"])
    with torch.no_grad():
        model(**kw)


def test_ids_with_the_media_input_the_forward_needs() -> None:
    """CLVP takes text and mel features, both optional, but runs only on both: the ids
    come from its text config and the first feature shape of the config's mel bins it
    runs on goes beside them."""
    model = _tiny("clvp")
    source = hf_input_source(model, batch=2, seq_len=8, seed=0)
    assert source is not None
    kw = source(0).kwargs
    mels = model.config.decoder_config.feature_size
    assert kw["input_ids"].shape == (2, 8) and kw["input_features"].shape[:2] == (2, mels)
    with torch.no_grad():
        model(**kw)
    assert describe_batch(source(0)) == f"2 clips of {mels}×200 features + 2×8 tokens"


@pytest.mark.slow
def test_variance_adaptor_labels_run_the_training_forward() -> None:
    """FastSpeech 2's training forward raises without its variance adaptor's labels:
    durations (2 frames a token), mels for the frames they give, pitch and energy; with
    them it computes its own loss, the one the scan's default loss then takes."""
    from actscan.measure.inputs import default_loss, describe_loss
    from actscan.measure.side_inputs import with_side_inputs

    model = _tiny("fastspeech2_conformer")
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    source = with_side_inputs(model, lambda i: Batch(kwargs={"input_ids": ids}), seed=0)
    b = source(0)
    assert b.kwargs["spectrogram_labels"].shape == (2, 12, model.config.num_mel_bins)
    assert b.kwargs["duration_labels"].sum(dim=1).tolist() == [12, 12]
    model.train()
    out = model(**b.kwargs)
    assert default_loss("encoder", None)(out, b) is out.loss
    assert describe_loss("encoder", b, caller=False) == (
        "the model's own loss on random duration, spectrogram, pitch, energy labels"
    )


def test_a_dict_of_another_models_tensors_is_named_in_the_refusal() -> None:
    """A drafter that reads its target's key/value states (`shared_kv_states`, a dict of
    tensor pairs) cannot have them invented: the refusal says what the argument is and
    that another model builds it."""
    from actscan.measure.model_inputs import cannot_invent

    class Drafter(torch.nn.Module):
        def forward(
            self,
            input_ids: torch.Tensor | None = None,
            shared_kv_states: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        ) -> torch.Tensor:
            raise ValueError("shared_kv_states cannot be None")

    line = cannot_invent(Drafter())
    assert "shared_kv_states (a dict of tensors another model computes, not a tensor)" in line
    assert "inputs={'shared_kv_states': <dict>} in Python (another model builds it)" in line
