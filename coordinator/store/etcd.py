"""The coordinator's durable state in an etcd v3 cluster (``--store etcd://HOST:PORT,...``).

Keys under one prefix (default ``/elasticpipe``), values JSON:

    PREFIX/stage/<stage_id>     a StageRow and its ``forgotten`` flag
    PREFIX/incarnation/<name in hex>/<n:010d>  the stage id of incarnation n of a name
    PREFIX/kv/<name>            a named value (job, lease, partition, epoch_change, ...)
    PREFIX/epoch/<epoch:016d>   an EpochRow (zero-padded: key order is epoch order)

The commit point of an epoch change is one etcd ``Txn``. A read-modify-write (a stage's
flags, a loop pause) is a ``Txn`` conditioned on the key's ``mod_revision``, retried when
another writer came first. The client speaks etcd's own gRPC API through stubs generated
from etcd's protos (``elasticpipe.etcdpb``); a call that finds a member unreachable goes
to the next one, so that losing one member of three changes nothing.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from elasticpipe.coordinator.store.base import STAGE_FLAGS, Store
from elasticpipe.coordinator.store.rows import EpochRow, StageRow, latest_epochs
from elasticpipe.errors import (
    CommitOutcomeUnknown,
    ElasticPipeError,
    InvalidRequest,
    NotLeader,
    Unavailable,
)
from elasticpipe.etcdpb import rpc_pb2 as pb
from elasticpipe.etcdpb import rpc_pb2_grpc as pb_grpc
from elasticpipe.partition import Partition
from elasticpipe.transport.serving import check_dial_address

DEFAULT_PREFIX = "/elasticpipe"
CALL_TIMEOUT_S = 5.0  # one etcd request, per member tried
RETRY_FOR_S = 10.0  # passes over the members before a call gives up
MIN_ATTEMPT_S = 0.2  # the shortest timeout a try gets, however little time is left
COMMIT_READBACK_S = 120.0  # reading back a commit whose reply was lost
EPOCH_PAGE = 500  # history rows per Range
INCARNATION_DIGITS = 10  # an incarnation number in its index key, zero-padded
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
T = TypeVar("T")


class Leadership(Protocol):
    """What a fenced store needs of a won election (``election.Election``)."""

    @property
    def address(self) -> str: ...

    @property
    def key(self) -> bytes: ...

    @property
    def term(self) -> int: ...  # 0: not leading


def created_at(key: bytes, revision: int) -> pb.Compare:
    """The condition that ``key`` is the one created at ``revision`` (0: it is absent). A
    leader key created at a leader's term is that leader's."""
    return pb.Compare(
        key=key, target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=revision
    )


@dataclass(frozen=True)
class EtcdTLS:
    """TLS to etcd: the CA that signed the members' certificates, and this client's
    certificate and key where the members ask for one (``--client-cert-auth``)."""

    ca: str
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidRequest(
                f"TLS to etcd takes a client certificate and its key together (got cert "
                f"{self.cert!r}, key {self.key!r})"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials (the files read now).

        Raises:
            InvalidRequest: a file that cannot be read (named).
        """

        def read(path: str, what: str) -> bytes:
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise InvalidRequest(f"cannot read the etcd {what} {path!r}: {exc}") from exc

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca, "CA certificate"),
            private_key=read(self.key, "client key") if self.key else None,
            certificate_chain=read(self.cert, "client certificate") if self.cert else None,
        )


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """``etcd://h1:p1,h2:p2/prefix`` as (endpoints, prefix); the prefix defaults to
    ``/elasticpipe``. Raises InvalidRequest naming the bad part."""
    if not url.startswith("etcd://"):
        raise InvalidRequest(
            f"an etcd store is etcd://HOST:PORT[,HOST:PORT...][/PREFIX], not {url!r}"
        )
    rest = url[len("etcd://") :]
    hosts, _, prefix = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    if not endpoints:
        raise InvalidRequest(f"etcd store {url!r} names no HOST:PORT")
    for endpoint in endpoints:
        check_dial_address(endpoint, "etcd endpoint")
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX
    return endpoints, prefix


