"""Calibration and evaluation text: sources, fingerprints, and packing into token samples.

Sources: a Hugging Face dataset id (streamed), local .txt / .jsonl / .parquet files or a folder of
them, or the embedded defaults, real English text from Python's own documentation:
- calibration: the documentation topics of `pydoc_data` (the language reference);
- held-out: IDLE's documentation (Python's `idlelib`: the help page as text, NEWS.txt, README.txt, NEWS2x.txt,
  HISTORY.txt, TODO.txt, extend.txt, CREDITS.txt), which calibration never sees. It ships with oscar
  (oscar_core/corpus/heldout.txt, Python Software Foundation License), because some Pythons (the GPU image's)
  install no idlelib docs: 42,984 tokens with the SmolLM2 tokenizer, documents joined with EOS, so one window
  of 32K tokens fits.
"""

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from oscar_core.errors import OscarError

DEFAULT_CALIBRATION = "default"
DEFAULT_HELDOUT = "default-heldout"
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
HELDOUT_FILE = Path(__file__).parent.parent / "corpus" / "heldout.txt"
HELDOUT_SEPARATOR = "\n\f\n"


def _pydoc_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _heldout_docs() -> Iterator[str]:
    """The documents of HELDOUT_FILE: a header line, then documents separated by form-feed lines."""
    body = HELDOUT_FILE.read_text(encoding="utf-8").split("\n", 1)[1]
    yield from body.split(HELDOUT_SEPARATOR)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise OscarError(f"no text files (.txt, .md, .jsonl, .parquet) in {path}")
    return files


def _file_texts(path: Path, text_field: str) -> Iterator[str]:
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        row = json.loads(line)
                        if text_field not in row:
                            raise OscarError(f"{path}:{n} has no field '{text_field}' (use --text-field)")
                        yield str(row[text_field])
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if text_field not in table.column_names:
                raise OscarError(f"{path} has no column '{text_field}' (use --text-field)")
            yield from (str(t) for t in table.column(text_field).to_pylist())
        else:
            yield path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OscarError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    except OSError as e:
        raise OscarError(f"cannot read {path}: {e.strerror or e}") from None
    except OscarError:
        raise
    except Exception as e:  # pyarrow's errors for a corrupt parquet file
        raise OscarError(f"cannot read {path}: {e}") from None


def _hub_texts(dataset_id: str, split: str, text_field: str) -> Iterator[str]:
    import datasets

    try:
        stream = datasets.load_dataset(dataset_id, split=split, streaming=True)
        for row in stream:
            if text_field not in row:
                raise OscarError(f"dataset {dataset_id} has no field '{text_field}' (use --text-field)")
            yield str(row[text_field])
    except OscarError:
        raise
    except Exception as e:
        raise OscarError(f"cannot stream dataset {dataset_id}: {str(e).splitlines()[0] if str(e) else e}") from None


def texts(source: str | None, split: str = "train", text_field: str = "text") -> Iterator[str]:
    """Yield the documents of a source, in a fixed order."""
    if source in (None, "", DEFAULT_CALIBRATION):
        return _pydoc_topics()
    if source == DEFAULT_HELDOUT:
        return _heldout_docs()
    path = Path(source).expanduser()
    if path.exists():
        return (t for f in _files(path) for t in _file_texts(f, text_field))
    if source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix in TEXT_SUFFIXES:
        raise OscarError(f"data path not found: {source}")
    return _hub_texts(source, split, text_field)


def bos_prefix(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before every text it encodes for the model (its BOS where `add_bos_token`
    holds, as Gemma's does; none for SmolLM2 or Qwen2.5): what every served prompt starts with, so every window
    that calibration, verify and eval show the model starts with them too."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    if len(full) > len(plain) and full[len(full) - len(plain):] == plain:
        return list(full[:len(full) - len(plain)])
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos_token", False) is True and bos is not None:
        return [bos]   # declared but not applied by this transformers' tokenizer (a GGUF's, on 5.17)
    return []


def token_windows(docs: Iterable[str], tokenizer, seq_len: int, prefix: list[int] = ()) -> Iterator[torch.Tensor]:
    """Tokenize documents, join them with the end-of-sequence token, cut into windows of seq_len tokens, each
    `prefix` (bos_prefix) then seq_len − len(prefix) tokens of the text stream."""
    eos = tokenizer.eos_token_id
    prefix = list(prefix)
    body = seq_len - len(prefix)
    if body < 1:
        raise OscarError(f"a window of {seq_len} tokens holds nothing past its {len(prefix)} prefix tokens")
    buffer: list[int] = []
    for doc in docs:
        if not doc.strip():
            continue
        buffer.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            buffer.append(eos)
        while len(buffer) >= body:
            yield torch.tensor(prefix + buffer[:body], dtype=torch.long)
            buffer = buffer[body:]


def sample_windows(windows: Iterable[torch.Tensor], n: int, seed: int, max_windows: int | None = None):
    """Draw n windows uniformly and deterministically (reservoir sampling with a seeded generator).

    Memory stays at n windows whatever the source's size; at most max_windows are read.
    Returns (samples [n', seq_len] in source order, fingerprint of the chosen tokens, windows read).
    """
    gen = torch.Generator().manual_seed(seed)
    reservoir: list[tuple[int, torch.Tensor]] = []
    seen = 0
    for window in windows:
        if seen < n:
            reservoir.append((seen, window))
        else:
            j = int(torch.randint(0, seen + 1, (1,), generator=gen))
            if j < n:
                reservoir[j] = (seen, window)
        seen += 1
        if max_windows is not None and seen >= max_windows:
            break
    reservoir.sort(key=lambda item: item[0])
    if not reservoir:
        return torch.empty(0, 0, dtype=torch.long), hashlib.sha256().hexdigest(), seen
    samples = torch.stack([w for _, w in reservoir])
    return samples, hashlib.sha256(samples.numpy().tobytes()).hexdigest(), seen


def load_samples(source: str | None, tokenizer, n: int, seq_len: int, seed: int,
                 split: str = "train", text_field: str = "text", scan_factor: int = 64):
    """n token windows of seq_len drawn from a source, each starting with the tokenizer's bos_prefix; raises
    OscarError when the source is too small."""
    windows = token_windows(texts(source, split, text_field), tokenizer, seq_len, bos_prefix(tokenizer))
    samples, fingerprint, seen = sample_windows(windows, n, seed, max_windows=max(n * scan_factor, n))
    name = source or DEFAULT_CALIBRATION
    if seen == 0:
        raise OscarError(f"data source {name} holds no text long enough for one sample of {seq_len} tokens")
    if seen < n:
        raise OscarError(f"data source {name} yields only {seen} samples of {seq_len} tokens; {n} asked for")
    return samples, fingerprint


@functools.lru_cache(maxsize=None)
def _heldout_stream(tokenizer) -> tuple:
    """The held-out text's documents tokenized and joined by the end-of-sequence token (once per tokenizer)."""
    stream = []
    for doc in texts(DEFAULT_HELDOUT):
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return tuple(stream)


def heldout_prompts(tokenizer, context: int, batch: int) -> torch.Tensor:
    """[batch, context] token ids of real text for long prompts: sequence b starts b/batch of the way into the
    held-out token stream, which is cycled where it is shorter than context."""
    stream = _heldout_stream(tokenizer)
    ids = torch.tensor(stream)
    reps = -(-(context + len(ids)) // len(ids)) + 1
    ids = ids.repeat(reps)
    return torch.stack([ids[b * len(stream) // batch:][:context] for b in range(batch)])
