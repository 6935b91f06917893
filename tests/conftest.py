"""Shared fixtures: the real default model (loaded once), tiny random models of several architectures.

Without a GPU the Triton kernels run in triton's interpreter. TRITON_INTERPRET must be set before triton is
first imported (triton's own library functions are decorated then), so it is set here, before any test module
imports it: a subset of the suite run in any order sees the same triton as the whole suite."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

TEXT = ["the quick brown fox jumps over the lazy dog, number %d, and then some more words follow" % i
        for i in range(200)]

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def tiny_model(kind: str, seed: int = 0):
    """A randomly initialised causal LM of architecture `kind` (llama, qwen3, qwen2, mistral, gemma)."""
    import transformers as tf

    configs = {
        "llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config, "qwen2": tf.Qwen2Config,
        "mistral": tf.MistralConfig, "gemma": tf.GemmaConfig,
    }
    extra = {"head_dim": 16} if kind in ("qwen3", "gemma", "mistral") else {}
    config = configs[kind](**TINY, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_sliding_model(kind: str, window: int = 8, seed: int = 0):
    """A randomly initialised causal LM with sliding-window layers of `window` tokens: gemma3 (layers 0 and 2
    sliding, 1 global; Gemma's query_pre_attn_scalar), mistral (every layer sliding) or qwen2 (use_sliding_window,
    layers from max_window_layers = 1 on sliding)."""
    import transformers as tf

    small = {**TINY, "num_hidden_layers": 3}
    if kind == "gemma3":
        config = tf.Gemma3TextConfig(**small, head_dim=16, sliding_window=window, query_pre_attn_scalar=24,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    elif kind == "mistral":
        config = tf.MistralConfig(**small, head_dim=16, sliding_window=window)
    else:
        config = tf.Qwen2Config(**small, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model():
    from oscar_core.calibrate.models import load_model

    return load_model(None)


def run_cli(capfd, monkeypatch, *args: str) -> tuple[int, str]:
    """Run the oscar CLI in this process; returns (exit code, stdout + stderr)."""
    import sys

    from oscar_cli.app import main

    monkeypatch.setattr(sys, "argv", ["oscar", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capfd.readouterr()
    return exit_info.value.code, out + err


def instruction_sets() -> list[str]:
    """The ATEN_CPU_CAPABILITY settings the suite exercises: the portable default, AVX2 and this CPU's own."""
    return sorted({"default", "avx2", torch.backends.cpu.get_cpu_capability().lower()})


def capability_env(capability: str) -> dict:
    """os.environ with torch dispatching to `capability`; skips the test where this CPU cannot run it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True)
    if probe.stdout.strip().lower() != capability:
        pytest.skip(f"this CPU cannot run {capability} (torch dispatches to {probe.stdout.strip()})")
    return env


def write_tokenizer_and_corpus(out) -> int:
    """A byte-level BPE tokenizer trained on TEXT saved to directory `out`, with TEXT as out/corpus.txt;
    returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    (out / "corpus.txt").write_text("\n\n".join(TEXT))
    return tok.get_vocab_size()


def cli(*args: str) -> None:
    """Run the oscar CLI in this process (outside a test, so without capfd); it must succeed."""
    import sys

    from oscar_cli.app import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["oscar", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
    assert exit_info.value.code == 0, f"oscar {' '.join(args)} exited {exit_info.value.code}"


def calibrate_and_export(model_dir, root):
    """`oscar calibrate` (2 samples of 32 tokens of the model's corpus.txt) and `oscar export` of a tiny model
    directory: (calibration directory, bundle directory)."""
    cli("calibrate", str(model_dir), "--out", str(root / "calib"), "--data", str(model_dir / "corpus.txt"),
        "--samples", "2", "--seq-len", "32", "--device", "cpu", "--dtype", "float32")
    cli("export", str(root / "calib"), "--out", str(root / "zoo"), "--workers", "1")
    return root / "calib", root / "zoo" / "local" / model_dir.name / "v1"
