"""The authors' rotation files (oscar_core/publish/upstream.py): files written here in their schema, no network."""

import io
import json
import re

import pytest
import torch
from conftest import run_cli, tiny_model
from test_cli import tiny_calibration

from oscar_core.calibrate.calibration import read_statistics
from oscar_core.calibrate.export import export_bundle
from oscar_core.calibrate.models import attention_layer_ids
from oscar_core.errors import OscarError
from oscar_core.evaluate.fidelity import capture_attention, key_error, value_error
from oscar_core.evaluate.verify import layer_errors
from oscar_core.formats.bundle import ModelInfo, load_bundle, write_bundle
from oscar_core.publish import upstream
from oscar_core.rotations import orthogonality_error, rotation

KV, D = 2, 8


def facts(num_layers: int = 2, kv: int = KV, d: int = D) -> ModelInfo:
    return ModelInfo(id="oscar-test/tiny", config_sha256="c" * 64, architecture="LlamaForCausalLM",
                     num_layers=num_layers, num_heads=2 * kv, num_kv_heads=kv, head_dim=d,
                     max_position_embeddings=2048)


def orthogonal(*shape, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def save(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def write_files(directory, layers: dict[int, tuple], objective_k: str = "qqt") -> None:
    """Both files in the authors' schema; layers: id -> (key rotation, value rotation), eigenvalues [d] descending."""
    for side, objective, which in (("key", objective_k, 0), ("value", "sst", 1)):
        entries = {i: {"layer_id": i, "rotation": r[which], "eigenvalues": torch.linspace(2.0, 0.1, D)}
                   for i, r in layers.items()}
        save(directory / upstream.FILES[side],
             {"format_version": 1, "objective": objective, "source_grouping": "layer", "layers": entries})


@pytest.fixture
def exported(tmp_path):
    """A tiny model's real calibration, its bundle (keys centred, per-head clips), and the upstream export."""
    calib = tiny_calibration(tmp_path / "calib")
    bundle, manifest = export_bundle(calib, tmp_path / "zoo")
    plan = upstream.plan_export(bundle, tmp_path / "rz", calib)
    return calib, bundle, upstream.write_export(plan), plan


def test_export_writes_the_schema_and_the_serve_command(exported):
    calib, bundle, directory, plan = exported
    source = load_bundle(bundle)
    m = source.manifest
    assert directory.name == f"seq{m.calibration.tokens}_prompt{m.calibration.samples}_group16"  # 128 capped at 16
    assert directory.parent.name == "tiny-llama"
    k = torch.load(directory / upstream.FILES["key"], weights_only=True)
    assert (k["format_version"], k["objective"], k["source_grouping"]) == (1, "qqt", "layer")
    assert sorted(k["layers"]) == [0, 1] and all(isinstance(i, int) for i in k["layers"])
    entry = k["layers"][1]
    assert entry["layer_id"] == 1 and entry["rotation"].dtype == torch.float32
    # One rotation per layer: U·H·P_br of C_Q averaged over the KV heads, and that average's eigenvalues.
    stats, _ = read_statistics(calib, m.model.num_heads)
    mean = stats.query_covariance(1).mean(0)
    assert torch.equal(entry["rotation"], rotation("oscar", mean, 16).float())
    want = torch.linalg.eigvalsh(mean).flip(-1).float()
    assert entry["eigenvalues"].shape == (16,) and torch.allclose(entry["eigenvalues"], want, rtol=1e-5)
    serve = (directory / upstream.SERVE_FILE).read_text()
    for needle in ("--kv-cache-dtype int2", "--kv-cache-quant-group-size 16", "SGLANG_ENABLE_MIXED_KV_WINDOWS=1",
                   f"SGLANG_OSCAR_K_CLIP_RATIO={plan.record['clips']['key']:g}", "SGLANG_OSCAR_ABSORB_V_ROTATION=1",
                   'SGLANG_OSCAR_K_ROTATION_PATH="$DIR/k_rotation_qqt_r_h_pbr.pt"', "SGLANG_MIXED_KV_PREFIX_TOKENS=64"):
        assert needle in serve
    record = json.loads((directory / upstream.RECORD_FILE).read_text())
    assert (record["format_version"], record["grouping"]) == (1, "layer")
    assert any("key centring dropped" in n for n in record["dropped"])
    assert any("averaged over the 2 KV heads (from the calibration statistics)" in n for n in record["dropped"])
    assert any("capped at head_dim 16" in n for n in record["dropped"])
    assert record["eigenvalues"] == "calibration statistics"
    # Deterministic: the same inputs give the same bytes.
    again = upstream.plan_export(bundle, directory.parent.parent, calib)
    assert again.files == plan.files


def test_round_trip_gives_the_same_rotations_and_the_predicted_errors(exported, tmp_path):
    calib, bundle, _, _ = exported
    source = load_bundle(bundle)
    plan = upstream.plan_export(bundle, tmp_path / "rz", calib, per_head=True)
    directory = upstream.write_export(plan)
    assert "SGLANG_OSCAR_ABSORB_V_ROTATION=0" in (directory / upstream.SERVE_FILE).read_text()
    out, manifest, files = upstream.import_upstream(directory, tmp_path / "imported", source.manifest.model)
    imported = load_bundle(out)
    assert manifest.source.grouping == "head" and manifest.source.format_version == 2
    assert manifest.rotation.key_centering is False
    assert manifest.quant.key_clip == plan.record["clips"]["key"] and "oscar_upstream.json" in manifest.source.clips
    for i in range(2):
        for side in ("key", "value"):
            assert torch.equal(imported.layer(i, f"{side}_rotation"), source.layer(i, f"{side}_rotation"))
        assert imported.layer(i, "key_mean") is None
        assert torch.equal(imported.layer(i, "key_eigenvalues"),
                           torch.load(directory / upstream.FILES["key"], weights_only=True)["layers"][i]["eigenvalues"])
    # verify's figures for the imported bundle are those of the served variant, predicted from the source bundle:
    # its rotations, no key mean, one clip per side, the served group size.
    model = tiny_model("llama")
    held = capture_attention(model, torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(1)))
    rows = layer_errors(held, imported, compared=("oscar",))
    ours = layer_errors(held, source, compared=("oscar",))
    clips, g, sink = plan.record["clips"], plan.record["group_size"]["served"], manifest.quant.sink_tokens
    for layer in range(2):
        q, k, v, scaling = held[layer]
        r_k, r_v = (source.layer(layer, f"{s}_rotation").double() for s in ("key", "value"))
        predicted_k = key_error(q, k, r_k, None, clips["key"], g, sink)
        predicted_v = value_error(q, k, v, scaling, r_v, None, clips["value"], g, sink)
        got = [r for r in rows if r["layer"] == layer]
        assert torch.allclose(torch.tensor([r["oscar_key"] for r in got]), predicted_k.float(), rtol=1e-6)
        assert torch.allclose(torch.tensor([r["oscar_value"] for r in got]), predicted_v.float(), rtol=1e-6)
    assert [r["oscar_key"] for r in rows] != [r["oscar_key"] for r in ours]  # centring and per-head clips differ
    # Exported again from the imported bundle (which carries the eigenvalues): the same rotation files.
    again = upstream.plan_export(out, tmp_path / "rz2", clips="upstream", key_clip=clips["key"],
                                 value_clip=clips["value"], group_size=g, per_head=True)
    for name in upstream.FILES.values():
        assert again.files[name] == plan.files[name]


def test_export_needs_the_calibration_for_what_the_bundle_lacks(exported, tmp_path):
    calib, bundle, directory, plan = exported
    with pytest.raises(OscarError, match="pass --calibration DIR.*no eigenvalues of C_Q and C_S.*or --per-head"):
        upstream.plan_export(bundle, tmp_path / "x", clips="upstream")
    with pytest.raises(OscarError, match="pass --calibration DIR.*no eigenvalues$"):
        upstream.plan_export(bundle, tmp_path / "x", clips="upstream", per_head=True)
    with pytest.raises(OscarError, match="pass --calibration DIR.*searches the clips"):
        upstream.plan_export(bundle, tmp_path / "x")
    per_head = upstream.plan_export(bundle, tmp_path / "x", calib, per_head=True, clips="upstream")
    k = torch.load(io.BytesIO(per_head.files[upstream.FILES["key"]]), weights_only=True)
    assert k["format_version"] == 2 and k["layers"][0]["rotation"].shape == (2, 16, 16)
    assert k["layers"][0]["eigenvalues"].shape == (2, 16)
    assert per_head.record["clips"]["key"] == 0.96 and per_head.record["grouping"] == "head"


def test_per_layer_file_broadcasts_to_every_kv_head(tmp_path):
    d = tmp_path / "Tiny" / "seq4096_prompt8_group128"
    write_files(d, {i: (orthogonal(D, D, seed=i), orthogonal(D, D, seed=10 + i)) for i in range(2)})
    out, manifest, files = upstream.import_upstream(d, tmp_path / "zoo", facts())
    b = load_bundle(out)
    assert manifest.source.grouping == "layer" and manifest.source.clips.startswith("upstream defaults")
    assert (manifest.quant.key_clip, manifest.quant.value_clip, manifest.quant.key_group_size) == (0.96, 0.92, 8)
    assert (manifest.calibration.tokens, manifest.calibration.samples, manifest.calibration.seed) == (4096, 8, None)
    r = b.layer(1, "key_rotation")
    assert r.shape == (KV, D, D) and torch.equal(r[0], orthogonal(D, D, seed=1)) and torch.equal(r[1], r[0])
    assert b.layer(0, "value_eigenvalues").shape == (KV, D)
    assert torch.equal(b.layer(0, "key_clip"), torch.full((KV,), 0.96))


def test_per_head_file_keeps_each_head(tmp_path):
    d = tmp_path / "Tiny" / "seq100_prompt1_group8"
    write_files(d, {i: (orthogonal(KV, D, D, seed=i), orthogonal(KV, D, D, seed=5 + i)) for i in range(2)})
    out, manifest, _ = upstream.import_upstream(d, tmp_path / "zoo", facts(), key_clip=0.9, value_clip=0.85)
    b = load_bundle(out)
    assert manifest.source.grouping == "head" and (manifest.quant.key_clip, manifest.quant.value_clip) == (0.9, 0.85)
    assert torch.equal(b.layer(1, "value_rotation"), orthogonal(KV, D, D, seed=6))


def test_hybrid_model_sparse_layer_ids(tmp_path):
    import transformers as tf

    config = tf.Qwen3NextConfig(num_hidden_layers=8)
    assert attention_layer_ids(config) == [3, 7]
    assert attention_layer_ids(tf.LlamaConfig(num_hidden_layers=4)) is None
    model = facts(num_layers=8)
    d = tmp_path / "Hybrid" / "seq64_prompt1_group8"
    write_files(d, {i: (orthogonal(D, D, seed=i), orthogonal(D, D, seed=i + 1)) for i in (3, 7)})
    out, manifest, _ = upstream.import_upstream(d, tmp_path / "zoo", model, [3, 7])
    b = load_bundle(out)
    assert manifest.rotation.layers == [3, 7]
    assert sorted({k.split(".")[1] for k in b.tensors}) == ["3", "7"]
    assert '"layers": [' in (out / "manifest.json").read_text()
    with pytest.raises(OscarError, match="has layer 3, which the model has no attention layer for"):
        upstream.import_upstream(d, tmp_path / "zoo", model, [1, 7])
    write_files(d, {3: (orthogonal(D, D), orthogonal(D, D))})
    with pytest.raises(OscarError, match="lacks layer 7"):
        upstream.import_upstream(d, tmp_path / "zoo", model, [3, 7])


def test_truncated_and_corrupt_files_are_one_line_errors(tmp_path):
    d = tmp_path / "M" / "seq1_prompt1_group8"
    write_files(d, {i: (orthogonal(D, D), orthogonal(D, D)) for i in range(2)})
    path = d / upstream.FILES["value"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OscarError, match="corrupt or truncated rotation file .*v_rotation_sst_r_h_pbr.pt"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(OscarError, match="corrupt or truncated"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    path.unlink()
    with pytest.raises(OscarError, match="missing v_rotation_sst_r_h_pbr.pt"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    assert not (tmp_path / "zoo").exists()


class RunsCode:
    """Unpickling this object calls exec: what a malicious .pt file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_pickle_that_needs_code_execution_is_refused_and_nothing_runs(tmp_path):
    d = tmp_path / "M" / "seq1_prompt1_group8"
    write_files(d, {i: (orthogonal(D, D), orthogonal(D, D)) for i in range(2)})
    marker = tmp_path / "pwned"
    evil = torch.load(d / upstream.FILES["key"], weights_only=True)
    evil["layers"][0]["payload"] = RunsCode(marker)
    save(d / upstream.FILES["key"], evil)
    torch.load(d / upstream.FILES["key"], weights_only=False)  # the payload is real: a full unpickle runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(OscarError, match="refused .*k_rotation_qqt_r_h_pbr.pt: it needs code execution"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    assert not marker.exists() and not (tmp_path / "zoo").exists()


def test_wrong_size_non_orthogonal_and_bad_schema_are_refused(tmp_path):
    d = tmp_path / "M" / "seq1_prompt1_group8"
    cases = [
        ({0: (orthogonal(16, 16), orthogonal(D, D)), 1: (orthogonal(D, D), orthogonal(D, D))},
         "layer 0 rotation has shape (16, 16); the model needs [8, 8] or [2, 8, 8]"),
        ({0: (orthogonal(3, D, D), orthogonal(D, D)), 1: (orthogonal(D, D), orthogonal(D, D))}, "shape (3, 8, 8)"),
        ({0: (orthogonal(D, D) * 1.01, orthogonal(D, D)), 1: (orthogonal(D, D), orthogonal(D, D))}, "not orthogonal"),
        ({0: (orthogonal(D, D), orthogonal(D, D))}, "lacks layer 1"),
    ]
    for layers, message in cases:
        write_files(d, layers)
        with pytest.raises(OscarError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            upstream.import_upstream(d, tmp_path / "zoo", facts())
    write_files(d, {i: (orthogonal(D, D), orthogonal(D, D)) for i in range(2)}, objective_k="sst")
    with pytest.raises(OscarError, match="objective 'sst' is not a key objective"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    save(d / upstream.FILES["key"], [1, 2, 3])
    with pytest.raises(OscarError, match="not a rotation file"):
        upstream.import_upstream(d, tmp_path / "zoo", facts())
    assert not (tmp_path / "zoo").exists()


def test_cli_refusals_are_one_line(exported, tmp_path, capfd, monkeypatch):
    calib, bundle, directory, plan = exported
    d = tmp_path / "M" / "seq1_prompt1_group8"
    write_files(d, {i: (orthogonal(D, D), orthogonal(D, D)) for i in range(2)})
    out = tmp_path / "cli-out"

    def refused(pattern, *args, exit_code=1):
        code, text = run_cli(capfd, monkeypatch, "upstream", *map(str, args))
        lines = [line for line in text.splitlines() if line.strip()]
        assert code == exit_code and "Traceback" not in text and len(lines) == 1 and pattern in lines[0], text

    refused("pass --model", "import", d, "--out", out)
    refused("not found", "import", tmp_path / "nope", "--out", out)
    refused("pass --calibration DIR", "export", bundle, "--out", out)
    refused("power of two", "export", bundle, "--out", out, "--calibration", calib, "--group-size", "12", exit_code=2)
    refused("--per-head and --per-layer exclude each other", "export", bundle, "--out", out, "--calibration", calib,
            "--per-head", "--per-layer", exit_code=2)
    assert not out.exists()


def test_a_hadamard_bundle_is_not_exported_as_r_h_pbr(exported, tmp_path):
    calib, bundle, directory, plan = exported
    b = load_bundle(bundle)
    manifest = b.manifest.model_copy(update={"rotation": b.manifest.rotation.model_copy(update={"key": "H"})})
    write_bundle(tmp_path / "h", manifest, b.tensors)
    with pytest.raises(OscarError, match="key rotation is H"):
        upstream.plan_export(tmp_path / "h", tmp_path / "x", calib)


def test_verify_table_shows_the_other_bundle_beside_ours(capsys):
    from oscar_cli.commands.verify import _print_report
    from oscar_core.evaluate.verify import merge_reports

    def sample(shift):
        rows = [{"layer": l, "kv_head": h, "oscar_key": 0.1 + l + shift, "oscar_value": 0.2, "hadamard_key": 0.3,
                 "hadamard_value": 0.4, "int2_key": 0.5, "int2_value": 0.6} for l in range(2) for h in range(2)]
        other = [{"layer": r["layer"], "kv_head": r["kv_head"], "oscar_key": 0.7 + shift, "oscar_value": 0.8} for r in rows]
        mean = lambda rs: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0] if k not in ("layer", "kv_head")}  # noqa
        return {"path": "torch reference", "layers": rows, "mean": mean(rows), "end_to_end": {"kl": 0.01, "top1_agreement": 0.9},
                "compare": {"layers": other, "mean": mean(other), "end_to_end": {"kl": 0.03 + shift, "top1_agreement": 0.8}}}

    report = merge_reports([sample(0.0), sample(0.02)])
    assert abs(report["compare"]["mean"]["oscar_key"] - 0.71) < 1e-12 and abs(report["compare"]["end_to_end"]["kl"] - 0.04) < 1e-12
    report.update(passed=True, max_logit_error=0.5)
    report["compare"].update(name="org/model", version="upstream-seq1_prompt1_group8", bundle="imported/x")
    before = json.dumps(report, sort_keys=True)
    _print_report(report)
    out = capsys.readouterr().out
    assert "other" in out and "0.7100" in out and "upstream-seq1_prompt1_group8" in out
    end_to_end = next(line for line in out.splitlines() if "other: org/model" in line and "0.0400" in line)
    assert "80.0%" in end_to_end  # the other bundle's row of the end-to-end table: KL, top-1
    assert json.dumps(report, sort_keys=True) == before  # printing leaves the report (and its JSON) as it was


def test_bundles_exported_with_eigenvalues_need_no_calibration_to_go_upstream(tmp_path):
    calib = tiny_calibration(tmp_path / "calib")
    plain, _ = export_bundle(calib, tmp_path / "plain")
    bundle, _ = export_bundle(calib, tmp_path / "zoo", with_eigenvalues=True)
    b = load_bundle(bundle)
    assert b.layer(1, "value_eigenvalues").shape == (2, 16)
    assert not any("eigenvalues" in k for k in load_bundle(plain).tensors)  # off by default: zoo bytes unchanged
    for name, t in load_bundle(plain).tensors.items():
        assert torch.equal(t, b.tensors[name])
    plan = upstream.plan_export(bundle, tmp_path / "rz", clips="upstream")
    assert plan.record["eigenvalues"] == "bundle" and plan.record["grouping"] == "layer"
    # The per-layer rotations derived from the bundle alone (C_h = U_h·diag(λ_h)·U_hᵀ) are those of the statistics.
    from_stats = upstream.plan_export(bundle, tmp_path / "rz", calib, clips="upstream")
    for name in upstream.FILES.values():
        ours, theirs = (torch.load(io.BytesIO(p.files[name]), weights_only=True)["layers"] for p in (plan, from_stats))
        for i in (0, 1):
            assert torch.allclose(ours[i]["rotation"], theirs[i]["rotation"], atol=1e-4)
            assert torch.allclose(ours[i]["eigenvalues"], theirs[i]["eigenvalues"], rtol=1e-4, atol=1e-6)
    bad = dict(b.tensors, **{"layers.0.key_eigenvalues": torch.zeros(16)})
    write_bundle(tmp_path / "bad", b.manifest, bad)
    with pytest.raises(OscarError, match=r"layers.0.key_eigenvalues has shape \(16,\), manifest implies \(2, 16\)"):
        load_bundle(tmp_path / "bad")


# What the loaders that read these files check, mirrored here (their code is not copied): the authors'
# load_oscar_rotations (sglang-research, srt/mem_cache/memory_pool.py), the vLLM work-in-progress PR's rotation
# loader, and the newer SGLang tree's load_oscar_rotations that also takes per-head ("V2") rotations.

def authors_loader(path, layer_ids: list[int], head_dim: int) -> torch.Tensor:
    """A dict with "layers"; for each global layer id an entry (int or str key) whose "rotation" is exactly
    (head_dim, head_dim); the matrices are stacked [layers, d, d] in the model's dtype."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert "layers" in state, "missing 'layers' key"
    mats = []
    for lid in layer_ids:
        entry = state["layers"].get(lid, state["layers"].get(str(lid)))
        assert entry is not None, f"missing layer {lid}"
        r = entry["rotation"]
        assert tuple(r.shape) == (head_dim, head_dim), f"layer {lid} shape {tuple(r.shape)}"
        mats.append(r.to(torch.bfloat16))
    return torch.stack(mats)


def vllm_pr_loader(path, layer_ids: list[int], head_dim: int) -> dict[int, torch.Tensor]:
    """A dict with "layers" whose every key int() reads and whose entries' "rotation" becomes float32; a layer the
    file lacks runs unrotated there without an error, so every attention layer must be present; each rotation
    exactly (head_dim, head_dim)."""
    obj = torch.load(path, map_location="cpu", weights_only=False)
    table = {int(k): (e["rotation"] if isinstance(e, dict) else e).float().contiguous()
             for k, e in obj["layers"].items()}
    for lid in layer_ids:
        assert lid in table, f"no rotation for layer {lid}"
        assert tuple(table[lid].shape) == (head_dim, head_dim), f"layer {lid} shape {tuple(table[lid].shape)}"
    return table


def v2_loader(path, layer_ids: list[int], head_dim: int, kv_heads: int) -> torch.Tensor:
    """As the authors' loader, and a rotation may also be per head, (num_kv_heads, head_dim, head_dim)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    mats = []
    for lid in layer_ids:
        r = state["layers"].get(lid, state["layers"].get(str(lid)))["rotation"]
        assert tuple(r.shape) in ((head_dim, head_dim), (kv_heads, head_dim, head_dim)), f"layer {lid} shape"
        mats.append(r.to(torch.bfloat16))
    return torch.stack(mats)


def serve_env_of(script: str, directory) -> dict[str, str]:
    """The VAR=value lines of serve.sh, $DIR as the directory it sits in."""
    lines = [line.rstrip(" \\") for line in script.splitlines() if re.match(r"^[A-Z_]+=", line)]
    return {k: v.strip('"').replace("$DIR", str(directory)) for k, v in (line.split("=", 1) for line in lines)}


def runtime_accepts(env: dict[str, str]) -> None:
    """Their runtime's configuration checks: both rotation files given, clip ratios in [0, 1], the flags booleans,
    a known scale dtype; folding R_V into the value projection takes [d, d] value rotations only."""
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] and env["SGLANG_OSCAR_V_ROTATION_PATH"]
    for side in "KV":
        assert 0.0 <= float(env[f"SGLANG_OSCAR_{side}_CLIP_RATIO"]) <= 1.0
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] in ("0", "1") and env["SGLANG_ENABLE_MIXED_KV_WINDOWS"] == "1"
    assert env["SGLANG_MIXED_KV_SCALE_DTYPE"] in ("float32", "bfloat16", "float16")
    if env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "1":
        values = torch.load(env["SGLANG_OSCAR_V_ROTATION_PATH"], weights_only=False)["layers"]
        assert all(e["rotation"].dim() == 2 for e in values.values()), "per-head value rotations cannot be absorbed"


@pytest.mark.parametrize("per_head", [False, True], ids=["default", "per-head"])
def test_what_the_export_writes_passes_the_loaders_checks(exported, tmp_path, per_head):
    calib, bundle, _, _ = exported
    directory = upstream.write_export(upstream.plan_export(bundle, tmp_path / "rz", calib, per_head=per_head))
    layers, d, kv = [0, 1], 16, 2
    assert re.fullmatch(r"seq\d+_prompt\d+_group16", directory.name) and directory.parent.name == "tiny-llama"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "serve.sh", "oscar_upstream.json"])
    for side, objective in (("key", "qqt"), ("value", "sst")):
        path = directory / upstream.FILES[side]
        obj = torch.load(path, weights_only=True)   # tensors and plain data: no code runs to read it
        assert (obj["format_version"], obj["objective"], obj["source_grouping"]) == (2 if per_head else 1, objective,
                                                                                     "layer")
        assert sorted(obj["layers"]) == layers
        for lid, entry in obj["layers"].items():
            r, e = entry["rotation"], entry["eigenvalues"]
            assert type(lid) is int and entry["layer_id"] == lid
            assert r.dtype == e.dtype == torch.float32 and r.is_contiguous() and torch.isfinite(r).all()
            assert r.shape[:-2] == e.shape[:-1] and orthogonality_error(r) <= 1e-5
            assert (e[..., :-1] >= e[..., 1:]).all() and (e >= -1e-6 * e.abs().max()).all()  # a covariance's
        assert v2_loader(path, layers, d, kv).shape == ((2, kv, d, d) if per_head else (2, d, d))
        if per_head:
            for loader in (authors_loader, vllm_pr_loader):
                with pytest.raises(AssertionError, match="shape"):
                    loader(path, layers, d)
        else:
            assert authors_loader(path, layers, d).shape == (2, d, d)
            assert sorted(vllm_pr_loader(path, layers, d)) == layers
    env = serve_env_of((directory / upstream.SERVE_FILE).read_text(), directory)
    runtime_accepts(env)
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == ("0" if per_head else "1")
    assert json.loads((directory / upstream.RECORD_FILE).read_text())["format_version"] == (2 if per_head else 1)


def test_a_per_head_file_labelled_version_1_still_imports_and_version_2_must_be_per_head(tmp_path):
    d = tmp_path / "M" / "seq1_prompt1_group8"
    write_files(d, {i: (orthogonal(KV, D, D, seed=i), orthogonal(KV, D, D, seed=5 + i)) for i in range(2)})
    assert upstream.import_upstream(d, tmp_path / "zoo", facts())[1].source.format_version == 1   # older oscar exports
    for side in upstream.FILES:
        obj = torch.load(d / upstream.FILES[side], weights_only=True)
        save(d / upstream.FILES[side], {**obj, "format_version": 2})
    _, manifest, _ = upstream.import_upstream(d, tmp_path / "zoo2", facts())
    assert (manifest.source.format_version, manifest.source.grouping) == (2, "head")
    write_files(d, {i: (orthogonal(D, D), orthogonal(D, D)) for i in range(2)})
    obj = torch.load(d / upstream.FILES["key"], weights_only=True)
    save(d / upstream.FILES["key"], {**obj, "format_version": 2})
    with pytest.raises(OscarError, match="format_version 2 holds per-head"):
        upstream.import_upstream(d, tmp_path / "zoo3", facts())
    save(d / upstream.FILES["key"], {**obj, "format_version": 3})
    with pytest.raises(OscarError, match=r"format_version 3 is not supported \(only 1 or 2\)"):
        upstream.import_upstream(d, tmp_path / "zoo3", facts())
