"""A running stage server: the gRPC service, and its registration and heartbeats."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping

from elasticpipe.errors import ElasticPipeError, NameInUse, NotReady
from elasticpipe.logs import get_logger
from elasticpipe.observe.metrics import MetricsEndpoint
from elasticpipe.security.bounds import MAX_BYTES_PER_S, MAX_NAME, MAX_TIMING_S
from elasticpipe.stage_server.bulk import BulkListener, listen_host
from elasticpipe.stage_server.callers import Grant
from elasticpipe.stage_server.protocol import Do, Effect
from elasticpipe.stage_server.service import (
    StageServicer,
    holdings_to_proto,
    state_to_proto,
    timings_to_proto,
)
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.stage_server.stage import Stage, StageConfig
from elasticpipe.transport.coordinators import Coordinators
from elasticpipe.transport.serving import (
    RunningServer,
    ServerLifecycle,
    metrics_bind_host,
    start_server,
)
from elasticpipe.transport.terms import TermFence
from elasticpipe.v1 import coordinator_pb2, stage_pb2

log = get_logger(__name__)

REGISTER_TIMEOUT_S = 5.0
SPEED_MOVED = 0.25  # a change of the layers' measured time reported at once
SPEED_POLL_S = 0.1  # how often a stage looks for such a change between heartbeats
MIN_BEAT_FRACTION = 0.25  # of the interval: the soonest a heartbeat follows another
BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 2.0  # a restarted coordinator is found again within ~3 s
QUESTION_TIMEOUT_S = 60.0
GRANT_TIMEOUT_S = 5.0  # asked on a request's path: short


class StageServer(ServerLifecycle):
    """Serves a ``Stage`` and keeps it registered with the coordinator (a context manager)."""

    def __init__(
        self,
        config: StageConfig,
        coordinator: str,
        listen: str = "127.0.0.1:0",
        on_refused: Callable[[NameInUse], None] | None = None,
    ):
        self.coordinators = Coordinators(coordinator, config.tls)
        self.coordinator = str(self.coordinators)  # every address given, comma-separated
        self.terms = TermFence()  # the highest coordinator term obeyed
        self._listen = listen
        self._config = config
        self.stage: Stage | None = None
        self._servicer: StageServicer | None = None
        self._server: RunningServer | None = None
        self.metrics: MetricsEndpoint | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stage_id = ""
        self.registered = threading.Event()
        self.refused: NameInUse | None = None  # the coordinator refused this stage's name
        self._on_refused = on_refused
        self._report_asked = False  # the coordinator wants the next step's measurements
        self._reported_s = 0.0  # the layers' time per micro-batch in the last heartbeat

    def start(self) -> StageServer:
        """Binds the port and starts registering in the background."""
        config = self._config
        metrics_on = metrics_bind_host(
            self._listen, config.metrics_port, config.metrics_listen, config.insecure
        )
        servicer = StageServicer(Stage(self._config))
        self._servicer = servicer
        self._server = start_server(
            self._listen,
            [(stage_pb2.DESCRIPTOR.services_by_name["StageService"], servicer)],
            tls=config.tls,
            insecure=config.insecure,
            advertise=config.advertise or None,
            interceptors=[servicer.stage.metrics.interceptor()],
            check=self.terms.check,
        )
        if config.metrics_port is not None:
            self.metrics = MetricsEndpoint(
                servicer.stage.metrics.registry, metrics_on, config.metrics_port
            )
        if config.bulk_port is not None:
            servicer.bulk = BulkListener(
                servicer, listen_host(self._listen), config.bulk_port, config.tls
            )
        config = StageConfig(**{**vars(self._config), "address": self._server.address})
        servicer.stage.config = config
        self.stage = servicer.stage
        self.stage.asker = self._ask
        servicer.gate.ask = self._ask_grant
        log.info(
            "stage_listening",
            name=config.name,
            address=self.address,
            bulk_port=servicer.bulk.port if servicer.bulk is not None else None,
            device=config.device,
            memory_bytes=servicer.stage.memory_bytes,
            coordinator=self.coordinator,
        )
        self._thread = threading.Thread(
            target=self._membership_loop, name="membership", daemon=True
        )
        self._thread.start()
        return self

    def leave(self, timeout: float) -> None:
        """Asks the coordinator to move this stage's layers off before it exits (SIGTERM);
        a stage holding none just says it goes, so that it counts as ``left``, not dead.

        Gives up quietly when the coordinator is gone or the time runs out: the stage
        then simply dies, and recovery replaces it.
        """
        stage = self.stage
        if stage is None or not self.stage_id:
            return
        placement = stage.placement
        if timeout <= 0 and placement is not None and placement.in_chain:
            return  # no time to move layers off: it dies, and recovery replaces it
        log.info("stage_leaving", stage_id=self.stage_id, timeout_s=timeout)
        try:
            reply = self.coordinators.call(
                "Leave",
                coordinator_pb2.LeaveRequest(stage_id=self.stage_id, timeout_s=timeout),
                timeout=timeout + 5.0,
            )
            log.info("stage_left", decision=reply.decision, epoch=reply.partition.epoch)
        except ElasticPipeError as exc:
            log.warning("stage_leave_failed", error=str(exc))

    def stop(self) -> None:
        """Stops heartbeats and the server."""
        self._stop.set()
        if self.stage is not None:
            self.stage.committed.set()  # wakes a heartbeat wait at once
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.stop()
        if self._servicer is not None and self._servicer.bulk is not None:
            self._servicer.bulk.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.stage is not None:
            self.stage.close()
        self.coordinators.close()

    # ---- membership --------------------------------------------------------------------

    def _membership_loop(self) -> None:
        backoff, interval = BACKOFF_START_S, 1.0
        attempt = 0
        while not self._stop.is_set():
            try:
                if not self.stage_id:
                    interval = self._register()
                    backoff, attempt = BACKOFF_START_S, 0
                else:
                    self._heartbeat(interval)
                self._until_next_beat(interval)
            except NameInUse as exc:  # retrying would not help: an operator must act
                log.error("stage_refused", name=self._config.name, error=str(exc))
                self.refused = exc
                if self._on_refused is not None:
                    self._on_refused(exc)
                return
            except ElasticPipeError as exc:  # a name's holder not yet decided: NotReady
                attempt += 1
                delay = backoff * (0.5 + random.random())
                held = not self.stage_id and isinstance(exc, NotReady)
                log.warning(
                    "stage_name_held" if held else "coordinator_unreachable",
                    coordinator=self.coordinators.leader,
                    attempt=attempt,
                    retry_in_s=round(delay, 2),
                    error=str(exc),
                )
                self._stop.wait(delay)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _until_next_beat(self, interval: float) -> None:
        """Waits ``interval``, or less: a step that commits after the last report took its
        figures ends the wait when the coordinator's policy asked for the next step's
        measurements, and this stage's compute per micro-batch moving by ``SPEED_MOVED`` or
        more since its last report ends it at once, in the middle of a step too where layer
        times are folded in as they come (CPU; CUDA's are read at the run's end), looked at
        every ``SPEED_POLL_S``: a straggler's first slowed step already proposes what its
        end confirms. Never sooner than ``MIN_BEAT_FRACTION`` of the interval after the
        last beat."""
        assert self.stage is not None
        committed, start = self.stage.committed, time.monotonic()
        while not self._stop.is_set():
            left = start + interval - time.monotonic()
            if left <= 0:
                return
            stepped = committed.wait(min(left, SPEED_POLL_S))
            if stepped:
                committed.clear()
            if (stepped and self._report_asked) or self._speed_moved():
                soonest = start + MIN_BEAT_FRACTION * interval - time.monotonic()
                self._stop.wait(max(0.0, soonest))
                return

    def _speed_moved(self) -> bool:
        """Whether the layers' measured time moved by ``SPEED_MOVED`` since the last report."""
        assert self.stage is not None
        now = _compute_s(self.stage.timings())
        was = self._reported_s
        return was > 0 and now > 0 and abs(now - was) >= SPEED_MOVED * was

    def _register(self) -> float:
        assert self.stage is not None
        reply = self.coordinators.call(
            "Register",
            coordinator_pb2.RegisterRequest(
                name=self._config.name,
                address=self.address,
                device=str(self.stage.device),
                memory_bytes=self.stage.memory_bytes,
                replica=self._config.replica,
            ),
            timeout=REGISTER_TIMEOUT_S,
        )
        self.stage_id = reply.stage_id
        self.stage.stage_id = reply.stage_id
        self._report_asked = False  # (an earlier incarnation's ask is not this one's)
        self.registered.set()
        log.info("stage_registered", stage_id=self.stage_id, coordinator=self.coordinators.leader)
        return reply.heartbeat_interval_s or 1.0

    def _heartbeat(self, interval: float) -> None:
        assert self.stage is not None
        stage = self.stage
        # A step that commits from here on is one this report may miss: it wakes the wait
        # for the next (``_until_next_beat``), also while this report is on its way.
        stage.committed.clear()
        timings = stage.timings()
        reply = self.coordinators.call(
            "Heartbeat",
            coordinator_pb2.HeartbeatRequest(
                stage_id=self.stage_id,
                epoch=stage.epoch,
                timings=timings_to_proto(timings),
                committed_step=stage.committed_step,
                slowdown=stage.slowdown.factor,
                state=state_to_proto(stage.state()),
                snapshots=holdings_to_proto(stage.holdings()),
                memory_bytes=stage.memory_bytes,
                replica=self._config.replica,
                # (measured figures kept within what the coordinator accepts: a figure
                # out of bounds would cost this stage its heartbeat)
                pipeline_s=min(stage.pipeline_time.at(stage.epoch), MAX_TIMING_S),
                reduce_bytes_per_s=min(stage.reduce_rate.value(), MAX_BYTES_PER_S),
                optimizer_bytes_per_s=min(stage.optimizer_rate.value(), MAX_BYTES_PER_S),
                between_runs_s=min(stage.between_runs.at(stage.epoch), MAX_TIMING_S),
            ),
            timeout=max(1.0, interval * 2),
        )
        stage.keep_from(reply.safe_step)
        stage.rendezvous = reply.rendezvous[:MAX_NAME]
        self._report_asked, self._reported_s = reply.report_after_step, _compute_s(timings)
        if reply.dead:
            stage.drop_job("the coordinator declared this incarnation dead")
        if stage.poisoned and not reply.reregister:
            # A new incarnation: the coordinator declares this one dead and recovers.
            log.warning("stage_replacing_itself", why=stage.poisoned)
            stage.poisoned = ""
            self.stage_id = ""
            return
        if reply.reregister:
            log.warning("stage_reregistering", stage_id=self.stage_id, dead=reply.dead)
            self.stage_id = ""

    def _ask_grant(self) -> Grant:
        """Asks the coordinator which client drives the job (a missed Fence)."""
        reply = self.coordinators.call(
            "JobClient",
            coordinator_pb2.JobClientRequest(stage_id=self.stage_id),
            timeout=GRANT_TIMEOUT_S,
        )
        log.info("job_client_learned", client=reply.client, holder=reply.holder)
        return Grant(reply.job_id, reply.client, reply.holder)

    def _ask(self, question: Effect) -> None:
        """Asks the coordinator what a lease that ran out left undecided, and applies it."""
        stage = self.stage
        assert stage is not None
        if question.do is Do.RESOLVE_RUN:
            reply = self.coordinators.call(
                "ResolveRun",
                coordinator_pb2.ResolveRunRequest(
                    stage_id=self.stage_id, run=question.run, step=question.step
                ),
                timeout=QUESTION_TIMEOUT_S,
            )
            log.info("run_resolution", run=question.run, decision=reply.decision)
            fence = stage.state().fence
            try:
                if reply.decision == "commit":
                    stage.commit_step(stage.epoch, question.run, question.step, fence)
                elif reply.decision == "abort":
                    stage.abort_step(question.run, "resolved by the coordinator", fence)
            except NotReady:
                pass  # the coordinator's own call settled it already
        elif question.do is Do.ASK_EPOCH:
            outcome = self.coordinators.call(
                "EpochOutcome",
                coordinator_pb2.EpochOutcomeRequest(epoch=question.epoch),
                timeout=QUESTION_TIMEOUT_S,
            ).outcome
            log.info("epoch_outcome", epoch=question.epoch, outcome=outcome)
            if outcome == "committed":
                stage.commit_epoch(question.epoch)
            elif outcome == "aborted":
                stage.abort_epoch(question.epoch)


def _compute_s(timings: Mapping[int, LayerTiming]) -> float:
    """Seconds of forward and backward per micro-batch over the layers measured."""
    return sum(t.forward_s + t.backward_s for t in timings.values())
