"""oscar_core.publish.served: the served variant of an upstream export, measured by verify in memory, and the
export's gate."""

import json

import pytest
from conftest import calibrate_and_export, run_cli, tiny_model, write_tokenizer_and_corpus

from oscar_core.evaluate.verify import VerifyRequest, run_verify
from oscar_core.formats.bundle import ModelInfo
from oscar_core.publish import upstream
from oscar_core.publish.served import measure_served

SEQ = 384   # past the 64 sink and 256 recent BF16 tokens


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, 2 KV heads, head_dim 16) with its own tokenizer, in a directory."""
    out = tmp_path_factory.mktemp("llama")
    model = tiny_model("llama")
    model.resize_token_embeddings(write_tokenizer_and_corpus(out))
    model.config.max_position_embeddings = 512
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def calibrated(llama_dir, tmp_path_factory):
    """`oscar calibrate` and `oscar export` of the tiny Llama: (calibration directory, bundle directory)."""
    return calibrate_and_export(llama_dir, tmp_path_factory.mktemp("llama-run"))


def request(llama_dir, bundle, **kw) -> VerifyRequest:
    return VerifyRequest(bundle=bundle, model=str(llama_dir), data=str(llama_dir / "corpus.txt"), seq_len=SEQ,
                         device="cpu", **kw)


def test_the_served_variant_measures_as_the_files_read_back(llama_dir, calibrated, tmp_path):
    """In memory, before anything is written, verify sees what `oscar upstream import` reads back from the files."""
    calib, bundle = calibrated
    plan = upstream.plan_export(bundle, tmp_path / "rz", calib)
    report = measure_served(plan, request(llama_dir, bundle))
    assert report["name"] == f"local/{llama_dir.name}" and report["compare"]["bundle"] == str(bundle)
    directory = upstream.write_export(plan)
    model = ModelInfo.model_validate(plan.record["model"])
    imported, _, _ = upstream.import_upstream(directory, tmp_path / "imported", model)
    theirs = run_verify(request(llama_dir, imported, compare=bundle, needles=0))
    for section in ("end_to_end", "mean"):
        for key, value in report[section].items():
            assert value == theirs[section][key], (section, key)
    assert report["compare"]["end_to_end"] == theirs["compare"]["end_to_end"]
    assert report["layers"][0]["oscar_key"] == theirs["layers"][0]["oscar_key"]
    assert (report["passed"], report["reasons"]) == (theirs["passed"], theirs["reasons"])
    assert set(report["end_to_end"]) >= {"kl", "ppl", "kivi_kl", "kivi_ppl", "bf16_ppl"}


def test_export_prints_the_cost_and_refuses_a_failing_served_variant_unless_forced(llama_dir, calibrated, tmp_path,
                                                                                    capfd, monkeypatch):
    calib, bundle = calibrated
    out = tmp_path / "rz"
    args = ("upstream", "export", str(bundle), "--calibration", str(calib), "--out", str(out), "--model",
            str(llama_dir), "--device", "cpu", "--clips", "upstream")
    # 300 tokens leave nothing past the BF16 windows: verify's gate fails the served variant.
    code, text = run_cli(capfd, monkeypatch, *args, "--seq-len", "300")
    assert code == 1 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1].startswith("error: the served variant fails verify's gate at 300 tokens")
    assert "nothing is quantized at 300 tokens" in text and "--force writes it anyway" in text
    assert not out.exists()
    code, text = run_cli(capfd, monkeypatch, *args, "--seq-len", "300", "--force")
    assert code == 0, text
    (directory,) = out.glob("*/seq*_prompt*_group*")
    served = json.loads((directory / upstream.RECORD_FILE).read_text())["served"]
    assert (served["seq_len"], served["passed"], served["forced"]) == (300, False, True)
    code, text = run_cli(capfd, monkeypatch, *args, "--seq-len", str(SEQ), "--force")
    assert code == 0, text
    assert "--kv-cache-quant-group-size 16" in text and "SGLANG_OSCAR_K_CLIP_RATIO=0.96" in text
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [*upstream.FILES.values(), upstream.SERVE_FILE, upstream.RECORD_FILE])
    for row in ("the bundle", "served by SGLang", "KIVI-style INT2", "next-token KL", "perplexity"):
        assert row in text, row
    served = json.loads((directory / upstream.RECORD_FILE).read_text())["served"]
    assert served["seq_len"] == SEQ and served["forced"] == (not served["passed"])
    assert set(served["served"]) >= {"kl", "kivi_kl", "ppl", "kivi_ppl", "attention_error"}
    assert set(served["bundle"]) >= {"kl", "ppl", "attention_error"}
    assert f"{served['served']['kl']:.4f}" in text and f"{served['bundle']['kl']:.4f}" in text
