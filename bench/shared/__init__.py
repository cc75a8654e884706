"""Code several benches share, imported as ``shared.<module>`` (``bench/`` is the script's folder).

A package rather than a module beside the benches: ``tests/integration/test_benches.py`` runs
every ``bench/*.py`` as a bench.

* ``devices``: ``--timer``, how stages time their ops for an emulated device;
* ``steps``: ``--steps`` with ``--quick``: the fewest steps a bench can measure with;
* ``timing``: the median wall-clock seconds of a call.
"""

__all__: list[str] = []
