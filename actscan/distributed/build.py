"""Targets built sharded from the start: no rank ever holds the whole model.

* Built-in configs (shipped names, actscan config files): the model is built on the
  meta device; its initialisation runs one *unit* at a time (a block, or a module
  outside the blocks that owns parameters) with only that unit materialised: each rank
  keeps the rows of its shards and frees the unit. Each parameter's values come from
  (seed, its name) alone, so they are bit-identical to the one-process model's (checked
  on a 2-layer copy of the config before each build; refused if not).
* Hugging Face folders (config.json + model.safetensors or a sharded index): built on
  the meta device, and each rank reads only its rows of each tensor, memory-mapped,
  through safetensors slices (`safe_open(...).get_slice`).

Everything else (module:callable targets, bare .safetensors files, Hugging Face configs
without weights) is refused with one line: building those needs the whole model in one
process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from actscan.distributed.fsdp import fill_local, materialize, param_bytes, shard_model
from actscan.distributed.runtime import DistRun
from actscan.distributed.telemetry import note_build_peak
from actscan.errors import BadInputError, UsageError
from actscan.layout.detect import detect_layout
from actscan.models import gpt
from actscan.models.arch import read_config_file
from actscan.models.gpt import build_model
from actscan.targets import safetensors_io as st
from actscan.targets.builtin import arch_from_mapping
from actscan.targets.classify import Kind, classify
from actscan.targets.hf import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    config_notes,
    hf_config,
    hf_info,
    hf_inputs,
    model_class,
)
from actscan.targets.hf_env import no_prompt, quiet
from actscan.targets.info import builtin_info
from actscan.targets.resolved import Resolved, TargetOptions

if TYPE_CHECKING:
    from actscan.models.arch import ArchConfig


def _refuse(what: str) -> UsageError:
    return UsageError(
        f"{what} cannot be profiled distributed (it needs the whole model in one process): "
        "use a built-in config or a Hugging Face folder, or drop --nproc"
    )


def build_sharded(target: str, opts: TargetOptions, run: DistRun) -> Resolved:
    """TARGET → the resolved model, sharded over the run's ranks (see the module doc)."""
    what = classify(target)
    if what.kind is Kind.CALLABLE:
        raise _refuse(f"{target} (a module:callable target)")
    path = what.path
    assert path is not None  # every kind but CALLABLE names a path
    if opts.input_shape is not None:
        raise _refuse("--input-shape")
    if what.kind is Kind.FOLDER:
        return _hf_folder(path, opts, run)
    if what.kind is Kind.BUILTIN_CONFIG:
        cfg = arch_from_mapping(what.config_dict(), str(path), opts)
        return _builtin(cfg, str(path), opts, run)
    if what.kind is Kind.HF_CONFIG:
        raise _refuse(f"{path} (a Hugging Face config without weights)")
    raise _refuse(f"{path}")


# -- built-in family -----------------------------------------------------------------------
def _owners(model: nn.Module, blocks: list[str]) -> list[list[str]]:
    """Init units in model.modules() order: each block, and each module outside the
    blocks that owns parameters itself."""
    units: list[list[str]] = []
    inside = tuple(f"{b}." for b in blocks)
    for name, mod in model.named_modules():
        if name in blocks:
            units.append([n for n, _ in mod.named_modules(prefix=name)])
        elif not name.startswith(inside) and any(True for _ in mod.parameters(recurse=False)):
            units.append([name])
    return units


def _set_params(model: nn.Module, names: list[str], device: torch.device | str) -> None:
    """Fresh (uninitialised) parameters on `device` for the modules `names` (not recursing)."""
    mods = dict(model.named_modules())
    for mname in names:
        mod = mods[mname]
        for pname, p in list(mod.named_parameters(recurse=False)):
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(mod, pname, nn.Parameter(t, requires_grad=p.requires_grad))


