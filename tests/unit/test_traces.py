"""Putting stages' spans on one clock: offsets, the Chrome trace, per-step efficiency."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe import timeline, traces
from elasticpipe.training.schedule import OpKind, stage_ops
from elasticpipe.v1 import stage_pb2

S = 1_000_000_000  # ns per second


EXAMPLE = {
    0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("B", 1, 7, 9)],
    1: [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7)],
}


def _worked_example(
    offsets: list[int], times: dict[int, list[tuple[str, int, int, int]]] = EXAMPLE
) -> list[traces.StageTrace]:
    """The 1F1B example of elasticpipe.observe.efficiency (2 stages, 2 micro-batches, F 1 s, B 2 s)
    run as ``times`` says (default: no bubble beyond the schedule's), each stage's clock
    ``offsets[s]`` ahead."""
    out = []
    for s, ops in times.items():
        spans = [
            stage_pb2.Span(
                kind=stage_pb2.SPAN_FORWARD if k == "F" else stage_pb2.SPAN_BACKWARD,
                start_ns=a * S + offsets[s],
                duration_ns=(b - a) * S,
                step=3,
                run=7,
                micro_batch=m,
                layer_lo=s,
                layer_hi=s + 1,
            )
            for k, m, a, b in ops
        ]
        spans.append(
            stage_pb2.Span(
                kind=stage_pb2.SPAN_SEND,
                start_ns=2 * S + offsets[s],
                duration_ns=S // 10,
                step=3,
                run=7,
                micro_batch=0,
                peer=f"peer-of-{s}",
            )
        )
        out.append(
            traces.StageTrace(s, f"s{s}", f"h:{s}", s, s + 1, offsets[s], 1000, tuple(spans), False)
        )
    return out


def test_offsets_are_subtracted_before_measuring_the_step() -> None:
    """Stage clocks 1000 s apart measure the step as 9 s: the ideal, so efficiency 1."""
    figures = traces.step_figures(_worked_example([0, 1000 * S]))
    assert [(f.step, f.ideal_s, f.measured_s, f.efficiency) for f in figures] == [
        (3, 9.0, 9.0, 1.0)
    ]


def test_a_bubble_lowers_the_efficiency() -> None:
    """The same ops with F(1, 1) two seconds late (a slow send): B(0, 1) ends at 11 s for
    an ideal of 9."""
    late = {
        0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("B", 1, 9, 11)],
        1: [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 6, 7), ("B", 1, 7, 9)],
    }
    (figure,) = traces.step_figures(_worked_example([0, 7 * S], late))
    assert figure.ideal_s == pytest.approx(9.0)
    assert figure.measured_s == pytest.approx(11.0)
    assert figure.efficiency == pytest.approx(9 / 11)


def _fields(span: stage_pb2.Span) -> dict[str, object]:
    return {f.name: getattr(span, f.name) for f in span.DESCRIPTOR.fields}


def test_a_step_missing_an_op_gets_no_figure() -> None:
    """A step whose spans were cut (a micro-batch's backward missing) is not measured."""
    stages = _worked_example([0, 0])
    stages[0] = traces.StageTrace(0, "s0", "h:0", 0, 1, 0, 1000, stages[0].spans[:3], False)
    assert traces.step_figures(stages) == []


def test_only_the_last_run_of_a_retried_step_counts() -> None:
    """Spans of an aborted earlier run of the same step are left out of its figure."""
    stages = _worked_example([0, 0])
    stale = stage_pb2.Span(
        kind=stage_pb2.SPAN_FORWARD, start_ns=-50 * S, duration_ns=S, step=3, run=6, micro_batch=0
    )
    stages[0] = traces.StageTrace(0, "s0", "h:0", 0, 1, 0, 1000, (stale, *stages[0].spans), False)
    assert [len(v) for v in traces.latest_ops(stages[0]).values()] == [4]
    assert traces.step_figures(stages)[0].efficiency == 1.0


def test_the_chrome_trace_has_a_named_track_per_stage_and_every_op() -> None:
    """One process per stage named after it, F/B events with micro-batch ids, sends on
    their own thread, timestamps in µs from the first span on the corrected clock."""
    doc = traces.chrome_trace(_worked_example([0, 5 * S]))
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "stage 0: s0 (layers 0:1)", 1: "stage 1: s1 (layers 1:2)"}
    ops = {(e["pid"], e["name"]): e for e in events if e["ph"] == "X" and e["cat"] in "FB"}
    assert len(ops) == 8
    assert ops[(1, "F0")]["ts"] == pytest.approx(1e6) and ops[(1, "F0")]["dur"] == 1e6
    assert ops[(0, "B1")]["args"] == {
        "step": 3,
        "run": 7,
        "epoch": 0,
        "micro_batch": 1,
        "layers": "0:1",
    }
    sends = [e for e in events if e.get("cat") == "send"]
    assert {e["tid"] for e in sends} == {traces.FIRST_SEND}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert threads[(0, traces.COMPUTE)] == "compute"
    assert threads[(1, traces.FIRST_SEND)] == "sends to peer-of-1"


class _SkewedStage:
    """A stage whose clock runs ``skew_ns`` ahead and whose replies take varying time."""

    def __init__(self, skew_ns: int, delays: list[float]):
        self.skew_ns, self.delays = skew_ns, delays

    def GetTrace(self, request: stage_pb2.TraceRequest, timeout: float) -> stage_pb2.TraceResponse:
        delay = self.delays.pop(0)
        now = time.time_ns() + self.skew_ns
        time.sleep(delay)  # a slow way back: the sample's midpoint is off by delay / 2
        return stage_pb2.TraceResponse(now_ns=now)


def test_the_clock_offset_comes_from_the_fastest_round_trip() -> None:
    """Of five probes, the one with the shortest round trip sets the offset, within it."""
    stage = _SkewedStage(3 * S, [0.2, 0.15, 0.0, 0.1, 0.2])
    offset, rtt = traces.clock_offset(stage, timeout=1.0)
    assert rtt < 0.05 * S
    assert abs(offset - 3 * S) <= rtt


def test_the_timeline_png_and_its_errors(tmp_path: Path) -> None:
    """The PNG is written with one row per stage; no F/B span is a clear error."""
    stages = _worked_example([0, 0])
    out = tmp_path / "t.png"
    timeline.draw(stages, traces.step_figures(stages), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = [traces.StageTrace(0, "s0", "h:0", 0, 1, 0, 1, (), False)]
    with pytest.raises(InvalidRequest, match="train a step first"):
        timeline.draw(empty, [], tmp_path / "e.png")


def test_the_schedules_in_the_example_are_what_the_stages_ran() -> None:
    """The example's op order is 1F1B's (so the figures above test the real schedule)."""
    stages = _worked_example([0, 0])
    for s, stage in enumerate(stages):
        spans = traces.latest_ops(stage)[3]
        got = [
            (OpKind.FORWARD if x.kind == stage_pb2.SPAN_FORWARD else OpKind.BACKWARD, x.micro_batch)
            for x in spans
        ]
        want = [(op.kind, op.micro_batch) for op in stage_ops("1f1b", 2, s, 2)]
        assert got == want


def _with_a_predict_after(stages: list[traces.StageTrace]) -> list[traces.StageTrace]:
    """``stages`` followed by an inference run (``predict``): a forward of one micro-batch
    on every stage, run 8, under the number of the step committed last (3), as a stage
    traces it, and the activation sent from stage 0 to stage 1."""
    out = []
    for t in stages:
        predicted = [
            stage_pb2.Span(
                kind=stage_pb2.SPAN_FORWARD,
                start_ns=(20 + t.index) * S + t.offset_ns,
                duration_ns=S // 2,
                step=3,
                run=8,
                micro_batch=0,
                layer_lo=t.layer_lo,
                layer_hi=t.layer_hi,
                inference=True,
            )
        ]
        if t.index == 0:
            predicted.append(
                stage_pb2.Span(
                    kind=stage_pb2.SPAN_SEND,
                    start_ns=20 * S + S // 2 + t.offset_ns,
                    duration_ns=S // 10,
                    step=3,
                    run=8,
                    micro_batch=0,
                    peer="peer-of-0",
                    inference=True,
                )
            )
        out.append(
            traces.StageTrace(
                t.index,
                t.name,
                t.address,
                t.layer_lo,
                t.layer_hi,
                t.offset_ns,
                t.rtt_ns,
                (*t.spans, *predicted),
                False,
            )
        )
    return out


def test_a_predict_after_the_last_step_leaves_that_step_whole(tmp_path: Path) -> None:
    """An inference run carrying the last step's number (a later run id, forwards only) is
    no part of that step: its figure, ops and timeline are the training run's, the summary
    lists the inference run apart, and the Chrome trace names its spans as a predict's."""
    trained = _worked_example([0, 5 * S])
    stages = _with_a_predict_after(trained)

    assert traces.step_figures(stages) == traces.step_figures(trained)
    assert [f.step for f in traces.step_figures(stages)] == [3]
    for with_predict, alone in zip(stages, trained, strict=True):
        assert traces.latest_ops(with_predict) == traces.latest_ops(alone)

    doc = traces.summary(stages, traces.step_figures(stages))
    assert [s["step"] for s in doc["steps"]] == [3]
    assert doc["inference_runs"] == [{"run": 8, "after_step": 3}]
    assert traces.summary(trained, traces.step_figures(trained))["inference_runs"] == []

    events = [e for e in traces.chrome_trace(stages)["traceEvents"] if e["ph"] == "X"]
    predicted = [e for e in events if e["cat"] == traces.INFERENCE]
    assert sorted((e["pid"], e["name"]) for e in predicted) == [
        (0, "predict F0"),
        (0, "predict send 0"),
        (1, "predict F0"),
    ]
    assert all(e["args"]["inference"] is True and e["args"]["run"] == 8 for e in predicted)
    training = [e for e in events if e["cat"] in ("F", "B")]
    assert len(training) == 8 and all("inference" not in e["args"] for e in training)

    # The PNG draws the training step's boxes only: the same picture as without the predict.
    with_predict, alone = tmp_path / "with.png", tmp_path / "alone.png"
    timeline.draw(stages, traces.step_figures(stages), with_predict)
    timeline.draw(trained, traces.step_figures(trained), alone)
    assert with_predict.read_bytes() == alone.read_bytes()
