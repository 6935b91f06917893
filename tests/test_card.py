"""Model cards written from a manifest: hub-specific YAML front matter and a body that tells the bundle's story."""

import shlex

import pytest
import yaml
from test_cli import tiny_calibration

from oscar_core.calibrate.export import export_bundle
from oscar_core.publish import upstream
from oscar_core.publish.card import model_card
from tiny_bundle import tiny_manifest

REPO = "alice/tiny-oscar"


def split(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    _, meta, body = card.split("---\n", 2)
    return yaml.safe_load(meta), body


def test_hf_front_matter_follows_the_hub_convention():
    from huggingface_hub import ModelCard

    card = model_card(tiny_manifest(), "hf", REPO)
    meta, _ = split(card)
    assert meta == {"license": "apache-2.0", "library_name": "oscar", "base_model": "oscar-test/tiny-llama",
                    "base_model_relation": "adapter", "pipeline_tag": "text-generation",
                    "tags": ["kv-cache", "int2", "oscar", "quantization", "rotation"]}
    data = ModelCard(card).data   # the hub client's own reading of it
    assert (data.base_model, data.pipeline_tag, data.library_name) == ("oscar-test/tiny-llama", "text-generation",
                                                                       "oscar")
    assert data.to_dict()["base_model_relation"] == "adapter"


def test_modelscope_front_matter_follows_the_hub_convention():
    meta, _ = split(model_card(tiny_manifest(), "modelscope", REPO))
    assert meta["license"] == "Apache License 2.0"
    assert meta["base_model"] == ["oscar-test/tiny-llama"]
    assert meta["tasks"] == ["text-generation"] and meta["frameworks"] == ["pytorch"]
    assert {"kv-cache", "int2", "oscar"} <= set(meta["tags"])


@pytest.mark.parametrize("model_id", ["my-model-dir", "models/qwen3.Q8_0.gguf", 'odd: "name" #1'])
def test_base_model_is_left_out_when_the_model_is_no_hub_id(model_id):
    for hub in ("hf", "modelscope"):
        meta, body = split(model_card(tiny_manifest(model_id), hub, REPO))
        assert "base_model" not in meta and "base_model_relation" not in meta
        assert f"`{model_id}`" in body


def test_body_states_purpose_model_calibration_bits_and_usage():
    m = tiny_manifest()
    _, body = split(model_card(m, "hf", REPO))
    assert "# OSCAR rotations for oscar-test/tiny-llama (v1)" in body
    assert "2-bit integers (INT2)" in body and "no model weights" in body
    for text in ("LlamaForCausalLM", "| layers | 2 |", "| attention heads / KV heads | 4 / 2 |", "| head dim | 8 |",
                 f"`{m.model.revision}`", f"`{m.model.config_sha256}`", "U_Q·H·P_br", "U_S·H·P_br",
                 "values are centred", "groups of 8 channels"):
        assert text in body, text
    for text in ("| data | pydoc_data |", f"`{m.calibration.data_fingerprint}`", "8 × 512 (4,096 tokens)",
                 "| seed | 0 |"):
        assert text in body, text
    assert "| 32,768 | 2.281 |" in body and "| 131,072 | 2.271 |" in body
    assert f"sha256 `{m.tensors.sha256}`" in body
    assert f"hf download {REPO} --local-dir oscar-bundle" in body
    assert 'load_bundle("oscar-bundle")' in body


def test_fidelity_figures_appear_when_recorded_and_are_said_missing_otherwise():
    _, body = split(model_card(tiny_manifest(fidelity={"logit_error": 0.2312, "ppl_ratio": 1.0134}), "hf", REPO))
    assert "| logit_error | 0.2312 |" in body and "| ppl_ratio | 1.013 |" in body
    assert "No verify or eval figures" not in body
    _, body = split(model_card(tiny_manifest(fidelity={}), "hf", REPO))
    assert "No verify or eval figures were recorded" in body and "| logit_error |" not in body


def test_modelscope_card_uses_the_modelscope_download_command():
    _, body = split(model_card(tiny_manifest(), "modelscope", REPO))
    assert f"modelscope download {REPO} --local-dir oscar-bundle" in body and "hf download" not in body


def test_card_is_a_pure_function_of_its_inputs():
    assert model_card(tiny_manifest(), "hf", REPO) == model_card(tiny_manifest(), "hf", REPO)
    assert model_card(tiny_manifest(), "hf", REPO) != model_card(tiny_manifest(), "hf", "bob/other")


def test_unknown_hub_is_refused():
    with pytest.raises(ValueError):
        model_card(tiny_manifest(), "gitlab", REPO)


@pytest.mark.parametrize("eigenvalues", [False, True], ids=["plain", "with-eigenvalues"])
def test_the_cards_export_command_writes_what_its_serve_command_reads(tmp_path, eigenvalues):
    """Run the export the card prints (its bundle and calibration in place of the placeholders): the files it
    writes are those the card's SGLang command points at, with the clips, windows and group size it passes."""
    calib = tiny_calibration(tmp_path / "calib")
    bundle, manifest = export_bundle(calib, tmp_path / "zoo", with_eigenvalues=eigenvalues)
    card = model_card(manifest, "hf", REPO, eigenvalues=eigenvalues)
    block = card.split("## Serve with SGLang")[1].split("```bash\n")[1].split("```")[0]
    export_line, serve = block.split("\n", 1)
    args = shlex.split(export_line.split("#")[0])
    assert args[:4] == ["oscar", "upstream", "export", "oscar-bundle"] and "--per-head" not in args
    flags = dict(zip(args[4::2], args[5::2]))
    channel = any(e.key_axis == "channel" for e in manifest.quant.layers or ())
    assert ("--calibration" in flags) == (not eigenvalues or channel)
    plan = upstream.plan_export(bundle, tmp_path / flags["--out"], calib if "--calibration" in flags else None,
                                clips=flags["--clips"])
    files = str(plan.directory.relative_to(tmp_path))
    env = {k: v.replace("$DIR", files) for k, v in plan.record["serve"]["env"].items()}
    assert serve == upstream.shell_lines(env, plan.command)
    assert plan.record["grouping"] == "layer" and "SGLANG_OSCAR_ABSORB_V_ROTATION=1" in serve
    assert "vllm" not in card.lower()   # no vLLM command until oscar's backend exists
