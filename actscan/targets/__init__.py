"""TARGET → (nn.Module, ModelInfo, input source): see resolve.resolve()."""