def _range_end(prefix: bytes) -> bytes:
    """The end of etcd's range covering every key that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdStore(Store):
    """Thread-safe access to the control state in etcd."""

    def __init__(
        self, endpoints: Sequence[str], prefix: str = DEFAULT_PREFIX, tls: EtcdTLS | None = None
    ):
        self.endpoints = list(endpoints)
        self.prefix = prefix.rstrip("/")
        self._lock = threading.Lock()
        if tls is None:
            self._channels = [grpc.insecure_channel(e) for e in self.endpoints]
        else:
            credentials = tls.credentials()
            self._channels = [grpc.secure_channel(e, credentials) for e in self.endpoints]
        self._current = 0  # the member that answered last
        self._leadership: Leadership | None = None  # writes conditioned on it (fence_with)

    @classmethod
    def from_url(cls, url: str, tls: EtcdTLS | None = None) -> EtcdStore:
        """An EtcdStore for ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (over TLS with
        ``tls``)."""
        endpoints, prefix = parse_etcd_url(url)
        return cls(endpoints, prefix, tls)

    def close(self) -> None:
        """Closes the connections."""
        for channel in self._channels:
            channel.close()

    # ---- calls -------------------------------------------------------------------------

    def call(
        self,
        do: Callable[[grpc.Channel, float], T],
        retry_for_s: float | None = None,
        attempt_s: float = CALL_TIMEOUT_S,
    ) -> T:
        """``do(channel, timeout)`` on the member that answered last, then on each other
        one in turn, in passes with a growing pause until ``retry_for_s`` (default
        ``RETRY_FOR_S``) has gone by: an etcd leader election leaves every member
        unavailable for a moment. Each try's timeout is ``attempt_s``, cut to the time
        left. Unavailable naming the members when none answered; an error etcd gives for
        the request itself is an ElasticPipeError naming etcd's status (the gRPC error is
        its ``__cause__``)."""
        retry_for_s = RETRY_FOR_S if retry_for_s is None else retry_for_s
        first = self._current
        deadline = time.monotonic() + retry_for_s
        pause = 0.05
        while True:
            error: grpc.RpcError | None = None
            for step in range(len(self._channels)):
                index = (first + step) % len(self._channels)
                timeout = min(attempt_s, max(MIN_ATTEMPT_S, deadline - time.monotonic()))
                try:
                    result = do(self._channels[index], timeout)
                except grpc.RpcError as exc:
                    if exc.code() not in _RETRIED:
                        raise ElasticPipeError(
                            f"etcd store at {self.endpoints[index]} refused a request "
                            f"({exc.code().name}: {exc.details()})"
                        ) from exc
                    error = exc
                    continue
                self._current = index
                return result
            assert error is not None
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"etcd store: no member of {','.join(self.endpoints)} answered "
                    f"within {retry_for_s:g} s ({error.code().name}: {error.details()})"
                ) from error
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)

    def range(self, key: bytes, prefix: bool = False, **options: Any) -> pb.RangeResponse:
        """etcd's Range of ``key`` (every key under it if ``prefix``), retried by ``call``."""
        options.setdefault("range_end", _range_end(key) if prefix else b"")
        request = pb.RangeRequest(key=key, **options)
        return self.call(lambda ch, timeout: pb_grpc.KVStub(ch).Range(request, timeout=timeout))

    def txn(self, request: pb.TxnRequest) -> pb.TxnResponse:
        """etcd's Txn, unfenced (``_write`` fences), retried by ``call``."""
        return self.call(lambda ch, timeout: pb_grpc.KVStub(ch).Txn(request, timeout=timeout))

    def fenced(self, leadership: Leadership) -> EtcdStore:
        """A view of this store (the same connections) whose writes are conditioned on
        ``leadership``: each won leadership writes through a view of its own, so that
        whatever is left of an earlier one can never write under a later one."""
        view = copy.copy(self)
        view._leadership = leadership
        return view

    def fence_with(self, leadership: Leadership | None) -> None:
        """Conditions every later write on ``leadership`` (a won ``Election``): a write
        after it ended raises NotLeader and changes nothing."""
        self._leadership = leadership

    def _write(self, request: pb.TxnRequest) -> pb.TxnResponse:
        """A write, conditioned on this store's leadership if it is fenced with one."""
        lead = self._leadership
        if lead is None:
            return self.txn(request)
        term = lead.term  # read once: the renewer may set it to 0 meanwhile
        if term == 0:
            raise NotLeader(f"{lead.address} no longer leads {self.prefix}: nothing written")
        request.compare.append(created_at(lead.key, term))
        answer = self.txn(request)
        if not answer.succeeded:
            found = self.range(lead.key).kvs
            if not found or found[0].create_revision != term:
                raise NotLeader(
                    f"{lead.address} (term {term}) was deposed at {self.prefix}: nothing written"
                )
        return answer

    def _get_json(self, key: bytes) -> tuple[Any, int]:
        """The value at ``key`` and its mod_revision (None, 0 if absent)."""
        found = self.range(key).kvs
        return (json.loads(found[0].value), found[0].mod_revision) if found else (None, 0)

    def _update(self, key: bytes, change: Callable[[Any], Any]) -> Any:
        """Writes ``change(old)`` at ``key`` unless another writer changed it in between
        (then reads again); a None from ``change`` writes nothing. Returns what it wrote."""
        while True:
            old, revision = self._get_json(key)
            new = change(old)
            if new is None:
                return None
            guard = pb.Compare(
                key=key, target=pb.Compare.MOD, result=pb.Compare.EQUAL, mod_revision=revision
            )
            request = pb.TxnRequest(compare=[guard], success=[_put_op(key, new)])
            if self._write(request).succeeded:
                return new

    # ---- keys --------------------------------------------------------------------------

    def _incarnation_key(self, name: str, incarnation: int) -> bytes:
        """The (name, incarnation) index key: the name in hex (no '/' to blur a prefix),
        the number zero-padded (key order is number order)."""
        return (
            f"{self.prefix}/incarnation/{name.encode().hex()}/"
            f"{incarnation:0{INCARNATION_DIGITS}d}".encode()
        )

    def _stage_key(self, stage_id: str) -> bytes:
        return f"{self.prefix}/stage/{stage_id}".encode()

    def _kv_key(self, name: str) -> bytes:
        return f"{self.prefix}/kv/{name}".encode()

    def _epoch_key(self, epoch: int) -> bytes:
        return f"{self.prefix}/epoch/{epoch:016d}".encode()

    # ---- stages --------------------------------------------------------------------

    def _stage_records(self) -> list[dict[str, Any]]:
        found = self.range(f"{self.prefix}/stage/".encode(), prefix=True).kvs
        return [json.loads(kv.value) for kv in found]

    def add_stage(self, row: StageRow) -> None:
        """Records a new incarnation: its record and its (name, incarnation) key, both
        new, in one ``Txn`` (the same row again, a write retried: no change)."""
        key = self._stage_key(row.stage_id)
        named = self._incarnation_key(row.name, row.incarnation)
        record = {**asdict(row), "forgotten": False}
        with self._lock:
            written = self._write(
                pb.TxnRequest(
                    compare=[created_at(key, 0), created_at(named, 0)],
                    success=[_put_op(key, record), _put_op(named, row.stage_id)],
                )
            )
            if written.succeeded:
                return
            found = self._get_json(key)[0]
            if found == record:
                return  # a retried Txn whose first try was applied, or the same row again
            if found is not None:
                raise ValueError(f"stage id {row.stage_id!r} exists")
            raise ValueError(f"stage {row.name!r} incarnation {row.incarnation} exists")

    def set_stage(self, stage_id: str, **flags: bool) -> None:
        """Sets ``drained``, ``leaving``, ``left``, ``dead`` or ``forgotten`` of an
        incarnation (an unknown id: nothing)."""
        for name in flags:
            if name not in STAGE_FLAGS:
                raise ValueError(f"unknown stage flag {name!r}")

        def change(old: Any) -> Any:
            return None if old is None else {**old, **{k: bool(v) for k, v in flags.items()}}

        with self._lock:
            self._update(self._stage_key(stage_id), change)

    def stages(self) -> list[StageRow]:
        """Every incarnation not forgotten, in registration order."""
        with self._lock:
            records = [r for r in self._stage_records() if not r.pop("forgotten", False)]
        rows = [StageRow(**r) for r in records]
        return sorted(rows, key=lambda r: (r.registered_at, r.name))

    def max_incarnation(self, name: str) -> int:
        """The latest incarnation number of a stage name (0: never registered): one read
        of the name's newest index key; only a name without any (a new name, or stages
        registered before the index existed) reads every record."""
        start = self._incarnation_key(name, 0)[:-INCARNATION_DIGITS]
        with self._lock:
            newest = self.range(
                start,
                prefix=True,
                limit=1,
                sort_order=pb.RangeRequest.DESCEND,
                sort_target=pb.RangeRequest.KEY,
            ).kvs
            if newest:
                return int(newest[0].key[-INCARNATION_DIGITS:])
            numbers = [r["incarnation"] for r in self._stage_records() if r["name"] == name]
        return max(numbers, default=0)

    # ---- named values ------------------------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        """Stores a JSON-able value."""
        with self._lock:
            self._write(pb.TxnRequest(success=[_put_op(self._kv_key(key), value)]))

    def get(self, key: str) -> Any:
        """A stored value, or None."""
        with self._lock:
            return self._get_json(self._kv_key(key))[0]

    def delete(self, key: str) -> None:
        """Removes a stored value."""
        op = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=self._kv_key(key)))
        with self._lock:
            self._write(pb.TxnRequest(success=[op]))

    def commit_change(
        self, partition: Partition, change: dict[str, Any], row: EpochRow | None = None
    ) -> None:
        """The commit point of an epoch change: the new partition, the change's
        "committed" record and its history row, written in one etcd transaction."""
        with self._lock:
            layout = self._kv_key("layout")
            ops = [
                _put_op(self._kv_key("partition"), partition.to_json()),
                # a job of several replicas: all of them, beside replica 0's partition
                _put_op(layout, change["layout"])
                if change.get("layout")
                else pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=layout)),
                _put_op(self._kv_key("epoch_change"), {**change, "phase": "committed"}),
            ]
            if row is not None:
                ops.append(self._epoch_op(row))
            try:
                self._write(pb.TxnRequest(success=ops))
            except NotLeader:
                raise  # nothing was written
            except ElasticPipeError as exc:
                # The Txn may have been applied although no answer came back: the store
                # decides, not the lost reply. Raises CommitOutcomeUnknown if it cannot.
                if not self._holds_commit(change["epoch"], exc):
                    raise

    def _holds_commit(self, epoch: int, error: ElasticPipeError) -> bool:
        """Whether the store says the change to ``epoch`` is committed, after a commit
        whose reply was lost. Reads until a member answers (the stages, prepared, wait for
        this outcome anyway), for up to ``COMMIT_READBACK_S``; CommitOutcomeUnknown after."""
        deadline = time.monotonic() + COMMIT_READBACK_S
        while True:
            try:
                stored = self._get_json(self._kv_key("epoch_change"))[0]
            except Unavailable as exc:
                if time.monotonic() >= deadline:
                    raise CommitOutcomeUnknown(
                        f"the commit of epoch {epoch} got no answer ({error}), and reading "
                        f"it back failed for {COMMIT_READBACK_S:g} s ({exc}): the store may "
                        "or may not hold it"
                    ) from error
                continue
            return (
                bool(stored) and stored.get("epoch") == epoch and stored.get("phase") == "committed"
            )

    # ---- history -----------------------------------------------------------------------

    def _epoch_op(self, row: EpochRow) -> pb.RequestOp:
        if not row.loop_pause_s:  # a row rewritten after its commit keeps what the loop saw
            old = self._get_json(self._epoch_key(row.epoch))[0]
            if old is not None and old.get("loop_pause_s"):
                row = replace(row, loop_pause_s=old["loop_pause_s"])
        if not row.at:
            row = replace(row, at=time.time())
        return _put_op(self._epoch_key(row.epoch), asdict(row))

    def add_epoch(self, row: EpochRow) -> None:
        """Records an epoch change."""
        with self._lock:
            self._write(pb.TxnRequest(success=[self._epoch_op(row)]))

    def set_loop_pause(self, job_id: str, epoch: int, pause_s: float) -> bool:
        """Records what ``job_id``'s training loop lost to the change to ``epoch``; False
        (and nothing written) if that epoch is no change of that job, or already says so."""

        def change(raw: Any) -> Any:
            if raw is None or raw.get("job_id", "") != job_id or raw.get("kind") == "abandoned":
                return None
            if raw.get("loop_pause_s") == pause_s:  # a renewal sent again: counted once
                return None
            return {**raw, "loop_pause_s": pause_s}

        with self._lock:
            return self._update(self._epoch_key(epoch), change) is not None

    def epochs(self, limit: int = 100, job_id: str | None = None) -> list[EpochRow]:
        """The most recent epoch records (of one job, if given), oldest first."""
        with self._lock:
            return latest_epochs(self._epoch_values_newest_first(), limit, job_id)

    def _epoch_values_newest_first(self) -> Iterator[bytes]:
        """The history's values, newest first, read ``EPOCH_PAGE`` keys at a time (so that
        no reply nears gRPC's message limit however long the history grows)."""
        start = f"{self.prefix}/epoch/".encode()
        end = _range_end(start)
        while True:
            found = self.range(
                start,
                range_end=end,
                limit=EPOCH_PAGE,
                sort_order=pb.RangeRequest.DESCEND,
                sort_target=pb.RangeRequest.KEY,
            )
            for kv in found.kvs:
                yield kv.value
            if not found.more or not found.kvs:
                return
            end = found.kvs[-1].key  # range_end is exclusive: the next page is older

    def max_epoch(self) -> int:
        """The highest epoch ever used (epochs never repeat, across jobs too)."""
        with self._lock:
            last = self.range(
                f"{self.prefix}/epoch/".encode(),
                prefix=True,
                limit=1,
                keys_only=True,
                sort_order=pb.RangeRequest.DESCEND,
                sort_target=pb.RangeRequest.KEY,
            ).kvs
        recorded = int(last[0].key.rsplit(b"/", 1)[1]) if last else 0
        stored = self.partition()
        attempted = self.get("epoch_attempted") or 0
        return max(recorded, stored.epoch if stored else 0, attempted)


def _put_op(key: bytes, value: Any) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=json.dumps(value).encode()))
