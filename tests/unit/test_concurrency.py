"""coordinator.concurrency.by_host: one call at a time per host, many hosts at once."""

from __future__ import annotations

import threading
import time

import pytest

from elasticpipe.coordinator.concurrency import by_host
from elasticpipe.errors import InvalidRequest, NotReady

pytestmark = pytest.mark.timeout(30)

ADDRESSES = [f"10.0.0.{h}:{5000 + i}" for i in range(3) for h in range(4)]  # 4 hosts x 3


def test_hosts_in_parallel_and_each_host_in_turn() -> None:
    lock = threading.Lock()
    busy: dict[str, int] = {}
    most_on_a_host, most_at_once, now = 0, 0, 0

    def call(address: str) -> str:
        nonlocal most_on_a_host, most_at_once, now
        host = address.split(":", maxsplit=1)[0]
        with lock:
            busy[host] = busy.get(host, 0) + 1
            now += 1
            most_on_a_host = max(most_on_a_host, busy[host])
            most_at_once = max(most_at_once, now)
        time.sleep(0.05)
        with lock:
            busy[host] -= 1
            now -= 1
        return address.upper()

    assert by_host(ADDRESSES, call, 16) == [a.upper() for a in ADDRESSES]
    assert most_on_a_host == 1
    assert most_at_once > 1
    most_at_once = 0
    by_host(ADDRESSES, call, 1)
    assert most_at_once == 1


def test_the_first_failure_in_address_order_is_raised_after_every_host_ended() -> None:
    called: list[str] = []
    lock = threading.Lock()

    def call(address: str) -> str:
        with lock:
            called.append(address)
        if address in (ADDRESSES[5], ADDRESSES[2]):
            raise NotReady(f"{address} is not ready")
        return address

    with pytest.raises(NotReady, match=ADDRESSES[2].replace(".", r"\.")):
        by_host(ADDRESSES, call, 4)
    # ADDRESSES[2]'s host stops there: its third stage (ADDRESSES[10]) is not called.
    assert ADDRESSES[10] not in called and ADDRESSES[11] in called


def test_bad_addresses_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="bad address"):
        by_host(["nohost"], lambda a: a, 4)
