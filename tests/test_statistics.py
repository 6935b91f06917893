import pytest
import torch
from conftest import tiny_model

from oscar_core.calibrate.models import check_supported
from oscar_core.calibrate.statistics import AttentionStatistics, observe_attention
from oscar_core.errors import OscarError

ARCHITECTURES = ["llama", "qwen3", "qwen2", "mistral", "gemma"]


def gather(model, ids):
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    stats = AttentionStatistics(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim,
                                probe_tokens=16, probe_queries=8)
    with torch.no_grad(), observe_attention(model, stats.observe):
        logits = model(ids).logits
    return stats, logits


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_hook_keeps_logits_and_matches_the_cache(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids, use_cache=True)
    stats, logits = gather(model, ids)
    assert torch.allclose(logits, reference.logits, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored
    for layer in range(model.config.num_hidden_layers):
        keys = reference.past_key_values.layers[layer].keys.double()  # post-RoPE keys, as the cache stores them
        values = reference.past_key_values.layers[layer].values.double()
        k = keys.transpose(0, 1).flatten(1, 2)
        assert torch.allclose(stats.key_covariance(layer), k.mT @ k / k.shape[1], atol=1e-6)
        assert torch.allclose(stats.key_mean(layer), k.mean(1), atol=1e-6)
        assert torch.allclose(stats.value_mean(layer), values.transpose(0, 1).flatten(1, 2).mean(1), atol=1e-6)
        assert stats.acc["query_rows"][layer] == 2 * 24 * model.config.num_attention_heads // model.config.num_key_value_heads
        for cov in (stats.query_covariance(layer), stats.score_weighted_value_covariance(layer)):
            assert torch.allclose(cov, cov.mT)
            assert torch.linalg.eigvalsh(cov).min() > -1e-9
    assert stats.non_finite() is None
    probe = stats.probe(0)
    assert probe["key"].shape[0] == 2 and probe["key"].shape[2] == 16 and probe["query"].shape[2] == 8


def test_score_weighted_value_covariance_is_attention_output_covariance():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    outputs = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: outputs.append(a[0]))
    stats, _ = gather(model, ids)
    hook.remove()
    o = outputs[0].reshape(1, 20, 4, 16).double()  # [B, T, heads, d], before o_proj
    o = o.reshape(1, 20, 2, 2, 16).permute(2, 0, 3, 1, 4).reshape(2, -1, 16)  # grouped by KV head
    assert torch.allclose(stats.score_weighted_value_covariance(0), o.mT @ o / o.shape[1], atol=1e-6)


def test_accumulation_is_additive_and_roundtrips():
    model = tiny_model("qwen3")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    whole, _ = gather(model, ids)
    half, _ = gather(model, ids[:1])
    with torch.no_grad(), observe_attention(model, half.observe):
        model(ids[1:])
    for name in ("query_cov", "output_cov", "key_sum"):
        assert torch.allclose(whole.acc[name], half.acc[name], atol=1e-6)
    again = AttentionStatistics.from_state_dict(whole.state_dict(), model.config.num_attention_heads)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in whole.state_dict().items())


def test_nan_is_detected():
    stats = AttentionStatistics(1, 2, 1, 4)
    stats.acc["query_cov"][0, 0, 0, 0] = float("nan")
    assert stats.non_finite() == "query_cov"


def test_unsupported_architecture():
    with pytest.raises(OscarError, match="unsupported architecture"):
        check_supported(torch.nn.Linear(2, 2))
