import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_core.errors import OscarError
from oscar_core.evaluate import perplexity as ev
from oscar_core.formats.bundle import load_bundle

BUNDLE = Path(__file__).resolve().parents[1] / "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"


class CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_needle_prompt_places_the_needle_at_depth():
    tok = CharTokenizer()
    filler = torch.arange(1000, 3000)
    for depth in (0.0, 0.5, 1.0):
        ids = ev.needle_prompt(tok, filler, 1200, depth, "12345")
        assert ids.numel() == 1200
        text = "".join(chr(i) if i < 1000 else "." for i in ids.tolist())
        assert text.startswith(ev.NEEDLE_INTRO) and text.endswith(ev.NEEDLE_QUESTION)
        at = text.index("The pass key is 12345")
        n = 1200 - len(ev.NEEDLE_INTRO) - len(ev.NEEDLE.format(key="12345")) - len(ev.NEEDLE_QUESTION)
        assert at == len(ev.NEEDLE_INTRO) + round(depth * n) + 1
    with pytest.raises(OscarError, match="filler"):
        ev.needle_prompt(tok, filler[:10], 1200, 0.5, "12345")


class BosCharTokenizer(CharTokenizer):
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([999] if add_special_tokens else []) + [ord(c) for c in text]}


def test_needle_prompts_and_windows_start_with_bos():
    tok = BosCharTokenizer()
    ids = ev.needle_prompt(tok, torch.arange(1000, 3000), 1200, 0.5, "12345")
    assert ids.numel() == 1200 and ids[0] == 999 and (ids[1:] != 999).all()
    wins = ev.windows_of(torch.arange(1000, 1100), 10, 3, "x", [999])
    assert wins.shape == (3, 10) and (wins[:, 0] == 999).all()
    assert torch.equal(wins[:, 1:].flatten(), torch.arange(1000, 1027))


def test_answer_matching_is_exact():
    assert ev.answer_matches(" 48213. Remember", "48213")
    assert not ev.answer_matches(" 4821", "48213") and not ev.answer_matches("482135", "48213")
    assert not ev.answer_matches("the key", "48213")


def test_bad_requests_fail_with_one_line():
    bundle = load_bundle(BUNDLE)
    with pytest.raises(OscarError, match="beyond the model's limit of 8192"):
        ev.check_request(ev.EvalRequest(contexts=[16384]), bundle)
    with pytest.raises(OscarError, match="--batch must be positive"):
        ev.check_request(ev.EvalRequest(batch=0), bundle)
    assert ev.default_batch("cuda:0") == ev.CUDA_BATCH and ev.default_batch("cpu") == 1
    with pytest.raises(OscarError, match="unknown method"):
        ev.check_request(ev.EvalRequest(methods=["int3"]), bundle)
    with pytest.raises(OscarError, match="fewer than one window"):
        ev.windows_of(torch.arange(100), 2048, 2, "x")


