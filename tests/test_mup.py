"""`parametrization: sp|mup` in the built-in family (Tensor Programs V, Table 3, Adam)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from actscan.errors import ConfigError
from actscan.models.arch import ArchConfig, apply_overrides, build_config
from actscan.models.gpt import ScaledReadout, arch_facts, build_model

SMALL = dict(n_layers=2, n_heads=2, vocab_size=61, seq_len=8)


def cfg(d: int, p: str = "mup", base: int = 32, **kw) -> ArchConfig:
    return ArchConfig(d_model=d, parametrization=p, mup_base_width=base, **{**SMALL, **kw})


def test_sp_is_the_default_and_builds_what_it_always_built() -> None:
    sp = ArchConfig(d_model=32, **SMALL)
    assert sp.parametrization == "sp" and sp.width_mult == 1.0
    model = build_model(sp)
    assert type(model.head) is nn.Linear
    assert model.blocks[0].attn.scale == 1 / math.sqrt(sp.head_dim)
    (group,) = model.actscan_param_groups(3e-4)
    assert group["lr"] == 3e-4 and len(group["params"]) == len(list(model.parameters()))


def test_mup_at_its_base_width_is_sp_bit_for_bit() -> None:
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    sp, mup = build_model(cfg(32, "sp")), build_model(cfg(32, "mup"))
    for a, b in zip(sp.state_dict().values(), mup.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(sp(ids), mup(ids))


def test_mup_param_groups_scale_hidden_matrices_only() -> None:
    model = build_model(cfg(128, base=32))  # width_mult 4
    hidden, rest = model.actscan_param_groups(1e-2)
    assert (hidden["name"], hidden["lr"]) == ("hidden", pytest.approx(1e-2 / 4))
    assert rest["lr"] == 1e-2
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in hidden["params"]} == {
        f"blocks.{b}.{m}.weight"
        for b in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
    }
    rest_names = {names[id(p)] for p in rest["params"]}
    assert "tok_emb.weight" in rest_names and "blocks.0.norm1.weight" in rest_names
    assert "blocks.0.mlp.up.bias" in rest_names
    ids = [id(p) for g in (hidden, rest) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    torch.optim.AdamW(model.actscan_param_groups(1e-2))  # groups an optimizer accepts


def test_mup_logits_scale_by_inverse_width_mult_and_attention_by_inverse_head_dim() -> None:
    model = build_model(cfg(128, base=32))
    assert isinstance(model.head, ScaledReadout) and model.head.mult == pytest.approx(0.25)
    assert model.head.weight is model.tok_emb.weight  # tied embeddings still work
    x = torch.randn(3, 128)
    expected = nn.functional.linear(x, model.head.weight) / 4
    assert torch.allclose(model.head(x), expected, rtol=1e-6, atol=0)
    # 1/d_head, equal to 1/√d_head at the base width
    for d in (32, 128, 512):
        hd = d // 2
        assert build_model(cfg(d, base=32)).blocks[0].attn.scale == pytest.approx(
            math.sqrt(32 // 2) / hd
        )


def test_mup_init_variance_follows_fan_in_and_readout_keeps_base_std() -> None:
    wide = build_model(cfg(512, base=32, tie_embeddings=False))
    std = wide.blocks[0].mlp.down.weight.std().item()
    assert std == pytest.approx(0.02 / 4, rel=0.05)  # 0.02 / √16
    assert wide.head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert wide.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    fan = build_model(cfg(512, base=32, init="fan-in"))
    sp_fan = build_model(cfg(512, "sp", init="fan-in"))
    w, w_sp = fan.blocks[0].attn.qkv.weight, sp_fan.blocks[0].attn.qkv.weight
    assert torch.allclose(w, w_sp)  # a fan-in rule already is μP's hidden init


def test_config_knobs_validate_and_report() -> None:
    c = build_config({"n_layers": 2, "parametrization": "mup", "mup_base_width": 64})
    assert c.width_mult == 4.0 and arch_facts(c)["parametrization"] == "mup"
    assert arch_facts(c)["attn_scale"] == "1/dk"
    with pytest.raises(ConfigError, match="parametrization must be one of sp\\|mup"):
        build_config({"n_layers": 2, "parametrization": "ntk"})
    with pytest.raises(ConfigError, match="mup_base_width must be ≥ 1"):
        build_config({"n_layers": 2, "mup_base_width": 0})
    with pytest.raises(ConfigError, match="sets the attention scale itself"):
        apply_overrides(c, {"attn_scale": "1/dk"})


def test_checkpoints_store_the_new_knobs_only_when_used(tmp_path) -> None:
    """An SP model saves the same config as before the knobs existed; a μP one keeps them."""
    import json

    from safetensors import safe_open

    from actscan.targets.checkpoint import save_builtin

    for p, base, expect in (("sp", 64, set()), ("mup", 32, {"parametrization", "mup_base_width"})):
        path = tmp_path / f"{p}.safetensors"
        save_builtin(build_model(cfg(64, p, base=base)), path)
        with safe_open(str(path), "pt") as fh:
            stored = json.loads(fh.metadata()["actscan_config"])
        assert {"parametrization", "mup_base_width"} & set(stored) == expect
        assert build_config(stored) == cfg(64, p, base=base)  # missing: the default
