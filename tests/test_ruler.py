"""The RULER-style suite: prompts generated offline (exact lengths, pieces where they are said to be, BOS first,
the same prompts from the same seed), RULER's string-match score, one-line errors for bad input, and the suite end
to end through the CLI on the default model."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from oscar_core.errors import OscarError
from oscar_core.evaluate import ruler
from oscar_core.evaluate.evaluate_ruler import RulerRequest, check_request, default_samples, fitting_tasks
from oscar_core.formats.bundle import load_bundle

BUNDLE = Path(__file__).resolve().parents[1] / "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"
EOS, BOS = 1, 2


class CharTokenizer:
    """One token a character (its code point); EOS 1."""
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class BosTokenizer(CharTokenizer):
    """Puts BOS (id 2) before every text it encodes with special tokens, as Gemma's tokenizer does."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([BOS] if add_special_tokens else []) + [ord(c) for c in text]}


@pytest.fixture(scope="module")
def hay():
    return ruler.haystack("default-heldout", BosTokenizer(), 4000)


def text(ids) -> str:
    return "".join(chr(i) for i in ids.tolist())


@pytest.mark.parametrize("task", ruler.TASKS)
def test_prompts_fill_the_length_and_start_with_bos(task, hay):
    for length in (3000, 4000):
        s = ruler.sample(task, BosTokenizer(), hay, length, seed=0, index=0)
        assert s.task == task and s.ids[0] == BOS and (s.ids[1:] != BOS).all()
        if task == "common_words":
            assert length - 12 <= s.ids.numel() <= length  # within one item of "\n123. word" (f_u = 1 here)
        else:
            assert s.ids.numel() == length
        assert s.max_new_tokens == ruler.ANSWER_TOKENS[task]
    plain = ruler.sample(task, CharTokenizer(), hay, 3000, seed=0, index=0)
    assert plain.ids[0] != BOS and plain.ids.numel() <= 3000


@pytest.mark.parametrize("task", ruler.TASKS)
def test_the_same_seed_gives_the_same_prompt(task, hay):
    a, b = (ruler.sample(task, BosTokenizer(), hay, 3000, seed=7, index=1) for _ in range(2))
    assert torch.equal(a.ids, b.ids) and a.expected == b.expected and a.starts == b.starts
    other = ruler.sample(task, BosTokenizer(), hay, 3000, seed=8, index=1)
    assert not torch.equal(a.ids, other.ids) and a.expected != other.expected
    assert not torch.equal(a.ids, ruler.sample(task, BosTokenizer(), hay, 3000, seed=7, index=2).ids)


@pytest.mark.parametrize("task", list(ruler.NIAH))
def test_needles_sit_where_the_sample_says(task, hay):
    keys, values, asked = ruler.NIAH[task]
    for index in range(5):
        s = ruler.sample(task, BosTokenizer(), hay, 3000, seed=0, index=index)
        prompt = text(s.ids)
        needles = [re.match(r"\nOne of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.\n", prompt[at:])
                   for at in s.starts]
        assert len(needles) == keys * values and all(needles)
        assert sorted(s.starts) == list(s.starts) and s.starts[-1] < 3000
        question = prompt[prompt.rindex("\nWhat"):]
        asked_keys = {k for k, _ in (n.groups() for n in needles) if k in question}
        assert len(asked_keys) == asked and len({n.group(1) for n in needles}) == keys
        assert s.expected == tuple(v for k, v in (n.groups() for n in needles) if k in asked_keys)
        assert len(s.expected) == asked * values and len(set(s.expected)) == len(s.expected)
        assert question.endswith("mentioned in the provided text " + ("is" if len(s.expected) == 1 else "are"))
        assert prompt.startswith("\x02" + ruler.NIAH_INTRO)


def test_variable_chains_are_in_order_and_asked_by_value(hay):
    for index in range(5):
        s = ruler.sample("variable_tracking", BosTokenizer(), hay, 3000, seed=0, index=index)
        prompt = text(s.ids)
        statements = [re.match(r"\nVAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})\.\n", prompt[at:]).groups() for at in s.starts]
        assert len(statements) == ruler.CHAINS * (ruler.HOPS + 1)
        bound = {}
        for name, source in statements:  # each variable is assigned after the one it copies
            bound[name] = bound[source[4:]] if source.startswith("VAR ") else source
        value = re.search(r"assigned the value (\d{5}) in the text above", prompt).group(1)
        assert set(s.expected) == {name for name, v in bound.items() if v == value}
        assert len(s.expected) == ruler.HOPS + 1 and len(set(bound.values())) == ruler.CHAINS


def test_common_words_are_the_most_common_of_the_list(hay):
    for length in (1000, 4000):
        s = ruler.sample("common_words", BosTokenizer(), hay, length, seed=0, index=0)
        prompt = text(s.ids)
        items = re.findall(r"\n(\d+)\. ([a-z]+)", prompt)
        assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        assert len(s.expected) == ruler.COMMON and all(w in hay.words for w in counts)
        least_common = min(counts[w] for w in s.expected)
        assert least_common >= 3 and max(c for w, c in counts.items() if w not in s.expected) < least_common
        assert len(counts) >= 2 * ruler.COMMON


