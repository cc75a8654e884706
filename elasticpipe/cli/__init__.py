"""The ``elasticpipe`` command: its parser and entry point, the admin commands, the live
watch, and the JSON schemas of ``--json``.

* ``admin``: ``elasticpipe admin``: the operator's view of a running cluster, and its levers.
* ``entry``: The ``elasticpipe`` command: coordinator, stage, admin and demo.
* ``process``: How a coordinator's or stage's process ends once its server has stopped
  cleanly: at once, without the interpreter's teardown.
* ``schemas``: JSON Schemas of what ``elasticpipe admin COMMAND --json`` prints: the contract
  for scripts.
* ``watch``: ``elasticpipe admin status --watch``: a live view of the cluster, redrawn every
  interval.
"""

from elasticpipe.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
