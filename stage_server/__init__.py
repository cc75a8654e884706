"""The data plane: a stage server holding a slice of layers, with forward/backward RPCs."""

from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import Stage, StageConfig

__all__ = ["Stage", "StageConfig", "StageServer"]
