"""Issue 51's probes: nothing escapes --out, nothing unchecked is published or exported, flags mean what they say,
verify does not pass what it did not measure, killed runs leave nothing behind, cards stay cards."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli
from test_cli import tiny_calibration
from tiny_bundle import tiny_manifest, write_tiny_bundle

from oscar_core.calibrate.derive import key_formats
from oscar_core.calibrate.export import export_bundle
from oscar_core.errors import OscarError
from oscar_core.evaluate.verify import too_short
from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE, load_bundle, read_manifest, write_bundle
from oscar_core.formats.fileio import atomic_write_dir, atomic_write_stream, path_under
from oscar_core.publish import upstream
from oscar_core.publish.card import model_card

oscar = run_cli


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ---------------------------------------------------------------------------------------------------- names, paths

@pytest.mark.parametrize("name", ["..", "a/..", "../b", "a/./b", "/etc", "a//b", "a\\b", "a\nb", ""])
def test_a_name_that_is_not_plain_never_becomes_a_path(tmp_path, name):
    with pytest.raises(OscarError, match="invalid bundle name"):
        path_under(tmp_path, name, "bundle name")


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "org").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(OscarError, match="leads outside"):
        path_under(tmp_path / "root", "org/model/v1", "bundle name")
    assert path_under(tmp_path / "root", "a/b/v1", "bundle name") == tmp_path / "root" / "a" / "b" / "v1"


def test_export_writes_nothing_outside_out(tmp_path, capfd, monkeypatch):
    calib = tiny_calibration(tmp_path / "calib")
    out = tmp_path / "esc" / "a" / "b" / "zoo"
    code, text = oscar(capfd, monkeypatch, "export", str(calib), "--out", str(out), "--name", "../..",
                       "--version", "X", "--workers", "1")
    assert code == 2 and "Traceback" not in text and "--name" in text
    record = json.loads((calib / "calibration.json").read_text())
    # a calibration of that model id; a GGUF file named so, without name metadata
    for model_id, name in (("../..", "../.."), ("...gguf", "local/..")):
        (calib / "calibration.json").write_text(json.dumps({**record, "model": {**record["model"], "id": model_id}}))
        code, text = oscar(capfd, monkeypatch, "export", str(calib), "--out", str(out), "--workers", "1")
        assert code == 1 and f"error: invalid bundle name {name!r}" in text, text
    assert not (tmp_path / "esc").exists()


def test_upstream_import_and_zoo_recipes_refuse_names_that_climb(tmp_path, capfd, monkeypatch):
    from oscar_core.publish import zoo

    code, text = oscar(capfd, monkeypatch, "upstream", "import", str(tmp_path), "--model", "default",
                       "--name", "../..", "--out", str(tmp_path / "out"))
    assert code == 2 and "--name" in text and not (tmp_path / "out").exists()
    (tmp_path / "zoo" / "recipes").mkdir(parents=True)
    recipe = tmp_path / "zoo" / "recipes" / "evil.toml"
    for field in ('name = "../.."\nversion = "v1"', 'name = "a/b"\nversion = ".."'):
        recipe.write_text(f'{field}\nmodel = "default"\nsamples = 1\nseq_len = 8\n')
        with pytest.raises(OscarError, match=f"recipe {recipe}: (name|version): invalid recipe"):
            zoo.load_recipes(tmp_path / "zoo")


def with_eigenvalues(src, out, model_id: str | None = None, **tensors) -> object:
    """The tiny bundle at `src` with eigenvalues (what upstream export needs without a calibration), another model id
    and `tensors` replaced, re-signed (its checksum right) into `out`."""
    b = load_bundle(src)
    extra = {f"layers.{i}.{s}_eigenvalues": torch.linspace(2, 0.1, 8).expand(2, 8) for i in range(2)
             for s in ("key", "value")}
    m = b.manifest
    if model_id is not None:
        m = m.model_copy(update={"model": m.model.model_copy(update={"id": model_id})})
    write_bundle(out, m, {**b.tensors, **extra, **tensors})
    return out


@pytest.mark.parametrize("model_id", ["..", "org/.."])
def test_upstream_export_of_a_model_id_that_climbs_is_refused(tmp_path, model_id):
    write_tiny_bundle(tmp_path / "b")
    bundle = with_eigenvalues(tmp_path / "b", tmp_path / "e", model_id)
    with pytest.raises(OscarError, match="invalid model directory"):
        upstream.plan_export(bundle, tmp_path / "out", clips="upstream")
    plan = upstream.plan_export(with_eigenvalues(tmp_path / "b", tmp_path / "ok"), tmp_path / "out", clips="upstream")
    assert plan.directory.resolve().is_relative_to((tmp_path / "out").resolve())


@pytest.mark.parametrize("file", ["/etc/hostname", "../rotations.safetensors", "sub/rotations.safetensors", ".."])
def test_tensors_file_is_a_bare_name_in_the_bundle(tmp_path, file):
    write_tiny_bundle(tmp_path / "b")
    path = tmp_path / "b" / MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "tensors": {
        **json.loads(path.read_text())["tensors"], "file": file}}))
    with pytest.raises(OscarError, match="invalid manifest .*tensors.file"):
        load_bundle(tmp_path / "b")


def test_a_tensor_file_linked_from_outside_is_refused(tmp_path):
    write_tiny_bundle(tmp_path / "b")
    (tmp_path / "b" / TENSOR_FILE).rename(tmp_path / "outside.safetensors")
    (tmp_path / "b" / TENSOR_FILE).symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(OscarError, match="outside the bundle"):
        load_bundle(tmp_path / "b")


# ---------------------------------------------------------------------------------------------------- the schema

BAD_FIELDS = [  # (section, key, value, what the one line names)
    ("tensors", "bytes", -5, "tensors.bytes"), ("quant", "key_group_size", 0, "quant.key_group_size"),
    ("quant", "value_group_size", 48, "quant.value_group_size"), ("quant", "sink_tokens", -64, "quant.sink_tokens"),
    ("quant", "recent_tokens", 10**9, "quant.recent_tokens"), ("model", "num_layers", -1, "model.num_layers"),
    ("quant", "key_clip", float("nan"), "quant.key_clip"), ("quant", "bits_per_element", {"32768": float("nan")},
                                                            "quant.bits_per_element"),
    ("rotation", "layers", [0, 999], "rotation.layers"), ("rotation", "windows", {"0": -5}, "rotation.windows"),
    ("model", "id", "a\n---\n<script>", "model.id"), ("calibration", "samples", -1, "calibration.samples"),
]


@pytest.mark.parametrize("section,key,value,where", BAD_FIELDS, ids=[f"{s}.{k}" for s, k, *_ in BAD_FIELDS])
def test_a_manifest_value_the_format_does_not_allow_fails_at_load(tmp_path, section, key, value, where):
    write_tiny_bundle(tmp_path)
    path = tmp_path / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest[section][key] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(OscarError, match=f"invalid manifest {path}: {where}"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("key,value", [("name", "../.."), ("version", ".."), ("max_kl", 0), ("max_logit_error", -1)])
def test_top_level_manifest_fields_are_checked(tmp_path, key, value):
    write_tiny_bundle(tmp_path)
    path = tmp_path / MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(OscarError, match=f"invalid manifest .*{key}"):
        read_manifest(tmp_path)


def test_a_manifest_that_lies_about_the_file_size_is_refused(tmp_path):
    write_tiny_bundle(tmp_path)
    path = tmp_path / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["tensors"]["bytes"] = 10**18
    path.write_text(json.dumps(manifest))
    with pytest.raises(OscarError, match="its manifest says 1,000,000,000,000,000,000"):
        load_bundle(tmp_path)


@pytest.mark.parametrize("edit,what", [({"attention_layers": [0, 999]}, "attention_layers"),
                                       ({"windows": {"0": -5}}, "windows"), ({"model": None}, "model")])
def test_a_calibration_record_export_cannot_use_is_named(tmp_path, capfd, monkeypatch, edit, what):
    calib = tiny_calibration(tmp_path / "calib")
    record = {**json.loads((calib / "calibration.json").read_text()), **edit}
    if record["model"] is None:
        del record["model"]
    (calib / "calibration.json").write_text(json.dumps(record))
    code, text = oscar(capfd, monkeypatch, "export", str(calib), "--out", str(tmp_path / "zoo"), "--workers", "1")
    assert code == 1 and f"calibration record {calib / 'calibration.json'}" in text and what in text, text
    assert "KeyError" not in text and not (tmp_path / "zoo").exists()


def test_an_upstream_record_with_a_negative_window_is_named():
    with pytest.raises(OscarError, match="sink -64"):
        upstream.served_windows({"serve": {"env": {"SGLANG_MIXED_KV_PREFIX_TOKENS": "-64"}}})


# ---------------------------------------------------------------------------------------------------- what leaves

def broken(tmp_path, what: str):
    write_tiny_bundle(tmp_path / "b")
    r = load_bundle(tmp_path / "b").tensors["layers.0.key_rotation"]
    bad = {"nan clip": {"layers.1.value_clip": torch.tensor([0.9, float("nan")])},
           "not orthogonal": {"layers.0.key_rotation": r * 9}}[what]
    return with_eigenvalues(tmp_path / "b", tmp_path / what.replace(" ", "-"), **bad)


@pytest.mark.parametrize("what", ["nan clip", "not orthogonal"])
def test_push_and_upstream_export_refuse_what_verify_rejects(tmp_path, capfd, monkeypatch, what):
    bundle = broken(tmp_path, what)
    code, text = oscar(capfd, monkeypatch, "push", str(bundle), "--hub", "hf", "--repo", "a/b", "--dry-run")
    assert code == 1 and "bundle check failed" in text and "would push" not in text, text
    code, text = oscar(capfd, monkeypatch, "upstream", "export", str(bundle), "--clips", "upstream",
                       "--out", str(tmp_path / "rz"))
    assert code == 1 and "bundle check failed" in text and not (tmp_path / "rz").exists(), text


# ---------------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("args", [
    ("verify", "B", "--max-kl", "nan"), ("verify", "B", "--max-kl", "0"), ("verify", "B", "--max-kl", "inf"),
    ("verify", "B", "--max-logit-error", "nan"), ("verify", "B", "--seq-len", "0"), ("verify", "B", "--samples", "0"),
    ("calibrate", "--out", "O", "--gpus", "-1"), ("calibrate", "--out", "O", "--checkpoint-every", "nan"),
    ("export", "C", "--out", "O", "--key-clip-floor", "nan"), ("export", "C", "--out", "O", "--workers", "0"),
    ("eval", "B", "--context", "0"), ("eval", "B", "--plot", "DIR"), ("eval", "B", "--needle-trials", "-1"),
    ("upstream", "export", "B", "--out", "O", "--key-clip", "nan"),
    ("upstream", "import", "B", "--out", "O", "--value-clip", "1.5"),
])
def test_a_numeric_flag_out_of_range_is_a_usage_error(tmp_path, capfd, monkeypatch, args):
    places = {"B": str(tmp_path / "bundle"), "O": str(tmp_path / "out"), "C": str(tmp_path / "calib"),
              "DIR": str(tmp_path)}
    write_tiny_bundle(tmp_path / "bundle")
    code, text = oscar(capfd, monkeypatch, *(places.get(a, a) for a in args))
    lines = text.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: Invalid value for"), text
    assert not (tmp_path / "out").exists()


def test_eval_with_no_method_and_zoo_list_of_no_zoo_are_usage_errors(tmp_path, capfd, monkeypatch):
    write_tiny_bundle(tmp_path / "b")
    code, text = oscar(capfd, monkeypatch, "eval", str(tmp_path / "b"), "--methods", ",")
    assert code == 2 and text.strip().startswith("error: --methods names no method: give some of bf16"), text
    code, text = oscar(capfd, monkeypatch, "zoo", "list", "--zoo", str(tmp_path / "nowhere"))
    assert code == 2 and text.strip() == f"error: zoo directory not found: {tmp_path / 'nowhere'}"


def test_an_explicit_key_rotation_holds_for_every_key_format(tmp_path):
    assert key_formats("auto") == (("token", "oscar"), ("channel", "none"), ("channel", "eigen"))  # the default
    assert key_formats("auto", "none") == (("token", "none"), ("channel", "none"))
    assert key_formats("channel", "hadamard") == (("channel", "hadamard"),)
    from oscar_core.calibrate.derive import DeriveOptions

    calib = tiny_calibration(tmp_path / "calib")
    opts = DeriveOptions(key_rotation="none", value_rotation="none", key_centering=False,
                         key_formats=key_formats("auto", "none"))
    path, manifest = export_bundle(calib, tmp_path / "zoo", opts=opts)
    b = load_bundle(path)
    for name, r in b.tensors.items():
        if name.endswith("_rotation"):
            assert torch.equal(r, torch.eye(r.shape[-1]).expand_as(r)), name
    assert {e.key_format for e in manifest.quant.layers} <= {"token none", "channel none"}


# ---------------------------------------------------------------------------------------------------- verify

def test_verify_does_not_judge_a_length_that_quantizes_nothing():
    from oscar_core.formats.bundle import LayerQuant

    m = tiny_manifest()   # sink 64, recent 256, groups of 8, keys per token
    assert too_short(256, m).startswith("nothing is quantized at 256 tokens")
    assert too_short(320, m) is not None and too_short(321, m) is None and too_short(512, m) is None
    channel = m.model_copy(update={"quant": m.quant.model_copy(update={"layers": [
        LayerQuant(layer=0, key_axis="channel"), LayerQuant(layer=1, key_axis="token")]})})
    assert too_short(325, channel).startswith("only 5 tokens are quantized at 325 tokens")  # no key block of 8
    assert "use --seq-len 328 or more" in too_short(325, channel) and too_short(328, channel) is None


# ---------------------------------------------------------------------------------------------------- killed runs

def test_a_killed_writers_temporaries_go_with_the_next_write(tmp_path):
    """A dead process's temporary directory (export's .v1.*.tmp/) and file (assemble's hidden .gguf temporary)
    are removed by the next write of the same target; a live writer's are left alone; a swap a kill left half
    done is settled."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale_dir = tmp_path / f".v1.{pid}.abcd1234.tmp"
    stale_dir.mkdir()
    (stale_dir / TENSOR_FILE).write_bytes(b"partial")
    legacy = tmp_path / ".v1.k2j4h5g6.tmp"   # written before temporaries carried a process id
    legacy.mkdir()
    live = tmp_path / f".v1.{os.getpid()}.zzzz9999.tmp"
    live.mkdir()
    atomic_write_dir(tmp_path / "v1", {"a": b"1"})
    assert files_under(tmp_path) == {"v1", "v1/a", live.name}
    os.replace(tmp_path / "v1", tmp_path / ".v1.old")  # killed between moving the old bundle aside and the swap
    atomic_write_dir(tmp_path / "v1", {"a": b"2"})
    assert (tmp_path / "v1" / "a").read_bytes() == b"2" and not (tmp_path / ".v1.old").exists()
    partial = tmp_path / f".model.gguf.{pid}.abcd1234.tmp"
    partial.write_bytes(b"x" * 1000)
    atomic_write_stream(tmp_path / "model.gguf", [b"whole"])
    assert not partial.exists() and (tmp_path / "model.gguf").read_bytes() == b"whole"


def test_export_workers_die_with_a_killed_export(tmp_path):
    script = ("import os, sys, time\n"
              "from oscar_core.calibrate.export import worker_pool\n"
              "if __name__ == '__main__':\n"
              "    pool = worker_pool(2)\n"
              "    futures = [pool.submit(os.getpid) for _ in range(8)]\n"
              "    print(*sorted({f.result() for f in futures}), flush=True)\n"
              "    time.sleep(600)\n")
    (tmp_path / "run.py").write_text(script)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert workers and all(alive(p) for p in workers)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------------- cards

def test_card_fields_are_escaped_and_the_front_matter_stays_yaml():
    m = tiny_manifest("evil|id<script>alert(1)</script>`x`")
    m = m.model_copy(update={"calibration": m.calibration.model_copy(update={"data": "d | --- <b>[x](y)"})})
    for hub in ("hf", "modelscope"):
        card = model_card(m, hub, "alice/tiny")
        _, meta, body = card.split("---\n", 2)
        assert isinstance(yaml.safe_load(meta), dict) and "base_model" not in yaml.safe_load(meta)
        blocks = re.sub(r"^```.*?^```", "", body, flags=re.M | re.S)
        shown = re.sub(r"(`+).+?\1", "", blocks)   # what markdown reads: outside code blocks and spans
        assert "<script>" not in shown and "<b>" not in shown and "[x](y)" not in shown
        rows = [line for line in body.splitlines() if line.startswith("| data |") or line.startswith("| model |")]
        assert len(rows) == 2 and all(len(row.replace("\\|", "").split("|")) == 4 for row in rows), rows
        assert card.count("\n---\n") == 1
