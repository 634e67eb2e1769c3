"""Every user mistake and every resource limit is exit 2 with one `actscan: error:` line,
never exit 3 ("a bug in actscan") and never a traceback (issue 19, defect 6).

One table drives the CLI in process with each case a careless user could type: path names
the file system refuses (too long, a symlink loop), token ids past int64 or nested past
Python's parser, sizes torch cannot allocate, hyperparameters outside the domain where
they can work, and mistakes on the command line itself (a non-integer, an unknown option).
The allocator's errors are recognised by kind wherever they are raised: a planted one in a
model's forward gets the same line and advice.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import one_line_error
from typer.testing import CliRunner

from actscan.cli import app
from actscan.errors import BUILD_ADVICE, MEMORY, RUN_ADVICE, SIZE, resource_cause, resource_kind
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.targets.checkpoint import save_builtin

TINY = "n_layers: 2\nd_model: 32\nn_heads: 4\nvocab_size: 64\nseq_len: 64\n"
FAST = ["--batch", "2", "--seq-len", "8", "--device", "cpu", "-q"]
LONG = "x" * 300  # one name longer than any file system's 255 bytes


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the cases name: a tiny config, a bare checkpoint, bad --input files."""
    root = tmp_path_factory.mktemp("mistakes")
    (root / "tiny.yaml").write_text(TINY)
    # beyond the 128 TB any process can address: refused by every allocator, at once
    (root / "wide.yaml").write_text(TINY.replace("d_model: 32", "d_model: 10000000"))
    save_builtin(
        build_model(ArchConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64)),
        root / "w.safetensors",
    )
    (root / "int64.json").write_text(json.dumps([[1, 2**70]]))
    (root / "int63.json").write_text(json.dumps([[1, 2**63]]))
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    os.symlink("loop.yaml", root / "loop.yaml")
    os.symlink("loop.json", root / "loop.json")
    planted = """
        import torch
        from torch import nn


        class Hungry(nn.Module):
            def __init__(self, error):
                super().__init__()
                self.emb = nn.Embedding(64, 8)
                self.error = error

            def forward(self, ids):
                if ids.shape[0] > 1:  # the real batch: the resolver's 1-row try passes
                    raise self.error
                return self.emb(ids)


        def cpu():
            msg = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
            return Hungry(RuntimeError(msg + "memory: you tried to allocate 5300000000 bytes."))


        def cuda():
            return Hungry(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    """
    (root / "hungry_models.py").write_text(textwrap.dedent(planted))
    return root


def tiny(root: Path) -> list[str]:
    return ["profile", str(root / "tiny.yaml"), *FAST]


