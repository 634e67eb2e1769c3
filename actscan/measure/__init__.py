"""Measuring one pass: inputs to feed, the model's layout (`structure`), the hooks that
record on the device (`recorder`) and the per-module statistics built from them (`stats`)."""
