"""Property: whatever a config file or an `--input` file holds, `actscan profile` profiles
it (exit 0/1) or refuses it in one line (exit 2), in bounded time and memory — never an
internal error (3), a traceback, a hang, or the allocator's limit.

Mutations of a tiny actscan config in YAML, TOML and JSON (byte flips, truncation, alias
bombs, deep nesting, huge, negative, NaN and infinite numbers, wrong types, unknown keys,
unicode, empty files) and of a token-id `--input` file (huge, negative and non-integer
ids, nesting, wrong shapes), drawn from a fixed seed. They all run in one child process
under an address-space limit, each under a hang guard (tests/bounded_cli.py); a case that
reaches the memory limit shows as "out of memory" and fails the test, since every input
here must be refused or measured long before that.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from bounded_cli import run_batch

SEED = 20261202
BASE = {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 32, "seq_len": 8}
FAST = ["--device", "cpu", "--batch", "1", "--seq-len", "8", "--quiet"]
VALUES: list[Any] = [
    0,
    -1,
    2,
    10**9,
    10**30,
    2**63,
    -(2**63),
    1e308,
    -1e-308,
    math.nan,
    math.inf,
    -math.inf,
    1.5,
    "x",
    "ünïcödé ✓",
    "9" * 5000,
    True,
    None,
    [],
    {},
    [1, 2],
    {"a": 1},
]
INTS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "d_ff", "mup_base_width")
FLOATS = ("init_std", "embed_std", "layerscale_init", "norm_eps", "mlp_bias_init")
KEYS = [*INTS, *FLOATS, "norm", "activation", "position", "tie_embeddings", "bogus", "ключ"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '""'  # TOML has no null


def dump(data: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, ensure_ascii=False)
    if fmt == "toml":
        return "".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in data.items())
    import yaml

    return yaml.safe_dump(data, allow_unicode=True)


def deep(fmt: str, n: int) -> str:
    if fmt == "toml":
        return "n_layers = " + "[" * n + "]" * n + "\n"
    return ("{'a': " * n + "1" + "}" * n) if fmt == "yaml" else '{"a": ' * n + "1" + "}" * n


BOMB = "\n".join(
    ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    + [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefg", "bcdefgh", strict=True)]
    + ["n_layers: 1", "d_model: *h"]
)


def flip(text: str, rng: random.Random) -> bytes:
    raw = bytearray(text.encode())
    for _ in range(rng.randint(1, 4)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


def config_cases(root: Path, rng: random.Random) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for fmt in ("yaml", "toml", "json"):
        text = dump(BASE, fmt)
        out[f"ok.{fmt}"] = text
        out[f"empty.{fmt}"] = ""
        out[f"blank.{fmt}"] = "\n  \n"
        out[f"bom.{fmt}"] = "\ufeff" + text
        out[f"deep.{fmt}"] = deep(fmt, 50_000)
        out[f"list.{fmt}"] = dump({"x": [1]}, fmt).replace("x", "n_layers")
        for i in range(4):
            out[f"flip{i}.{fmt}"] = flip(text, rng)
            out[f"cut{i}.{fmt}"] = text[: rng.randrange(len(text))]
        for i in range(7):
            key, value = rng.choice(KEYS), rng.choice(VALUES)
            out[f"value{i}.{fmt}"] = dump({**BASE, key: value}, fmt)
    # every number field at the edges of its domain (JSON: NaN and Infinity too)
    for key in (
        "n_layers",
        "d_model",
        "n_heads",
        "vocab_size",
        "seq_len",
        "d_ff",
        "mup_base_width",
    ):
        for value in (0, -1, 1e308, 2**63, 10**9):
            out[f"{key}={value}.json"] = json.dumps({**BASE, key: value})
    for key in FLOATS:
        for value in (-1.0, math.nan, math.inf, 1e308, -1e-308):
            out[f"{key}={value}.json"] = json.dumps({**BASE, key: value})
    out["top-level-list.json"] = "[1, 2, 3]"
    out["top-level-scalar.yaml"] = "42"
    out["bomb.yaml"] = BOMB
    out["anchor.yaml"] = dump(BASE, "yaml").replace("d_model: 16", "d_model: &w 16") + (
        "mup_base_width: *w\n"
    )
    out["tag.yaml"] = "!!python/object/apply:os.system ['true']\n"
    out["huge-int.toml"] = dump(BASE, "toml") + "d_ff = " + "9" * 5000 + "\n"
    out["not-utf8.yaml"] = b"\xff\xfe\x00n_layers: 1"
    return out


def input_cases(rng: random.Random) -> dict[str, bytes | str]:
    ok = [[rng.randrange(32) for _ in range(8)]]
    rest = ok[0][1:]
    cases: dict[str, Any] = {
        "ok": ok,
        "huge-id": [[2**63, *rest]],
        "bigger-id": [[10**40, *rest]],
        "vocab-id": [[32, *rest]],
        "negative-id": [[-1, *rest]],
        "float-id": [[1.5, *rest]],
        "bool-id": [[True, *rest]],
        "string-id": [["a", *rest]],
        "flat": ok[0],
        "nested": [ok],
        "ragged": [ok[0], ok[0][:3]],
        "empty": [],
        "empty-row": [[]],
        "object": {"ids": ok},
        "long": [list(range(8)) * 8],
        "many-rows": ok * 64,
    }
    out: dict[str, bytes | str] = {f"{k}.json": json.dumps(v) for k, v in cases.items()}
    text = json.dumps(ok)
    out["deep.json"] = "[" * 100_000 + "]" * 100_000
    out["digits.json"] = "[[" + "9" * 5000 + "]]"
    out["nan.json"] = "[[NaN, 1]]"
    out["text.txt"] = "hello world"
    out["odd.bin"] = "[[1]]"
    for i in range(4):
        out[f"flip{i}.json"] = flip(text, rng)
        out[f"cut{i}.json"] = text[: rng.randrange(len(text))]
    return out


def _write(path: Path, content: bytes | str) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    rng = random.Random(SEED)
    root = tmp_path_factory.mktemp("fuzz-inputs")
    cases: dict[str, list[str]] = {}
    for name, content in config_cases(root, rng).items():
        path = _write(root / f"config-{name}", content)
        mode = rng.choice([[], ["--no-backward"], ["--steps", "1"]])
        cases[f"config {name}"] = ["profile", str(path), *FAST, *mode]
    target = _write(root / "target.yaml", dump(BASE, "yaml"))
    for name, content in input_cases(rng).items():
        path = _write(root / f"input-{name}", content)
        cases[f"input {name}"] = ["profile", str(target), "--input", str(path), *FAST]
    return run_batch(cases, per_case=60.0, total=900.0)


@pytest.mark.slow
def test_every_mutated_input_is_profiled_or_refused_in_one_line(fuzzed) -> None:
    bad = []
    for name, r in fuzzed.items():
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        ok = r["code"] in (0, 1, 2) and "Traceback" not in r["stderr"] + r["stdout"]
        if r["code"] == 2:
            ok = ok and len(lines) == 1 and lines[0].startswith("actscan: error: ")
            ok = ok and "out of memory" not in lines[0]  # the limit is never reached
        if not ok:
            bad.append(f"{name}: exit {r['code']}: {r['stderr'].strip()[:300]}")
    assert not bad, "\n".join(bad)
    # the fuzz is not vacuous: good files run, and bad ones are refused
    assert fuzzed["config ok.yaml"]["code"] in (0, 1) and fuzzed["input ok.json"]["code"] in (0, 1)
    assert fuzzed["config anchor.yaml"]["code"] in (0, 1)
    assert sum(r["code"] == 2 for r in fuzzed.values()) > len(fuzzed) // 2
