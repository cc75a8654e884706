"""The data plane: a stage server holding a slice of layers, with forward/backward RPCs."""
