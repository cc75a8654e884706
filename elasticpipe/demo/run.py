"""``elasticpipe demo``: a local cluster trains a character-level GPT on Python's own source.

With events (the default) the demo also shows what makes the pipeline elastic, at fixed
steps: one stage becomes 3x slower (as ``admin slowdown`` does) and the coordinator moves
layers off it while training runs; the stage recovers and the layers come back; then one
stage process is killed (SIGKILL) and the job recovers on the survivors (the chain shrinks:
the demo starts no spare). At the end it prints the events and the step rate of each phase,
and draws them (:mod:`elasticpipe.demo.plot`).
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import torch

from elasticpipe.demo.corpus import CharCorpus, sample_text
from elasticpipe.demo.record import Event, Sample, Timeline
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.wire import structure

# Quick reactions for a demo of a few minutes: re-plan twice a second, and allow a move
# every 2 s (the coordinator's defaults, 1 s and 5 s, suit long jobs).
DEMO_COORDINATOR_ARGS = ("--policy-interval", "0.5", "--rebalance-cooldown", "2")


@dataclass(frozen=True)
class Events:
    """When the demo disturbs its cluster: after which step (0: never).

    Attributes:
        slow_at: after this step, ``slow_stage`` becomes ``factor`` times slower.
        recover_at: after this step, it runs at full speed again.
        kill_at: after this step, ``kill_stage``'s process is killed (SIGKILL).
        slow_stage: the stage slowed down (a process name, ``stage-N``; default: the
            second of the chain, so that its layers go to stages that already hold blocks).
        kill_stage: the stage killed (default: the third of the chain, or the last).
        factor: the slowdown factor.
    """

    slow_at: int = 0
    recover_at: int = 0
    kill_at: int = 0
    slow_stage: str = ""
    kill_stage: str = ""
    factor: float = 3.0

    @classmethod
    def spread_over(cls, steps: int, **overrides: int | float | str | None) -> Events:
        """Slowdown after 1/6 of the steps, recovery after 9/20, the kill after 3/4
        (each overridden by a non-None keyword)."""
        default = cls(slow_at=steps // 6, recover_at=steps * 9 // 20, kill_at=steps * 3 // 4)
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{**default.__dict__, **given})

    def placed(self, chain: list[str]) -> Events:
        """These events with the default stages resolved from the chain's order."""
        return replace(
            self,
            slow_stage=self.slow_stage or chain[min(1, len(chain) - 1)],
            kill_stage=self.kill_stage or chain[min(2, len(chain) - 1)],
        )

    def validate(self, stages: int, steps: int) -> None:
        """Raises InvalidRequest for events out of order, beyond the last step, on a
        stage that does not exist, or a kill that would leave no stage."""
        names = {f"stage-{i}" for i in range(stages)}
        for what, stage, at in (
            ("slowdown", self.slow_stage, self.slow_at),
            ("kill", self.kill_stage, self.kill_at),
        ):
            if at and stage and stage not in names:
                raise InvalidRequest(f"--{what}-stage {stage!r} is not one of {sorted(names)}")
        for what, at in (
            ("slow", self.slow_at),
            ("recover", self.recover_at),
            ("kill", self.kill_at),
        ):
            if at < 0 or at >= steps:
                raise InvalidRequest(
                    f"--{what}-at {at} must be 0 (never) or within the {steps} steps"
                )
        if self.recover_at and not self.slow_at < self.recover_at:
            raise InvalidRequest(
                f"--recover-at {self.recover_at} must come after --slow-at {self.slow_at}"
            )
        if self.kill_at and stages < 2:
            raise InvalidRequest("--kill-at needs at least 2 stages (one must survive)")
        if not self.factor >= 1:
            raise InvalidRequest(f"--slow-factor must be >= 1 (got {self.factor})")


def _slowdown(cluster: LocalCluster, stage: str, factor: float) -> None:
    """What ``elasticpipe admin slowdown STAGE FACTOR`` does."""
    with cluster.admin(timeout=30.0) as admin:
        admin.slowdown(stage, factor)


