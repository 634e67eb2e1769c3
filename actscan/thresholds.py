"""Every threshold actscan uses, in one place, with the theory that sets its default.

Override with `--threshold NAME=VALUE`, a `thresholds` table in `[tool.actscan]`, or the
`thresholds=` argument of `scan()`. Names are kebab-case.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from actscan.errors import UsageError


@dataclass(frozen=True)
class Thresholds:
    # outlier-channels: a channel whose max-abs is this many times the median channel's.
    # Gaussian channels differ by < 2× at these token counts; emergent LLM outlier
    # features are tens to hundreds of × the median, "massive activations" ~1000×.
    outlier_ratio: float = 20.0
    # …and at least this large in absolute value: LLM.int8()'s outlier threshold |x| ≥ 6.
    outlier_abs: float = 6.0

    # ---- compare: precision divergence (not a check: reported, not gated) ----------------
    # Relative RMS error ‖a−b‖/‖a‖ of a layer's output against the higher precision. One
    # bf16 rounding is ≤ 2^-8 ≈ 0.4% per element (RMS ≈ 0.2%); at init the shipped configs
    # stay ≲ 3% at every module in bf16, so 5% means amplified rounding error.
    divergence_rel_err: float = 0.05

    def with_overrides(self, overrides: Mapping[str, float | str] | None) -> Thresholds:
        if not overrides:
            return self
        known = {f.name.replace("_", "-"): f.name for f in fields(self)}
        values: dict[str, float] = {}
        for key, raw in overrides.items():
            name = known.get(str(key).replace("_", "-"))
            if name is None:
                raise UsageError(f"unknown threshold '{key}' (known: {', '.join(sorted(known))})")
            try:
                values[name] = float(raw)
            except (TypeError, ValueError):
                raise UsageError(f"threshold '{key}' must be a number, got {raw!r}") from None
        return replace(self, **values)

    def as_dict(self) -> dict[str, float]:
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}


DEFAULT = Thresholds()


def parse_threshold_options(items: list[str] | None) -> dict[str, str]:
    """`--threshold NAME=VALUE` (repeatable) into a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--threshold expects NAME=VALUE, got '{item}'")
        out[key.strip()] = value.strip()
    return out
