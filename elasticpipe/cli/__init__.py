"""The ``elasticpipe`` command: its parser and entry point, the two servers' commands, the
admin commands, the live watch, and the JSON schemas of ``--json``.

* ``admin``: ``elasticpipe admin``: the operator's view of a running cluster, and its levers.
* ``entry``: The ``elasticpipe`` command: its parser and ``main``; demo, certs, export-hf
  and admin.
* ``process``: How a coordinator's or stage's process ends once its server has stopped
  cleanly: at once, without the interpreter's teardown.
* ``schemas``: JSON Schemas of what ``elasticpipe admin COMMAND --json`` prints: the contract
  for scripts.
* ``serve``: ``elasticpipe coordinator`` and ``elasticpipe stage``: their flags, their
  configs, serving until SIGTERM/SIGINT.
* ``watch``: ``elasticpipe admin status --watch``: a live view of the cluster, redrawn every
  interval.
"""

from elasticpipe.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
