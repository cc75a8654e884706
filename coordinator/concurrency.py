"""Calls to many stages, one host at a time per host but many hosts at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

from elasticpipe.errors import ElasticPipeError
from elasticpipe.transport.serving import split_address

T = TypeVar("T")


def by_host(addresses: Sequence[str], call: Callable[[str], T], hosts_at_once: int) -> list[T]:
    """``call(address)`` for every address: those on one host in turn (a profile's timings
    would suffer from a neighbour's load), up to ``hosts_at_once`` hosts at a time, so a
    long chain of stages on their own hosts takes about as long as one host's stages.

    Returns:
        The results, in the order of ``addresses``.

    Raises:
        ElasticPipeError: the first failure in the order of ``addresses``, after every
            host's calls ended (a host's calls stop at its first failure).
    """
    groups: dict[str, list[int]] = {}
    for i, address in enumerate(addresses):
        groups.setdefault(split_address(address)[0], []).append(i)
    results: dict[int, T] = {}
    failures: dict[int, ElasticPipeError] = {}

    def run(indices: list[int]) -> None:
        for i in indices:
            try:
                results[i] = call(addresses[i])
            except ElasticPipeError as exc:  # raised below, in address order
                failures[i] = exc
                return

    workers = max(1, min(hosts_at_once, len(groups)))
    with futures.ThreadPoolExecutor(workers, thread_name_prefix="by-host") as pool:
        for done in [pool.submit(run, group) for group in groups.values()]:
            done.result()
    if failures:
        raise failures[min(failures)]
    return [results[i] for i in range(len(addresses))]
