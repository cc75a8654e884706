"""``--steps N`` with ``--quick``: quick mode runs the fewest steps a bench measures with."""

from __future__ import annotations

import argparse


def fewest_steps(
    parser: argparse.ArgumentParser, args: argparse.Namespace, fewest: int, why: str = ""
) -> None:
    """Sets ``args.steps`` to ``fewest`` under ``--quick``, and refuses fewer steps.

    Args:
        parser: the bench's parser (it reports the error and exits 2).
        args: its parsed arguments, with ``steps`` and ``quick``.
        fewest: the fewest steps the bench measures anything with.
        why: said after the bound in the error (": the first step is not counted").
    """
    if args.quick:
        args.steps = fewest
    if args.steps < fewest:
        parser.error(f"--steps must be >= {fewest}{why} (got {args.steps})")
