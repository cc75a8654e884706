"""A live move's pause against its bytes at the data path's bandwidth (issue 20's goal).

A 2-stage ``LocalCluster`` trains an MLP of ``--width``-wide layers (``Linear`` + ``ReLU``
pairs: a ``Linear`` of 2048 x 2048 is 16.8 MB with its bias, under SGD) with the default
snapshots (``snapshot_every=10``: every epoch starts with a snapshot, as a user's job
does). Between steps, ``admin set-partition`` moves the cut by 1, 2 and 3 ``Linear`` layers
and back, ``--rounds`` times, and every move's pause is read from its outcome: what the
stages stood still, from the freeze at the cut to the new epoch committed everywhere
(``MoveResult.pause_s``). Each move comes ``SETTLE_S`` after a step of the new epoch, so
that the previous epoch's first snapshot, copied to the neighbour in the background at the
lowest priority, is not still moving during the next pause.

Printed, in the same run: the data path's bandwidth (``bench/datapaths.py``'s
``DataPath``: 4 MiB activations over the bulk channel into a stage of its own), and per
size the median pause against the goal -- the move's bytes at half that bandwidth, plus
0.1 s -- and the rate a pause grows at per byte beyond its fixed part (the slope of the
line through the sizes' medians, least squares: one slow move does not tilt it), against
the bandwidth. Sizes beyond
those measured are an extrapolation of that line, not a measurement.

Run: ``python bench/move_pause.py [--width N] [--rounds R] [--quick]`` (``--quick``: width
256, one round, to check the script end to end; its figures mean little). The last line is
JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/move_pause.py`

from first_step import data_path_gbps  # bench/first_step.py, next to this script

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster

LINEARS = 8  # Linear + ReLU pairs, the last Linear without one: 15 layers
SHIFTS = (1, 2, 3)  # Linear layers moved (each with its ReLU)
GOAL_SHARE = 0.5  # of the data path's bandwidth
GOAL_FIXED_S = 0.1
SETTLE_S = 1.0  # after a move and its first step: the snapshot copies done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="the layers' width")
    parser.add_argument("--rounds", type=int, default=3, help="moves of each size, there and back")
    parser.add_argument("--quick", action="store_true", help="width 256, one round")
    args = parser.parse_args()
    width, rounds = (256, 1) if args.quick else (args.width, args.rounds)
    torch.set_num_threads(1)

    bandwidth = data_path_gbps(repeats=1 if args.quick else 3, messages=4 if args.quick else 16)
    print(f"data path: {bandwidth:.2f} GB/s (4 MiB activations over the bulk channel)")
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, width, generator=g), torch.randint(0, width, (64,), generator=g))]
    moves: list[tuple[int, int, float]] = []  # (Linear layers moved, bytes, pause s)
    with (
        LocalCluster(stages=2, state=":memory:", auto_rebalance=False) as cluster,
        Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            model_kwargs={"sizes": [width] * (LINEARS + 1)},
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.01},
            micro_batches=2,
            stages=2,
            snapshot_every=10,
        ) as pipe,
        cluster.admin(timeout=120) as admin,
    ):
        middle = 2 * (LINEARS // 2)  # between two pairs: 4 Linear layers a side (the last
        home = [0, middle, 2 * LINEARS - 1]  # has no ReLU after it)
        pipe.train_step(*data[0])  # (the job is set up at the first step)
        admin.set_partition(home)
        for _ in range(2):
            pipe.train_step(*data[0])
        for _ in range(rounds):
            for shift in SHIFTS:
                for cut in (middle - 2 * shift, middle):  # there and back
                    move = admin.set_partition([0, cut, 2 * LINEARS - 1])
                    if not move.changed:
                        raise SystemExit(f"the move to cut {cut} did not happen: {move.decision}")
                    moves.append((shift, move.bytes_moved, move.pause_s))
                    pipe.train_step(*data[0])
                    time.sleep(0.1 if args.quick else SETTLE_S)

    print(f"{'moved':>22} {'pause (median)':>15} {'goal':>9} {'pause/goal':>11}")
    figures: dict[str, object] = {"width": width, "data_path_gbps": round(bandwidth, 3)}
    worst = 0.0
    medians: list[tuple[float, float]] = []  # (bytes, pause s) per size
    for shift in SHIFTS:
        mine = [(b, p) for s, b, p in moves if s == shift]
        nbytes = statistics.median(b for b, _ in mine)
        pause = statistics.median(p for _, p in mine)
        goal = nbytes / (GOAL_SHARE * bandwidth * 1e9) + GOAL_FIXED_S
        worst = max(worst, pause / goal)
        medians.append((nbytes, pause))
        print(
            f"{shift} Linear, {nbytes / 1e6:7.1f} MB {1e3 * pause:12.1f} ms "
            f"{1e3 * goal:6.1f} ms {pause / goal:10.2f}x"
        )
        figures[f"pause_ms_{shift}"] = round(1e3 * pause, 1)
        figures[f"goal_ms_{shift}"] = round(1e3 * goal, 1)
    xs, ys = [b for b, _ in medians], [p for _, p in medians]
    slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    rate = 1 / slope / 1e9 if slope > 0 else None  # (None: the pause did not grow)
    grows = f"at {rate:.2f} GB/s, {rate / bandwidth:.2f}x the data path" if rate else "not at all"
    print(
        f"beyond its fixed part, a pause grew with the bytes moved {grows} (the goal: >= "
        f"{GOAL_SHARE}x); the worst size's pause is {worst:.2f}x its goal"
    )
    figures["move_gbps"] = round(rate, 3) if rate else None
    figures["move_vs_data_path"] = round(rate / bandwidth, 3) if rate else None
    figures["worst_pause_vs_goal"] = round(worst, 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
