"""The built-in family: config validation, init schemes, branch scales, structure."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from actscan.errors import ConfigError
from actscan.measure.structure import detect_layout, stream_ks
from actscan.models.arch import (
    ArchConfig,
    apply_overrides,
    build_config,
    parse_set,
    read_config_file,
)
from actscan.models.gpt import build_model
from actscan.targets.resolve import shipped_configs

SMALL = dict(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=16)


def test_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'n_layer_typo'"):
        build_config({"n_layer_typo": 3})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"norm": "batchnorm"}, "norm must be one of"),
        ({"d_model": 100, "n_heads": 3}, "divisible"),
        ({"n_layers": 0}, "n_layers must be ≥ 1"),
        ({"n_layers": "many"}, "'n_layers' must be int"),
        ({"branch_scale": "deepnorm"}, "post-LN"),
        ({"tie_embeddings": "maybe"}, "must be bool"),
        ({"family": "llama"}, "family must be"),
    ],
)
def test_bad_values_are_refused(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(data)


def test_set_overrides_coerce_strings() -> None:
    cfg = apply_overrides(ArchConfig(), parse_set(["n_layers=6", "tie_embeddings=false",
                                                   "init_std=0.01", "d_ff=null"]))  # fmt: skip
    assert (cfg.n_layers, cfg.tie_embeddings, cfg.init_std, cfg.d_ff) == (6, False, 0.01, None)
    with pytest.raises(ConfigError, match="key=value"):
        parse_set(["n_layers"])


@pytest.mark.parametrize(
    ("suffix", "text"),
    [(".yaml", "n_layers: [1,\n"), (".toml", "n_layers = = 2"), (".json", "{bad json")],
)
def test_malformed_files_raise_one_line(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match="malformed") as err:
        read_config_file(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_every_shipped_config_builds() -> None:
    shipped = shipped_configs()
    assert {"gpt-12-preln", "gpt-48-naive", "gpt-48-scaled", "gpt-24-postln", "gpt-24-rezero",
            "gpt-24-deepnorm", "llama-12"} <= set(shipped)  # fmt: skip
    for name, path in shipped.items():
        cfg = build_config(read_config_file(path), name)
        assert cfg.n_layers >= 12


def _std(t: torch.Tensor) -> float:
    return t.detach().double().std().item()


@pytest.mark.parametrize(
    ("init", "rule"),
    [
        ("gpt2", lambda fi, fo: 0.02),
        ("small", lambda fi, fo: 0.002),
        ("xavier", lambda fi, fo: math.sqrt(2 / (fi + fo))),
        ("kaiming", lambda fi, fo: math.sqrt(2 / fi)),
        ("fan-in", lambda fi, fo: math.sqrt(1 / fi)),
    ],
)
def test_init_schemes_follow_their_rule(init: str, rule) -> None:
    model = build_model(ArchConfig(**SMALL, init=init))
    up = model.blocks[0].mlp.up.weight  # (4d, d): fan_in d, fan_out 4d
    assert _std(up) == pytest.approx(rule(64, 256), rel=0.05)
    assert torch.all(model.blocks[0].mlp.up.bias == 0)
    assert torch.all(model.blocks[0].norm1.weight == 1)


def test_branch_scales() -> None:
    L = 4
    depth = build_model(ArchConfig(**SMALL, branch_scale="depth"))
    assert _std(depth.blocks[1].attn.proj.weight) == pytest.approx(
        0.02 / math.sqrt(2 * L), rel=0.08
    )
    assert _std(depth.blocks[1].attn.qkv.weight) == pytest.approx(0.02, rel=0.05)
    rezero = build_model(ArchConfig(**SMALL, branch_scale="rezero"))
    assert torch.all(rezero.blocks[0].attn_gain.gain == 0)
    ls = build_model(ArchConfig(**SMALL, branch_scale="layerscale"))
    assert ls.blocks[0].mlp_gain.gain.shape == (64,)
    deep = build_model(
        ArchConfig(**SMALL, branch_scale="deepnorm", placement="post", init="xavier")
    )
    assert deep.blocks[0].alpha == pytest.approx((2 * L) ** 0.25)
    beta = (2 * L) ** -0.25
    assert _std(deep.blocks[0].mlp.down.weight) == pytest.approx(
        beta * math.sqrt(2 / 320), rel=0.05
    )
    q, v = deep.blocks[0].attn.qkv.weight[:64], deep.blocks[0].attn.qkv.weight[128:]
    assert _std(v) / _std(q) == pytest.approx(beta, rel=0.08)


def test_tied_embeddings_share_storage_and_build_is_deterministic() -> None:
    a = build_model(ArchConfig(**SMALL), seed=3)
    b = build_model(ArchConfig(**SMALL), seed=3)
    assert a.head.weight is a.tok_emb.weight
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    untied = build_model(ArchConfig(**SMALL, tie_embeddings=False))
    assert untied.head.weight is not untied.tok_emb.weight


def test_layout_of_builtin_model() -> None:
    model = build_model(ArchConfig(**SMALL))
    layout = detect_layout(model)
    assert layout.container == "blocks"
    assert [b.name for b in layout.blocks] == [f"blocks.{i}" for i in range(4)]
    assert layout.blocks[2].attn == "blocks.2.attn" and layout.blocks[2].mlp == "blocks.2.mlp"
    assert stream_ks(layout) == [2, 4, 6, 8]
    roles = layout.roles
    assert roles["tok_emb"] == "embed" and roles["pos_emb"] == "embed"
    assert roles["head"] == "head" and layout.head == "head"
    assert roles["norm_f"] == "norm" and layout.final_norm == "norm_f"
    assert roles["blocks.1.norm2"] == "norm" and roles["blocks.1.mlp.act"] == "act"
    assert roles["blocks.1.mlp.up"] == "mlp" and roles["blocks.1.attn.qkv"] == "attn"
    assert roles["blocks.1"] == "stream" and layout.block_of["blocks.1.mlp.down"] == 1
