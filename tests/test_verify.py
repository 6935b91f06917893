"""oscar_core.evaluate.verify: the per-layer attention error, the end-to-end figures, the gate; a bundle that breaks
a real model's layer fails, the committed one passes."""

import math
from pathlib import Path

import pytest
import torch

from oscar_core.calibrate.data import DEFAULT_HELDOUT, load_samples
from oscar_core.evaluate.fidelity import capture_attention
from oscar_core.evaluate.verify import (gate, layer_errors, layer_ranking, merge_reports, query_positions,
                                        restored)
from oscar_core.formats.bundle import load_bundle, write_bundle
from oscar_core.serve import methods

COMMITTED = Path(__file__).resolve().parents[1] / "zoo" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "v1"
BROKEN_LAYER = 13


def broken_bundle(out: Path, layers: tuple[int, ...] = (BROKEN_LAYER,), factor: float = 0.05) -> Path:
    """The committed SmolLM2 bundle with some layers' keys quantized per token and their clips scaled by `factor`
    (re-signed: every check passes). Per token, every key leaves the BF16 window on its own, so the damage reaches
    a short sample; the committed layers keep keys per channel, whose blocks of 64 barely leave the window there."""
    b = load_bundle(COMMITTED)
    tensors = dict(b.tensors)
    for layer in layers:
        tensors[f"layers.{layer}.key_clip"] = tensors[f"layers.{layer}.key_clip"] * factor
    quant = b.manifest.quant
    entries = [e.model_copy(update={"key_axis": "token"}) if e.layer in layers else e for e in quant.layers or ()]
    write_bundle(out, b.manifest.model_copy(update={"quant": quant.model_copy(update={"layers": entries or None})}),
                 tensors)
    return out


def report_with(kl=0.01, kivi_kl=0.02, ppl=20.0, kivi_ppl=21.0, logit=0.2):
    return {"end_to_end": {"kl": kl, "kivi_kl": kivi_kl, "ppl": ppl, "kivi_ppl": kivi_ppl},
            "mean": {"oscar_key": logit}}


def test_the_gate_fails_a_bundle_that_loses_to_kivi_or_passes_the_kl_bound():
    assert gate(report_with(), 0.1) == []
    assert gate(report_with(kl=0.0205, ppl=21.01), 0.1) == []  # ties: within 0.001 nats and 0.1%
    assert gate(report_with(kl=0.03), 0.1) == [
        "OSCAR loses to KIVI-style: next-token KL 0.0300 > 0.0200 nats"]
    assert gate(report_with(ppl=21.5), 0.1) == ["OSCAR loses to KIVI-style: perplexity 21.500 > 21.000"]
    assert gate(report_with(kl=0.2, kivi_kl=0.3), 0.1) == [
        "OSCAR's next-token KL 0.2000 nats is above the bound 0.1"]
    assert gate(report_with(), 0.1, max_logit_error=0.01) == [
        "OSCAR mean logit error 0.2000 is above the threshold 0.01"]
    assert gate(report_with(), 0.1, max_logit_error=0.5) == []
    assert gate(report_with(kl=0.2, kivi_kl=0.3)) == []   # no absolute bound unless one is given


def test_the_gate_reads_position_buckets_and_needles_beyond_their_noise():
    def with_buckets(ours, kivi, se, correct=(8, 8)):
        return {**report_with(), "buckets": {"bounds": [[1, 10], [11, 20]], "excess": {"oscar": ours, "kivi": kivi},
                                             "standard_error": se},
                "needle": {"prompts": 10, "correct": {"oscar": correct[0], "kivi": correct[1]}}, "seq_len": 20}

    assert gate(with_buckets([0.01, 0.02], [0.05, 0.06], [0.01, 0.01])) == []
    assert gate(with_buckets([0.01, 0.05], [0.05, 0.04], [0.01, 0.01])) == []   # within two standard errors
    assert gate(with_buckets([0.01, 0.30], [0.05, 0.04], [0.01, 0.01])) == [
        "OSCAR loses to KIVI-style at positions 11-20: NLL excess over BF16 +0.3000 > +0.0400 nats a token"]
    assert gate(with_buckets([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], correct=(1, 2))) == []   # noise
    assert gate(with_buckets([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], correct=(1, 8))) == [
        "OSCAR retrieves fewer needles than KIVI-style at 20 tokens: 1 < 8 of 10"]


def test_samples_merge_with_perplexity_pooled_over_tokens():
    def sample(ppl, kl):
        return {"path": "torch reference", "layers": [{"layer": 0, "kv_head": 0, "oscar_attention": kl}],
                "mean": {"oscar_attention": kl}, "end_to_end": {"kl": kl, "ppl": ppl, "bf16_ppl": ppl}}

    merged = merge_reports([sample(10.0, 0.1), sample(40.0, 0.3)])
    assert math.isclose(merged["end_to_end"]["ppl"], 20.0) and math.isclose(merged["end_to_end"]["kl"], 0.2)
    assert math.isclose(merged["layers"][0]["oscar_attention"], 0.2)


def test_restored_keys_follow_the_methods_axis_and_keep_the_sink():
    """KIVI-style keys are quantized per channel over blocks of G tokens after the sink, as the cache stores them."""
    x = torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(0)) + torch.linspace(-3, 3, 64)
    lm = methods.layer_method("kivi", 0, 2, 64)
    k_hat = restored(lm.key, x, sink=8)
    assert k_hat.dtype == torch.float64 and torch.equal(k_hat[:, :8], x[:, :8].double())
    assert torch.equal(k_hat[:, 8:].float(), methods.fake(lm.key, x[:, 8:]))
    assert torch.equal(k_hat[:, 8 + 192:], x[:, 8 + 192:].double())  # the partial block stays exact
    token = restored(methods.layer_method("int2", 0, 2, 64).key, x, sink=8)
    assert not torch.allclose(token, k_hat)
    assert query_positions(100, 64, 512) is None and len(query_positions(4096, 64, 512)) == 512


@pytest.mark.slow
def test_the_attention_error_ranks_a_broken_layer_worst(default_model, tmp_path):
    """Real model, real held-out text: the layer whose key clips were cut is the worst by attention error, and on
    the committed bundle OSCAR's attention error is below KIVI-style's, Hadamard's and no rotation's."""
    ids, _ = load_samples(DEFAULT_HELDOUT, default_model.tokenizer, 1, 512, 0)
    held = capture_attention(default_model.model, ids)
    rows = layer_errors(held, load_bundle(COMMITTED), positions=256)
    assert len(rows) == 30 * 3
    mean = {m: sum(r[f"{m}_attention"] for r in rows) / len(rows) for m in ("oscar", "kivi", "hadamard", "int2")}
    assert mean["oscar"] < mean["kivi"] < mean["hadamard"] < mean["int2"], mean
    broken = layer_errors(held, load_bundle(broken_bundle(tmp_path / "broken")), compared=("oscar",), positions=256)
    assert layer_ranking(broken)[0] == BROKEN_LAYER
    worst = [r["oscar_attention"] for r in broken if r["layer"] == BROKEN_LAYER]
    assert min(worst) > 2 * max(r["oscar_attention"] for r in rows if r["layer"] == BROKEN_LAYER)
