"""A network cable with a fixed delay, for a "host" (network namespace) that this kernel's
``tc`` cannot delay: it has no ``netem`` qdisc (``CONFIG_NET_SCH_NETEM`` is not set), nor
``fq``, which honours a departure time. Two TAP devices joined by this process: every
Ethernet frame the host sends is held ``DELAY`` seconds before it goes out on the other
side, as ``tc qdisc add dev IFACE root netem delay DELAY`` on the host's interface would;
frames coming in pass at once. Frames keep their order (one FIFO per direction, all held
equally long).

Run as ``python tests/support/delay_wire.py INNER OUTER DELAY`` (root): it creates the TAP
devices ``INNER`` (the host's side, to move into its namespace) and ``OUTER`` (to put on
the bridge), prints ``ready`` and forwards until killed; the devices go with it."""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA  # linux/if_tun.h
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000  # frames without the 4-byte packet-information header
MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """A new TAP device ``name``; returns the file descriptor its frames are read from and
    written to (the device exists while it is open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def forward(source: int, sink: int, delay_s: float) -> None:
    """Copies every frame read from ``source`` to ``sink``, ``delay_s`` after it was read
    (forever: run it in a thread)."""
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def send() -> None:
        while True:
            with ready:
                while not held:
                    ready.wait()
                due, frame = held.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                os.write(sink, frame)
            except OSError as exc:  # EIO while the far side is down: the frame is lost
                if exc.errno != errno.EIO:
                    raise

    threading.Thread(target=send, daemon=True).start()
    while True:
        frame = os.read(source, MAX_FRAME)
        with ready:
            held.append((time.monotonic() + delay_s, frame))
            ready.notify()


def _die(args: threading.ExceptHookArgs) -> None:
    sys.excepthook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
    os._exit(1)


def main(argv: list[str]) -> None:
    inner, outer, delay = argv
    delay_s = float(delay)
    if not 0 <= delay_s <= 10:
        raise SystemExit(f"delay must be 0-10 seconds, got {delay!r}")
    threading.excepthook = _die  # a direction that stops would pass nothing, silently
    host, bridge = open_tap(inner), open_tap(outer)
    for source, sink, wait in ((host, bridge, delay_s), (bridge, host, 0.0)):
        threading.Thread(target=forward, args=(source, sink, wait), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
