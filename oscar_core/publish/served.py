"""What the method authors' runtime would serve, measured before `oscar upstream export` writes it.

The served variant (upstream.served_bundle) is the bundle as `oscar upstream import` reads back the files an export
writes: keys and values not centred, one clip per side for every layer and KV head, keys per token in every layer,
the served group size, per-layer rotations broadcast to every KV head (what the export's record lists as dropped).
measure_served holds it in memory and runs verify on it (verify.measure_loaded) with the bundle itself as the
compared one, on held-out text of SEQ_LEN tokens unless told: verify's figures for the served variant, ours beside
them, and verify's gate for the served variant, which fails when its next-token KL, perplexity or NLL excess over
BF16 in a position bucket is worse than KIVI-style INT2's at the same length and bits.
"""

from collections.abc import Callable
from dataclasses import replace

from oscar_core.errors import OscarError
from oscar_core.evaluate.verify import (VerifyRequest, check_tensors, first_failure, headline, load_checked,
                                        measure_loaded, resolve_model_spec)
from oscar_core.publish.upstream import ExportPlan, served_bundle

SEQ_LEN = 2048      # verify's CPU length: past the BF16 windows, and minutes, not hours, on a CPU
COMPARED = ("oscar", "kivi")   # the served variant and what the gate holds it to


def measure_served(plan: ExportPlan, req: VerifyRequest, on_step: Callable[[str], None] | None = None) -> dict:
    """verify's report (verify.measure_loaded) for the plan's served variant, with the bundle at req.bundle as the
    compared one (report["compare"]); req.seq_len None: SEQ_LEN, capped by the model's context; needles only when
    asked. report["passed"] is verify's gate for the served variant."""
    from oscar_core.calibrate.models import load_model, resolve_device

    step = on_step or (lambda s: None)
    source = load_checked(req.bundle)
    m = source.manifest
    served = served_bundle(plan, m)
    failure = first_failure(check_tensors(served))
    if failure:
        raise OscarError(f"the served variant fails a bundle check: {failure}")
    device = resolve_device(req.device)
    step("loading the model")
    loaded = load_model(resolve_model_spec(req.model, m.model, m.calibration.model_source), device, req.dtype)
    limit = loaded.info.max_position_embeddings
    seq_len = req.seq_len or (min(SEQ_LEN, limit) if limit else SEQ_LEN)
    req = replace(req, seq_len=seq_len, needles=req.needles or 0)
    return measure_loaded(loaded, device, served, source, req, check_tensors(served), step, COMPARED)


def summary(report: dict, forced: bool = False) -> dict:
    """What oscar_upstream.json keeps of a measure_served report: the run, the gate, and verify's headline figures
    for the served variant ("served", with KIVI-style's) and for the bundle ("bundle")."""
    return {"seq_len": report["seq_len"], "samples": report["samples"], "data": report["data"],
            "device": report["device"], "passed": report["passed"], "reasons": report["reasons"], "forced": forced,
            "served": headline(report), "bundle": headline(report["compare"])}
