"""The zoo: recipes, list, build (with skips) and the byte-for-byte check, on a tiny local model."""

import sys
from pathlib import Path

import pytest
from conftest import capability_env, instruction_sets, run_cli, write_tokenizer_and_corpus
import torch

from oscar_core.errors import OscarError
from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE, load_bundle, write_bundle
from oscar_core.publish import zoo
from tiny_bundle import write_tiny_bundle

REPO_ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (head_dim 64, GQA 2/1) with its own byte-level BPE tokenizer, saved to a directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-model")
    vocab = write_tokenizer_and_corpus(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def write_recipe(zoo_root: Path, file: str, **fields) -> None:
    (zoo_root / "recipes").mkdir(parents=True, exist_ok=True)
    lines = [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in fields.items()]
    (zoo_root / "recipes" / f"{file}.toml").write_text("\n".join(lines).replace("'", '"') + "\n")


def tiny_recipe(zoo_root: Path, model: Path, **overrides) -> None:
    fields = dict(name="local/tiny", version="v1", model=str(model), data=str(model / "corpus.txt"), samples=2,
                  seq_len=32, seed=0, device="cpu", dtype="float32")
    write_recipe(zoo_root, "tiny", **{**fields, **overrides})


@pytest.fixture
def roots(tmp_path) -> tuple[Path, Path]:
    (tmp_path / "manifests").mkdir()
    return tmp_path / "zoo", tmp_path / "manifests"


oscar = run_cli
NOTHING = "nothing is quantized at 32 tokens"  # within the 64 sink and 256 recent BF16 tokens: verify does not pass


def test_committed_recipes_cover_the_default_model_and_qwen3():
    recipes = {r.name: r for r in zoo.load_recipes(REPO_ROOT / "zoo")}
    assert set(recipes) == {"HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen3-4B",
                            "Qwen/Qwen3-8B", "Qwen/Qwen3-32B", "google/gemma-3-270m"}
    assert recipes["Qwen/Qwen2.5-Coder-0.5B-Instruct"].model == "packaged:Qwen2.5-Coder-0.5B-Instruct"
    assert recipes["google/gemma-3-270m"].model == "packaged:gemma-3-270m"
    with pytest.raises(OscarError, match="no recipe builds a/b"):
        zoo.select(list(recipes.values()), ["a/b"])
    default = recipes["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert (default.model, default.samples, default.seq_len, default.seed, default.version) == ("default", 8, 512, 0, "v1")
    assert all(recipes[f"Qwen/Qwen3-{s}"].device == "cuda" for s in ("4B", "8B", "32B"))


@pytest.mark.parametrize("text, message", [
    ('name = "a/b"\nversion = "v1"\nmodel = "default"\nsamples = 8\n', "seq_len: Field required"),
    ('name = "a/b"\nversion = "v1"\nmodel = "default"\nsamples = 8\nseq_len = 64\nsteps = 3\n', "steps: Extra inputs"),
    ('name = "nope"\nversion = "v1"\nmodel = "default"\nsamples = 8\nseq_len = 64\n', "name: String should match"),
    ('name = "a/b\n', "not TOML"),
])
def test_a_bad_recipe_is_one_line_naming_its_file(tmp_path, text, message):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "bad.toml").write_text(text)
    with pytest.raises(OscarError, match=message) as e:
        zoo.load_recipes(tmp_path)
    assert "bad.toml" in str(e.value) and "\n" not in str(e.value)


def test_two_recipes_for_one_bundle_are_refused(tmp_path):
    for file in ("one", "two"):
        write_recipe(tmp_path, file, name="a/b", version="v1", model="default", samples=8, seq_len=64)
    with pytest.raises(OscarError, match="two recipes build a/b v1"):
        zoo.load_recipes(tmp_path)


def test_missing_requirements_name_what_this_machine_lacks(tmp_path):
    write_recipe(tmp_path, "gone", name="a/gone", version="v1", model=str(tmp_path / "no-such-model"),
                 samples=2, seq_len=32)
    write_recipe(tmp_path, "gpu", name="a/gpu", version="v1", model="default", samples=2, seq_len=32, device="cuda")
    recipes = {r.name: r for r in zoo.load_recipes(tmp_path)}
    assert zoo.missing_requirements(recipes["a/gone"]) == [f"model path not found: {tmp_path / 'no-such-model'}"]
    gpu = zoo.missing_requirements(recipes["a/gpu"])
    assert ("no CUDA GPU" in gpu) == (not torch.cuda.is_available())


def test_differences_compare_bytes(tmp_path):
    write_tiny_bundle(tmp_path / "a")
    write_tiny_bundle(tmp_path / "b")
    assert zoo.differences(tmp_path / "a", tmp_path / "b") == []
    write_tiny_bundle(tmp_path / "c", seed=1)
    assert zoo.differences(tmp_path / "a", tmp_path / "c") == [f"{TENSOR_FILE} differs", f"{MANIFEST_FILE} differs"]
    (tmp_path / "b" / TENSOR_FILE).unlink()
    assert zoo.differences(tmp_path / "b", tmp_path / "a") == [f"{TENSOR_FILE} is not committed"]


def test_build_then_check_then_tamper(tiny_model, roots, tmp_path, capfd, monkeypatch):
    zoo_root, manifests = roots
    tiny_recipe(zoo_root, tiny_model)
    write_recipe(zoo_root, "elsewhere", name="a/elsewhere", version="v1", model=str(tmp_path / "absent"), samples=2,
                 seq_len=32)
    args = ["--zoo", str(zoo_root), "--manifests", str(manifests)]

    code, out = oscar(capfd, monkeypatch, "zoo", "check", *args)
    assert code == 1 and "missing local/tiny v1" in out

    code, out = oscar(capfd, monkeypatch, "zoo", "build", *args)
    assert code == 0, out
    assert "built local/tiny v1" in out and "skipped a/elsewhere v1: not available here: model path not found" in out
    bundle = zoo_root / "local" / "tiny" / "v1"
    copy = manifests / "local" / "tiny" / "v1.json"
    assert copy.read_bytes() == (bundle / MANIFEST_FILE).read_bytes()

    code, out = oscar(capfd, monkeypatch, "zoo", "check", *args)
    assert code == 0, out
    assert "same local/tiny v1" in out and "skipped a/elsewhere v1" in out

    monkeypatch.setenv("COLUMNS", "400")
    code, out = oscar(capfd, monkeypatch, "zoo", "list", *args)
    assert code == 0 and "corpus.txt 2×32 seed 0" in out
    assert "local/tiny" in out and "a/elsewhere" in out and "not built" in out

    data = bytearray((bundle / TENSOR_FILE).read_bytes())
    data[-1] ^= 1
    (bundle / TENSOR_FILE).write_bytes(bytes(data))
    code, out = oscar(capfd, monkeypatch, "zoo", "check", *args)
    assert code == 1
    assert "differs local/tiny v1: checksum mismatch" in out
    assert out.strip().splitlines()[-1] == "error: 1 bundle(s) do not match their recipe: local/tiny v1"


def test_list_shows_bits_calibration_and_verify_figures(roots, capfd, monkeypatch):
    zoo_root, manifests = roots
    m = write_tiny_bundle(zoo_root / "oscar-test" / "tiny-llama" / "v1")
    (manifests / "oscar-test" / "tiny-llama").mkdir(parents=True)
    (manifests / "oscar-test" / "tiny-llama" / "v1.json").write_bytes(
        (zoo_root / "oscar-test" / "tiny-llama" / "v1" / MANIFEST_FILE).read_bytes())
    monkeypatch.setenv("COLUMNS", "200")
    code, out = oscar(capfd, monkeypatch, "zoo", "list", "--zoo", str(zoo_root), "--manifests", str(manifests))
    assert code == 0, out
    row = next(line for line in out.splitlines() if "oscar-test/tiny-llama" in line)
    for text in ("v1", f"{m.quant.bits_per_element['131072']:.3f}", "pydoc_data 8×512 seed 0",
                 "hadamard_logit_error 0.289", "logit_error 0.231"):
        assert text in row, text


def test_list_shows_figures_recorded_by_verify(roots, capfd, monkeypatch):
    """A manifest without figures: zoo list reads the verify.json that `oscar verify --record` left beside it."""
    import json

    zoo_root, manifests = roots
    bundle = zoo_root / "oscar-test" / "tiny-llama" / "v1"
    write_tiny_bundle(bundle, fidelity={})
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    manifest["fidelity"] = None
    (manifests / "oscar-test" / "tiny-llama").mkdir(parents=True)
    (manifests / "oscar-test" / "tiny-llama" / "v1.json").write_text(json.dumps(manifest))
    (bundle / "verify.json").write_text(json.dumps({"figures": {"logit_error": 0.1885, "kl": 0.0131}}))
    monkeypatch.setenv("COLUMNS", "200")
    code, out = oscar(capfd, monkeypatch, "zoo", "list", "--zoo", str(zoo_root), "--manifests", str(manifests))
    row = next(line for line in out.splitlines() if "oscar-test/tiny-llama" in line)
    assert code == 0 and "kl 0.0131" in row and "logit_error 0.1885" in row


def tiny_recipe_object(model: Path, seed: int = 0) -> zoo.Recipe:
    return zoo.Recipe(name="local/tiny", version="v1", model=str(model), data=str(model / "corpus.txt"), samples=2,
                      seq_len=32, seed=seed, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The tiny recipe built twice with seed 0 ("a", "b") and once with seed 1: (bundle, calibration directory)."""
    root = tmp_path_factory.mktemp("built")
    out = {}
    for tag, seed in (("a", 0), ("b", 0), ("seed1", 1)):
        recipe = tiny_recipe_object(tiny_model, seed)
        path = zoo.build_one(recipe, root / tag / "zoo", root / tag / "manifests", root / tag / "work")
        out[tag] = (path, zoo.calibration_dir(root / tag / "work", recipe))
    return out


def test_a_rebuild_on_the_same_machine_is_byte_identical(built):
    (a, _), (b, calib) = built["a"], built["b"]
    assert zoo.differences(a, b) == []
    assert zoo.compare(a, b, calib) == ("same", [], [])


def test_the_manifest_records_the_platform_and_the_model_source(built, tiny_model):
    import platform

    m = load_bundle(built["a"][0]).manifest
    assert m.calibration.model_source == str(tiny_model.resolve())
    p = m.calibration.platform
    assert p["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and p["torch"] == torch.__version__
    assert p["python"] == platform.python_version() and p["machine"] == platform.machine()
    assert p["blas"] and p["lapack"] and p["processor"] and p["device"] == "cpu"


def write_variant(src: Path, dst: Path, edit=None, manifest=None) -> Path:
    """A copy of the bundle at src with its tensors edited in place by edit(tensors), checksum rewritten."""
    b = load_bundle(src)
    tensors = {k: v.clone() for k, v in b.tensors.items()}
    if edit:
        edit(tensors)
    write_bundle(dst, manifest or b.manifest, tensors)
    return dst


def clip_far_off(t):
    c = t["layers.0.key_clip"]
    c[0] = 1.0 if c[0] < 0.9 else 0.8


def swap_layers(t):
    for name in [n for n in t if n.startswith("layers.0.")]:
        other = name.replace("layers.0.", "layers.1.")
        t[name], t[other] = t[other], t[name]


def perturb_rotation(t):
    """R·exp(εA), A antisymmetric: still orthogonal (verify's check passes), each entry moved by at most 1e-3."""
    r = t["layers.1.value_rotation"].double()
    a = torch.randn(r.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = a - a.mT
    eps = 1e-3 / float((r @ a).abs().amax())
    t["layers.1.value_rotation"] = (r @ torch.linalg.matrix_exp(eps * a)).float()
    assert 0.5e-3 < float((t["layers.1.value_rotation"] - r).abs().amax()) < 2e-3


@pytest.mark.parametrize("edit, reason", [
    (clip_far_off, "at layers.0.key_clip head 0 ("),
    (swap_layers, "key_rotation deviates"),
    (perturb_rotation, "value_rotation deviates"),
])
def test_a_tampered_bundle_fails_with_a_one_line_reason(built, tmp_path, edit, reason):
    (a, calib) = built["a"]
    tampered = write_variant(a, tmp_path / "t", edit)
    status, deviations, reasons = zoo.compare(tampered, a, calib)
    assert status == "differs" and any(reason in r for r in reasons), reasons
    assert all("\n" not in r for r in reasons)
    assert {d.kind for d in deviations} >= {"key_rotation", "value_rotation", "key_clip", "value_clip", "key_mean"}


def test_another_calibration_seed_is_not_equivalent(built, tmp_path):
    """Seed 1's tensors fail even under seed 0's manifest: the tolerances sit below the seed-to-seed spread."""
    (a, calib), (seed1, _) = built["a"], built["seed1"]
    status, _, reasons = zoo.compare(seed1, a, calib)
    assert status == "differs" and "manifest calibration.seed: 1 ≠ 0" in reasons
    disguised = write_variant(seed1, tmp_path / "d", manifest=load_bundle(a).manifest)
    status, deviations, reasons = zoo.compare(disguised, a, calib)
    assert status == "differs" and not any(r.startswith("manifest") for r in reasons)
    failed = {d.kind for d in deviations if not d.ok}
    assert {"key_rotation", "value_rotation", "key_mean"} <= failed, reasons


def test_provenance_alone_is_equivalent_and_verify_figures_are_held_to_the_record(built, tiny_model, tmp_path,
                                                                                    capfd, monkeypatch):
    """A bundle that differs from the rebuild only in platform provenance is equivalent; a verify.json left by
    `oscar verify --record` is then reproduced on the rebuild, and a figure moved past its margin fails."""
    import json

    (a, calib) = built["a"]
    m = load_bundle(a).manifest
    other = m.model_copy(update={"calibration": m.calibration.model_copy(
        update={"platform": {**m.calibration.platform, "cpu_capability": "AVX512", "processor": "elsewhere"}})})
    committed = write_variant(a, tmp_path / "c", manifest=other)
    status, deviations, reasons = zoo.compare(committed, a, calib)
    assert (status, reasons) == ("equivalent", []) and all(d.worst == 0 for d in deviations)

    code, out = oscar(capfd, monkeypatch, "verify", str(committed), "--data", str(tiny_model / "corpus.txt"),
                      "--seq-len", "32", "--max-logit-error", "10", "--record")
    assert code == 1 and NOTHING in out, out   # 32 tokens judge nothing, but their figures are recorded
    status, deviations, reasons = zoo.compare(committed, a, calib)
    figures = {d.kind: d for d in deviations if d.kind.startswith("verify")}
    assert status == "equivalent" and len(figures) == len(zoo.VERIFY_MARGINS) and all(d.worst < 1e-4 for d in figures.values()), reasons
    record = json.loads((committed / "verify.json").read_text())
    record["figures"]["logit_error"] += 0.01
    (committed / "verify.json").write_text(json.dumps(record))
    status, _, reasons = zoo.compare(committed, a, calib)
    assert status == "differs" and [r for r in reasons if r.startswith("verify logit_error deviates by 0.01")]


def test_verify_finds_a_local_model_by_its_hint_and_says_when_it_is_gone(tiny_model, tmp_path, capfd, monkeypatch):
    import shutil

    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    bundle = zoo.build_one(tiny_recipe_object(model), tmp_path / "zoo", tmp_path / "manifests", tmp_path / "work")
    args = ["verify", str(bundle), "--data", str(tiny_model / "corpus.txt"), "--seq-len", "32",
            "--max-logit-error", "10"]
    code, out = oscar(capfd, monkeypatch, *args)
    assert code == 1 and "model matches manifest" in out and NOTHING in out, out
    moved = model.rename(tmp_path / "moved")
    code, out = oscar(capfd, monkeypatch, *args)
    assert code == 1 and out.strip() == (f"error: the model of this bundle was loaded from {model}, which no longer "
                                         "exists: pass --model (a directory, .gguf file or hub id)")
    code, out = oscar(capfd, monkeypatch, *args, "--model", str(moved))
    assert code == 1 and "model matches manifest" in out and NOTHING in out, out


def test_verify_caps_its_default_length_at_the_models_context(built, tiny_model, tmp_path, capfd, monkeypatch):
    """The default held-out length (2,048 on the CPU) is above this model's 256: 256 are used, with a note; an
    explicit --seq-len above it is a one-line error."""
    import json

    (a, _) = built["a"]
    args = ["verify", str(a), "--data", str(tiny_model / "corpus.txt"), "--device", "cpu"]
    code, out = oscar(capfd, monkeypatch, *args, "--json", str(tmp_path / "r.json"))
    assert code == 1 and "nothing is quantized at 256 tokens" in out, out
    assert "note: the default of 2048 tokens is above the model's context of 256: 256 used" in out
    assert json.loads((tmp_path / "r.json").read_text())["seq_len"] == 256
    code, out = oscar(capfd, monkeypatch, *args, "--seq-len", "512")
    assert code == 1 and out.strip().splitlines()[-1] == "error: --seq-len 512 is above the model's limit of 256"


@pytest.mark.parametrize("command", ["check", "build"])
def test_a_zoo_with_nothing_to_do_is_an_error(tmp_path, capfd, monkeypatch, command):
    args = ["--manifests", str(tmp_path)]
    code, out = oscar(capfd, monkeypatch, "zoo", command, "--zoo", str(tmp_path / "absent"), *args)
    assert code == 1 and out.strip() == f"error: zoo directory not found: {tmp_path / 'absent'}"
    (tmp_path / "empty").mkdir()
    code, out = oscar(capfd, monkeypatch, "zoo", command, "--zoo", str(tmp_path / "empty"), *args)
    recipes = tmp_path / "empty" / "recipes"
    assert code == 1 and out.strip() == f"error: no recipes in {recipes}: nothing to build or check"
    write_recipe(tmp_path / "empty", "gone", name="a/gone", version="v1", model=str(tmp_path / "nope"), samples=2,
                 seq_len=32)
    code, out = oscar(capfd, monkeypatch, "zoo", command, "--zoo", str(tmp_path / "empty"), *args)
    done = "checked" if command == "check" else "built"
    assert code == 1 and out.strip().splitlines()[-1] == (
        f"error: nothing was {done}: none of the 1 recipe(s) in {tmp_path / 'empty'} can be built here")


@pytest.mark.slow
@pytest.mark.parametrize("capability", instruction_sets())
def test_committed_default_bundle_checks_under_each_instruction_set(capability):
    """`oscar zoo check` on the repo's own zoo, with torch dispatching to each CPU instruction set this machine
    has: the committed default bundle is byte-identical or numerically equivalent to the rebuild. The verify
    run (minutes on 2 cores; bundles whose `oscar verify --record` left a verify.json) is part of the first setting's
    check only, and so are the packaged Qwen2.5-Coder-0.5B
    and Gemma 3 270M (after `make models`; skipped, saying so, without it), to keep the suite short."""
    import subprocess

    from oscar_core.calibrate import packaged

    root = Path(__file__).resolve().parents[1]
    env = {**capability_env(capability), "COLUMNS": "200"}
    first = capability == instruction_sets()[0]
    args = [] if first else ["HuggingFaceTB/SmolLM2-135M-Instruct", "--no-verify"]
    result = subprocess.run([sys.executable, "-c", "from oscar_cli.app import main; main()", "zoo", "check", *args],
                            cwd=root, env=env, capture_output=True, text=True, timeout=2400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert ("same HuggingFaceTB/SmolLM2-135M-Instruct v1" in out
            or "equivalent HuggingFaceTB/SmolLM2-135M-Instruct v1" in out), out
    if first and packaged.installed_path("Qwen2.5-Coder-0.5B-Instruct") is not None:
        assert ("same Qwen/Qwen2.5-Coder-0.5B-Instruct v1" in out
                or "equivalent Qwen/Qwen2.5-Coder-0.5B-Instruct v1" in out), out
    elif first:
        assert "skipped Qwen/Qwen2.5-Coder-0.5B-Instruct v1: not available here" in out and "make models" in out, out
    if first and packaged.installed_path("gemma-3-270m") is not None:
        assert "same google/gemma-3-270m v1" in out or "equivalent google/gemma-3-270m v1" in out, out
    if "equivalent" in out:
        assert "key_rotation" in out, out
    recorded = [name for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                                  "google/gemma-3-270m")
                if f"equivalent {name} v1" in out and (root / "zoo" / name / "v1" / "verify.json").is_file()]
    assert ("verify logit_error" in out) == (first and bool(recorded)), out  # verify.json reproduced on the rebuild


def test_layer_formats_must_match_and_their_probe_errors_agree_within_tolerance():
    m = load_bundle(REPO_ROOT / "zoo" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "v1").manifest

    def with_layer0(**update):
        layers = [e.model_copy(update=update) if e.layer == 0 else e for e in m.quant.layers]
        return m.model_copy(update={"quant": m.quant.model_copy(update={"layers": layers})})

    errors = dict(m.quant.layers[0].errors)
    near = {k: v * (1 + 0.5 * zoo.LAYER_ERROR_TOLERANCE) for k, v in errors.items()}
    far = {k: v * (1 + 2 * zoo.LAYER_ERROR_TOLERANCE) for k, v in errors.items()}
    assert zoo.manifest_differences(m, with_layer0(errors=near)) == []
    assert any("layer 0's probe errors differ" in d for d in zoo.manifest_differences(m, with_layer0(errors=far)))
    other = "token U_Q·H·P_br" if m.quant.layers[0].key_format != "token U_Q·H·P_br" else "channel none"
    assert zoo.manifest_differences(m, with_layer0(key_format=other))
