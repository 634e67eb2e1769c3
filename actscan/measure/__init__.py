"""Measuring one pass: the inputs to feed (`inputs`, `model_inputs`), the one owner of hooks
(`hooks`), the hooks that reduce on the device (`recorder`, `attention`) and the per-module
statistics built from them (`stats`, `streams`, `tokens`, `moments`)."""
