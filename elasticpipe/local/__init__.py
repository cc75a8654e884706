"""One host: ``LocalCluster`` (real processes on loopback) and ``LocalPipeline`` (the
single-process reference).

* ``cluster``: ``LocalCluster``: a coordinator and N stage servers as separate processes on
  loopback.
* ``reference``: ``LocalPipeline``: the single-process reference, with the semantics of
  ``Pipeline``.
"""

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.local.reference import LocalPipeline

__all__ = ["LocalCluster", "LocalPipeline"]
