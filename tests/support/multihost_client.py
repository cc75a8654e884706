"""The client "host" of the multi-host test: run inside its own network namespace.

Trains the scenario's job through stages on other hosts, moves every layer to another
host halfway (``elasticpipe admin set-partition`` with a new chain order: a live
migration between hosts), trains on, and prints one JSON line: the losses and weights
against single-process training, and what the coordinator reported.

Usage: python multihost_client.py COORDINATOR CERTS_DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.security.tls import TLS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from tests.support.scenario import ADAM, KWARGS, REFERENCE, STEPS, batch

MOVE_AFTER = 4


def admin(coordinator: str, certs: Path, *args: str) -> dict[str, object]:
    env = {
        **os.environ,
        "ELASTICPIPE_TLS_CERT": str(certs / "admin.pem"),
        "ELASTICPIPE_TLS_KEY": str(certs / "admin.key"),
        "ELASTICPIPE_TLS_CA": str(certs / "ca.pem"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticpipe",
            "admin",
            "--coordinator",
            coordinator,
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"admin {args} failed: {done.stdout} {done.stderr}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main() -> None:
    coordinator, certs = sys.argv[1], Path(sys.argv[2])
    tls = TLS(str(certs / "client.pem"), str(certs / "client.key"), str(certs / "ca.pem"))
    losses: list[float] = []
    with Pipeline(
        coordinator=coordinator,
        model="mlp",
        model_kwargs=KWARGS,
        seed=3,
        optimizer="adam",
        optimizer_kwargs=ADAM,
        micro_batches=3,
        stages=3,
        tls=tls,
    ) as pipe:
        for step in range(1, MOVE_AFTER + 1):
            losses.append(pipe.train_step(*batch(step)))
        before = admin(coordinator, certs, "status")
        chain = before["partition"]["stage_ids"]  # type: ignore[index]
        moved = admin(
            coordinator, certs, "set-partition", "0:2,2:5,5:9", "--stages", *reversed(chain)
        )
        for step in range(MOVE_AFTER + 1, STEPS + 1):
            losses.append(pipe.train_step(*batch(step)))
        after = admin(coordinator, certs, "status")
        state = pipe.state_dict()
    want_losses, want_state = REFERENCE
    exact = all(
        torch.equal(torch.tensor(got), torch.tensor(want))
        for got, want in zip(losses, want_losses, strict=True)
    ) and all(torch.equal(state[k], v) for k, v in want_state.items())
    close = all(
        torch.allclose(torch.tensor(got), torch.tensor(want))
        for got, want in zip(losses, want_losses, strict=True)
    ) and all(torch.allclose(state[k], v) for k, v in want_state.items())
    print(
        json.dumps(
            {
                "exact": exact,
                "close": close,
                "losses": losses,
                "want": want_losses,
                "before": before,
                "moved": moved,
                "after": after,
            }
        )
    )


if __name__ == "__main__":
    main()
