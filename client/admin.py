"""``Admin``: the typed client of the coordinator's admin RPCs, one method per RPC.

::

    from elasticpipe import Admin

    with Admin("10.0.0.1:7000", tls=TLS("admin.pem", "admin.key", "ca.pem")) as admin:
        status = admin.status()
        print(status.partition.boundaries, [s.name for s in status.chain])
        admin.set_partition([0, 4, 8, 12])
        admin.slowdown("host-3", 2.0)

Every answer is a frozen dataclass that mirrors its protobuf message field for field, in
the message's order (``document(answer)`` is what ``elasticpipe admin ... --json`` prints);
repeated fields are tuples, and an optional field that is not set (a step time
before profiling) is None. Failures raise the SDK's errors (``elasticpipe.errors``): an
unreachable coordinator is ``CoordinatorUnavailable``, a refused request ``InvalidRequest``
(or ``NotReady``: no job yet), naming the bad value. TLS goes through the same ``TLS`` as the
``Pipeline``, with a certificate of the ``admin`` role.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe import traces
from elasticpipe.security.tls import TLS
from elasticpipe.transport.coordinators import Coordinators
from elasticpipe.v1 import coordinator_pb2 as pb

__all__ = [
    "Ack",
    "Admin",
    "EpochRecord",
    "Move",
    "PartitionInfo",
    "PlanReport",
    "StageInfo",
    "Status",
    "Trace",
    "document",
]

ADMIN_TIMEOUT_S = 300.0  # a move waits for its layers to be copied
GONE_STATES = ("dead", "left")

T = TypeVar("T")


def from_proto(cls: type[T], message: Message) -> T:
    """The dataclass ``cls`` with the fields of ``message`` (nested messages, repeated
    fields and unset optional scalars converted as the class's annotations say)."""
    values = {name: _field(hint, message, name) for name, hint in _fields(cls)}
    return cls(**values)


_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved annotation) of each field of a dataclass, resolved once per class."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return _FIELDS[cls]


def _field(hint: Any, message: Message, name: str) -> Any:
    value = getattr(message, name)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:  # repeated: tuple[X, ...]
        element = args[0]
        if dataclasses.is_dataclass(element):
            return tuple(from_proto(element, v) for v in value)  # type: ignore[arg-type]
        return tuple(value)
    if isinstance(hint, types.UnionType):  # optional scalar: X | None
        return value if message.HasField(name) else None
    if dataclasses.is_dataclass(hint):
        return from_proto(hint, value)  # type: ignore[arg-type]
    return value


def document(answer: Any) -> Any:
    """The JSON form of an answer (what ``elasticpipe admin ... --json`` prints): every
    field, tuples as lists, an unset optional as None."""
    if dataclasses.is_dataclass(answer) and not isinstance(answer, type):
        return {f.name: document(getattr(answer, f.name)) for f in dataclasses.fields(answer)}
    if isinstance(answer, tuple | list):
        return [document(v) for v in answer]
    return answer


# ---- the answers ---------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionInfo:
    """Which stages own which layers in one epoch (the wire's ``Partition``).

    Stage ``s`` of the chain (``stage_ids[s]`` at ``addresses[s]``) owns layers
    ``[boundaries[s], boundaries[s + 1])``; ``predicted_step_s`` is the planner's seconds
    per step (None until the stages are profiled). A job of several replicas lists each
    replica's partition in ``replicas`` and its share of the micro-batches in ``shares``;
    the fields above are then replica 0's.
    """

    epoch: int
    job_id: str
    boundaries: tuple[int, ...]
    stage_ids: tuple[str, ...]
    addresses: tuple[str, ...]
    predicted_step_s: float | None
    restored_step: int
    restore_epoch: int
    replicas: tuple[PartitionInfo, ...]
    shares: tuple[int, ...]


@dataclass(frozen=True)
class StageInfo:
    """One incarnation of a stage, as the coordinator last heard of it.

    ``state`` is ``chain`` (holds layers ``layer_lo:layer_hi``, place ``index``), ``spare``,
    ``drained``, ``dead`` or ``left``; ``speed`` is relative to the job's profile (0 while
    unknown); ``slowdown`` the emulated factor; ``memory_bytes`` what it offers (0: unknown);
    ``replica`` the replica whose chain it is in (-1: none); ``pinned_replica`` the replica
    name it is pinned to (``stage --replica``; "": none).
    """

    stage_id: str
    name: str
    address: str
    device: str
    speed: float
    alive: bool
    last_heartbeat_unix: float
    index: int
    layer_lo: int
    layer_hi: int
    committed_step: int
    slowdown: float
    state: str
    incarnation: int
    memory_bytes: int
    replica: int
    pinned_replica: str