def test_string_match_scores():
    assert ruler.string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert ruler.string_match_all(" 123456.", ["1234567"]) == 0.0  # one expected string: all or nothing
    assert ruler.string_match_all("They are 111 and 333, then 444", ["111", "222", "333", "444"]) == 0.75
    assert ruler.string_match_all("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("", ["a"]) == 0.0


def test_a_task_that_does_not_fit(hay):
    for task in ruler.TASKS:
        with pytest.raises(ruler.DoesNotFit, match=f"{task} needs"):
            ruler.sample(task, BosTokenizer(), hay, 200, seed=0, index=0)
    req = RulerRequest(contexts=[500, 3000], methods=["bf16"], tasks=["niah_single", "common_words"])
    fits, skipped = fitting_tasks(req, BosTokenizer(), hay)
    assert fits == {500: ["niah_single"], 3000: ["niah_single", "common_words"]}
    assert list(skipped[500]) == ["common_words"] and skipped[3000] == {}
    with pytest.raises(OscarError, match="--context 200: no task of the suite fits: niah_single needs at least"):
        fitting_tasks(RulerRequest(contexts=[3000, 200], tasks=["niah_single"]), BosTokenizer(), hay)


def test_the_haystack_is_the_held_out_text_without_eos(hay):
    assert EOS not in hay.tokens.tolist() and hay.tokens.numel() > 65536
    assert "\n\nWhat's New in IDLE" in text(hay.tokens) and "editor" in hay.words and "IDLE" not in hay.words


def test_a_haystack_source_too_short(tmp_path):
    (tmp_path / "short.txt").write_text("some words of text, " * 40)
    short = ruler.haystack(str(tmp_path / "short.txt"), BosTokenizer(), 3000)
    assert short.tokens.numel() == 768  # whole windows of 256 tokens of its 800 characters
    with pytest.raises(OscarError, match=r"short.txt holds 768 tokens, fewer than the \d+ of haystack"):
        ruler.sample("niah_single", BosTokenizer(), short, 3000, seed=0, index=0)
    with pytest.raises(OscarError, match="holds 3 distinct words, fewer than 8"):
        ruler.sample("niah_multikey", BosTokenizer(), short, 1000, seed=0, index=0)
    with pytest.raises(OscarError, match="holds 3 distinct words, too few for a common-words list"):
        ruler.sample("common_words", BosTokenizer(), short, 1000, seed=0, index=0)


def test_bad_requests():
    bundle = load_bundle(BUNDLE)
    with pytest.raises(OscarError, match="beyond the model's limit of 8192"):
        check_request(RulerRequest(contexts=[16384]), bundle)
    with pytest.raises(OscarError, match="unknown task niah_double"):
        check_request(RulerRequest(tasks=["niah_single", "niah_double"]), bundle)
    with pytest.raises(OscarError, match="--samples must be positive"):
        check_request(RulerRequest(samples=0), bundle)
    with pytest.raises(OscarError, match="--batch must be positive"):
        check_request(RulerRequest(batch=0), bundle)
    assert default_samples("cuda:0") == 50 and default_samples("cpu") == 4


def test_cli_bad_input_is_one_line(capfd, monkeypatch, tmp_path):
    for args, message in ((["--context", "16384"], "beyond the model's limit of 8192"),
                          (["--suite", "rulers"], "unknown suite rulers"),
                          (["--tasks", "niah_single,words"], "unknown task words"),
                          (["--samples", "0"], "0 is not a finite number at least 1"),
                          (["--batch", "0"], "0 is not a finite number at least 1")):
        code, out = run_cli(capfd, monkeypatch, "eval", str(BUNDLE), "--suite", "ruler", *args,
                            "--json", str(tmp_path / "r.json"))
        assert code == 2 and message in out and len(out.strip().splitlines()) == 1, out  # usage errors
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ruler_suite_end_to_end(default_model, capfd, monkeypatch, tmp_path):
    """512 tokens, one prompt a task, BF16 and OSCAR with the SmolLM2 zoo bundle, through the CLI: the table, the
    JSON report and the PNG; then a context that no task fits: one line, exit 2 (a usage error), nothing written."""
    monkeypatch.setattr("oscar_cli.commands.eval.load_model", lambda spec, device: default_model)
    report_path, plot_path = tmp_path / "ruler.json", tmp_path / "ruler.png"
    code, out = run_cli(capfd, monkeypatch, "eval", str(BUNDLE), "--suite", "ruler", "--context", "512",
                        "--samples", "1", "--methods", "bf16,oscar", "--device", "cpu",
                        "--json", str(report_path), "--plot", str(plot_path))
    assert code == 0, out
    assert "RULER-style @ 512 tokens" in out and "variable_tracking" in out and "average" in out
    report = json.loads(report_path.read_text())
    assert report["suite"] == "ruler" and report["samples"] == 1 and report["skipped"] == {"512": {}}
    assert report["prompts"] == {"512": dict.fromkeys(ruler.TASKS, 1)}
    assert len(report["answers"]) == 2 * len(ruler.TASKS)
    assert all(a["prompt_tokens"] <= 512 for a in report["answers"])
    for m in ("bf16", "oscar"):
        scores = report["scores"][m]["512"]
        assert set(scores) == set(ruler.TASKS) and all(0 <= v <= 1 for v in scores.values())
        assert report["average"][m]["512"] == pytest.approx(sum(scores.values()) / len(scores))
    assert report["scores"]["bf16"]["512"]["niah_single"] == 1.0  # SmolLM2 finds one needle in 512 tokens
    assert "ruler @ 512 niah_single: bf16 100.0%, oscar" in out and report["finished"] == [512]  # a log's lines
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code, out = run_cli(capfd, monkeypatch, "eval", str(BUNDLE), "--suite", "ruler", "--context", "64",
                        "--methods", "bf16", "--device", "cpu", "--json", str(tmp_path / "none.json"))
    assert code == 2 and "--context 64: no task of the suite fits" in out and len(out.strip().splitlines()) == 1
    assert not (tmp_path / "none.json").exists()


@pytest.mark.slow
def test_a_killed_run_leaves_its_lines_and_finished_contexts(default_model, capfd, monkeypatch, tmp_path):
    """Output to a log (not a terminal): a plain line per finished (context, task) and context, and the JSON report
    rewritten after each finished context, so a run that dies during the second context keeps the first. The
    prompts go to the answerer `--batch` at a time (answers faked: this tests the bookkeeping)."""
    sizes = []

    def answers(model, tok, prompts, names, bundle, layers, new_tokens):
        if prompts[0].numel() > 600:
            raise OscarError("killed during the second context")
        sizes.append(len(prompts))
        return [{m: (" 1234567", 0, 1, 1) for m in names} for _ in prompts]

    monkeypatch.setattr("oscar_cli.commands.eval.load_model", lambda spec, device: default_model)
    monkeypatch.setattr("oscar_core.evaluate.evaluate_ruler.batch_answers", answers)
    path = tmp_path / "ruler.json"
    code, out = run_cli(capfd, monkeypatch, "eval", str(BUNDLE), "--suite", "ruler", "--context", "512",
                        "--context", "1024", "--samples", "5", "--batch", "2", "--tasks", "niah_single,niah_multikey",
                        "--methods", "bf16,kivi", "--device", "cpu", "--json", str(path))
    assert code == 1 and "killed during the second context" in out
    lines = [line for line in out.splitlines() if line.startswith("ruler @")]
    assert lines[0].startswith("ruler @ 512 niah_single: bf16 0.0%, kivi 0.0% (5 prompts, ")
    assert lines[1].startswith("ruler @ 512 niah_multikey: ") and lines[2].startswith("ruler @ 512 average: ")
    assert len(lines) == 3 and sizes == [2, 2, 1] * 2
    report = json.loads(path.read_text())
    assert report["finished"] == [512] and report["batch"] == 2 and len(report["answers"]) == 2 * 2 * 5
    assert report["scores"]["kivi"] == {"512": {"niah_single": 0.0, "niah_multikey": 0.0}, "1024": {}}


def test_table_and_plot_give_prompt_counts_and_tasks_left_out():
    from rich.console import Console

    from oscar_cli.commands.eval import plot_ruler, ruler_tables

    report = {"model": "m", "bundle": "b v1", "device": "cpu", "samples": 4, "contexts": [512, 1024],
              "methods": ["bf16", "oscar"], "labels": {"bf16": "BF16", "oscar": "OSCAR INT2"},
              "bits_per_element": {m: {"512": 2.5, "1024": 2.5} for m in ("bf16", "oscar")},
              "prompts": {"512": {"niah_single": 4}, "1024": {"niah_single": 4, "common_words": 4}},
              "skipped": {"512": {"common_words": "common_words needs more than 512 tokens"}, "1024": {}},
              "scores": {"bf16": {"512": {"niah_single": 1.0}, "1024": {"niah_single": 0.75, "common_words": 0.5}},
                         "oscar": {"512": {"niah_single": 0.5}, "1024": {"niah_single": 0.25, "common_words": 0.3}}},
              "average": {"bf16": {"512": 1.0, "1024": 0.625}, "oscar": {"512": 0.5, "1024": 0.275}}}
    console = Console(width=250, record=True)
    for t in ruler_tables(report):
        console.print(t)
    shown = console.export_text()
    assert "RULER-style @ 512 tokens · 4 prompts per task on cpu" in shown
    assert "common_words left out: common_words needs more than 512 tokens" in shown
    rows = [re.findall(r"[\w.%]+", line) for line in shown.splitlines() if "average" in line]
    assert rows == [["average", "4", "100.0%", "50.0%"], ["average", "8", "62.5%", "27.5%"]]
    assert plot_ruler(report)[:8] == b"\x89PNG\r\n\x1a\n"
