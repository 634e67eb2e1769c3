"""Shared fixtures: tiny built-in models, offline Hugging Face, deterministic threads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# Tiny models are dominated by threading overhead on a shared 2-core machine.
torch.set_num_threads(1)