@dataclass(frozen=True)
class EpochRecord:
    """One partition change of a job: its kind (start, move, scale-out, recovery, restore,
    attach, abandoned), what moved, how long training paused, and why. ``pause_s`` is the
    stages' pause (frozen to committed); ``loop_pause_s`` what the training loop lost, as its
    client reported (0 until it did, and for changes no step ran into)."""

    epoch: int
    at_unix: float
    reason: str
    boundaries: tuple[int, ...]
    layers_moved: int
    bytes_moved: int
    pause_s: float
    kind: str
    stages: tuple[str, ...]
    restored_step: int
    lost_steps: int
    job_id: str
    detected_unix: float
    loop_pause_s: float


@dataclass(frozen=True)
class Status:
    """The cluster: every stage incarnation, the job's partition, its epoch history."""

    stages: tuple[StageInfo, ...]
    partition: PartitionInfo
    history: tuple[EpochRecord, ...]
    job_model: str
    num_layers: int
    auto_rebalance: bool
    job_id: str
    client: str
    committed_step: int
    job_failure: str
    factory_file: str
    factory_sha256: str
    efficiency: float
    efficiency_step: int
    leader: str  # the coordinator that answered: the leader
    term: int  # its term (0: no election, a SQLite store)

    @property
    def chain(self) -> list[StageInfo]:
        """The stages that hold layers, in chain order (replica after replica)."""
        chain = (s for s in self.stages if s.state == "chain")
        return sorted(chain, key=lambda s: (s.replica, s.index))

    @property
    def alive(self) -> list[StageInfo]:
        """The live incarnations (chain, spare or drained)."""
        return [s for s in self.stages if s.alive]

    def stage(self, name: str) -> StageInfo:
        """The live incarnation named ``name`` (or with that id), else the newest gone one.

        Raises:
            InvalidRequest: no stage of that name or id ever registered.
        """
        rows = [s for s in self.stages if name in (s.name, s.stage_id)]
        if not rows:
            raise InvalidRequest(f"no stage named {name!r} in the status")
        return max(rows, key=lambda s: (s.state not in GONE_STATES, s.incarnation))


@dataclass(frozen=True)
class LayoutCandidate:
    """A layout the planner considered for ``replicas="auto"`` (``PlanReport.layouts``):
    each replica's cuts and stages (a proposal, epoch 0), the shares, and its predicted
    step (the slowest replica's plus the reduction's ``reduce_s`` and the part outside the
    pipelines, ``per_step_s``; unit-less costs until the stages are profiled,
    ``in_seconds`` false)."""

    replicas: tuple[PartitionInfo, ...]
    shares: tuple[int, ...]
    step_s: float
    reduce_s: float
    in_seconds: bool
    per_step_s: float = 0.0


@dataclass(frozen=True)
class PlanReport:
    """The current partition beside the planner's optimum for the measured speeds."""

    current: PartitionInfo
    optimal_boundaries: tuple[int, ...]
    current_step_s: float | None
    optimal_step_s: float | None
    stage_speeds: tuple[float, ...]
    layer_costs: tuple[float, ...]
    bytes_to_move: int
    stage_names: tuple[str, ...]
    # per stage: (max - min) / median of its live speed over its last heartbeats
    stage_speed_spreads: tuple[float, ...] = ()
    # what replicas="auto" would choose over the job's stages and spares, fastest first
    layouts: tuple[LayoutCandidate, ...] = ()
    # bytes/s reductions are planned at (--link-bandwidth, else the stages' measured
    # median); 0: neither known, and reductions count as free
    reduce_bytes_per_s: float = 0.0
    # seconds added per pipeline slot to a layout's predicted step (chains' measured
    # overhead beyond the planner's model, median); 0 before any was measured
    slot_overhead_s: float = 0.0
    # seconds added once per step besides the optimizer steps (what stages waited between
    # runs beyond them: fan-out, commit, the client's loop, median); 0 before measured
    step_overhead_s: float = 0.0
    # parameter bytes/s optimizer steps are planned at (the stages' measured median); 0:
    # not measured, and optimizer steps count as free
    optimizer_bytes_per_s: float = 0.0

    @property
    def gain(self) -> float | None:
        """The fraction of step time the optimum would save (None until profiled)."""
        if self.current_step_s is None or self.optimal_step_s is None:
            return None
        return 1 - self.optimal_step_s / self.current_step_s if self.current_step_s else 0.0


