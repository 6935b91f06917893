import pytest
import torch

from oscar_core.metrics import same_prefix


def test_same_prefix_counts_tokens_before_the_first_difference():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    got = torch.tensor([[1, 2, 0, 4], [5, 6, 7, 8], [0, 9, 9, 9]])
    assert same_prefix(got, ref) == pytest.approx((2 + 4 + 0) / 3)