class _Recorder:
    """Turns each finished step into a sample, and partition changes into events."""

    def __init__(self, cluster: LocalCluster, out: TextIO):
        self.cluster, self.out = cluster, out
        self.timeline = Timeline()
        self.epoch = 0
        self.changes: list[tuple[int, float, int]] = []  # (step, t, epoch) as first seen

    def sample(self, step: int, t: float, loss: float, epoch: int, layers: dict[str, int]) -> None:
        self.timeline.samples.append(Sample(step, t, loss, epoch, layers))
        if self.epoch and epoch != self.epoch:
            self.changes.append((step, t, epoch))
            print(
                f"step {step:>5}  partition changed: epoch {epoch}, layers per stage {layers}",
                file=self.out,
                flush=True,
            )
        self.epoch = epoch

    def event(self, step: int, t: float, kind: str, label: str, stage: str = "") -> None:
        self.timeline.events.append(Event(step, t, kind, label, stage))
        print(f"step {step:>5}  {label}", file=self.out, flush=True)

    def finish(self) -> Timeline:
        """Adds the partition changes, labelled from the coordinator's epoch history."""
        history = {r.epoch: r for r in self.cluster.status().history}
        seen = 0
        for step, t, epoch in self.changes:
            records = [history[e] for e in range(seen + 1, epoch + 1) if e in history]
            record = records[-1] if records else None
            kind = record.kind if record else "move"
            if any(r.kind == "recovery" for r in records):
                kind = "recovery"
            self.timeline.events.append(Event(step, t, kind, f"epoch {epoch}: {kind}"))
            seen = epoch
        self.timeline.events.sort(key=lambda e: (e.step, e.t))
        return self.timeline


def _layers(
    cluster: LocalCluster, addresses: tuple[str, ...], bounds: tuple[int, ...]
) -> dict[str, int]:
    names = {a: f"stage-{i}" for i, a in enumerate(cluster.stage_addresses)}
    return {
        names.get(a, a): hi - lo
        for a, (lo, hi) in zip(addresses, itertools.pairwise(bounds), strict=True)
    }


def print_summary(timeline: Timeline, out: TextIO) -> None:
    """The events with their steps, and the step rate of every phase between two."""
    print("\n--- summary ---\nevents:", file=out)
    for e in timeline.events:
        print(f"  after step {e.step:>5}  ({e.t:6.1f}s)  {e.label}", file=out)
    print("phases:", file=out)
    for p in timeline.phases():
        layers = ",".join(str(n) for n in p.layers.values())
        print(
            f"  steps {p.first:>5}-{p.last:<5} {p.steps_per_s:6.2f} steps/s  layers "
            f"[{layers}]  after: {p.after}",
            file=out,
        )
    if timeline.samples:
        last = timeline.samples[-1]
        print(f"final loss {last.loss:.3f} at step {last.step}", file=out, flush=True)


