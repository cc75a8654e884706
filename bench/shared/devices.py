"""The emulated devices' timer, as the benches that emulate devices offer it."""

from __future__ import annotations

import argparse


def add_timer_argument(parser: argparse.ArgumentParser) -> None:
    """``--timer``: how the stages time their ops for the emulated device (the stages'
    own ``--timer``), ``fastest`` by default; pass it on as ``["--timer", args.timer]``."""
    parser.add_argument(
        "--timer",
        choices=["fastest", "cpu"],
        default="fastest",
        help="the stages' --timer: fastest (each op's CPU time the fastest of its recent "
        "runs) or cpu (each run's own CPU time, which grows with the host's load)",
    )
