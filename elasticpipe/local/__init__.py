"""One host: ``LocalCluster`` (real processes on loopback) and ``LocalPipeline`` (the
single-process reference).

* ``cluster``: ``LocalCluster``: a coordinator and N stage servers as separate processes on
  loopback.
* ``reference``: ``LocalPipeline``: the single-process reference, with the semantics of
  ``Pipeline``.
* ``etcd``: ``LocalEtcd``: etcd members on loopback (a store for standby coordinators).
* ``ports``: ``free_port``.
"""

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.local.reference import LocalPipeline

__all__ = ["LocalCluster", "LocalPipeline"]
