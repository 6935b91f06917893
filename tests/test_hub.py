"""oscar push against a local stand-in hub (tests/hubserver.py): real HTTP, the real client libraries."""

import base64
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE, manifest_json
from oscar_core.publish.card import model_card
from tiny_bundle import write_tiny_bundle

HERE = Path(__file__).parent
TOKEN = "hf_good-token-0123456789"
BAD_TOKEN = "hf_bad-token-9876543210"
REPO = "alice/tiny-oscar"
HUBS = ("hf", "modelscope")
MAIN = {"hf": "main", "modelscope": "master"}


class HubServer:
    """tests/hubserver.py as a process on a free port of 127.0.0.1."""

    def __init__(self, hub: str):
        self.hub = hub
        self.proc = subprocess.Popen([sys.executable, str(HERE / "hubserver.py"), "--hub", hub, "--token", TOKEN],
                                     stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline().split()[1])}"

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data)) as r:
            return json.load(r)

    def state(self) -> dict:
        return self._call("/_fake/state")

    def seed(self, repo: str, files: dict[str, bytes]) -> None:
        self._call("/_fake/seed", {"repo": repo, "files": {p: base64.b64encode(d).decode() for p, d in files.items()}})

    def fail(self, method: str, contains: str, status: int) -> None:
        self._call("/_fake/fail", {"method": method, "contains": contains, "status": status})

    def files(self, repo: str, branch: str | None = None) -> dict[str, bytes]:
        branch_state = self.state()["repos"][repo]["branches"][branch or MAIN[self.hub]]
        return {p: base64.b64decode(f["b64"]) for p, f in branch_state["files"].items()}

    def requests(self) -> list[dict]:
        # huggingface_hub fetches its agent registry on its own; it is not part of a push.
        return [r for r in self.state()["requests"] if r["path"] != "/api/agent-harnesses"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(params=HUBS)
def hub(request) -> str:
    return request.param


@pytest.fixture
def server(hub):
    s = HubServer(hub)
    yield s
    s.stop()


@pytest.fixture
def client_env(hub, server, tmp_path, monkeypatch):
    """Point the hub's client at the server through its own endpoint and token settings."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    if hub == "hf":
        import huggingface_hub.constants as c

        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        # huggingface_hub reads these variables once, at import: mirror them into its constants.
        monkeypatch.setattr(c, "ENDPOINT", server.url)
        monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        monkeypatch.setattr(c, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-home" / "agents.json"))
    else:
        monkeypatch.setenv("MODELSCOPE_ENDPOINT", server.url)
        monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))
        monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    return "HF_TOKEN" if hub == "hf" else "MODELSCOPE_API_TOKEN"


@pytest.fixture
def bundle(tmp_path) -> Path:
    write_tiny_bundle(tmp_path / "bundle")
    return tmp_path / "bundle"


oscar = run_cli


def push_args(bundle: Path, hub: str, *extra: str) -> list[str]:
    return ["push", str(bundle), "--hub", hub, "--repo", REPO, *extra]


def writes(requests: list[dict]) -> list[dict]:
    return [r for r in requests if r["method"] in ("POST", "PUT", "DELETE") and "validate-yaml" not in r["path"]]


def test_first_push_uploads_bundle_manifest_and_card_in_one_commit(hub, server, client_env, bundle, capfd,
                                                                   monkeypatch):
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 0, out
    assert "published oscar-test/tiny-llama v1" in out and "(new repo)" in out and server.url in out
    files = server.files(REPO)
    manifest_bytes = (bundle / MANIFEST_FILE).read_bytes()
    assert files[TENSOR_FILE] == (bundle / TENSOR_FILE).read_bytes()
    assert files[MANIFEST_FILE] == manifest_bytes
    from oscar_core.formats.bundle import Manifest

    manifest = Manifest.model_validate_json(manifest_bytes)
    assert manifest_json(manifest).encode() == manifest_bytes
    assert files["README.md"] == model_card(manifest, hub, REPO).encode()
    repo_state = server.state()["repos"][REPO]
    ours = [c for c in repo_state["commits"] if c["message"].startswith("oscar push")]
    assert len(ours) == 1 and ours[0]["files"] == ["README.md", MANIFEST_FILE, TENSOR_FILE]
    assert repo_state["branches"][MAIN[hub]]["files"][TENSOR_FILE]["lfs"]
    assert repo_state["private"] is False
    assert all(r["auth"] == "valid" for r in server.requests() if not r["path"].startswith("/_lfs/"))
    if hub == "hf":
        assert ours[0]["sha"] in out


def test_private_flag_creates_a_private_repo(hub, server, client_env, bundle, capfd, monkeypatch):
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub, "--private"))
    assert code == 0, out
    assert server.state()["repos"][REPO]["private"] is True


def test_pushing_the_same_bundle_again_is_a_no_op(hub, server, client_env, bundle, capfd, monkeypatch):
    assert oscar(capfd, monkeypatch, *push_args(bundle, hub))[0] == 0
    before = server.state()
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 0, out
    assert "unchanged" in out and "nothing uploaded" in out
    after = server.state()
    assert after["repos"] == before["repos"]
    assert writes(after["requests"][len(before["requests"]):]) == []


def test_a_new_version_of_the_same_model_is_a_new_commit(hub, server, client_env, tmp_path, capfd, monkeypatch):
    write_tiny_bundle(tmp_path / "v1", seed=0)
    write_tiny_bundle(tmp_path / "v2", seed=1)
    assert oscar(capfd, monkeypatch, *push_args(tmp_path / "v1", hub))[0] == 0
    code, out = oscar(capfd, monkeypatch, *push_args(tmp_path / "v2", hub))
    assert code == 0, out
    assert "published" in out and "(new repo)" not in out
    assert server.files(REPO)[TENSOR_FILE] == (tmp_path / "v2" / TENSOR_FILE).read_bytes()
    commits = [c for c in server.state()["repos"][REPO]["commits"] if c["message"].startswith("oscar push")]
    assert len(commits) == 2


def test_dry_run_prints_files_hashes_and_card_and_sends_nothing(hub, server, client_env, bundle, capfd, monkeypatch):
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub, "--dry-run"))
    assert code == 0, out
    from oscar_core.publish.hub import plan_push

    plan = plan_push(str(bundle), hub, REPO)
    for f in plan.files:
        assert f.path in out and f"{f.size:,} bytes" in out and f.sha256 in out
    assert plan.card in out
    assert server.requests() == [] and server.state()["repos"] == {}


@pytest.mark.parametrize("flaw", ["nan clip", "not orthogonal", "tensor file outside"])
def test_a_bundle_verify_rejects_is_not_published(hub, server, client_env, bundle, tmp_path, capfd, monkeypatch, flaw):
    """Push runs verify's integrity checks before anything leaves: a NaN clip or a non-orthogonal rotation (re-signed,
    the checksum right), or a tensor file linked from outside the bundle, is refused and the hub sees no request."""
    from oscar_core.formats.bundle import load_bundle, write_bundle

    b = load_bundle(bundle)
    if flaw == "tensor file outside":
        (bundle / TENSOR_FILE).rename(tmp_path / "elsewhere.safetensors")
        (bundle / TENSOR_FILE).symlink_to(tmp_path / "elsewhere.safetensors")
    else:
        name, value = (("layers.0.key_clip", b.tensors["layers.0.key_clip"] * float("nan")) if flaw == "nan clip" else
                       ("layers.1.value_rotation", b.tensors["layers.1.value_rotation"] * 8))
        write_bundle(bundle, b.manifest, {**b.tensors, name: value})
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1 and out.strip().startswith("error: ") and len(out.strip().splitlines()) == 1, out
    assert ("outside the bundle" if flaw == "tensor file outside" else "bundle check failed") in out
    assert server.requests() == [] and server.state()["repos"] == {}


def test_missing_token_is_one_line_and_sends_nothing(hub, server, client_env, bundle, capfd, monkeypatch):
    monkeypatch.delenv(client_env)
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1
    assert out.strip().startswith("error: no ") and "token" in out and len(out.strip().splitlines()) == 1
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub, "--token-env", "OSCAR_TEST_UNSET_TOKEN"))
    assert code == 1 and "$OSCAR_TEST_UNSET_TOKEN" in out
    assert server.requests() == []


def test_token_env_names_the_variable_to_read(hub, server, client_env, bundle, capfd, monkeypatch):
    monkeypatch.delenv(client_env)
    monkeypatch.setenv("MY_PUSH_TOKEN", TOKEN)
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub, "--token-env", "MY_PUSH_TOKEN"))
    assert code == 0, out
    assert REPO in server.state()["repos"]


def test_rejected_token_is_one_line_without_the_token(hub, server, client_env, bundle, capfd, monkeypatch):
    monkeypatch.setenv(client_env, BAD_TOKEN)
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1
    assert "rejected the token" in out and len(out.strip().splitlines()) == 1
    assert BAD_TOKEN not in out and TOKEN not in out
    assert server.state()["repos"] == {} and writes(server.requests()) == []


def test_repo_holding_another_model_is_refused(hub, server, client_env, bundle, tmp_path, capfd, monkeypatch):
    write_tiny_bundle(tmp_path / "other", model_id="other-org/other-model")
    theirs = {p: (tmp_path / "other" / p).read_bytes() for p in (TENSOR_FILE, MANIFEST_FILE)}
    server.seed(REPO, theirs)
    before = server.state()["repos"]
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1
    assert "holds the bundle for other-org/other-model" in out and len(out.strip().splitlines()) == 1
    assert server.state()["repos"] == before and writes(server.requests()) == []


def test_repo_holding_files_that_are_no_bundle_is_refused(hub, server, client_env, bundle, capfd, monkeypatch):
    server.seed(REPO, {"config.json": b"{}", "model.safetensors": b"weights"})
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1 and "not an oscar bundle (config.json)" in out
    assert writes(server.requests()) == []


def test_corrupt_bundle_is_refused_before_any_request(hub, server, client_env, bundle, capfd, monkeypatch):
    data = bytearray((bundle / TENSOR_FILE).read_bytes())
    data[-1] ^= 0xFF
    (bundle / TENSOR_FILE).write_bytes(bytes(data))
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1 and "checksum mismatch" in out
    assert server.state()["requests"] == []


def test_failed_commit_leaves_nothing_published(hub, server, client_env, bundle, capfd, monkeypatch):
    server.fail("POST", "/commit/", 422)
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub))
    assert code == 1
    assert "HTTP 422" in out and "nothing was published" in out and len(out.strip().splitlines()) == 1
    assert server.state()["repos"] == {}, "the repo created for the push was not removed"


def test_hf_revision_is_a_branch_of_its_own(server, client_env, bundle, capfd, monkeypatch):
    if server.hub != "hf":
        code, out = oscar(capfd, monkeypatch, *push_args(bundle, server.hub, "--revision", "v1"))
        assert code == 1 and "branch" in out and server.state()["repos"] == {}
        return
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, "hf", "--revision", "v1"))
    assert code == 0, out
    assert server.files(REPO, "v1")[TENSOR_FILE] == (bundle / TENSOR_FILE).read_bytes()
    assert TENSOR_FILE not in server.files(REPO, "main")


def test_server_down_is_one_line_in_a_fresh_process(hub, bundle, tmp_path):
    down = HubServer(hub)
    down.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_"))}
    env.update(HF_ENDPOINT=down.url, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1",
               MODELSCOPE_ENDPOINT=down.url, MODELSCOPE_API_TOKEN=TOKEN, MODELSCOPE_HOME=str(tmp_path / "ms-home"),
               MODELSCOPE_API_MAX_RETRIES="1")
    code = "import sys; from oscar_cli.app import main; sys.argv[0] = 'oscar'; main()"
    run = subprocess.run([sys.executable, "-c", code, *push_args(bundle, hub)], env=env, capture_output=True,
                         text=True, timeout=60)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert out.strip().splitlines() == [f"error: cannot reach {'Hugging Face' if hub == 'hf' else 'ModelScope'} "
                                        f"at {down.url} (connection failed); nothing was published"]
    assert TOKEN not in out


@pytest.fixture
def upstream_dir(tmp_path, bundle) -> Path:
    """`oscar upstream export` of the tiny bundle (given eigenvalues, so no calibration is needed)."""
    import torch

    from oscar_core.formats.bundle import load_bundle, write_bundle
    from oscar_core.publish import upstream

    b = load_bundle(bundle)
    tensors = dict(b.tensors)
    for i in range(2):
        for side in ("key", "value"):
            tensors[f"layers.{i}.{side}_eigenvalues"] = torch.linspace(3.0, 0.5, 8).expand(2, 8)
    write_bundle(tmp_path / "with-eigen", b.manifest, tensors)
    return upstream.write_export(upstream.plan_export(tmp_path / "with-eigen", tmp_path / "rz", clips="upstream"))


def test_upstream_layout_publishes_the_sglang_files_and_a_card_that_serves_them(hub, server, client_env, upstream_dir,
                                                                                bundle, capfd, monkeypatch):
    from oscar_core.publish.hub import plan_push

    code, out = oscar(capfd, monkeypatch, *push_args(upstream_dir, hub, "--layout", "upstream"))
    assert code == 0, out
    assert "published oscar-test/tiny-llama upstream-seq4096_prompt8_group8" in out
    files = server.files(REPO)
    folder = "tiny-llama/seq4096_prompt8_group8"
    names = ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "serve.sh", "oscar_upstream.json")
    for name in names:
        assert files[f"{folder}/{name}"] == (upstream_dir / name).read_bytes()
    card = files["README.md"].decode()
    assert card == plan_push(str(upstream_dir), hub, REPO, layout="upstream").card
    assert "## Serve with SGLang" in card and "--kv-cache-dtype int2 --kv-cache-quant-group-size 8" in card
    assert f"SGLANG_OSCAR_K_ROTATION_PATH=rotations/{folder}/k_rotation_qqt_r_h_pbr.pt" in card
    assert "SGLANG_OSCAR_K_CLIP_RATIO=0.96" in card and "keys not centred" in card
    # Again: nothing to upload. A bundle given for the upstream layout, or tampered files: one line, nothing sent.
    code, out = oscar(capfd, monkeypatch, *push_args(upstream_dir, hub, "--layout", "upstream"))
    assert code == 0 and "unchanged" in out
    sent = len(server.requests())
    code, out = oscar(capfd, monkeypatch, *push_args(bundle, hub, "--layout", "upstream"))
    assert code == 1 and "run it on" in out and "oscar upstream export" in out
    data = bytearray((upstream_dir / names[0]).read_bytes())
    data[-30] ^= 1
    (upstream_dir / names[0]).write_bytes(bytes(data))
    code, out = oscar(capfd, monkeypatch, *push_args(upstream_dir, hub, "--layout", "upstream"))
    assert code == 1 and len(out.strip().splitlines()) == 1, out
    assert len(server.requests()) == sent


def test_upstream_card_of_per_head_files_says_which_loaders_read_them_and_what_they_cost(hub, upstream_dir,
                                                                                         tmp_path):
    from oscar_core.publish import upstream
    from oscar_core.publish.hub import plan_push

    plan = upstream.plan_export(tmp_path / "with-eigen", tmp_path / "heads", clips="upstream", per_head=True)
    served = {"seq_len": 2048, "passed": True, "served": {"kl": 0.0321, "kivi_kl": 0.0456}, "bundle": {"kl": 0.0123}}
    card = plan_push(str(upstream.write_export(upstream.with_served(plan, served))), hub, REPO, layout="upstream").card
    assert "SGLANG_OSCAR_ABSORB_V_ROTATION=0" in card and "one rotation per KV head (format version 2)" in card
    assert "| kl | 0.0321 |" in card and "| kivi_kl | 0.0456 |" in card   # verify's figures for what is served
    card = plan_push(str(upstream_dir), hub, REPO, layout="upstream").card
    assert "SGLANG_OSCAR_ABSORB_V_ROTATION=1" in card and "per KV head" not in card


def test_oscar_layout_card_says_how_to_serve_with_sglang(hub, bundle):
    from oscar_core.publish.hub import plan_push

    card = plan_push(str(bundle), hub, REPO).card
    assert "## Serve with SGLang" in card
    assert "oscar upstream export oscar-bundle --out rotations --clips upstream --calibration CALIBRATION_DIR" in card
    assert "python -m sglang.launch_server --model-path oscar-test/tiny-llama --kv-cache-dtype int2" in card


def test_a_cache_from_a_bundle_directory_or_a_hub_id(server, client_env, hub, tmp_path, monkeypatch):
    """OscarCache.from_pretrained: a local bundle as it is; a repo id downloaded through the hub client (the local
    stand-in hub) into its cache, then read from that cache alone under HF_HUB_OFFLINE; an unknown id is one line."""
    if hub != "hf":
        pytest.skip("hub ids are Hugging Face repos")
    import huggingface_hub.constants as c

    from oscar_core.errors import OscarError
    from oscar_core.formats.bundle import load_bundle
    from oscar_core.serve.cache import OscarCache

    write_tiny_bundle(tmp_path / "bundle")
    local = OscarCache.from_pretrained(tmp_path / "bundle", "oscar")
    files = {name: (tmp_path / "bundle" / name).read_bytes() for name in ("manifest.json", "rotations.safetensors")}
    server.seed(REPO, files)
    monkeypatch.setenv("OSCAR_BUNDLES", str(tmp_path / "bundles"))
    fetched = OscarCache.from_pretrained(REPO, "kivi")
    want = load_bundle(tmp_path / "bundle")
    assert fetched.bundle.manifest == want.manifest and fetched.method == "kivi" and local.method == "oscar"
    assert all(torch.equal(fetched.bundle.tensors[k], v) for k, v in want.tensors.items())
    server.stop()
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert OscarCache.from_pretrained(REPO).bundle.manifest == want.manifest      # from the cache, no server
    with pytest.raises(OscarError, match="cannot fetch bundle alice/none"):
        OscarCache.from_pretrained("alice/none")
