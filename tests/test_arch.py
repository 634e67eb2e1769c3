"""The built-in family: config validation, init schemes, branch scales, structure."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from actscan.errors import ConfigError
from actscan.layout.detect import detect_layout, stream_ks
from actscan.models.arch import (
    ArchConfig,
    apply_overrides,
    build_config,
    parse_set,
    read_config_file,
)
from actscan.models.gpt import build_model
from actscan.targets.classify import shipped_configs

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
    cfg = apply_overrides(
        ArchConfig(),
        parse_set(["n_layers=6", "tie_embeddings=false", "init_std=0.01", "d_ff=null"]),
    )
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
    assert {
        "gpt-12-preln",
        "gpt-48-naive",
        "gpt-48-scaled",
        "gpt-24-postln",
        "gpt-24-rezero",
        "gpt-24-deepnorm",
        "llama-12",
    } <= set(shipped)
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


def _attention_reference(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The pre-QK-norm attention, written out independently of gpt.Attention."""
    b, t, c = x.shape
    h, d = attn.n_heads, attn.head_dim
    q, k, v = attn.qkv(x).split(c, dim=-1)
    q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in (q, k, v))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return attn.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


def test_qk_norm_off_by_default_leaves_the_model_exactly_as_it_was() -> None:
    assert ArchConfig().qk_norm is False
    plain = build_model(ArchConfig(**SMALL), seed=1)
    assert not any("q_norm" in n or "k_norm" in n for n in plain.state_dict())
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    attn = plain.blocks[1].attn
    assert torch.equal(attn(x), _attention_reference(attn, x))
    # the knob draws no random numbers: every shared weight is bit-identical
    qk = build_model(ArchConfig(**SMALL, qk_norm=True), seed=1)
    qk_sd = qk.state_dict()
    for name, p in plain.state_dict().items():
        assert torch.equal(p, qk_sd[name]), name
    extra = sorted(set(qk_sd) - set(plain.state_dict()))
    assert "blocks.0.attn.q_norm.weight" in extra and "blocks.3.attn.k_norm.bias" in extra


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_qk_norm_bounds_attention_scores_when_weights_grow(norm: str) -> None:
    """Normalised q and k have norm √d_head, so |score| ≤ √d_head·scale·d_head = √d_head
    at 1/√d_head, however large the q/k weights grow; without the norms the scores grow
    with the square of the weights (the attention-logit growth QK-norm exists to stop)."""
    scores: dict[bool, float] = {}
    recorded: dict[bool, float] = {}
    x = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0))
    for qk in (False, True):
        model = build_model(ArchConfig(**SMALL, norm=norm, qk_norm=qk), seed=0)
        with torch.no_grad():
            for blk in model.blocks:
                blk.attn.qkv.weight[:128].mul_(30.0)  # q and k projections ×30
        attn = model.blocks[0].attn
        with torch.no_grad():
            h = model.tok_emb(x) + model.pos_emb(torch.arange(16))
            q, k, _ = attn.qkv(model.blocks[0].norm1(h)).split(64, dim=-1)
            q, k = (z.view(2, 16, 4, 16).transpose(1, 2) for z in (q, k))
            if qk:
                q, k = attn.q_norm(q), attn.k_norm(k)
            scores[qk] = float((q @ k.transpose(-2, -1)).abs().max()) * attn.scale
            hook = attn.logits.register_forward_hook(
                lambda _m, _i, out, qk=qk: recorded.update({qk: float(out.abs().max())})
            )
            model(x)  # the model's own forward applies the norms where the scores are taken
            hook.remove()
        assert recorded[qk] == pytest.approx(scores[qk], rel=1e-5)
    assert scores[True] <= math.sqrt(16) + 1e-4  # head_dim 16
    assert scores[False] > 20 * scores[True]
    cfg = build_config({**SMALL, "qk_norm": "true"})
    assert cfg.qk_norm is True
    from actscan.models.gpt import arch_facts

    assert arch_facts(cfg)["qk_norm"] is True and arch_facts(ArchConfig())["qk_norm"] is False


def test_checkpoints_store_qk_norm_only_when_used(tmp_path: Path) -> None:
    """A model without QK-norm saves the same config (and file) as before the knob."""
    import json

    from safetensors import safe_open

    from actscan.targets.checkpoint import save_builtin

    for qk in (False, True):
        path = tmp_path / f"qk{qk}.safetensors"
        save_builtin(build_model(ArchConfig(**SMALL, qk_norm=qk)), path)
        with safe_open(str(path), "pt") as fh:
            stored = json.loads(fh.metadata()["actscan_config"])
            names = set(fh.keys())
        assert ("qk_norm" in stored) is qk
        assert build_config(stored) == ArchConfig(**SMALL, qk_norm=qk)
        assert ("blocks.0.attn.q_norm.weight" in names) is qk


