"""Sliding-window layers (layers.py) on tiny random Gemma 3, Mistral and Qwen2 whose windows (8 tokens) are far
shorter than the test sequences: simulation, the calibration hook and OscarCache attend exactly as the model does."""

import math

import pytest
import torch
import transformers as tf
from conftest import TINY, tiny_model, tiny_sliding_model

from oscar_core.calibrate.statistics import observe_attention
from oscar_core.errors import OscarError
from oscar_core.layers import (LayerSpec, attention_layer_ids, check_config, holds_int2, int2_layer_ids, int2_reason,
                               layer_specs, visible, window_recent, windowed_attention, windows)
from oscar_core.serve.cache import OscarCache, OscarLayer, RingLayer, exact_cache, fill, memory_plan
from oscar_core.serve.simulate import simulate_int2

KINDS = ["gemma3", "mistral", "qwen2"]
WINDOW = 8


def ids(t, seed=0):
    return torch.randint(0, TINY["vocab_size"], (1, t), generator=torch.Generator().manual_seed(seed))


def test_layer_specs_follow_transformers_conventions():
    gemma = tf.Gemma3TextConfig(num_hidden_layers=7, sliding_window=512, query_pre_attn_scalar=256)
    assert windows(layer_specs(gemma)) == {0: 512, 1: 512, 2: 512, 3: 512, 4: 512, 6: 512}   # five of every six
    assert layer_specs(gemma)[5] == LayerSpec(window=None, scaling=256 ** -0.5)
    assert windows(layer_specs(tf.MistralConfig(num_hidden_layers=2, sliding_window=4096))) == {0: 4096, 1: 4096}
    qwen2 = tf.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert windows(layer_specs(qwen2)) == {2: 64, 3: 64}
    for plain in (tf.Qwen2Config(num_hidden_layers=4), tf.LlamaConfig(num_hidden_layers=2),
                  tf.Qwen3Config(num_hidden_layers=2)):
        assert windows(layer_specs(plain)) is None and attention_layer_ids(plain) is None
    assert attention_layer_ids(gemma) is None
    # INT2 only where the window is over 2·(sink + recent): Gemma 3's 512 is a BF16 ring at 64 + 256.
    assert int2_layer_ids(layer_specs(gemma), 64, 256) == [5]
    reason = int2_reason(layer_specs(gemma), 64, 256)
    assert reason.startswith("layers 0, 1, 2, 3, 4, 6 attend to a sliding window of 512 tokens")
    assert holds_int2(LayerSpec(window=4096), 64, 256) and not holds_int2(LayerSpec(kv_cache=False), 64, 256)


def test_visible_matches_transformers_sliding_mask():
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(5)
    t = torch.tensor
    want = torch.tensor([[bool(fn(t(0), t(0), t(q), t(k))) for k in range(12)] for q in range(12)])
    assert torch.equal(visible(torch.arange(12), 12, 5), want)
    assert visible(torch.arange(12), 12, 5).sum(-1).max() == 5          # a query sees W tokens, its own included


