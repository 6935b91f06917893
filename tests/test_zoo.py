"""The zoo: recipes, list, build (with skips) and the byte-for-byte check, on a tiny local model."""

import sys
from pathlib import Path

import pytest
from conftest import run_cli
import torch

from oscar_core import zoo
from oscar_core.bundle import MANIFEST_FILE, TENSOR_FILE
from oscar_core.errors import OscarError
from tiny_bundle import write_tiny_bundle

REPO_ROOT = Path(__file__).parent.parent
TEXT = ["the quick brown fox jumps over the lazy dog, number %d, and then some more words follow" % i
        for i in range(200)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (head_dim 64, GQA 2/1) with its own byte-level BPE tokenizer, saved to a directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(out)
    (out / "corpus.txt").write_text("\n\n".join(TEXT))
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


def test_committed_recipes_cover_the_default_model_and_qwen3():
    recipes = {r.name: r for r in zoo.load_recipes(REPO_ROOT / "zoo")}
    assert set(recipes) == {"HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B"}
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
    assert f"differs local/tiny v1: {TENSOR_FILE} differs" in out
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


@pytest.mark.slow
def test_committed_default_bundle_rebuilds_byte_identical():
    """`oscar zoo check` on the repo's own zoo: the committed default-model bundle is reproducible here."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", "from oscar_cli.app import main; main()", "zoo", "check"],
                            cwd=root, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SmolLM2-135M-Instruct" in result.stdout + result.stderr
