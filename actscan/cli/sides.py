"""A and B of `compare` and `sweep`: what B inherits from A, how each side is labelled.

Not a command: compare and sweep both import it (command modules never import each other).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from actscan.cli import options as c
from actscan.settings import ROWS

if TYPE_CHECKING:
    from actscan.api import TargetSpec
    from actscan.settings import Settings


@dataclass(frozen=True)
class Side:
    """How one side is built and run, beyond the settings both sides share."""

    tag: str  # "a" | "b"
    target: str
    config: Path | None
    init: str | None
    sets: tuple[str, ...]
    dtype: str | None
    amp: str | None

    def settings(self, shared: Settings) -> Settings:
        """The shared settings with this side's precision."""
        return replace(shared, dtype=self.dtype, amp=self.amp)

    def spec(
        self,
        *,
        input_file: Path | None = None,
        input_shape: tuple[int, ...] | None = None,
        allow_nonfinite: bool = False,
        at_init: bool | None = None,
    ) -> TargetSpec:
        from actscan.api import TargetSpec

        return TargetSpec(
            target=self.target,
            config=self.config,
            init=self.init,
            overrides=self.sets,
            input_file=input_file,
            input_shape=input_shape,
            allow_nonfinite=allow_nonfinite,
            at_init=at_init,
            option_prefix=self.flag(""),
        )

    def flag(self, name: str) -> str:
        """An option as the user typed it for this side: --set for A, --vs-set for B."""
        return f"--{name}" if self.tag == "a" else f"--vs-{name}"

    def label(self) -> str:
        bits = [self.target]
        if self.init:
            bits.append(f"--init {self.init}")
        bits += [f"--set {s}" for s in self.sets]
        if self.dtype:
            bits.append(f"--dtype {self.dtype}")
        if self.amp:
            bits.append(f"--amp {self.amp}")
        return " ".join(bits) or self.target

    def label_vs(self, a: Side, vs_sets: list[str] | None) -> str:
        """B as "what changed from A" when both build the same TARGET."""
        if self.target != a.target or self.config != a.config:
            return self.label()
        bits = ["A"]
        if self.init != a.init:
            bits.append(f"--init {self.init}")
        bits += [f"--set {s}" for s in vs_sets or ()]
        if (self.dtype, self.amp) != (a.dtype, a.amp):
            bits.append(f"--dtype {self.dtype or 'model'}" if self.dtype or not self.amp else "")
            bits.append(f"--amp {self.amp}" if self.amp else "")
        return " ".join(b for b in bits if b)


def side_a(
    target: str, config: Path | None, init: str | None, sets: list[str] | None, shared: Settings
) -> Side:
    """A: the target with the shared settings' precision."""
    return Side("a", target, config, init, tuple(sets or ()), shared.dtype, shared.amp)


def side_b(
    a: Side,
    *,
    target: str | None,
    config: Path | None,
    init: str | None,
    sets: list[str] | None,
    dtype: str | None,
    amp: str | None,
) -> Side:
    """B inherits everything from A except what a --vs-* option (or TARGET B) changes.
    A --vs-amp alone runs B with the model's own weights (no inherited --dtype), and a
    --vs-dtype alone drops an inherited --amp: autocast and a cast do not combine."""
    b_dtype, b_amp = a.dtype, a.amp
    if dtype is not None or amp is not None:
        b_dtype = ROWS["dtype"].validate(dtype, "--vs-dtype")
        b_amp = ROWS["amp"].validate(amp, "--vs-amp")
    return Side(
        tag="b",
        target=target or a.target,
        # A's --config goes with A's bare checkpoint: a B that carries its own architecture
        # (a config, a folder, module:callable) is built from that, not refused for it
        config=config or (a.config if target is None or _bare(target) else None),
        init=init or a.init,
        sets=a.sets + tuple(sets or ()),
        dtype=b_dtype,
        amp=b_amp,
    )


def _bare(target: str) -> bool:
    return target.lower().endswith(".safetensors")


def check_precision(side: Side) -> None:
    if side.dtype not in (None, "fp32") and side.amp is not None:
        flag = "--dtype/--amp" if side.tag == "a" else "--vs-dtype/--vs-amp"
        raise c.fail(f"{flag} together: autocast runs fp32 weights (drop the dtype)")