@pytest.mark.parametrize("config,what", [
    (tf.Gemma2Config(num_hidden_layers=2), "attention-logit soft-capping"),
    (tf.Llama4TextConfig(num_hidden_layers=2), "chunked attention"),
    (tf.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True), "bidirectional attention"),
])
def test_unmodelled_attention_is_refused(config, what):
    with pytest.raises(OscarError, match=what) as e:
        check_config(config, "Model")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_bf16_equals_the_models_forward(kind):
    """simulate's bf16 arm (what eval's BF16 perplexity and verify's reference run) is the model's own forward up to
    the BF16 rounding of K and V; attending globally instead would be far off."""
    model = tiny_sliding_model(kind, WINDOW)
    x = ids(48)
    with torch.inference_mode():
        want = model(x).logits
        with simulate_int2(model, "bf16"):
            got = model(x).logits
        wide = tiny_sliding_model(kind, 10_000)       # same weights, windows wider than the sequence
        wide.load_state_dict(model.state_dict())
        global_ = wide(x).logits
    scale = want.abs().max()
    err = float((got - want).abs().max() / scale)
    assert err < 1e-2, err
    assert float((global_ - want).abs().max() / scale) > 10 * err


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_bf16_perplexity_equals_the_models(kind):
    from oscar_core.evaluate.perplexity import negative_log_likelihood, perplexity

    model = tiny_sliding_model(kind, WINDOW)
    wins = torch.cat([ids(64, 1), ids(64, 2)])
    nll, n = 0.0, 0
    for row in wins:
        a, b = negative_log_likelihood(model, row[None])
        nll, n = nll + a, n + b
    got = perplexity(model, wins, "bf16", None)
    assert abs(got / math.exp(nll / n) - 1) < 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_calibration_hook_sees_windowed_attention(kind):
    """The observer gets the attention output the model computes (windowed), and the logits are unchanged."""
    model = tiny_sliding_model(kind, WINDOW)
    x, seen = ids(40), {}

    def keep(layer, q, k, v, out, scaling):
        seen[layer] = (q, k, v, out, scaling)

    with torch.inference_mode():
        want = model(x).logits
        with observe_attention(model, keep):
            got = model(x).logits
    assert torch.allclose(got, want, atol=1e-5)
    specs = layer_specs(model.config)
    for layer, (q, k, v, out, scaling) in seen.items():
        group = q.shape[1] // k.shape[1]
        s = scaling * q @ k.repeat_interleave(group, 1).mT
        s = s.masked_fill(~visible(torch.arange(40), 40, specs[layer].window), float("-inf"))
        exact = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
        assert torch.allclose(out.transpose(1, 2), exact, atol=1e-5), layer
    assert any(s.window for s in specs)


