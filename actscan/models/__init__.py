"""The built-in model family, actscan-gpt: its config (`arch`) and its `nn.Module` (`gpt`)."""
