"""ElasticPipe: pipeline model parallelism over gRPC that re-partitions while it trains.

The facade: ``from elasticpipe import Pipeline, Admin, LocalCluster, LocalPipeline``. Imports are
lazy so that ``import elasticpipe`` stays light and the core modules never import the services.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticpipe.client.admin import Admin
    from elasticpipe.client.pipeline import Pipeline, StepStats
    from elasticpipe.local.cluster import LocalCluster
    from elasticpipe.local.reference import LocalPipeline
    from elasticpipe.partition import Partition
    from elasticpipe.security.tls import TLS

__all__ = ["TLS", "Admin", "LocalCluster", "LocalPipeline", "Partition", "Pipeline", "StepStats"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("Pipeline", "StepStats"):
        from elasticpipe.client import pipeline

        return getattr(pipeline, name)
    if name == "Admin":
        from elasticpipe.client.admin import Admin

        return Admin
    if name == "TLS":
        from elasticpipe.security.tls import TLS

        return TLS
    if name == "Partition":
        from elasticpipe.partition import Partition

        return Partition
    if name == "LocalPipeline":
        from elasticpipe.local.reference import LocalPipeline

        return LocalPipeline
    if name == "LocalCluster":
        from elasticpipe.local.cluster import LocalCluster

        return LocalCluster
    raise AttributeError(f"module 'elasticpipe' has no attribute {name!r}")
