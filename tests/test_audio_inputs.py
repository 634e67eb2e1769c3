"""Audio, codec and speech inputs invented from the model's own description (issue 22
item 1): a spectrogram given as `input_values`, a codec's channel axis, an optional mask
the forward needs, a variance adaptor's targets and token ids over audio codebooks. The
model's forward accepting the batch is the independent check; the tiny configs come from
the breadth matrix's generic shrink (benchmarks/families.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from actscan.measure.inputs import Batch, default_loss, describe_loss  # noqa: E402
from actscan.measure.model_inputs import (  # noqa: E402
    codebook_layout,
    describe_batch,
    hf_input_source,
    layout_source,
)
from actscan.measure.side_inputs import with_side_inputs  # noqa: E402
from benchmarks import families  # noqa: E402

TYPES = families.model_types()


def _tiny(model_type: str) -> Any:
    return families.build(model_type, TYPES[model_type]).eval()


def _batch(model: Any) -> Batch:
    source = hf_input_source(model, batch=2, seq_len=16, seed=0)
    assert source is not None
    return source(0)


def test_a_spectrogram_given_as_input_values_has_the_configs_frames_and_mel_bins() -> None:
    """AST names `input_values` but patches a (frames × mel bins) spectrogram whose grid
    its learned positions fix: config.max_length × config.num_mel_bins, said so."""
    model = _tiny("audio-spectrogram-transformer")
    b = _batch(model)
    config = model.config
    assert tuple(b.kwargs["input_values"].shape) == (2, config.max_length, config.num_mel_bins)
    with torch.no_grad():
        model(**b.kwargs)
    assert describe_batch(b) == f"2 clips of {config.max_length}×128 spectrogram features"


@pytest.mark.parametrize("model_type", ["mimi", "xcodec"])
def test_a_codec_gets_its_channel_axis(model_type: str) -> None:
    """Mimi and X-Codec take (batch, audio_channels, samples): the probe picks it once
    the tiny config's codec widths agree (OVERRIDES), and the header says 1×N."""
    model = _tiny(model_type)
    b = _batch(model)
    wave = b.kwargs["input_values"]
    assert wave.dim() == 3 and wave.shape[:2] == (2, 1)
    with torch.no_grad():
        model(**b.kwargs)
    assert describe_batch(b) == f"2 clips of 1×{wave.shape[2]} samples"


def test_an_optional_mask_the_encoder_needs_is_given_all_ones() -> None:
    """AudioFlamingo 3's encoder defaults `input_features_mask` to None and then sums it:
    the mask is given, every frame real."""
    model = _tiny("audioflamingo3_encoder")
    kw = _batch(model).kwargs
    mask = kw["input_features_mask"]
    assert mask.shape == (2, kw["input_features"].shape[2]) and bool((mask == 1).all())
    with torch.no_grad():
        model(**kw)


def test_a_variance_adaptor_gets_its_targets_and_its_own_loss_runs() -> None:
    """FastSpeech 2 refuses to train without duration, pitch, energy and spectrogram
    targets: it gets them (2 frames a token, the spectrogram as long as the durations
    add up to, of the config's mel bins) and its own loss is the objective."""
    model = _tiny("fastspeech2_conformer")
    ids = torch.randint(0, model.config.vocab_size, (2, 8))

    def tokens(i: int) -> Batch:
        return Batch(kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    b = with_side_inputs(model, tokens, 0)(0)
    kw = b.kwargs
    assert kw["duration_labels"].shape == (2, 8) and not kw["duration_labels"].is_floating_point()
    assert kw["pitch_labels"].shape == kw["energy_labels"].shape == (2, 8, 1)
    assert kw["spectrogram_labels"].shape == (2, 16, model.config.num_mel_bins)
    model.train()
    out = model(**kw)
    assert default_loss("encoder", None)(out, b) is out.loss
    assert "duration, spectrogram, pitch, energy labels" in describe_loss("encoder", b, False)
    assert "2×16 target frames of 80 mel bins" in (describe_batch(b) or "")


def test_token_ids_over_codebooks_take_the_layout_the_forward_runs_on() -> None:
    """MusicGen's decoder reads a row per (sample, codebook); Kyutai STT a channel per
    codebook after the text's, each id inside every channel's range."""
    music = _tiny("musicgen")
    layout = codebook_layout(music, music.config.vocab_size, 16)
    assert layout is not None and layout.rows and layout.codebooks == 4
    source = layout_source(layout, music.config.vocab_size, 2, 16, 0, mask=False)
    assert source(0).kwargs["input_ids"].shape == (8, 16)
    assert source.fed == "2 samples × 4 codebooks, a row each"
    with torch.no_grad():
        music(**source(0).kwargs)

    stt = _tiny("kyutai_speech_to_text")
    config = stt.config
    layout = codebook_layout(stt, config.vocab_size, 16)
    assert layout is not None and not layout.rows
    assert layout.channels == config.num_codebooks + 1
    ids = layout_source(layout, config.vocab_size, 2, 16, 0, mask=True)(0).kwargs["input_ids"]
    assert ids.shape == (2, 16, config.num_codebooks + 1)
    assert int(ids.max()) < min(config.vocab_size, config.codebook_vocab_size)
    assert describe_batch(Batch(kwargs={"input_ids": ids})) == "2×16 tokens of 33 channels"


def test_a_model_that_takes_plain_ids_keeps_them_despite_naming_codebooks() -> None:
    """A config that names `num_codebooks` changes nothing when (batch, seq) ids run."""

    class Plain(nn.Module):
        config = SimpleNamespace(num_codebooks=8)

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            assert input_ids.dim() == 2
            return self.embed(input_ids)

    assert codebook_layout(Plain(), 32, 16) is None
