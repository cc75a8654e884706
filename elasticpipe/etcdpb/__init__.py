"""etcd's v3 API (KV, Watch, Lease, Maintenance.Status): generated from the trimmed copies of
etcd's own protos in ``proto/elasticpipe/etcdpb/`` by ``proto/generate.py``; never edit by hand.
Used only by ``coordinator.store.etcd``.
"""
