"""`--steps N`: the first optimizer steps after the step-0 profile (`loop`) and the figures
derived from them (`derived`, no torch)."""
