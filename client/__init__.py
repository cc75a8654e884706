"""The client SDK: ``Pipeline`` drives micro-batches through the stage servers."""

from elasticpipe.client.pipeline import PartitionInfo, Pipeline, StepStats

__all__ = ["PartitionInfo", "Pipeline", "StepStats"]