# (case id, the command line from the files' folder, words the one line must hold)
Case = tuple[str, Callable[[Path], list[str]], tuple[str, ...]]
CASES: list[Case] = [
    # -- paths the file system refuses ---------------------------------------------------
    ("target-name-too-long", lambda r: ["profile", str(r / LONG), *FAST], ("file name too long",)),
    (
        "config-name-too-long",
        lambda r: ["profile", str(r / "w.safetensors"), "--config", str(r / f"{LONG}.yaml"), *FAST],
        ("--config", "file name too long"),
    ),
    ("target-symlink-loop", lambda r: ["profile", str(r / "loop.yaml"), *FAST], ("symlink loop",)),
    # -- resource limits: the allocator, wherever it is hit (--force: past the estimate) ----
    (
        "config-d_model-1e7",
        lambda r: ["profile", str(r / "wide.yaml"), *FAST, "--force"],
        ("building", "out of memory", "smaller config"),
    ),
    (  # 2e9 × 64 int64 token ids: 1 TB, refused by the allocator of any machine at once
        "batch-2e9",
        lambda r: ["profile", str(r / "tiny.yaml"), "--batch", "2000000000", "-q", "--force"],
        ("running", "out of memory", "--batch"),
    ),
    (
        "planted-cpu-allocator",
        lambda r: ["profile", "hungry_models:cpu", *FAST],
        ("5.3 GB", "--batch"),
    ),
    (
        "planted-cuda-oom",
        lambda r: ["profile", "hungry_models:cuda", *FAST],
        ("2.00 GiB", "--batch"),
    ),
    ("batch-past-int64", lambda r: [*tiny(r), "--batch", str(2**70)], ("--batch", "at most")),
    ("seq-len-past-int64", lambda r: [*tiny(r), "--seq-len", str(2**70)], ("--seq-len", "at most")),
    ("seed-past-int64", lambda r: [*tiny(r), "--seed", str(2**64)], ("--seed", "at most")),
    ("batches-1e21", lambda r: [*tiny(r), "--batches", str(10**21)], ("--batches", "at most")),
    ("steps-1e6", lambda r: [*tiny(r), "--steps", "1000000"], ("--steps", "at most")),
    # -- hyperparameters outside their domain ------------------------------------------------
    ("lr-1e300", lambda r: [*tiny(r), "--steps", "1", "--lr", "1e300"], ("--lr", "at most")),
    ("eps-0", lambda r: [*tiny(r), "--steps", "1", "--eps", "0"], ("--eps", "> 0")),
    ("eps-2", lambda r: [*tiny(r), "--steps", "1", "--eps", "2"], ("--eps", "at most 1")),
    (
        "weight-decay-1e300",
        lambda r: [*tiny(r), "--steps", "1", "--weight-decay", "1e300"],
        ("--weight-decay", "at most"),
    ),
    (
        "lr-times-weight-decay",
        lambda r: [*tiny(r), "--steps", "1", "--lr", "10", "--weight-decay", "0.5"],
        ("--weight-decay 0.5", "--lr 10", "zero or flip"),
    ),
    # -- the command line itself -----------------------------------------------------------
    ("steps-not-an-int", lambda r: [*tiny(r), "--steps", "1e9"], ("--steps", "integer")),
    ("batch-not-an-int", lambda r: [*tiny(r), "--batch", "abc"], ("--batch", "integer")),
    ("unknown-option", lambda r: [*tiny(r), "--stpes", "3"], ("--stpes",)),
    ("missing-target", lambda r: ["profile"], ("target",)),
    (  # was ignored in silence: the config target's own architecture ran
        "config-for-a-config-target",
        lambda r: [*tiny(r), "--config", str(r / "tiny.yaml")],
        ("--config", "bare .safetensors"),
    ),
]
# The other cases, refused already by the bounded reads of --input files and the
# --nproc limit (actscan/files.py, distributed/launch.py): here too, so that this one
# table holds every user mistake of the issue.
CASES += [
    ("input-name-too-long", lambda r: [*tiny(r), "--input", str(r / f"{LONG}.json")], ("--input",)),
    ("input-symlink-loop", lambda r: [*tiny(r), "--input", str(r / "loop.json")], ("--input",)),
    ("input-id-past-int64", lambda r: [*tiny(r), "--input", str(r / "int64.json")], ("[0, 64)",)),
    ("input-id-2**63", lambda r: [*tiny(r), "--input", str(r / "int63.json")], ("[0, 64)",)),
    ("input-nested-deep", lambda r: [*tiny(r), "--input", str(r / "deep.json")], ("nested",)),
    ("nproc-100000", lambda r: [*tiny(r), "--nproc", "100000"], ("--nproc 100000",)),
    (
        "batch-1e8",
        lambda r: ["profile", str(r / "tiny.yaml"), "--batch", "100000000"],
        ("--force",),
    ),
]


@pytest.mark.parametrize(("name", "argv", "needles"), CASES, ids=[c[0] for c in CASES])
def test_user_mistake_is_one_line_exit_2(
    name: str,
    argv: Callable[[Path], list[str]],
    needles: tuple[str, ...],
    files: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(files)  # module:callable targets import from the working folder
    monkeypatch.syspath_prepend(str(files))
    result = CliRunner().invoke(app, argv(files))
    line = one_line_error(result, *needles)
    assert "internal error" not in line


@pytest.mark.parametrize(
    ("err", "kind", "cause"),
    [
        (
            RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 12 bytes"
            ),
            MEMORY,
            "out of memory (tried to allocate 12 bytes)",
        ),
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
            MEMORY,
            "20.00 MiB",
        ),
        (MemoryError(), MEMORY, "out of memory"),
        (RuntimeError("Trying to create tensor with negative dimension -3: [-3, 4]"), SIZE, "(-3)"),
        (ValueError("Overflow when unpacking long long"), SIZE, "beyond torch's limits"),
        (RuntimeError("numel: integer multiplication overflow"), SIZE, "beyond torch's limits"),
    ],
)
def test_resource_errors_are_recognised_by_kind(err: Exception, kind: str, cause: str) -> None:
    """The classifier behind every stage's net: each of torch's limits by its kind, with
    advice for each kind at each stage."""
    assert resource_kind(err) == kind
    assert cause in resource_cause(err)
    assert kind in BUILD_ADVICE and kind in RUN_ADVICE


def test_other_errors_are_not_resources() -> None:
    """A bug stays a bug: exit 3 is kept for what is not a limit."""
    for err in (
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
        KeyError("x"),
        OSError(),
    ):
        assert resource_kind(err) is None
