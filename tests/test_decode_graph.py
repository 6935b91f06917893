import os

import pytest
import torch

from oscar_core.serve.decode_graph import compile_shared_parts


@pytest.mark.slow
@pytest.mark.skipif("ATEN_CPU_CAPABILITY" in os.environ,
                    reason="inductor's CPU code under a forced ATen capability gives NaN norms (torch 2.13, avx2 on an "
                           "avx512 CPU); the serving benchmark compiles for the GPU")
def test_compile_shared_parts_swaps_norms_and_mlps_and_keeps_the_logits():
    """Every RMSNorm and MLP of a tiny Qwen3 (four norms and an MLP a layer, the final norm) becomes its compiled
    form; attention and its projections stay; the logits match the model's own within float32 rounding."""
    import transformers as tf

    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                         num_key_value_heads=2, head_dim=16, vocab_size=100)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(ids).logits
        assert compile_shared_parts(model) == 2 * 5 + 1
        layer = model.model.layers[0]
        compiled = [type(m).__name__ for m in (layer.mlp, layer.self_attn.k_norm, layer.input_layernorm)]
        assert compiled == ["OptimizedModule"] * 3
        assert type(layer.self_attn.q_proj) is torch.nn.Linear
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