def _unitwise_values(
    cfg: ArchConfig, seed: int, rows_of: Any, device: torch.device
) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
    """The built-in model on meta, for each parameter the rows `rows_of(name, shape)`
    picks of its one-process init, computing one unit at a time, and the most parameter
    bytes held at once (the rows kept so far plus the one unit being initialised)."""

    with torch.device("meta"), gpt.NoMetaNormal():
        model = gpt.ActscanGPT(cfg, seed)  # draws nothing
    blocks = [f"blocks.{i}" for i in range(cfg.n_layers)]
    values: dict[str, torch.Tensor] = {}
    held = peak = 0
    for unit in _owners(model, blocks):
        _set_params(model, unit, "cpu")
        if cfg.tie_embeddings:
            model.head.weight = model.tok_emb.weight
        mods = dict(model.named_modules())
        gpt.init_weights(model, cfg, seed)  # only this unit holds values: its share
        full = 0
        for n in unit:
            for pname, p in mods[n].named_parameters(recurse=False):
                if p.is_meta:  # tied to another unit's parameter: valued there
                    continue
                key = f"{n}.{pname}" if n else pname
                values[key] = rows_of(key, p.detach()).clone()
                held += values[key].numel() * values[key].element_size()
                full += p.numel() * p.element_size()
        peak = max(peak, held + full)
        _set_params(model, unit, "meta")
        if cfg.tie_embeddings:
            model.head.weight = model.tok_emb.weight
    return model, values, peak


def _check_unitwise(cfg: ArchConfig, seed: int) -> None:
    """The unit-wise init must equal the one-process build: checked on a 2-layer copy."""
    from dataclasses import replace

    try:
        # 2 layers, at most 1024 tokens × 64 positions: a few blocks' worth of memory
        small = replace(
            cfg, n_layers=2, vocab_size=min(cfg.vocab_size, 1024), seq_len=min(cfg.seq_len, 64)
        )
        ref = dict(build_model(small, seed=seed).named_parameters())
    except Exception:
        ref = None
    if ref is not None:
        _, got, peak = _unitwise_values(small, seed, lambda _n, t: t, torch.device("cpu"))
        note_build_peak(peak)
        if set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref):
            return
    raise UsageError(
        f"{cfg.family}: the sharded build of this config does not reproduce the one-process "
        "weights; drop --nproc"
    )


def _builtin(cfg: ArchConfig, source: str, opts: TargetOptions, run: DistRun) -> Resolved:
    from torch.distributed.tensor import DTensor

    from actscan.distributed.fsdp import local_rows

    _check_unitwise(cfg, opts.seed)
    with torch.device("meta"), gpt.NoMetaNormal():
        shell = gpt.ActscanGPT(cfg)
    shard_model(shell, [f"blocks.{i}" for i in range(cfg.n_layers)], run.device)
    spans = {
        n: local_rows(p) if isinstance(p, DTensor) else (0, p.shape[0] if p.dim() else 0)
        for n, p in shell.named_parameters()
    }

    def rows_of(name: str, full: torch.Tensor) -> torch.Tensor:
        lo, hi = spans.get(name, (0, 0))
        return full[lo:hi] if full.dim() else full

    _, values, peak = _unitwise_values(cfg, opts.seed, rows_of, run.device)
    note_build_peak(peak)
    materialize(shell, run.device)
    missing = fill_local(shell, lambda n, lo, hi: values.get(n))
    values.clear()
    if missing:
        raise UsageError(f"sharded build: no values for {', '.join(missing[:3])}")
    n_params = sum(p.numel() for p in shell.parameters())
    return Resolved(model=shell, info=builtin_info(cfg, source, n_params, at_init=True))


# -- Hugging Face folders ------------------------------------------------------------------
class _Slices:
    """Rows of checkpoint tensors, read memory-mapped through safetensors slices."""

    def __init__(self, files: dict[str, Path]) -> None:
        from safetensors import safe_open

        self._open: dict[Path, Any] = {}
        self.where: dict[str, Path] = dict(files)
        for path in set(files.values()):
            self._open[path] = safe_open(str(path), framework="pt")
        self.dtypes: set[str] = set()

    def names(self) -> set[str]:
        return set(self.where)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        sl = self._open[self.where[name]].get_slice(name)
        shape = sl.get_shape()
        return sl[lo:hi] if shape else sl[:]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open[self.where[name]].get_slice(name).get_shape())


def _weight_files(path: Path) -> dict[str, Path]:

    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file():
        st.read_header(single)  # refuses pickles and broken headers with one line
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    if index.is_file():
        weight_map = st.read_index(index)  # bounded and checked, as a single process reads it
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            st.read_header(f)
        return files
    raise BadInputError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME} to load shard-wise")


