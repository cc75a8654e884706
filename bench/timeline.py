"""The example timeline of docs/tracing.md: one 1F1B step of the char-GPT on 4 local stages.

Starts a ``LocalCluster`` of 4 stage processes, trains a few steps of the built-in ``gpt``
(6 blocks, so 8 layers: 2 per stage) with 8 micro-batches, then runs
``elasticpipe admin trace --steps 1`` and writes the trace JSON and the PNG. Prints the
step's pipeline efficiency as the client measured it (``pipe.last_step``) and as the trace
measured it (first forward to last backward, clocks corrected).

    .venv/bin/python bench/timeline.py --png docs/img/timeline.png

``--quick``: 1 step before tracing, to check the script end to end. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from shared.steps import fewest_steps  # bench/shared/steps.py, beside this script

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", default="timeline.png")
    parser.add_argument("--out", default="trace.json")
    parser.add_argument("--steps", type=int, default=4, help="steps trained before tracing")
    parser.add_argument("--quick", action="store_true", help="1 step before tracing")
    args = parser.parse_args()
    fewest_steps(parser, args, 1)
    kwargs = {"n_layers": 6, "d_model": 64, "max_seq_len": 32}
    with (
        LocalCluster(stages=4, auto_rebalance=False) as cluster,
        Pipeline(
            coordinator=cluster.coordinator,
            model="gpt",
            model_kwargs=kwargs,
            micro_batches=8,
            schedule="1f1b",
            stages=4,
        ) as pipe,
    ):
        g = torch.Generator().manual_seed(0)
        for _ in range(args.steps):
            tokens = torch.randint(0, 96, (32, 33), generator=g)
            pipe.train_step(tokens[:, :-1], tokens[:, 1:])
        print(pipe.last_step)
        print(
            f"client: ideal {pipe.last_step.ideal_s * 1e3:.1f} ms, "
            f"efficiency {pipe.last_step.efficiency:.1%}"
        )
        traced = subprocess.run(
            [
                sys.executable,
                "-m",
                "elasticpipe",
                "admin",
                "--coordinator",
                cluster.coordinator,
                "--json",
                "trace",
                "--steps",
                "1",
                "--out",
                args.out,
                "--png",
                args.png,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    step = json.loads(traced.stdout)["steps"][-1]
    print(
        f"trace: step {step['step']}: ideal {step['ideal_s'] * 1e3:.1f} ms, measured "
        f"{step['measured_s'] * 1e3:.1f} ms, pipeline efficiency {step['efficiency']:.1%}; "
        f"wrote {args.out} and {args.png}"
    )
    print(
        json.dumps(
            {
                "client_efficiency": round(pipe.last_step.efficiency, 4),
                "client_ideal_ms": round(pipe.last_step.ideal_s * 1e3, 3),
                "trace_step": step["step"],
                "trace_efficiency": round(step["efficiency"], 4),
                "trace_measured_ms": round(step["measured_s"] * 1e3, 3),
                "out": args.out,
                "png": args.png,
            }
        )
    )


if __name__ == "__main__":
    main()
