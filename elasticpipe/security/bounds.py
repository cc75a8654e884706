"""Every number a request may carry, bounded before it is used.

A request field outside its bound is refused with ``INVALID_ARGUMENT`` naming the field,
the value and the bound, before anything is allocated or changed. The bounds:

==========================================  ==========================================
field                                       bound
==========================================  ==========================================
RunStep micro_batches                       1 .. 4096
RunStep / step timeouts (timeout_s)         (0, 3600] seconds
RunStep previous (decisions carried)        at most 16
RunStep inline (inputs and targets)         at most 8,192 entries, 4 MiB of tensors
run ids (RunStep, data, AbortStep)          generation (run >> 40) of the calling
                                            client, at most 16 generations past the
                                            stage's fence for data arriving first
RunStep secret, DataHeader secret (data)    exactly 16 bytes
epochs (Freeze, Assign)                     at most 1,000,000 past the stage's epoch
slowdown factor (stage and admin)           [1, 1000]
Profile repeats                             1 .. 100
lease_s (freeze, prepare, client lease)     (0, 3600] seconds
wait_s, timeout_s of coordinator calls      [0, 600] seconds (long polls: [0, 60])
SetupJob num_stages                         0 .. 4096
JobSpec micro_batches / snapshot_every      1 .. 4096 / 0 .. 1,000,000
names, addresses, reasons                   at most 256 characters (reasons: 500)
SetPartition boundaries / stage ids         at most 65,537 / 4,096 entries
SetLayout replicas / boundaries of each     at most 4,096 / 65,537 /
  one / stage ids / shares                  4,096 / 4,096 entries
ReportFailure suspects                      at most 4,096
tensor shapes                               at most 32 dimensions
steps (Heartbeat committed_step, CommitStep, 0 .. 2**53
  ResolveRun, EndRestore, snapshot_step)
run ids at the coordinator and CommitStep   0 .. 2**63 - 1
epochs (Heartbeat, EndRestore, CommitStep,  at most 1,000,000 past the receiver's epoch
  EpochOutcome)
client generations (RenewLease, ProfileJob, 0 .. 2**23
  BeginRestore)
FetchOutput micro_batch                     0 .. 4095
Heartbeat timings, pipeline_s               at most 65,536 entries; layer 0 .. 65,535;
                                            seconds finite in [0, 1e6]; bytes and
                                            samples 0 .. 2**50
Heartbeat reduce_bytes_per_s                finite in [0, 1e15]
Heartbeat slowdown                          0 (not reported) or [1, 1000]
RenewLease loop_pauses                      at most 16; epochs 0 .. 2**53; seconds
                                            finite in [0, 1e6]
==========================================  ==========================================
"""

from __future__ import annotations

import math
from collections.abc import Sized

from elasticpipe.errors import InvalidRequest

RUN_ID_BITS = 40  # a run id is (client generation << 40) + n
RUN_SECRET_BYTES = 16  # a run's secret (RunStepRequest.secret): random, never guessed
MAX_MICRO_BATCHES = 4096
MAX_INLINE_BYTES = 4 << 20  # a RunStep's inline inputs and targets (``RunStepRequest.inline``)
MAX_TIMEOUT_S = 3600.0
MAX_WAIT_S = 600.0
MAX_LONG_POLL_S = 60.0
MAX_DECISIONS = 16
MAX_LOOP_PAUSES = 16  # epochs a client reports having paused for, per lease renewal
MAX_GENERATIONS_AHEAD = 16
MAX_EPOCHS_AHEAD = 1_000_000
MAX_SLOWDOWN = 1000.0
MAX_STAGES = 4096
MAX_LAYERS = 65_536
MAX_NAME = 256
MAX_REASON = 500
MAX_DIMS = 32
MAX_STEP = 2**53  # exact as a float, in JSON and in SQLite
MAX_RUN = 2**63 - 1  # SQLite's largest integer
MAX_CLIENT = 2**23  # a client generation: run ids (generation << 40) stay under 2**63
MAX_TIMING_S = 1e6
MAX_BYTES_PER_S = 1e15  # a measured bandwidth
MAX_COUNTED = 2**50  # bytes or samples one layer reports