class _ParamsOnMeta:
    """Construct a module with parameters on meta and buffers real (rotary tables…)."""

    def __enter__(self) -> None:
        self._orig = nn.Module.register_parameter

        def register(mod: nn.Module, name: str, param: nn.Parameter | None) -> None:
            self._orig(mod, name, param)
            if param is not None and not param.is_meta:
                p = mod._parameters[name]
                assert p is not None
                mod._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

        # a deliberate patch of torch's method for the construction, which mypy forbids
        nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]

    def __exit__(self, *exc: object) -> None:
        nn.Module.register_parameter = self._orig  # type: ignore[method-assign]  # undo it


def _hf_folder(path: Path, opts: TargetOptions, run: DistRun) -> Resolved:
    from transformers.initialization import no_init_weights

    if opts.config is not None:
        raise UsageError(f"--config is for a bare .safetensors file; {path} has its config.json")
    if opts.init is not None:
        raise UsageError(
            f"--init re-initializes weights, which would discard {path}'s; "
            "profile its config.json instead to see an initialization"
        )
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise BadInputError(f"{path}: not a Hugging Face model folder: no {CONFIG_NAME}")
    data = read_config_file(config_path)
    config = hf_config(data, str(config_path), opts.overrides, opts.flag("set"))
    files = _weight_files(path)
    cls: Any = model_class(config)  # a transformers model class (`_from_config`)
    try:
        with quiet(), no_prompt(), no_init_weights(), _ParamsOnMeta():
            model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        model.tie_weights()
    except Exception as err:
        raise BadInputError(f"{path}: transformers cannot build this model: {err}") from None
    slices = _Slices(files)
    for name in slices.names():
        slices.dtypes.add(str(slices._open[slices.where[name]].get_slice(name).get_dtype()))
    dtypes = sorted(
        {
            d.lower()
            .replace("f32", "float32")
            .replace("bf16", "bfloat16")
            .replace("f16", "float16")
            for d in slices.dtypes
        }
    )
    info = hf_info(  # read off the unwrapped model (FSDP renames its class)
        model,
        config,
        str(path),
        at_init=False,
        init=None,
        extra={"config_source": str(config_path), "checkpoint_dtypes": _same_dtypes(dtypes)},
    )
    layout = detect_layout(model, info.family)
    shard_model(model, [b.name for b in layout.blocks], run.device)
    materialize(model, run.device)
    prefix = f"{model.base_model_prefix}."
    names = slices.names()

    def key(name: str) -> str | None:
        for k in (name, name.removeprefix(prefix), prefix + name):
            if k in names:
                return k
        return None

    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    wrong = [n for n, s in expected.items() if (k := key(n)) is not None and slices.shape(k) != s]
    if wrong:
        raise BadInputError(
            f"bad checkpoint {path}: shapes differ from config.json for {', '.join(wrong[:3])}"
        )
    bad = torch.zeros(1, dtype=torch.float64)

    def read(name: str, lo: int, hi: int) -> torch.Tensor | None:
        k = key(name)
        if k is None:
            return None
        rows = slices.rows(k, lo, hi)  # only this rank's rows are read
        if rows.is_floating_point():
            bad.add_((~torch.isfinite(rows)).sum().double())
        return rows.to(torch.float32) if rows.is_floating_point() else rows

    missing = fill_local(model, read)
    note_build_peak(param_bytes(model))  # rows of its shards only
    if missing:
        raise BadInputError(
            f"bad checkpoint {path}: missing {len(missing)} tensors: {', '.join(missing[:3])}"
        )
    import torch.distributed as dist

    dist.all_reduce(bad)
    note = None
    if bad.item():
        n = int(bad.item())
        if not opts.allow_nonfinite:
            raise BadInputError(
                f"bad checkpoint {path}: {n} non-finite (NaN/Inf) weights "
                "(pass --allow-nonfinite to profile it anyway)"
            )
        note = f"weights hold {n} non-finite values (NaN/Inf)"
    notes = config_notes(data, str(config_path)) + ((note,) if note else ())
    return Resolved(
        model=model,
        info=info,
        inputs=hf_inputs(opts, info, model),
        notes=notes,
        extra={"tokenizer_dir": str(path)},
    )


def _same_dtypes(dtypes: list[str]) -> list[str]:
    """Dtype names as a one-process load lists them (torch's names)."""
    names = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
    return sorted({names.get(d, d) for d in dtypes})