@dataclass(frozen=True)
class Move:
    """The outcome of a rebalance, set-partition, drain or undrain (or what a dry run
    would do): ``changed`` says whether layers moved, ``decision`` why or why not."""

    changed: bool
    partition: PartitionInfo
    decision: str
    predicted_gain: float
    bytes_moved: int
    pause_s: float
    target: PartitionInfo


@dataclass(frozen=True)
class Ack:
    """A lever's answer (slowdown, auto, forget): what the coordinator did."""

    message: str


@dataclass(frozen=True)
class Trace:
    """The spans of the last steps of every stage in the chain, clock-aligned, with the
    per-step figures (``admin trace``); ``chrome()`` is the Chrome/Perfetto trace."""

    job_id: str
    stages: tuple[traces.StageTrace, ...]
    figures: tuple[traces.StepFigure, ...]

    def chrome(self) -> dict[str, Any]:
        """The Chrome trace-event document (open in Perfetto or chrome://tracing)."""
        return traces.chrome_trace(self.stages)

    def summary(self) -> dict[str, Any]:
        """Per stage, per training step, and the inference runs apart (``--json``)."""
        return traces.summary(self.stages, self.figures)

    def draw(self, png: str) -> None:
        """Draws the timeline of the steps to ``png`` (needs matplotlib)."""
        from elasticpipe.observe import timeline

        timeline.draw(self.stages, self.figures, png, title=f"job {self.job_id}")


# ---- the client -------------------------------------------------------------------------


def _cuts(boundaries: Sequence[int], what: str) -> list[int]:
    """``boundaries`` as ints (cuts of a partition), checked before any call.

    Raises:
        InvalidRequest: empty, or not non-negative layer numbers (naming ``what``).
    """
    try:
        cuts = [operator.index(b) for b in boundaries]
    except TypeError:
        cuts = []
    if not cuts or len(cuts) != len(boundaries) or any(b < 0 for b in cuts):
        raise InvalidRequest(f"{what} must be non-negative layer numbers, got {list(boundaries)!r}")
    return cuts


