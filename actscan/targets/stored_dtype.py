"""The dtype a checkpoint was stored in, against the dtype the run used.

The loaders record the stored dtypes of a file's tensors in `ModelInfo.arch`
("checkpoint_dtypes"); a bf16 checkpoint run in fp32 measures the weights exactly but not
the rounding the model sees when it runs as shipped, so the report says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# safetensors header names and torch names of the floating dtypes, by actscan's names.
_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16", "f16": "fp16", "fp16": "fp16", "float16": "fp16",
    "half": "fp16", "f32": "fp32", "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "f64": "fp64", "float64": "fp64",
}  # fmt: skip
_BITS = {"fp16": 16, "bf16": 16, "fp32": 32, "fp64": 64}


def stored_dtypes(arch: Mapping[str, Any]) -> list[str]:
    """The floating dtypes a loaded checkpoint stored its tensors in (actscan names)."""
    raw = arch.get("checkpoint_dtypes") or ()
    found = [_NAMES.get(str(d).lower().removeprefix("torch.")) for d in raw]
    return sorted({d for d in found if d is not None})


def stored_dtype_note(arch: Mapping[str, Any], run_dtype: str) -> str | None:
    """A note when the checkpoint's weights are stored in a half precision the run does
    not use (e.g. stored in bf16, run in fp32), else None."""
    stored = [d for d in stored_dtypes(arch) if d != "fp64"]
    half = [d for d in stored if _BITS[d] == 16 and d != run_dtype]
    if not half:
        return None
    kind = " and ".join(half)
    return (
        f"the checkpoint is stored in {kind}; this run is {run_dtype} (the weights are exact, "
        f"but activations are not rounded to {kind} as when it runs as stored: add "
        f"--dtype {half[0]} to measure that)"
    )