def test_empty_text_source(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(OscarError, match="holds no text"):
        ev.heldout_tokens(str(tmp_path), CharTokenizer(), 4096)


def test_bundle_for_another_model(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_bundle import write_tiny_bundle

    write_tiny_bundle(tmp_path / "b")
    other = load_bundle(tmp_path / "b")
    mine = load_bundle(BUNDLE)
    with pytest.raises(OscarError, match="is for model"):
        ev.check_bundle(other, mine.manifest.model)
    ev.check_bundle(mine, mine.manifest.model)


def test_cli_errors_are_one_line(tmp_path):
    run = [sys.executable, "-c", "from oscar_cli.app import main; main()", "eval", str(BUNDLE)]
    out = subprocess.run(run + ["--context", "16384"], capture_output=True, text=True)
    assert out.returncode == 2 and "beyond the model's limit" in out.stderr  # a usage error
    assert len(out.stderr.strip().splitlines()) == 1


def test_needle_results_say_how_many_prompts():
    """The table and the plot give each needle accuracy with the number of prompts behind it."""
    from rich.console import Console

    from oscar_cli.commands.eval import plot_report, table

    report = {"model": "m", "bundle": "b v1", "data": "d", "contexts": [512, 1024], "methods": ["bf16", "oscar"],
              "labels": {"bf16": "BF16", "oscar": "OSCAR INT2"},
              "bits_per_element": {m: {"512": 2.5, "1024": 2.5} for m in ("bf16", "oscar")},
              "perplexity": {m: {"512": 10.0, "1024": 9.0} for m in ("bf16", "oscar")},
              "needle": {"bf16": {"512": {"0.1": 1.0, "0.5": 0.5}, "1024": {"0.1": 1.0, "0.5": 1.0}},
                         "oscar": {"512": {"0.1": 0.5, "0.5": 0.0}, "1024": {"0.1": 1.0, "0.5": 0.5}}},
              "needle_prompts": {"512": {"0.1": 2, "0.5": 2}, "1024": {"0.1": 2, "0.5": 2}},
              "needle_accuracy": {"bf16": {"512": 0.75, "1024": 1.0}, "oscar": {"512": 0.25, "1024": 0.75}}}
    console = Console(width=250, record=True)
    console.print(table(report))
    shown = console.export_text()
    assert "75% (3/4)" in shown and "25% (1/4)" in shown and "100% (4/4)" in shown
    assert plot_report(report)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_evaluate_short_context(default_model, tmp_path):
    """Perplexity and needle at 512 tokens: BF16 finds the key, naive INT2 is the worst perplexity."""
    bundle = load_bundle(BUNDLE)
    req = ev.EvalRequest(contexts=[512], methods=["bf16", "int2", "oscar"], samples=1, depths=(0.3,))
    steps = []
    report = ev.evaluate(default_model, bundle, req, on_step=steps.append)
    done = [s.text for s in steps if s.done]
    assert done[0].startswith("perplexity @ 512: bf16 ") and done[1].startswith("needle @ 512: bf16 100%, int2 ")
    assert len(done) == 2 and [s.report is report for s in steps if s.done] == [True, True]
    assert report["finished"] == {"perplexity": [512], "needle": [512]}
    ppl = {m: report["perplexity"][m]["512"] for m in req.methods}
    assert ppl["bf16"] < ppl["int2"] and abs(ppl["oscar"] / ppl["bf16"] - 1) < 0.05
    assert report["needle"]["bf16"]["512"]["0.3"] == 1.0 and report["needle_prompts"] == {"512": {"0.3": 1}}
    assert report["memory"]["oscar"]["bytes"] < report["memory"]["oscar"]["bf16_bytes"]
    assert report["bits_per_element"]["bf16"]["512"] == 16.0


def test_batches_keep_order_and_key():
    items = [(0, 8), (1, 8), (2, 8), (3, 16), (4, 8)]
    assert ev.in_batches(items, 2, key=lambda x: x[1]) == [[(0, 8), (1, 8)], [(2, 8)], [(3, 16)], [(4, 8)]]
    assert ev.in_batches(items, 1) == [[x] for x in items] and ev.in_batches([], 3) == []


@pytest.mark.slow
def test_a_batch_answers_as_each_prompt_alone(default_model):
    """Three needle prompts of 530, 460 and 400 tokens (pads 0, 70 and 130: not whole key blocks) answered as one
    left-padded batch give, for bf16, kivi and oscar (SmolLM2, float32, the zoo bundle: a sink of 64, 256 recent,
    keys per channel), each prompt's answer and cached tokens alone (every prompt holds INT2 tokens).
    tests/test_cache.py tests the fill alone."""
    bundle, tok = load_bundle(BUNDLE), default_model.tokenizer
    filler = ev.heldout_tokens(ev.DEFAULT_HELDOUT, tok, 2000)
    prompts = [ev.needle_prompt(tok, filler[i * 300:], n, 0.4, key)
               for i, (n, key) in enumerate([(530, "48213"), (460, "70554"), (400, "31337")])]
    model, layers, names = default_model.model, default_model.info.num_layers, ["bf16", "kivi", "oscar"]
    together = ev.batch_answers(model, tok, prompts, names, bundle, layers)
    for p, got in zip(prompts, together):
        alone = ev.greedy_answers(model, tok, p, names, bundle, layers)
        for m in names:
            assert got[m][:2] == alone[m][:2], (p.numel(), m, got[m], alone[m])
    assert together[0]["bf16"][3] == together[0]["kivi"][3] > together[0]["kivi"][2]