def test_windowed_attention_is_chunked_exactly():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 30, 16, generator=g)
    k, v = torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    mask = visible(torch.arange(20, 50), 50, 7)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.allclose(windowed_attention(q, k, v, 0.3, 7, chunk=4), want, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_cache_decodes_as_generate(kind):
    """Greedy decoding through OscarCache("bf16") equals transformers' generate token for token past the window; a
    sliding layer holds only its last W − 1 tokens (a BF16 ring), and the bytes count them."""
    model = tiny_sliding_model(kind, WINDOW)
    x = ids(20)
    args = dict(attention_mask=torch.ones_like(x), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.inference_mode():
        want = model.generate(x, **args)
        cache = OscarCache(None, "bf16", config=model.config)
        got = model.generate(x, past_key_values=cache, **args)
    assert torch.equal(got, want)
    specs = layer_specs(model.config)
    for spec, layer in zip(specs, cache.layers):
        assert isinstance(layer, RingLayer) == (spec.window is not None)
    assert cache.ring_layers and all(layer.keys.shape[2] == WINDOW - 1 for layer in cache.ring_layers)
    # Storage of W tokens a ring (a decode step's ring is a view of its W tokens), as memory_plan counts it.
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert all(layer.nbytes() == 2 * 2 * WINDOW * head_dim * 2 for layer in cache.ring_layers)
    assert cache.bf16_nbytes() == cache.nbytes()


def test_int2_cache_keeps_short_windows_in_bf16_and_decodes_the_global_layer():
    """Gemma 3: the short sliding windows hold no INT2 (window stores of the sink and an N-slot BF16 ring), the global
    layer INT2; an exact prefill written into the cache (fill) decodes on like the cache that saw the whole prompt."""
    model = tiny_sliding_model("gemma3", WINDOW)
    cache = OscarCache(None, "int2", config=model.config, sink_tokens=2, recent_tokens=4)
    assert [type(layer) for layer in cache.layers] == [OscarLayer] * 3
    assert [layer.int2 for layer in cache.layers] == [False, True, False]
    assert [type(layer) for layer in OscarCache(None, "kivi", config=model.config).layers] == [RingLayer, OscarLayer,
                                                                                              RingLayer]
    x = ids(30)
    with torch.inference_mode():
        prefill = exact_cache(cache)
        model(input_ids=x[:, :-1], past_key_values=prefill, use_cache=True)
        filled = fill(OscarCache(None, "int2", config=model.config, sink_tokens=2, recent_tokens=4), prefill)
        a = model(input_ids=x[:, -1:], past_key_values=filled, use_cache=True).logits
        model(input_ids=x[:, :-1], past_key_values=cache, use_cache=True)
        b = model(input_ids=x[:, -1:], past_key_values=cache, use_cache=True).logits
    assert torch.allclose(a, b, atol=1e-5)
    store = filled.layers[0].store
    assert store.key_codes.shape[2] == 0 and store.ring_slots == WINDOW and filled.layers[0].int2_tokens() == 0
    assert filled.layers[1].int2_tokens() == 30 - 2 - 4


def generated_and_simulated(model, cache, new_tokens: int):
    """Greedy decoding of `new_tokens` after one token through `cache` ("int2", sink 1, recent 3): the sequence, each
    decoded token's logits, and simulate's teacher-forced logits at those positions."""
    x = ids(1)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        with simulate_int2(model, "int2", sink_tokens=1, recent_tokens=3):
            simulated = model(out.sequences[:, :-1]).logits[0]
    return out.sequences, torch.stack(out.logits, 1)[0], simulated


def test_long_window_layer_holds_int2_and_decodes_as_simulated():
    """A window longer than 2·(sink + recent) but too short for a tile of INT2 rows beside the recent ones holds INT2
    in SideStores trimmed to its last W − 1 tokens: each decoded token's logits equal simulate's teacher-forced
    logits at that position."""
    model = tiny_sliding_model("mistral", 12)
    cache = OscarCache(None, "int2", config=model.config, sink_tokens=1, recent_tokens=3)
    assert all(isinstance(layer, OscarLayer) and layer.window == 12 for layer in cache.layers)
    sequences, decoded, simulated = generated_and_simulated(model, cache, 30)
    assert torch.allclose(decoded, simulated, atol=1e-4)
    with torch.inference_mode():
        exact = model(sequences[:, :-1]).logits[0]
    assert not torch.allclose(decoded, exact, atol=1e-3)   # INT2 was read
    for layer in cache.layers:                            # the last 11 tokens: 3 recent in BF16, 8 INT2
        assert layer.get_seq_length() == 30 and layer.key_store.held() == 11 and layer.key_store.n_int2 == 8
    assert cache.bf16_nbytes() == 3 * 2 * 2 * 11 * 16 * 2


def test_short_window_store_decodes_as_simulated():
    """A window of 8 (not over 2·(sink + recent)) is a window store with no INT2 rows and no sink, 8 BF16 slots:
    decoding past the window, each token's logits equal simulate's, which reads that layer in BF16, and the cache
    holds the window, its bytes whole from the first update."""
    from oscar_core import kvstore

    model = tiny_sliding_model("gemma3", WINDOW)
    cache = OscarCache(None, "int2", config=model.config, sink_tokens=1, recent_tokens=3)
    _, decoded, simulated = generated_and_simulated(model, cache, 40)
    assert torch.allclose(decoded, simulated, atol=1e-4)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for layer in cache.layers[::2]:
        assert layer.store.key_codes.shape[2] == 0 and layer.int2_tokens() == 0 and layer.get_seq_length() == 40
        assert layer.sink_tokens == 0 and layer.nbytes() == kvstore.store_nbytes(
            1, WINDOW, layer.shape[0], head_dim, *layer.group_sizes, sink_tokens=0, recent_tokens=WINDOW, rows=0) - 4


def test_window_store_decodes_as_simulated():
    """A window of 80 with a tile of INT2 rows beside the recent 3 is a window's store (the sink of 1, 64 INT2 rows,
    16 BF16 slots: layers.window_recent): decoding past the window, each token's logits equal simulate's at its
    position (the sink token read while in the window), and the cache holds the window, its bytes whole from the
    first update."""
    from oscar_core import kvstore

    model = tiny_sliding_model("mistral", 80)
    cache = OscarCache(None, "int2", config=model.config, sink_tokens=1, recent_tokens=3)
    assert window_recent(80, 3) == 16 and window_recent(80, 3, token_block=128) == 3
    assert window_recent(80, 3, stored=False) == 3 and window_recent(None, 3) == 3
    _, decoded, simulated = generated_and_simulated(model, cache, 120)
    assert torch.allclose(decoded, simulated, atol=1e-4)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for layer in cache.layers:
        assert layer.store.window == 80 and layer.int2_tokens() == 64 and layer.get_seq_length() == 120
        assert layer.nbytes() == kvstore.store_nbytes(1, 81, layer.shape[0], head_dim, *layer.group_sizes,
                                                      sink_tokens=1, recent_tokens=16) - 4
    groups = dict(zip(("key_group_size", "value_group_size"), cache.layers[0].group_sizes))
    plan = memory_plan(len(cache.layers), cache.layers[0].shape[0], head_dim, 120, **groups, sink_tokens=1,
                       recent_tokens=3, windows=[80] * len(cache.layers))
    assert plan["bytes_per_sequence"] == cache.nbytes() + 4 * len(cache.layers)
    assert cache.bf16_nbytes() == len(cache.layers) * 2 * 2 * 80 * head_dim * 2


@pytest.mark.parametrize("method", ["kivi", "int2"])
def test_long_window_prefill_then_decode(method):
    """A prefill longer than the window, then decode steps, through a trimmed INT2 window (KIVI keys: whole blocks
    of 8 tokens leave the window together): each decoded token's attention reads what simulate gives its position.
    One layer, so that its keys and values do not depend on the prefill attending exactly (as the cache's does)."""
    model = tiny_sliding_model("mistral", 24)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    cache = OscarCache(None, method, config=model.config, sink_tokens=2, recent_tokens=4)
    x = ids(60)
    with torch.inference_mode():
        prefill = model(x[:, :40], past_key_values=cache, use_cache=True).logits[0]
        steps = [model(x[:, p:p + 1], past_key_values=cache, use_cache=True).logits[0, -1] for p in range(40, 60)]
        with simulate_int2(model, method, sink_tokens=2, recent_tokens=4):
            simulated = model(x).logits[0]
        exact = model(x).logits[0]
    assert torch.allclose(prefill, exact[:40], atol=1e-5)
    assert torch.allclose(torch.stack(steps), simulated[40:], atol=1e-4)
    assert not torch.allclose(simulated[40:], exact[40:], atol=1e-3)
    (layer,) = cache.layers
    assert layer.get_seq_length() == 60 and 23 <= layer.key_store.held() < 23 + 8


def test_memory_plan_counts_the_rings():
    """Gemma 3 270M's shape: 18 layers, five of six sliding with a 512-token window: in the INT2 cache a window store
    of 64 + 512 BF16 tokens and its length (no INT2 rows), in the BF16 cache a ring of 512."""
    w = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    plan = memory_plan(18, 1, 256, 32768, windows=w)
    int2 = memory_plan(3, 1, 256, 32768)
    ring = 15 * 2 * 512 * 256 * 2
    assert plan["bytes_per_sequence"] == int2["bytes_per_sequence"] + 15 * (2 * (64 + 512) * 256 * 2 + 4)
    assert plan["bf16_bytes_per_sequence"] == int2["bf16_bytes_per_sequence"] + ring
    assert plan["bytes_per_token"] == int2["bytes_per_token"]
    assert memory_plan(2, 1, 64, 4096, windows=[None, None]) == memory_plan(2, 1, 64, 4096)


def test_global_models_are_unchanged():
    model = tiny_model("llama")
    assert windows(layer_specs(model.config)) is None
    cache = OscarCache(None, "int2", config=model.config)
    assert all(isinstance(layer, OscarLayer) and layer.window is None for layer in cache.layers)


def test_verify_metrics_read_the_window():
    """metrics.causal_attention (verify's value error) masks a sliding layer's keys as the model does."""
    from oscar_core.metrics import causal_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 30, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = windowed_attention(q, k, v, 0.25, 6, chunk=7)
    assert torch.allclose(causal_attention(q, k, v, 0.25, torch.arange(30), 6), want, atol=1e-10)
    assert torch.equal(causal_attention(q, k, v, 0.25, torch.arange(30), None),
                       causal_attention(q, k, v, 0.25, torch.arange(30), 10_000))


def test_hooks_refuse_a_window_the_config_does_not_state():
    """The window a layer passes its attention function is checked against layers.layer_specs: a model attending
    otherwise than its config says is refused in one line rather than observed or simulated wrongly."""
    model = tiny_sliding_model("gemma3", WINDOW)
    model.config.sliding_window = 16             # the modules were built with 8 and still pass it
    with torch.inference_mode(), pytest.raises(OscarError, match="layer 0 attends to a sliding window of 8 tokens, "
                                                                 "its config says 16"):
        with observe_attention(model, lambda *args: None):
            model(ids(20))
    with torch.inference_mode(), pytest.raises(OscarError, match="its config says 16"):
        with simulate_int2(model, "bf16"):
            model(ids(20))

