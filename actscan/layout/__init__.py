"""Where the residual stream is: propose a layout from the module tree (`detect`), prove it on
one pass (`proof`) and, at init, read how the forward uses each parameter (`usage`)."""