def run_demo(
    stages: int = 4,
    steps: int = 160,
    batch_size: int = 16,
    seq_len: int = 64,
    micro_batches: int = 4,
    n_layers: int = 8,
    d_model: int = 128,
    log_dir: str | None = None,
    events: Events | None = None,
    png: str | None = None,
    sample_chars: int = 200,
) -> int:
    """Starts a coordinator and ``stages`` stage processes, trains, samples, shuts down.

    Args:
        events: when to slow down, recover and kill a stage (None: a plain run).
        png: where the picture goes (default: ``LOG_DIR/demo.png``; with events only),
            with its data beside it (``.json``).
        sample_chars: how many characters of text to generate at the end.

    Returns:
        The process exit code (0 on success, 130 on Ctrl-C).

    Raises:
        InvalidRequest: events that do not fit the run.
    """
    from elasticpipe.client.pipeline import Pipeline

    out = sys.stdout
    if events is not None:
        events.validate(stages, steps)
    log_dir = log_dir or time.strftime("runs/demo-%Y%m%d-%H%M%S")  # kept after the demo
    corpus = CharCorpus.from_stdlib()
    model_kwargs = {
        "vocab_size": corpus.vocab_size,
        "d_model": d_model,
        "n_heads": 4,
        "n_layers": n_layers,
        "max_seq_len": seq_len,
    }
    print(
        f"corpus: {len(corpus):,} characters of the Python standard library's source; "
        f"model: gpt with {n_layers} blocks (d_model {d_model}), {n_layers + 2} layers",
        file=out,
    )
    if events is not None:
        print(
            f"events: {events.slow_stage or 'the 2nd stage'} {events.factor:g}x slower after "
            f"step {events.slow_at or '-'}, back to full speed after {events.recover_at or '-'}"
            f"; {events.kill_stage or 'the 3rd stage'} killed after {events.kill_at or '-'}",
            file=out,
        )
    print(
        f"starting a coordinator and {stages} stage servers on 127.0.0.1 ...", file=out, flush=True
    )
    generator = torch.Generator().manual_seed(0)
    timeline: Timeline | None = None
    try:
        with LocalCluster(
            stages=stages,
            log_dir=log_dir,
            coordinator_args=["--state", ":memory:", *DEMO_COORDINATOR_ARGS],
        ) as cluster:
            print(
                f"coordinator at {cluster.coordinator}; stages at "
                f"{', '.join(cluster.stage_addresses)}; logs in {cluster.log_dir}",
                file=out,
                flush=True,
            )
            recorder = _Recorder(cluster, out)
            with Pipeline(
                coordinator=cluster.coordinator,
                model="gpt",
                model_kwargs=model_kwargs,
                seed=0,
                optimizer="adamw",
                optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.01},
                loss="cross_entropy",
                micro_batches=micro_batches,
                schedule="1f1b",
            ) as pipe:
                started = time.perf_counter()
                window_start, window_tokens = started, 0
                for step in range(1, steps + 1):
                    inputs, targets = corpus.batch(batch_size, seq_len, generator)
                    loss = pipe.train_step(inputs, targets)
                    now = time.perf_counter()
                    part = pipe.partition
                    layers = _layers(cluster, part.addresses, part.boundaries)
                    recorder.sample(step, now - started, loss, part.epoch, layers)
                    window_tokens += inputs.numel()
                    if step == 1:
                        print(
                            f"step     1/{steps}  loss {loss:6.3f}  (job setup, profiling and "
                            f"first step: {now - started:.1f}s)  partition "
                            f"{list(part.boundaries)}",
                            file=out,
                            flush=True,
                        )
                        window_start, window_tokens = now, 0
                    elif step % 10 == 0 or step == steps:
                        rate = window_tokens / max(now - window_start, 1e-9)
                        print(
                            f"step {step:>5}/{steps}  loss {loss:6.3f}  {rate:8.0f} tokens/s  "
                            f"epoch {part.epoch}  layers per stage "
                            f"{[b - a for a, b in itertools.pairwise(part.boundaries)]}",
                            file=out,
                            flush=True,
                        )
                        window_start, window_tokens = now, 0
                    if events is not None:
                        if step == 1:
                            events = events.placed(list(layers))
                        _disturb(cluster, recorder, events, step, now - started)
                elapsed = time.perf_counter() - started
                print(f"trained {steps} steps in {elapsed:.1f}s", file=out)
                text = sample_text(
                    lambda x: structure.single(pipe.predict(x), "the model returned"),
                    corpus,
                    prompt="def ",
                    length=sample_chars,
                    max_seq_len=seq_len,
                    temperature=0.6,
                    seed=0,
                )
                print("\n--- sample ---\n" + text + "\n--------------", file=out, flush=True)
            if events is not None:
                timeline = recorder.finish()
    except KeyboardInterrupt:
        print("\ninterrupted: every process was stopped", file=out)
        return 130
    print("cluster stopped cleanly", file=out)
    if timeline is not None:
        from elasticpipe.demo.plot import plot

        print_summary(timeline, out)
        path = Path(png or Path(log_dir) / "demo.png")
        plot(timeline, path, f"ElasticPipe demo: char-GPT on {stages} local stages")
        timeline.save(path.with_suffix(".json"))
        print(f"picture: {path} (its data: {path.with_suffix('.json')})", file=out, flush=True)
    return 0


def _disturb(
    cluster: LocalCluster, recorder: _Recorder, events: Events, step: int, t: float
) -> None:
    """Causes the events due after ``step``."""
    if step == events.slow_at:
        _slowdown(cluster, events.slow_stage, events.factor)
        recorder.event(
            step, t, "slowdown", f"{events.slow_stage} {events.factor:g}x slower", events.slow_stage
        )
    if step == events.recover_at and events.slow_at:
        _slowdown(cluster, events.slow_stage, 1.0)
        label = f"{events.slow_stage} back to full speed"
        recorder.event(step, t, "recovered", label, events.slow_stage)
    if step == events.kill_at:
        cluster.kill(events.kill_stage)
        label = f"{events.kill_stage} killed (SIGKILL)"
        recorder.event(step, t, "kill", label, events.kill_stage)
