"""No code from a model folder runs, by any path, whatever stdin says.

A Hugging Face folder can name Python files of its own (`auto_map` in config.json,
tokenizer_config.json, the processor files). transformers imports them when
`trust_remote_code` is true and, when it is left unset, asks on stdin, where a piped `y`
is consent. Here every file transformers honours names a module that writes a canary
when imported, and `actscan profile` runs in a subprocess whose stdin answers `y` to
everything: the canary must never appear, and no question may be asked.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# A byte-level tokenizer (256 ids) built offline, shipped with the samples.
TOKENIZER = ROOT / "sample_models" / "tiny-gpt2-hf" / "tokenizer.json"
# Llama: transformers has no tokenizer class mapped to its config, so a tokenizer_config
# auto_map is the only class on offer and transformers would ask before running it.
LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
RUN = ("--batch", "1", "--seq-len", "8", "--no-backward", "--device", "cpu")
HANG_GUARD_S = 300  # a run takes seconds; a prompt left waiting would block forever
PROMPTS = ("Do you wish to run", "[y/N]", "trust_remote_code=True")


def _canary_module(canary: Path) -> str:
    """Python that records its own import in `canary` (an absolute path: transformers
    copies the module into its modules cache before importing it)."""
    return (
        "import pathlib\n"
        f"pathlib.Path({str(canary)!r}).write_text('custom code ran')\n"
        "from transformers import LlamaConfig as CanaryConfig\n"
        "from transformers import LlamaForCausalLM as CanaryModel\n"
        "from transformers import PreTrainedTokenizerFast as CanaryTokenizer\n"
        "CanaryProcessor = CanaryTokenizer\n"
    )


def _plant(folder: Path, canary: Path, *, tokenizer_class: str) -> None:
    """An auto_map pointing at canary.py in every file transformers reads one from."""
    (folder / "canary.py").write_text(_canary_module(canary))
    auto = {
        "AutoConfig": "canary.CanaryConfig",
        "AutoModel": "canary.CanaryModel",
        "AutoModelForCausalLM": "canary.CanaryModel",
        "AutoTokenizer": ["canary.CanaryTokenizer", "canary.CanaryTokenizer"],
        "AutoProcessor": "canary.CanaryProcessor",
        "AutoFeatureExtractor": "canary.CanaryProcessor",
        "AutoImageProcessor": "canary.CanaryProcessor",
    }
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": auto}))
    tokenizer_config = {
        "tokenizer_class": tokenizer_class,
        "model_max_length": 64,
        "auto_map": {"AutoTokenizer": auto["AutoTokenizer"]},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name in ("preprocessor_config.json", "processor_config.json"):
        (folder / name).write_text(
            json.dumps({"processor_class": "CanaryProcessor", "auto_map": auto})
        )
    generation = folder / "generation_config.json"
    data = json.loads(generation.read_text()) if generation.is_file() else {}
    generation.write_text(json.dumps({**data, "auto_map": auto}))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (weights, config, byte-level tokenizer) saved the usual way."""
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.AutoConfig.for_model("llama", **LLAMA)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


def _folder(llama: Path, tmp_path: Path, tokenizer_class: str) -> tuple[Path, Path]:
    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    canary = tmp_path / "CANARY"
    _plant(folder, canary, tokenizer_class=tokenizer_class)
    return folder, canary


def _actscan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`actscan ARGS` in a fresh process; stdin answers yes to any question."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf-home"),  # its modules cache too: nothing leaks out
        "HF_MODULES_CACHE": str(tmp_path / "hf-modules"),
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "actscan", "profile", *args, *RUN],
        input="y\n" * 200,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=env,
        cwd=tmp_path,
    )


def _assert_no_code_ran(res: subprocess.CompletedProcess[str], canary: Path) -> None:
    output = res.stdout + res.stderr
    assert not canary.exists(), output
    assert res.returncode in (0, 1, 2), output
    assert "Traceback" not in output
    for prompt in PROMPTS:
        assert prompt not in output, output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("actscan: error:")]
    assert len(errors) <= 1, res.stderr
    if res.returncode == 2:
        assert res.stderr.strip().splitlines() == errors, res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer_class", ["CanaryTokenizer", "PreTrainedTokenizerFast"])
def test_no_folder_code_runs_with_a_yes_on_stdin(
    llama: Path, tmp_path: Path, tokenizer_class: str
) -> None:
    """The folder, its config.json alone and `--input text.txt` (the tokenizer) load
    nothing of the folder's own, with a custom tokenizer class or a native one."""
    folder, canary = _folder(llama, tmp_path, tokenizer_class)
    text = tmp_path / "prompt.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)

    res = _actscan(tmp_path, str(folder), "--input", str(text))
    _assert_no_code_ran(res, canary)
    if tokenizer_class == "CanaryTokenizer":  # no transformers class for it: refused
        assert res.returncode == 2
        assert "never runs a folder's code" in res.stderr
    else:  # transformers' own class reads the files
        assert res.returncode in (0, 1), res.stderr
        assert "custom code is never run" in res.stdout + res.stderr


@pytest.mark.slow
def test_no_folder_code_runs_when_building_the_model(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder and its config.json alone, built in process (no tokenizer is read, so
    no prompt could wait on stdin): the model and config loaders import nothing planted."""
    from transformers import dynamic_module_utils

    from actscan.api import TargetSpec, scan_target
    from actscan.settings import Settings

    folder, canary = _folder(llama, tmp_path, "CanaryTokenizer")
    # were code imported, it would be copied here, not into the user's cache
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    settings = Settings(batch=1, seq_len=8, backward=False, device="cpu")
    for target in (folder, folder / "config.json"):
        report = scan_target(TargetSpec(str(target)), settings).report
        assert not canary.exists()
        assert report.layers  # it ran


def test_every_loader_is_called_without_remote_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process and fast: the loaders actscan calls see trust_remote_code=False and an
    empty stdin, so transformers can neither run code nor read a `y`."""
    from actscan.targets import hf_env

    seen: list[tuple[object, str]] = []

    def spy(*args: object, **kwargs: object) -> None:
        seen.append((kwargs.get("trust_remote_code"), sys.stdin.read()))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    hf_env.load_tokenizer(Path("anywhere"))
    assert seen == [(False, "")]
    assert sys.stdin.read() == "y\n"  # the caller's stdin is given back untouched
