"""``elasticpipe demo``: a local cluster trains a character-level GPT on Python's own source."""

from __future__ import annotations

import itertools
import sys
import time

import torch

from elasticpipe import structure
from elasticpipe.cluster import LocalCluster
from elasticpipe.data import CharCorpus, sample_text


def run_demo(
    stages: int = 4,
    steps: int = 150,
    batch_size: int = 16,
    seq_len: int = 64,
    micro_batches: int = 4,
    n_layers: int = 6,
    d_model: int = 128,
    log_dir: str | None = None,
) -> int:
    """Starts a coordinator and ``stages`` stage processes, trains, samples, shuts down.

    Returns:
        The process exit code (0 on success, 130 on Ctrl-C).
    """
    from elasticpipe.client.pipeline import Pipeline

    out = sys.stdout
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
    print(
        f"starting a coordinator and {stages} stage servers on 127.0.0.1 ...", file=out, flush=True
    )
    generator = torch.Generator().manual_seed(0)
    try:
        with LocalCluster(
            stages=stages, log_dir=log_dir, coordinator_args=["--state", ":memory:"]
        ) as cluster:
            print(
                f"coordinator at {cluster.coordinator}; stages at "
                f"{', '.join(cluster.stage_addresses)}; logs in {cluster.log_dir}",
                file=out,
                flush=True,
            )
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
                    window_tokens += inputs.numel()
                    if step == 1:
                        part = pipe.partition
                        print(
                            f"step     1/{steps}  loss {loss:6.3f}  (job setup, profiling and "
                            f"first step: {time.perf_counter() - started:.1f}s)  partition "
                            f"{list(part.boundaries)}",
                            file=out,
                            flush=True,
                        )
                        window_start, window_tokens = time.perf_counter(), 0
                    elif step % 10 == 0 or step == steps:
                        now = time.perf_counter()
                        rate = window_tokens / max(now - window_start, 1e-9)
                        part = pipe.partition
                        print(
                            f"step {step:>5}/{steps}  loss {loss:6.3f}  {rate:8.0f} tokens/s  "
                            f"epoch {part.epoch}  layers per stage "
                            f"{[b - a for a, b in itertools.pairwise(part.boundaries)]}",
                            file=out,
                            flush=True,
                        )
                        window_start, window_tokens = now, 0
                elapsed = time.perf_counter() - started
                print(f"trained {steps} steps in {elapsed:.1f}s", file=out)
                text = sample_text(
                    lambda x: structure.single(pipe.predict(x), "the model returned"),
                    corpus,
                    prompt="def ",
                    length=200,
                    max_seq_len=seq_len,
                    temperature=0.6,
                    seed=0,
                )
                print("\n--- sample ---\n" + text + "\n--------------", file=out, flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: every process was stopped", file=out)
        return 130
    print("cluster stopped cleanly", file=out)
    return 0