BUILDS = [
    {},
    {"branch_scale": "rezero", "tie_embeddings": False},
    {"branch_scale": "layerscale", "norm": "rmsnorm", "position": "rope", "qk_norm": True},
    {"branch_scale": "deepnorm", "placement": "post", "activation": "swiglu", "bias": False},
    {"branch_scale": "depth", "init": "kaiming", "mlp_bias_init": -0.5, "embed_std": 0.3},
    {"parametrization": "mup", "mup_base_width": 16},
]


def _meta_model(cfg: ArchConfig, seed: int) -> torch.nn.Module:
    from actscan.models.gpt import ActscanGPT, NoMetaNormal

    with torch.device("meta"), NoMetaNormal():
        return ActscanGPT(cfg, seed)


def _one_unit_at_a_time(cfg: ArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """As a rank builds: one unit (a block, or a module outside the blocks) holds values
    at a time, the others stay on meta; the units in reverse order."""
    from actscan.models.gpt import init_weights

    model = _meta_model(cfg, seed)
    units = [(n, m) for n, m in model.named_children() if n != "blocks" and m is not None]
    units += [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    got: dict[str, torch.Tensor] = {}
    for name, unit in reversed(units):
        unit.to_empty(device="cpu")
        if cfg.tie_embeddings:  # leaving meta makes new parameters: tie them again
            model.head.weight = model.tok_emb.weight
        init_weights(model, cfg, seed)
        held = unit.state_dict(prefix=f"{name}.")
        got.update({k: v.detach().clone() for k, v in held.items() if not v.is_meta})
        unit.to("meta")
    return got  # a tied head holds no values of its own: valued as tok_emb.weight


@pytest.mark.parametrize("kw", BUILDS)
def test_any_build_order_gives_the_same_weights(kw: dict) -> None:
    """Each parameter is drawn from (seed, its name): the fast build, the eager constructor,
    meta then init, and one unit at a time in another order give the same tensors, and
    none of them moves the caller's random stream except the eager constructor's own
    default initialisers."""
    from actscan.models.gpt import ActscanGPT, init_weights

    cfg = ArchConfig(n_layers=3, d_model=32, n_heads=2, vocab_size=37, seq_len=17, **kw)
    for seed in (0, 3):
        before = torch.random.get_rng_state()
        fast = build_model(cfg, seed).state_dict()
        assert torch.equal(before, torch.random.get_rng_state())  # caller's stream untouched
        eager = ActscanGPT(cfg, seed).state_dict()
        meta = _meta_model(cfg, seed)
        meta.to_empty(device="cpu")
        if cfg.tie_embeddings:
            meta.head.weight = meta.tok_emb.weight
        init_weights(meta, cfg, seed)
        units = _one_unit_at_a_time(cfg, seed)
        if cfg.tie_embeddings:
            units["head.weight"] = units["tok_emb.weight"]
        for other in (eager, meta.state_dict(), units):
            assert sorted(other) == sorted(fast)
            assert [k for k in fast if not torch.equal(fast[k], other[k])] == []


def test_different_seeds_and_different_parameters_draw_different_numbers() -> None:
    cfg = ArchConfig(**SMALL)
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=1)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.numel() > 1 and _std(p) > 0:
            assert not torch.equal(p, q), name
    # same shape, same std, other name: independent draws (no shared stream offset)
    w0, w1 = a.blocks[0].mlp.up.weight.flatten(), a.blocks[1].mlp.up.weight.flatten()
    corr = torch.corrcoef(torch.stack([w0, w1]).double())[0, 1].item()
    assert abs(corr) < 0.05


@pytest.mark.parametrize("init", ["gpt2", "kaiming", "fan-in"])
def test_every_parameter_has_its_scheme_std(init: str) -> None:
    """Per parameter, the drawn std and mean match what the init scheme asks for."""
    from actscan.models.gpt import linear_std

    L = SMALL["n_layers"]
    cfg = ArchConfig(**SMALL, init=init, branch_scale="depth", tie_embeddings=False)
    model = build_model(cfg, seed=5)
    emb = 0.02 if init == "gpt2" else 1.0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            want = emb
        elif isinstance(mod, torch.nn.Linear):
            want = linear_std(cfg, mod.in_features, mod.out_features)
            if name.endswith(("attn.proj", "mlp.down")):
                want /= math.sqrt(2 * L)
        else:
            continue
        w = mod.weight.detach().double()
        assert _std(w) == pytest.approx(want, rel=0.05), name
        assert abs(w.mean().item()) < 5 * want / math.sqrt(w.numel()), name