def number(value: float, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """``value`` if ``lo <= value <= hi`` (``lo < value`` with ``lo_open``), finite.

    Raises:
        InvalidRequest: naming the field, the value and the bound.
    """
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        bracket = "(" if lo_open else "["
        raise InvalidRequest(f"{what} must be in {bracket}{lo:g}, {hi:g}] (got {value})")
    return value


def count(items: Sized, what: str, most: int) -> None:
    """Checks that a repeated field holds at most ``most`` entries.

    Raises:
        InvalidRequest: naming the field, its length and the bound.
    """
    if len(items) > most:
        raise InvalidRequest(f"{what} holds {len(items)} entries (at most {most})")


def text(value: str, what: str, most: int = MAX_NAME) -> str:
    """Checks a string's length.

    Raises:
        InvalidRequest: naming the field, its length and the bound.
    """
    if len(value) > most:
        raise InvalidRequest(f"{what} is {len(value)} characters long (at most {most})")
    return value


def generation(run: int) -> int:
    """The client generation a run id belongs to."""
    return run >> RUN_ID_BITS


def run_secret(value: bytes, what: str = "secret") -> bytes:
    """A run's secret: exactly ``RUN_SECRET_BYTES`` bytes.

    Raises:
        InvalidRequest: naming the field, its length and the one allowed.
    """
    if len(value) != RUN_SECRET_BYTES:
        raise InvalidRequest(
            f"{what} is {len(value)} bytes long (a run's secret is {RUN_SECRET_BYTES} "
            "random bytes, chosen by the client)"
        )
    return value


def integer(value: int, what: str, lo: int, hi: int) -> int:
    """``value`` if ``lo <= value <= hi`` (integers: no float rounding at 2**63).

    Raises:
        InvalidRequest: naming the field, the value and the bound.
    """
    if not lo <= value <= hi:
        raise InvalidRequest(f"{what} must be in [{lo}, {hi}] (got {value})")
    return value


def step(value: int, what: str = "step") -> int:
    """A training step: 0 .. ``MAX_STEP``."""
    return integer(value, what, 0, MAX_STEP)


def run(value: int, what: str = "run") -> int:
    """A run id: 0 .. ``MAX_RUN``."""
    return integer(value, what, 0, MAX_RUN)


def client(value: int, what: str = "client") -> int:
    """A client generation: 0 .. ``MAX_CLIENT``."""
    return integer(value, what, 0, MAX_CLIENT)


def epoch(value: int, current: int, what: str = "epoch") -> int:
    """An epoch at most ``MAX_EPOCHS_AHEAD`` past the receiver's ``current`` one."""
    return integer(value, what, 0, max(0, current) + MAX_EPOCHS_AHEAD)


def slowdown_report(value: float, what: str = "slowdown") -> float:
    """A reported slowdown factor: 0 (not reported, read as 1) or [1, ``MAX_SLOWDOWN``]."""
    if value == 0:
        return 1.0
    return number(value, what, 1.0, MAX_SLOWDOWN)


def timing(
    layer: int, forward_s: float, backward_s: float, output_bytes: int, samples: int
) -> None:
    """One layer's measurements in a heartbeat.

    Raises:
        InvalidRequest: naming the field (with its layer), the value and the bound.
    """
    integer(layer, "timings.layer", 0, MAX_LAYERS - 1)
    number(forward_s, f"timings[{layer}].forward_s", 0.0, MAX_TIMING_S)
    number(backward_s, f"timings[{layer}].backward_s", 0.0, MAX_TIMING_S)
    integer(output_bytes, f"timings[{layer}].output_bytes", 0, MAX_COUNTED)
    integer(samples, f"timings[{layer}].samples", 0, MAX_COUNTED)
