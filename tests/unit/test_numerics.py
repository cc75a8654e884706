"""The like-with-like helpers of tests/support/numerics.py: float32 losses compared at float32's
tolerance, and references run at a LocalCluster stage's thread count."""

from __future__ import annotations

import pytest
import torch

from tests.support.numerics import STAGE_THREADS, assert_losses_close, stage_threads

# Issue 18: the same GPT-2 loss from the pipeline and from Hugging Face, two float32 units
# in the last place apart (relative 1.3e-7): AVX-512 kernels added in another order.
HF_LOSS, PIPELINE_LOSS = 3.7296767234802246, 3.729677200317383


@pytest.mark.timeout(10)
def test_float32_losses_are_compared_at_float32_tolerance() -> None:
    """Two float32 losses two units apart pass, where assert_close on the Python floats
    applies float64's tolerance and fails; a difference of 1e-4 still fails, and
    ``exact`` admits no difference."""
    for loss in (HF_LOSS, PIPELINE_LOSS):
        assert torch.tensor(loss).item() == loss  # both are float32 values
    with pytest.raises(AssertionError):
        torch.testing.assert_close([PIPELINE_LOSS], [HF_LOSS])
    assert_losses_close([PIPELINE_LOSS, 1.0], [HF_LOSS, 1.0])
    with pytest.raises(AssertionError):
        assert_losses_close([PIPELINE_LOSS], [HF_LOSS * (1 + 1e-4)])
    with pytest.raises(AssertionError):
        assert_losses_close([PIPELINE_LOSS], [HF_LOSS], exact=True)
    assert_losses_close([PIPELINE_LOSS], [PIPELINE_LOSS], exact=True)


@pytest.mark.timeout(10)
def test_stage_threads_runs_the_block_at_a_stages_count_and_restores_it() -> None:
    """Inside: LocalCluster's default threads_per_stage (1); after, the count before, even
    when the block raises."""
    assert STAGE_THREADS == 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with stage_threads():
            assert torch.get_num_threads() == STAGE_THREADS
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), stage_threads(3):
            assert torch.get_num_threads() == 3
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
