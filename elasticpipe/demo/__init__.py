"""``elasticpipe demo``: the run, what it records, its picture, and its corpus.

* ``corpus``: An offline character-level corpus (the standard library's own source) and text
  sampling.
* ``plot``: The demo's picture: steps/s over time with the events marked, and the partition over
  time.
* ``record``: What the demo records as it trains: one sample per step, the events, and the
  phases.
* ``run``: ``elasticpipe demo``: a local cluster trains a character-level GPT on Python's own
  source.
"""

from elasticpipe.demo.corpus import CharCorpus
from elasticpipe.demo.record import Timeline
from elasticpipe.demo.run import run_demo

__all__ = ["CharCorpus", "Timeline", "run_demo"]
