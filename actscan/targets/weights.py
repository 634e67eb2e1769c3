"""Put checkpoint tensors into a built model, after checking they fit it exactly.

Why a separate step: `load_state_dict` reports mismatches as a multi-line RuntimeError and
stops at the first mis-shaped tensor. Users need the whole picture in one line — which
tensors the file lacks, which it has that the model does not, and which have the wrong
shape — so they can tell a wrong `--config` from a truncated export. The check works on
shapes only, so it can run against a model built on the meta device before any memory is
spent on the real one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from actscan.errors import BadInputError

if TYPE_CHECKING:
    import torch
    from torch import nn

SHOW = 4  # names listed per category before "…"


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """alias -> canonical name for parameters registered under more than one name.

    A tied output head (`head.weight` is `tok_emb.weight`) is one tensor; a checkpoint may
    store it once under either name, or under both.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter and persistent buffer of `model`, tied aliases included."""
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}


def _names(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(repr(n) for n in items[:SHOW])
    return shown + (f", … ({len(items) - SHOW} more)" if len(items) > SHOW else "")


def check_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    where: str,
) -> None:
    """Raise one BadInputError line listing missing, unexpected and mis-shaped tensors.

    `aliases` maps tied names to their canonical name: a tied pair is satisfied when either
    name is in the file (shape-checked like any other tensor).
    """
    missing: list[str] = []
    for name in expected:
        if name in found:
            continue
        canonical = aliases.get(name, name)
        partners = [canonical] + [a for a, c in aliases.items() if c == canonical]
        if not any(p in found for p in partners):
            missing.append(name if name == canonical else canonical)
    misshaped = [
        (n, list(found[n]), list(expected[n]))
        for n in found
        if n in expected and tuple(found[n]) != tuple(expected[n])
    ]
    unexpected = [n for n in found if n not in expected]
    error = mismatch_error(where, list(dict.fromkeys(missing)), unexpected, misshaped)
    if error is not None:
        raise error


def mismatch_error(
    where: str,
    missing: list[str],
    unexpected: list[str],
    misshaped: list[tuple[str, list[int], list[int]]],
) -> BadInputError | None:
    """The one line listing missing, unexpected and mis-shaped (name, file, model) tensors."""
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} ({_names(missing)})")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} ({_names(unexpected)})")
    if misshaped:
        shown = [f"{n!r} file {f} vs model {m}" for n, f, m in misshaped]
        more = f", … ({len(shown) - SHOW} more)" if len(shown) > SHOW else ""
        parts.append(f"mis-shaped {len(shown)} ({', '.join(shown[:SHOW])}{more})")
    if not parts:
        return None
    hint = " — wrong --config or architecture?" if misshaped or (missing and unexpected) else ""
    return BadInputError(
        f"bad checkpoint {where}: tensors do not match the model: {'; '.join(parts)}{hint}"
    )


def check_finite(tensors: Mapping[str, torch.Tensor], where: str, *, allow: bool) -> str | None:
    """Refuse NaN/Inf weights (named, with counts) unless `allow`; then return a note."""
    from actscan.targets.safetensors_io import count_nonfinite

    bad = {n: c for n, c in count_nonfinite(tensors).items() if c}
    if not bad:
        return None
    listed = ", ".join(f"{n!r} {c}" for n, c in list(bad.items())[:SHOW])
    if len(bad) > SHOW:
        listed += f", … ({len(bad) - SHOW} more tensors)"
    total = sum(bad.values())
    if not allow:
        raise BadInputError(
            f"bad checkpoint {where}: {total} non-finite (NaN/Inf) weights in {len(bad)} "
            f"tensors: {listed} (pass --allow-nonfinite to profile it anyway)"
        )
    return f"weights hold {total} non-finite values (NaN/Inf) in {len(bad)} tensors: {listed}"


def load_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Copy `tensors` into `model` (names and shapes checked first; dtypes are cast).

    Copies, never aliases: the checkpoint's memory map stays read-only and the user's file
    can never be written through a parameter.
    """
    import torch

    aliases = tied_aliases(model)
    check_shapes(
        expected_shapes(model), {n: tuple(t.shape) for n, t in tensors.items()}, aliases, where
    )
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, value in tensors.items():
            if aliases.get(name) in tensors:
                continue  # a tied alias stored twice: the canonical copy wins
            params[name].copy_(value)
