"""The client SDK: ``Pipeline`` drives micro-batches through the stage servers."""

from elasticpipe.client.pipeline import Pipeline, StageStep, StepStats

__all__ = ["Pipeline", "StageStep", "StepStats"]
