import json

import pytest
import torch

from oscar_core.calibrate.data import (DEFAULT_HELDOUT, bos_prefix, heldout_prompts, load_samples, sample_windows,
                                       texts, token_windows)
from oscar_core.errors import OscarError


class CharTokenizer:
    """A real (if simple) tokenizer: one token per byte, EOS = 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b + 1 for b in text.encode()]}


class BosTokenizer(CharTokenizer):
    """Puts BOS (id 300) before every text it encodes with special tokens, as Gemma's tokenizer does."""

    def __call__(self, text, add_special_tokens=True):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": ([300] if add_special_tokens else []) + ids}


class DeclaredBosTokenizer(CharTokenizer):
    """Says it adds BOS but does not (transformers 5.17's tokenizer of a Gemma GGUF)."""

    add_bos_token, bos_token_id = True, 300


def test_every_window_starts_with_the_tokenizers_bos():
    assert bos_prefix(CharTokenizer()) == [] and bos_prefix(BosTokenizer()) == [300]
    assert bos_prefix(DeclaredBosTokenizer()) == [300]
    plain = list(token_windows(["a" * 50, "b" * 50], CharTokenizer(), 16))
    windows = list(token_windows(["a" * 50, "b" * 50], BosTokenizer(), 16, bos_prefix(BosTokenizer())))
    assert all(w.shape == (16,) and w[0] == 300 and (w[1:] != 300).all() for w in windows)
    stream = torch.cat([w[1:] for w in windows])
    assert torch.equal(stream, torch.cat(plain)[:stream.numel()])  # no text token dropped or repeated
    samples, _ = load_samples("default-heldout", BosTokenizer(), 3, 64, seed=0)
    assert (samples[:, 0] == 300).all()
    with pytest.raises(OscarError, match="holds nothing past"):
        next(token_windows(["abc"], BosTokenizer(), 1, [300]))


def test_default_corpora_are_real_disjoint_english():
    calib = " ".join(texts(None))
    held = " ".join(texts("default-heldout"))
    assert len(calib) > 100_000 and len(held) > 50_000
    assert "statement" in calib and "IDLE" in held
    assert held[:2000] not in calib


def test_default_heldout_text_ships_with_oscar(monkeypatch, tmp_path):
    """The held-out default is the packaged file, read the same with no idlelib installed (the GPU image's Python)."""
    import sysconfig

    from oscar_core.calibrate.data import HELDOUT_FILE, HELDOUT_SEPARATOR

    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    assert HELDOUT_FILE.parent.name == "corpus" and HELDOUT_FILE.parent.parent.name == "oscar_core"
    header, body = HELDOUT_FILE.read_text(encoding="utf-8").split("\n", 1)
    assert "Python Software Foundation License" in header and "idlelib" in header
    docs = list(texts("default-heldout"))
    assert docs == body.split(HELDOUT_SEPARATOR) and len(docs) == 8
    assert docs[0].startswith("IDLE") and "What's New in IDLE" in docs[1] and sum(map(len, docs)) > 150_000


def test_windows_and_deterministic_sampling():
    windows = list(token_windows(["a" * 50, "b" * 50], CharTokenizer(), 16))
    assert all(w.shape == (16,) for w in windows) and len(windows) == 102 // 16
    a, fa, _ = sample_windows(iter(windows), 3, seed=7)
    b, fb, _ = sample_windows(iter(windows), 3, seed=7)
    c, fc, _ = sample_windows(iter(windows), 3, seed=8)
    assert torch.equal(a, b) and fa == fb
    assert fa != fc or torch.equal(a, c)
    idx = [next(i for i, w in enumerate(windows) if torch.equal(w, row)) for row in a]
    assert idx == sorted(idx)


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 40)
    rows = [{"text": "jsonl row " * 30}, {"text": "second row " * 30}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["parquet text " * 30]}), tmp_path / "c.parquet")
    docs = list(texts(str(tmp_path)))
    assert docs[0].startswith("hello") and docs[1].startswith("jsonl") and docs[3].startswith("parquet")
    samples, fingerprint = load_samples(str(tmp_path), CharTokenizer(), 4, 64, seed=0)
    assert samples.shape == (4, 64) and len(fingerprint) == 64


def test_bad_sources(tmp_path):
    with pytest.raises(OscarError, match="not found"):
        list(texts(str(tmp_path / "missing.txt")))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(OscarError, match="no text"):
        load_samples(str(tmp_path / "empty.txt"), CharTokenizer(), 2, 64, 0)
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(OscarError, match="only 1 samples"):
        load_samples(str(tmp_path / "short.txt"), CharTokenizer(), 2, 64, 0)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(OscarError, match="no field 'text'"):
        list(texts(str(tmp_path / "bad.jsonl")))
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(OscarError, match="cannot read"):
        list(texts(str(tmp_path / "binary.txt")))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(OscarError, match="cannot read"):
        list(texts(str(tmp_path / "broken.parquet")))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(OscarError, match="no text files"):
        list(texts(str(tmp_path / "nothing")))


def test_heldout_prompts_are_windows_of_the_heldout_stream_from_spread_offsets(default_model):
    tok = default_model.tokenizer
    ids = heldout_prompts(tok, 200, 3)
    assert ids.shape == (3, 200)
    assert len({tuple(row.tolist()) for row in ids}) == 3
    stream = []
    for doc in texts(DEFAULT_HELDOUT):
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[0].tolist() == stream[:200]
    start = len(stream) // 3
    assert ids[1].tolist() == (stream + stream)[start:start + 200]
    long = heldout_prompts(tok, len(stream) + 50, 1)       # longer than the text: the stream cycles
    assert long[0, len(stream):].tolist() == stream[:50]
