"""The checks behind `actscan.diagnose.run_checks`, one module per family of pathology.

Each check is a pure function `CheckContext -> list[Finding]` (no torch, no printing):
- depth.py     sqrt-growth, exp-growth, collapse, vanishing-grad, exploding-grad
- branches.py  dead-branch
- channels.py  dead-units, outlier-channels
- numerics.py  overflow, logit-scale
- init.py      init-scale
Thresholds come from actscan.thresholds only; message wording helpers from common.py.
"""
