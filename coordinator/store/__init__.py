"""The coordinator's durable state behind one interface, and where it lives.

- ``base``: ``Store``, the interface: stage incarnations, named values, the partition and its
  commit point, the epoch history.
- ``rows``: ``StageRow`` and ``EpochRow``, what every store keeps.
- ``sqlite``: ``SqliteStore``, one embedded file (``--store sqlite:PATH``, the default).
- ``etcd``: ``EtcdStore``, an etcd v3 cluster (``--store etcd://HOST:PORT,...[/PREFIX]``),
  whose writes can be fenced with a leadership (``NotLeader`` once it ended).
- ``election``: ``Election``, one coordinator leads an etcd store, the others stand by.

``open_store(url)`` picks one from its URL; a bare path (``--state PATH``) is SQLite.
"""

from elasticpipe.coordinator.store.base import Store
from elasticpipe.coordinator.store.election import Election, Leader
from elasticpipe.coordinator.store.etcd import EtcdStore, EtcdTLS
from elasticpipe.coordinator.store.rows import EpochRow, StageRow
from elasticpipe.coordinator.store.sqlite import SqliteStore
from elasticpipe.errors import InvalidRequest, NotLeader

__all__ = [
    "Election",
    "EpochRow",
    "EtcdStore",
    "EtcdTLS",
    "Leader",
    "NotLeader",
    "SqliteStore",
    "StageRow",
    "Store",
    "open_store",
]


def open_store(url: str, etcd_tls: EtcdTLS | None = None) -> Store:
    """The store named by ``url``: ``sqlite:PATH``, ``etcd://HOST:PORT[,...][/PREFIX]``
    (over TLS with ``etcd_tls``), or a bare SQLite path (``:memory:``: nothing kept)."""
    if url.startswith("etcd://"):
        return EtcdStore.from_url(url, etcd_tls)
    if etcd_tls is not None:
        raise InvalidRequest(f"TLS to etcd was given, but the store {url!r} is not etcd://")
    return SqliteStore(url.removeprefix("sqlite:"))