class Admin:
    """A connection to a coordinator's admin RPCs; close it (or use ``with``) when done.

    Args:
        coordinator: HOST:PORT of the coordinator; with standby coordinators every one's
            (``"a:7100,b:7100"`` or a list): calls follow the one that leads.
        tls: mutual TLS material with a certificate of the ``admin`` role (None: plaintext).
        timeout: seconds each call may take (a move waits for its layers to be copied).
    """

    def __init__(
        self,
        coordinator: str | Sequence[str],
        tls: TLS | None = None,
        timeout: float = ADMIN_TIMEOUT_S,
    ) -> None:
        if timeout <= 0:
            raise InvalidRequest(f"timeout must be positive, got {timeout}")
        self._coordinators = Coordinators(coordinator, tls)
        self.coordinator = str(self._coordinators)  # every address given, comma-separated
        self.tls = tls
        self.timeout = timeout

    def close(self) -> None:
        """Closes the channels."""
        self._coordinators.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Message, timeout: float | None = None, **kw: Any) -> Any:
        deadline = self.timeout if timeout is None else timeout
        once = method not in ("Status", "Plan")  # a command: never sent twice
        return self._coordinators.call(method, request, deadline, once=once, **kw)

    # ---- views ---------------------------------------------------------------------

    def status(
        self, all_jobs: bool = False, timeout: float | None = None, wait: bool = False
    ) -> Status:
        """The stages, the partition and the epoch history (of every job with
        ``all_jobs``); with ``wait``, waits up to ``timeout`` for the coordinator to be
        reachable (a restarted one's channel may still be backing off)."""
        request = pb.StatusRequest(all_jobs=all_jobs)
        return from_proto(Status, self._call("Status", request, timeout, wait_for_ready=wait))

    def plan(self) -> PlanReport:
        """The current partition and the optimal one for the measured speeds."""
        return from_proto(PlanReport, self._call("Plan", pb.PlanRequest()))

    def trace(self, steps: int = 1) -> Trace:
        """The spans of the last ``steps`` steps of every stage in the chain.

        Raises:
            InvalidRequest: ``steps`` outside ``[1, MAX_STEPS]``, or no job is running.
        """
        if not 1 <= steps <= traces.MAX_STEPS:
            raise InvalidRequest(f"steps must be in [1, {traces.MAX_STEPS}] (got {steps})")
        status = self.status()
        collected = traces.collect(status.stages, steps, self.tls, self.timeout)
        figures = traces.step_figures(collected)
        return Trace(status.job_id, tuple(collected), tuple(figures))

    # ---- levers --------------------------------------------------------------------

    def rebalance(self, dry_run: bool = False, reason: str = "admin rebalance") -> Move:
        """Moves to the optimal partition if the planner predicts a gain (with
        ``dry_run``, only says what it would do)."""
        request = pb.RebalanceRequest(dry_run=dry_run, reason=reason)
        return from_proto(Move, self._call("Rebalance", request))

    def set_partition(self, boundaries: Sequence[int], stages: Iterable[str] = ()) -> Move:
        """Moves to ``boundaries`` (``S + 1`` cuts, ``0`` to the layer count), optionally
        with a new chain order (``stages``: names or ids)."""
        if isinstance(stages, str):
            raise InvalidRequest(
                f"stages must be a list of names or ids, got the string {stages!r}"
            )
        cuts = _cuts(boundaries, "boundaries")
        request = pb.SetPartitionRequest(boundaries=cuts, stage_ids=list(stages))
        return from_proto(Move, self._call("SetPartition", request))

    def set_layout(
        self,
        replicas: Sequence[Sequence[int]],
        stages: Sequence[Sequence[str]] = (),
        shares: Sequence[int] = (),
    ) -> Move:
        """Moves the job to your own replicas: per replica its cuts (``[0, 3, 7]``) and,
        optionally, its stages in chain order (names or ids; leave a replica's empty to
        keep its stages), and optionally the shares (micro-batches per replica; default:
        planned from the stages' speeds). One replica turns a job of several into one
        pipeline; more replicas than now form new ones from the named stages."""
        if isinstance(stages, str) or any(isinstance(s, str) for s in stages):
            raise InvalidRequest(
                f"stages must be one list of names or ids per replica, got {stages!r}"
            )
        if len(stages) > len(replicas):
            raise InvalidRequest(
                f"stages names {len(stages)} replicas, replicas gives {len(replicas)}"
            )
        specs = []
        for r, cuts in enumerate(replicas):
            ints = _cuts(cuts, f"replica {r}'s boundaries")
            names = list(stages[r]) if r < len(stages) else []
            specs.append(pb.ReplicaSpec(boundaries=ints, stage_ids=names))
        try:
            counts = [operator.index(m) for m in shares]
        except TypeError:
            counts = [-1]
        if any(m < 0 for m in counts):
            raise InvalidRequest(f"shares must be micro-batch counts >= 0, got {list(shares)!r}")
        request = pb.SetLayoutRequest(replicas=specs, shares=counts)
        return from_proto(Move, self._call("SetLayout", request))

    def drain(self, stage: str) -> Move:
        """Moves the layers off ``stage`` (a name or id) and keeps it out of the chain."""
        return from_proto(Move, self._call("Drain", pb.DrainRequest(stage=stage)))

    def undrain(self, stage: str) -> Move:
        """Lets a drained ``stage`` back in (a spare; the planner may take it in)."""
        return from_proto(Move, self._call("Undrain", pb.DrainRequest(stage=stage)))

    def slowdown(self, stage: str, factor: float) -> Ack:
        """Emulates a device ``factor`` times slower on ``stage`` (1: none)."""
        request = pb.AdminSlowdownRequest(stage=stage, factor=factor)
        return from_proto(Ack, self._call("Slowdown", request))

    def auto(self, enabled: bool) -> Ack:
        """Turns automatic rebalancing on or off."""
        request = pb.AutoRebalanceRequest(enabled=enabled)
        return from_proto(Ack, self._call("SetAutoRebalance", request))

    def forget(self, stage: str) -> Ack:
        """Removes the gone (dead or left) incarnations of ``stage``."""
        return from_proto(Ack, self._call("Forget", pb.DrainRequest(stage=stage)))
