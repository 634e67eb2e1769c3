"""Write the small sample checkpoints in sample_models/ (seeded: same bytes every run).

    .venv/bin/python sample_models/make_samples.py [OUT_DIR]

Each built-in sample is one self-describing `.safetensors` file (actscan writes the
architecture into the header), so `actscan profile sample_models/NAME.safetensors` needs no
other file. One pathology is planted per file; README.md says what each shows. Every file
stays under 2 MB: widths ≤ 64, vocabulary 256.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from actscan.models.arch import ArchConfig
from actscan.models.gpt import ActscanGPT
from actscan.targets.checkpoint import save_builtin

OUT = Path(__file__).resolve().parent
SEED = 0
MAX_BYTES = 2_000_000

# Healthy small GPT: pre-LN, unit-gain (fan-in) init with unit-variance embeddings, residual
# output projections scaled by 1/√(2L). The stream stays in a narrow band through depth.
HEALTHY = ArchConfig(
    name="healthy", n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=64,
    init="fan-in", branch_scale="depth",
)  # fmt: skip

OUTLIER_CHANNEL = 17  # the embedding channel made 100× larger
DEAD_BLOCK = 2  # the block whose MLP output projection is zeroed
OVERFLOW_BLOCK = 1  # the block whose MLP is scaled up until fp16 overflows
OVERFLOW_GAIN = 500.0  # applied to both MLP projections of that block


def _built(cfg: ArchConfig) -> torch.nn.Module:
    """A sample's model drawn as the committed files were: from the global random stream
    in module order (`ActscanGPT(cfg, seed=None)` after `torch.manual_seed(SEED)`), not
    `build_model`'s per-parameter draws, so that the files keep their bytes. The caller's
    random stream is left as it was."""
    state = torch.random.get_rng_state()
    torch.manual_seed(SEED)
    try:
        return ActscanGPT(cfg, seed=None)
    finally:
        torch.random.set_rng_state(state)


def healthy() -> torch.nn.Module:
    return _built(HEALTHY)


@torch.no_grad()
def outlier_channel() -> torch.nn.Module:
    """One embedding channel ×100: with embed_std 1 its values reach far past |x| = 6.

    The head is untied so the planted channel lives in the embedding only (a tied head
    would also blow up the logits and blur the point).
    """
    cfg = replace(HEALTHY, name="outlier-channel", tie_embeddings=False)
    model = _built(cfg)
    model.tok_emb.weight[:, OUTLIER_CHANNEL].mul_(100.0)
    return model


@torch.no_grad()
def dead_branch() -> torch.nn.Module:
    """Block 2's MLP output projection (weight and bias) is all zeros: the branch adds nothing."""
    model = _built(replace(HEALTHY, name="dead-branch"))
    down = model.blocks[DEAD_BLOCK].mlp.down
    down.weight.zero_()
    down.bias.zero_()
    return model


def gpt_48_naive() -> torch.nn.Module:
    """48 pre-LN blocks with a flat init and no branch scaling: the stream grows like √k.

    d = 32 and fp16 storage keep the file under 2 MB. The flat std is GPT-2's 0.02 carried to
    this width (0.02·√(256/32) ≈ 0.056, so σ²·d matches d = 256), the embedding keeps 0.02:
    each branch then adds as much variance, relative to the embedding, as in
    configs/gpt-48-naive.yaml. Its 1/√(2L) twin (`--set branch_scale=depth`) stays flat."""
    cfg = ArchConfig(
        name="gpt-48-naive", n_layers=48, d_model=32, n_heads=4, vocab_size=256, seq_len=64,
        init="gpt2", init_std=0.056, embed_std=0.02, branch_scale="none",
    )  # fmt: skip
    return _built(cfg)


@torch.no_grad()
def fp16_overflow() -> torch.nn.Module:
    """Block 1's MLP projections ×500 each: its output reaches ~2e5 — finite in fp32, beyond
    fp16's 65504 (run with --dtype fp16 to see Inf/NaN). The weights themselves stay small
    enough for fp16."""
    model = _built(replace(HEALTHY, name="fp16-overflow"))
    mlp = model.blocks[OVERFLOW_BLOCK].mlp
    mlp.up.weight.mul_(OVERFLOW_GAIN)
    mlp.down.weight.mul_(OVERFLOW_GAIN)
    return model


MASSIVE_CHANNEL = 5  # the channel of position 0's massive value
MASSIVE_VALUE = 2000.0


@torch.no_grad()
def massive_activation() -> torch.nn.Module:
    """Position 0's learned position embedding has channel 5 set to 2000: every sequence's
    first token carries one massive value (~3000× the median |x|) down the whole stream, as
    trained LLMs do on their start token (Sun et al. 2024)."""
    cfg = replace(HEALTHY, name="massive-activation", tie_embeddings=False)
    model = _built(cfg)
    model.pos_emb.weight[0, MASSIVE_CHANNEL] = MASSIVE_VALUE
    return model


def tiny_gpt2_hf(folder: Path) -> None:
    """A Hugging Face-layout GPT-2 (2 layers, hidden 64) with a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, **_safe_kwargs(model))
    # Byte-level BPE with no merges: exactly the 256 byte symbols, so ids fit the vocabulary.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=64).save_pretrained(folder)


def _byte_of(symbol: str) -> int:
    """Byte value a ByteLevel alphabet symbol stands for (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    code = ord(symbol)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _write_stable(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary file; keep the existing file if its content is the same.

    safetensors stores `__metadata__` from a Rust HashMap, so the order of its keys (and so
    the bytes) can change between runs while the content does not; this keeps the committed
    files from churning when the script is re-run.
    """
    tmp = path.with_name(f".{path.name}.new")
    write(tmp)
    if path.exists() and _content(path) == _content(tmp):
        tmp.unlink()
    else:
        tmp.replace(path)


def _content(path: Path) -> tuple[object, ...]:
    """Everything a safetensors file means: metadata, tensor entries and the data bytes."""
    from actscan.targets.safetensors_io import read_header

    header = read_header(path)
    with path.open("rb") as f:
        f.seek(header.data_offset)
        data = f.read()
    return header.metadata, header.tensors, data


def _safe_kwargs(model: torch.nn.Module) -> dict[str, bool]:
    """transformers 4.x needs safe_serialization=True; 5.x always writes safetensors."""
    import inspect

    params = inspect.signature(model.save_pretrained).parameters
    return {"safe_serialization": True} if "safe_serialization" in params else {}


SAMPLES = {
    "healthy": healthy,
    "outlier-channel": outlier_channel,
    "dead-branch": dead_branch,
    "gpt-48-naive": gpt_48_naive,
    "fp16-overflow": fp16_overflow,
    "massive-activation": massive_activation,
}
FP16_STORED = {"gpt-48-naive"}  # stored in fp16 to fit 2 MB; loaded back into fp32


def main(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, make in SAMPLES.items():
        path = out / f"{name}.safetensors"
        dtype = torch.float16 if name in FP16_STORED else None
        _write_stable(path, lambda tmp, m=make(), dt=dtype: save_builtin(m, tmp, dtype=dt))
        written.append(path)
    hf = out / "tiny-gpt2-hf"
    tiny_gpt2_hf(hf)
    written.extend(sorted(p for p in hf.iterdir() if p.is_file()))
    for path in written:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise SystemExit(f"{path} is {size} bytes, over the {MAX_BYTES}-byte budget")
        print(f"{size:>9,d}  {path.relative_to(out.parent) if out == OUT else path}")
    return written


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
