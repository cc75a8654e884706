"""The whole suite's set-up: every ``LocalCluster`` forks its coordinators and stages from
one fork server per test process (``elasticpipe/local/forkserver.py``), instead of each
process importing torch afresh (1.5 to 2 s of CPU each; a cluster of five starts in 0.2 s
instead of 4). The processes are as real: their own pids, sockets and signals. The demo's
tests run ``elasticpipe demo`` as a user does, every process spawned
(``tests/integration/test_demo.py``), and ``tests/integration/test_forkserver.py`` checks
that a forked cluster's processes are as a spawned one's."""

import os

from elasticpipe.local import forkserver

os.environ.setdefault(forkserver.ENV, "1")
