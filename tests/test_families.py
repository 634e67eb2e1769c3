"""Families beyond token-id decoders and encoders (issue 11, items 8–12).

Tiny transformers configs written to tmp folders (offline) and small modules returned by a
`module:callable`: models that take images, audio or mel features, encoder-decoders,
configs with per-layer `layer_types` at a new depth, and the failures that must be one
line with exit 2 (meta-device models, too-long sequences, wrong shapes, unknown types).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import one_line_error as _error
from typer.testing import CliRunner

from actscan.cli import app
from actscan.errors import UsageError
from actscan.run import scan
from actscan.targets.hf import hf_config

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
SEQ2SEQ = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}
TINY: dict[str, dict[str, object]] = {
    "vit": {**SMALL, "image_size": 32, "patch_size": 8, "num_channels": 3},
    "wav2vec2": {
        **SMALL,
        "conv_dim": [16, 16, 16],
        "conv_stride": [5, 2, 2],
        "conv_kernel": [10, 3, 3],
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 2,
    },
    "whisper": {
        **SEQ2SEQ,
        "num_mel_bins": 16,
        "max_source_positions": 30,
        "max_target_positions": 32,
        "vocab_size": 100,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 3,
        "begin_suppress_tokens": None,
        "suppress_tokens": None,
    },
    "t5": {
        "d_model": 32,
        "d_kv": 16,
        "d_ff": 64,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 2,
        "vocab_size": 100,
    },
    "bart": {**SEQ2SEQ, "vocab_size": 100, "max_position_embeddings": 64},
    "qwen3": {
        **SMALL,
        "vocab_size": 100,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
    },
    "gemma2": {
        **SMALL,
        "vocab_size": 100,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
    },
    "modernbert": {
        **SMALL,
        "vocab_size": 100,
        "max_position_embeddings": 64,
        "global_attn_every_n_layers": 2,
        "local_attention": 16,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "cls_token_id": 2,
        "sep_token_id": 1,
    },
    "bert": {**SMALL, "vocab_size": 100, "max_position_embeddings": 512},
}


def _config(model_type: str, **extra: object):
    return transformers.AutoConfig.for_model(model_type, **{**TINY[model_type], **extra})


def _write(folder: Path, model_type: str, **extra: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(_config(model_type, **extra).to_dict()))
    return path


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _json(result) -> dict:
    assert result.exit_code in (0, 1), (result.exit_code, result.output)
    assert "Traceback" not in result.output
    return json.loads(result.stdout)


# -- models that do not take token ids, encoder-decoders ----------------------------------

INPUTS = {
    "vit": "2 images 3×32×32",
    # wav2vec2's extractor (kernels 10,3,3, strides 5,2,2) gives 50 frames from 1020 samples
    "wav2vec2": "2 clips of 1020 samples",
    # Whisper takes exactly 2 × max_source_positions frames of num_mel_bins
    "whisper": "2 clips of 16×60 features + 2×8 decoder tokens",
    "t5": "2×8 tokens + 2×8 decoder tokens",
    "bart": "2×8 tokens + 2×8 decoder tokens",
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(INPUTS))
def test_family_runs_with_truthful_inputs(family: str, tmp_path: Path) -> None:
    cfg = _write(tmp_path, family)
    seq = [] if family == "wav2vec2" else ["--seq-len", 8]
    data = _json(run("profile", cfg, "--batch", 2, *seq, "--json", "-", "-q", "--fail-on", "never"))
    assert data["run"]["inputs"] == INPUTS[family]
    # an encoder-decoder's 2 encoder and 2 decoder blocks are all residual blocks found
    assert data["model"]["n_blocks"] == (4 if family in ("whisper", "t5", "bart") else 2)
    grads = [r["grad_rms"] for r in data["layers"] if r["grad_rms"] is not None]
    assert grads and all(g > 0 for g in grads)
    if family in ("whisper", "t5", "bart"):
        assert data["model"]["task"] == "seq2seq"
        # The model's own loss on the labels reaches the decoder: its layers have gradients.
        dec = [r for r in data["layers"] if "decoder." in r["name"] and r["grad_rms"]]
        assert dec, "no decoder layer got a gradient"
    if family in ("vit", "wav2vec2", "whisper"):
        assert data["run"]["seq_len"] == 0  # no tokens on the main input
    header = run("profile", cfg, "--batch", 2, *seq, "--fail-on", "never").stdout.splitlines()[1]
    assert INPUTS[family] in header and (" tokens" in header) == ("tokens" in INPUTS[family])


@pytest.mark.slow
def test_input_shape_is_the_main_input(tmp_path: Path) -> None:
    vit = _write(tmp_path / "vit", "vit")
    data = _json(run("profile", vit, "--input-shape", "3,3,32,32", "--json", "-", "-q"))
    assert data["run"]["inputs"] == "3 images 3×32×32"
    # A wrong shape: the model's own first line, exit 2.
    _error(
        run("profile", vit, "--input-shape", "2,3,17,17"),
        "ViTModel failed on 2 images 3×17×17",
        "Input image size (17*17) doesn't match model (32*32)",
    )
    w2v = _write(tmp_path / "w2v", "wav2vec2")
    data = _json(run("profile", w2v, "--input-shape", "2,2000", "--json", "-", "-q"))
    assert data["run"]["inputs"] == "2 clips of 2000 samples"
    _error(run("profile", w2v, "--input-shape", "2,3,5"), "Wav2Vec2Model failed on", "conv1d")


def test_scan_api_builds_inputs_for_a_vision_model() -> None:
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(_config("vit"), attn_implementation="eager")
    report = scan(model, batch=2)
    assert report.run.inputs == "2 images 3×32×32" and report.run.backward


def test_decoder_start_outside_vocab_is_one_line(tmp_path: Path) -> None:
    cfg = _write(tmp_path, "bart", decoder_start_token_id=500)
    _error(run("profile", cfg), "decoder_start_token_id = 500", "vocab_size = 100")


# -- layer_types at a new depth ----------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "modernbert"])
def test_layer_types_follow_a_deeper_set(family: str, tmp_path: Path) -> None:
    cfg = _write(tmp_path, family)
    data = _json(
        run(
            "profile",
            cfg,
            "--set",
            "num_hidden_layers=5",
            "--batch",
            2,
            "--seq-len",
            8,
            "--json",
            "-",
            "-q",
            "--fail-on",
            "never",
        )
    )
    assert data["model"]["n_blocks"] == 5


def test_layer_types_resize_rules() -> None:
    def types(model_type: str, depth: int, **kw: object) -> list[str]:
        data = transformers.AutoConfig.for_model(model_type, **kw).to_dict()
        return list(hf_config(data, "x", {"num_hidden_layers": str(depth)}).layer_types)

    s, f = "sliding_attention", "full_attention"
    # The config's own rule when the list is what it gives: gemma3's 5 sliding, 1 full.
    assert types("gemma3_text", 13, num_hidden_layers=6) == [s] * 5 + [f] + [s] * 5 + [f] + [s]
    assert types("gemma2", 5, num_hidden_layers=2) == [s, f, s, f, s]
    # A hand-written pattern repeats its period; a shallower model cuts it.
    assert types("gemma3_text", 5, num_hidden_layers=2, layer_types=[f, s]) == [f, s, f, s, f]
    assert types("gemma2", 1, num_hidden_layers=4) == [s]
    # Index lists stay; a user's own layer_types is theirs.
    data = transformers.AutoConfig.for_model(
        "qwen2_moe", num_hidden_layers=2, mlp_only_layers=[0, 1]
    ).to_dict()
    cfg = hf_config(data, "x", {"num_hidden_layers": "5"})
    assert cfg.mlp_only_layers == [0, 1] and len(cfg.layer_types) == 5
    cfg = hf_config(data, "x", {"num_hidden_layers": "3", "layer_types": json.dumps([f, f, s])})
    assert cfg.layer_types == [f, f, s]


def test_sweep_depth_with_layer_types(tmp_path: Path) -> None:
    cfg = _write(tmp_path, "gemma2")
    result = run(
        "sweep",
        cfg,
        "--depth",
        "2,5",
        "--batch",
        2,
        "--seq-len",
        8,
        "--fail-on",
        "never",
        "--json",
        "-",
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["report"]["model"]["n_blocks"] for r in rows] == [2, 5]


# -- one line, exit 2 ----------------------------------------------------------------------


def test_seq_len_past_learned_positions(tmp_path: Path) -> None:
    cfg = _write(tmp_path, "bert")
    _error(run("profile", cfg, "--seq-len", 1024), "max_position_embeddings = 512")
    whisper = _write(tmp_path / "w", "whisper")
    _error(run("profile", whisper, "--seq-len", 100), "max_target_positions = 32")


def test_unknown_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "not_a_real_arch_xyz"}))
    _error(
        run("profile", path),
        f"this transformers version ({transformers.__version__}) "
        "does not know model_type 'not_a_real_arch_xyz'",
    )


MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return self.lin(x) * self.scale

    def stack():
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def compiled():
        return torch.compile(stack())

    def meta_ok():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16))

    def meta_bad():
        with torch.device("meta"):
            return nn.Sequential(Scaled(), nn.Tanh())

    def meta_bert():
        from transformers import AutoConfig, AutoModel
        cfg = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64, vocab_size=100,
                                   max_position_embeddings=64)
        with torch.device("meta"):
            return AutoModel.from_config(cfg)

    def fails():
        class Broken(nn.Module):
            def forward(self, x):
                raise ValueError("shapes do not line up\\nsecond line")
        return Broken(), torch.zeros(2, 3)
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"fam_mods_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.slow
def test_compiled_module_profiles_the_original(user_module: str) -> None:
    from torch._dynamo.utils import counters

    frames = sum(counters["frames"].values())
    data = _json(run("profile", f"{user_module}:compiled", "--input-shape", "4,16", "--json", "-"))
    assert sum(counters["frames"].values()) == frames  # dynamo never ran: nothing compiled
    names = [r["name"] for r in data["layers"]]
    assert names and not any("_orig_mod" in n for n in names)
    assert any("torch.compile'd module" in n for n in data["notes"])
    plain = _json(run("profile", f"{user_module}:stack", "--input-shape", "4,16", "--json", "-"))
    assert names == [r["name"] for r in plain["layers"]]


def test_meta_device_models(user_module: str) -> None:
    data = _json(run("profile", f"{user_module}:meta_ok", "--input-shape", "4,16", "--json", "-"))
    assert any("materialised on the CPU" in n for n in data["notes"])
    assert all(r["rms"] is not None and r["rms"] > 0 for r in data["layers"])
    _error(
        run("profile", f"{user_module}:meta_bad", "--input-shape", "4,16"),
        "meta device",
        "(Scaled) has no reset_parameters()",
    )
    data = _json(
        run("profile", f"{user_module}:meta_bert", "--batch", 2, "--seq-len", 8, "--json", "-")
    )
    assert any("transformers' _init_weights" in n for n in data["notes"])
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    with pytest.raises(UsageError, match=r"meta device.*to_empty"):
        scan(meta, inputs=torch.zeros(2, 4))


def test_meta_bert_buffers_are_rebuilt() -> None:
    from actscan.measure.prepare import materialize_meta

    with torch.device("meta"):
        model = transformers.AutoModel.from_config(_config("bert", max_position_embeddings=64))
    assert materialize_meta(model, "x") is not None
    assert torch.equal(model.embeddings.position_ids[0], torch.arange(64))
    assert not any(t.is_meta for t in model.state_dict().values())


def test_model_error_is_one_line(user_module: str) -> None:
    _error(
        run("profile", f"{user_module}:fails"),
        "Broken failed on input 2×3 float32: ValueError: shapes do not line up",
    )
