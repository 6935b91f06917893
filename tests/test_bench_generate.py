"""bench/generate.py's pure parts: the prompts it builds and how it compares greedy tokens."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import generate  # noqa: E402


def test_same_prefix_counts_tokens_before_the_first_difference():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    got = torch.tensor([[1, 2, 0, 4], [5, 6, 7, 8], [0, 9, 9, 9]])
    assert generate.same_prefix(got, ref) == pytest.approx((2 + 4 + 0) / 3)


def test_prompts_are_windows_of_the_heldout_stream_from_spread_offsets(default_model):
    tok = default_model.tokenizer
    ids = generate.prompts(tok, 200, 3)
    assert ids.shape == (3, 200)
    assert len({tuple(row.tolist()) for row in ids}) == 3
    stream = []
    from oscar_core import data
    for doc in data.texts(data.DEFAULT_HELDOUT):
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[0].tolist() == stream[:200]
    start = len(stream) // 3
    assert ids[1].tolist() == (stream + stream)[start:start + 200]
    long = generate.prompts(tok, len(stream) + 50, 1)       # longer than the text: the stream cycles
    assert long[0, len(stream):].tolist() == stream[:50]
