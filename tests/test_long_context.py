"""A bundle that holds at the length it was verified at and breaks where it is served, and the gate that sees it.

The real default model (SmolLM2-135M) given a k_proj bias of 40 in one slow RoPE pair (21 of 32, θ = 7.5e-4: 0.19 rad
over the 256 calibration positions, 1.5 rad by 2K) in every layer: its post-RoPE key mean turns with position, as
a Qwen2.5 key bias does over 32K. Calibrated on 256-token windows, its keys exported per token (the published
format, centred on the probe's mean) leave INT2 noise that grows with position: verify passes them at 512 tokens
and fails them at 2,048, in the late position buckets. Exported with the key format scored at far positions (the
default), the same calibration holds at 2,048.
"""

import pytest
import torch

from oscar_core.calibrate.calibration import CalibrationRequest, calibrate
from oscar_core.calibrate.data import load_samples
from oscar_core.calibrate.derive import DeriveOptions, key_formats
from oscar_core.calibrate.export import export_bundle
from oscar_core.calibrate.models import load_model
from oscar_core.evaluate.verify import gate, verify
from oscar_core.formats.bundle import load_bundle

PAIR, BIAS = 21, 40.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drifting_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("drift")
    base = load_model(None)
    config = base.model.config
    config.attention_bias = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(base.model.state_dict(), strict=False)   # the biases are new
    d = config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(config.num_key_value_heads, d)
            bias[:, PAIR] = bias[:, PAIR + d // 2] = BIAS
    model.save_pretrained(out)
    base.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bundles(drifting_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("drift-run")
    calibrate(CalibrationRequest(model=str(drifting_model), samples=4, seq_len=256, device="cpu", dtype="float32"),
              root / "calib")
    token, _ = export_bundle(root / "calib", root / "token", opts=DeriveOptions(key_formats=key_formats("token")))
    scored, _ = export_bundle(root / "calib", root / "auto")
    return load_bundle(token), load_bundle(scored)


def judged(loaded, bundle, length: int) -> tuple[list[str], dict]:
    ids, _ = load_samples("default-heldout", loaded.tokenizer, 1, length, 0)
    report = verify(loaded, bundle, ids, use_kernels=False, compared=("oscar", "kivi"), positions=64)
    report.update(seq_len=length, sink_tokens=64, recent_tokens=256)
    return gate(report), report


def test_verify_fails_at_the_served_length_a_bundle_that_passes_short(drifting_model, bundles):
    token, scored = bundles
    loaded = load_model(str(drifting_model))
    assert judged(loaded, token, 512)[0] == []
    reasons, report = judged(loaded, token, 2048)
    late = [r for r in reasons if r.startswith("OSCAR loses to KIVI-style at positions")]
    assert late and "positions 1793-2047" in " ".join(late), reasons
    excess = report["buckets"]["excess"]["oscar"]
    assert excess[-1] > 4 * max(excess[:4]) and excess[-1] > report["buckets"]["excess"]["kivi"][-1]

    assert all(e.key_axis == "channel" for e in scored.manifest.quant.layers)   # scored where it is served
    assert judged(loaded, scored, 2048)[0] == []
