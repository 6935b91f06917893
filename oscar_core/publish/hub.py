"""Publishing a bundle to the Hugging Face Hub or ModelScope.

plan_push verifies the bundle and prepares what would be uploaded (bundle files and model card);
push sends it with the hub's own client library: the token is checked first, a repo that holds
another model is refused, an unchanged bundle is left alone, and the files land in one commit.
Tokens come from --token-env, the environment or the client's login cache, and never enter a message.
"""

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass

from oscar_core.errors import OscarError
from oscar_core.evaluate.verify import load_checked, recorded_figures
from oscar_core.formats.bundle import MANIFEST_FILE, Manifest
from oscar_core.formats.fileio import check_name, sha256_bytes
from oscar_core.publish.card import model_card
from oscar_core.publish.hub_clients import HfClient, ModelScopeClient, Remote, RemoteFile

HUBS = ("hf", "modelscope")
HUB_NAMES = {"hf": "Hugging Face", "modelscope": "ModelScope"}
CARD_FILE = "README.md"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Files a freshly created, empty repo may already hold.
SCAFFOLDING = {".gitattributes", CARD_FILE, "configuration.json"}


@dataclass(frozen=True)
class UploadFile:
    path: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.data)


@dataclass(frozen=True)
class Plan:
    """Everything a push would send; nothing here has touched the network."""
    hub: str
    repo: str
    revision: str | None
    private: bool
    manifest: Manifest
    files: tuple[UploadFile, ...]

    @property
    def card(self) -> str:
        return next(f.data.decode() for f in self.files if f.path == CARD_FILE)


@dataclass(frozen=True)
class PushResult:
    status: str  # "published" or "unchanged"
    url: str
    created_repo: bool


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def same_content(remote: RemoteFile | None, data: bytes) -> bool:
    """Whether the hub's hash of a file (sha256, or git blob id for plain git files) matches `data`."""
    if remote is None:
        return False
    return (remote.sha256 is not None and remote.sha256 == sha256_bytes(data)) or (
        remote.git_sha1 is not None and remote.git_sha1 == git_blob_sha1(data))


LAYOUTS = ("oscar", "upstream")


def plan_push(bundle: str, hub: str, repo: str, revision: str | None = None, private: bool = False,
              layout: str = "oscar") -> Plan:
    """Verify the bundle (verify.load_checked: manifest, checksum, tensor shapes, orthogonal, finite) and list the
    files and card a push sends.

    layout "upstream": `bundle` is a directory written by `oscar upstream export`; its files are checked as an
    import would check them and published under <Model>/seq<T>_prompt<N>_group<G>/, with a card that serves them."""
    if hub not in HUBS:
        raise OscarError(f"unknown hub {hub!r}: choose one of {', '.join(HUBS)}")
    if not REPO_ID.match(repo):
        raise OscarError(f"--repo must look like ORG/NAME, got {repo!r}")
    if layout not in LAYOUTS:
        raise OscarError(f"unknown layout {layout!r}: oscar or upstream")
    if layout == "upstream":
        return plan_upstream_push(bundle, hub, repo, revision, private)
    loaded = load_checked(bundle)
    manifest = loaded.manifest
    # Upload the bytes that were verified: reread, and refuse if the bundle changed meanwhile.
    tensor_data = (loaded.path / manifest.tensors.file).read_bytes()
    manifest_data = (loaded.path / MANIFEST_FILE).read_bytes()
    if sha256_bytes(tensor_data) != manifest.tensors.sha256 or Manifest.model_validate_json(manifest_data) != manifest:
        raise OscarError(f"bundle {loaded.path} changed while it was being read")
    figures = manifest.fidelity or recorded_figures(loaded.path)  # the card shows `verify --record` figures
    card = model_card(manifest.model_copy(update={"fidelity": figures}), hub, repo,
                      eigenvalues=any(name.endswith("_eigenvalues") for name in loaded.tensors))
    files = (UploadFile(manifest.tensors.file, tensor_data),
             UploadFile(MANIFEST_FILE, manifest_data),
             UploadFile(CARD_FILE, card.encode()))
    return Plan(hub, repo, revision, private, manifest, files)


def plan_upstream_push(directory: str, hub: str, repo: str, revision: str | None, private: bool) -> Plan:
    from pathlib import Path

    from oscar_core.formats.bundle import ModelInfo, bundle_dir, schema_errors
    from oscar_core.publish import upstream

    path = Path(directory)
    if (path / MANIFEST_FILE).is_file() or (path.is_file() and path.name in (MANIFEST_FILE, "rotations.safetensors")):
        raise OscarError(f"--layout upstream publishes a directory written by `oscar upstream export`: run it on "
                         f"{bundle_dir(path)} first")
    record = upstream.read_record(path) if path.is_dir() else None
    if record is None:
        raise OscarError(f"{directory} holds no {upstream.RECORD_FILE}: publish a directory written by "
                         "`oscar upstream export`")
    with schema_errors(f"{path / upstream.RECORD_FILE}: model"):
        model = ModelInfo.model_validate(record.get("model"))
    layers = record.get("layers")
    manifest, _, files = upstream.upstream_bundle(path, model, None if layers == list(range(model.num_layers)) else layers,
                                                  name=record["source"]["bundle"])
    if record.get("files") != manifest.source.files:
        raise OscarError(f"the rotation files in {directory} changed after `oscar upstream export` wrote them: "
                         "export again")
    prefix = check_name(f"{upstream.model_directory(model.id)}/{path.name}", "upload folder")
    names = (*upstream.FILES.values(), upstream.SERVE_FILE, upstream.RECORD_FILE)
    uploads = [UploadFile(f"{prefix}/{name}", (path / name).read_bytes()) for name in names]
    served = (record.get("served") or {}).get("served")   # verify's figures for these files, measured by the export
    card = model_card(manifest.model_copy(update={"fidelity": served}) if served else manifest, hub, repo,
                      upstream_files={f.path: f.sha256 for f in uploads})
    return Plan(hub, repo, revision, private, manifest, (*uploads, UploadFile(CARD_FILE, card.encode())))


def token_source(hub: str, token_env: str | None) -> str:
    """Where push looks for the token, in words (never the token)."""
    if token_env:
        return f"${token_env}"
    return "$HF_TOKEN or `hf auth login`" if hub == "hf" else "$MODELSCOPE_API_TOKEN or `modelscope login`"


def resolve_token(hub: str, token_env: str | None) -> str:
    if token_env:
        token = os.environ.get(token_env, "").strip()
    elif hub == "hf":
        from huggingface_hub import get_token
        token = get_token() or ""
    else:
        from modelscope_hub.config import HubConfig
        token = HubConfig().token or ""
    if not token:
        raise OscarError(f"no {HUB_NAMES[hub]} token: set {token_source(hub, token_env)}")
    return token


def push(plan: Plan, token_env: str | None = None) -> PushResult:
    """Publish the plan in one commit; a no-op when the remote already holds exactly these files."""
    token = resolve_token(plan.hub, token_env)
    client = (HfClient if plan.hub == "hf" else ModelScopeClient)(token)
    with translated_errors(plan, token, client.endpoint) as notes:
        client.check_token()
        remote = client.remote(plan.repo, plan.revision)
        if remote is not None:
            check_same_model(plan, remote, client)
            if remote.revision_exists and all(same_content(remote.files.get(f.path), f.data) for f in plan.files):
                return PushResult("unchanged", client.url(plan.repo, plan.revision, remote), False)
        if remote is None:
            client.create_repo(plan.repo, plan.private, plan.revision)
        new_revision = plan.revision not in (None, client.default_revision) and not (remote and remote.revision_exists)
        try:
            url = client.commit(plan.repo, plan.revision, plan.files, commit_message(plan.manifest), new_revision)
        except BaseException:
            if remote is None:
                try:
                    client.delete_repo(plan.repo)
                except Exception:  # noqa: BLE001 - the original failure is the one to report
                    notes.append(f"the empty repo {plan.repo} created for this push remains")
            raise
    return PushResult("published", url, remote is None)


def commit_message(manifest: Manifest) -> str:
    return f"oscar push: {manifest.name} {manifest.version} for {manifest.model.id}"


def check_same_model(plan: Plan, remote: Remote, client) -> None:
    """Refuse a repo that holds another model's bundle, or files that are no bundle at all (upstream layout:
    files outside this model's <Model>/ folder)."""
    if plan.manifest.source is not None:
        folder = plan.files[0].path.split("/", 1)[0] + "/"
        foreign = sorted(p for p in set(remote.files) - SCAFFOLDING if not p.startswith(folder))
        if foreign:
            raise OscarError(f"{plan.repo} already holds files that are not this model's upstream rotations "
                             f"({foreign[0]}): push to another --repo")
        return
    if MANIFEST_FILE not in remote.files:
        foreign = sorted(set(remote.files) - SCAFFOLDING - {f.path for f in plan.files})
        if foreign:
            raise OscarError(f"{plan.repo} already holds files that are not an oscar bundle ({foreign[0]}): "
                             "push to another --repo")
        return
    try:
        revision = plan.revision if remote.revision_exists else None
        theirs = Manifest.model_validate_json(client.read_file(plan.repo, revision, MANIFEST_FILE))
    except ValueError:
        raise OscarError(f"{plan.repo} holds a {MANIFEST_FILE} that is not an oscar manifest: "
                         "push to another --repo") from None
    ours = plan.manifest.model
    if (theirs.model.id, theirs.model.config_sha256) != (ours.id, ours.config_sha256):
        raise OscarError(f"{plan.repo} holds the bundle for {theirs.model.id} (config {theirs.model.config_sha256[:12]}),"
                         f" not {ours.id} (config {ours.config_sha256[:12]}): push to another --repo")


@contextlib.contextmanager
def translated_errors(plan: Plan, token: str, endpoint: str):
    """Turn client exceptions into one OscarError line, with the token scrubbed from it."""
    hub = HUB_NAMES[plan.hub]
    notes: list[str] = []
    try:
        yield notes
    except OscarError as e:
        if notes:
            raise OscarError("; ".join([str(e), *notes])) from None
        raise
    except Exception as e:  # noqa: BLE001 - each client raises its own hierarchy; classify, then re-raise as one line
        status = status_code(e)
        if status == 401:
            message = f"{hub} rejected the token (HTTP 401): check it and its expiry"
        elif status == 403:
            message = f"the token has no write access to {plan.repo} on {hub} (HTTP 403)"
        elif is_network_error(e):
            message = f"cannot reach {hub} at {endpoint} ({'timed out' if is_timeout(e) else 'connection failed'})"
        elif status is not None:
            message = f"{hub} refused the push to {plan.repo} (HTTP {status}): {first_line(e)}"
        else:
            message = f"push to {plan.repo} on {hub} failed: {type(e).__name__}: {first_line(e)}"
        raise OscarError("; ".join([message, "nothing was published", *notes]).replace(token, "***")) from None


def status_code(e: BaseException) -> int | None:
    for candidate in (e, e.__cause__, e.__context__):
        response = getattr(candidate, "response", None)
        code = getattr(response, "status_code", None) or getattr(candidate, "status_code", None)
        if isinstance(code, int):
            return code
    return None


def _class_names(e: BaseException) -> set[str]:
    return {cls.__name__ for err in (e, e.__cause__, e.__context__) if err is not None for cls in type(err).__mro__}


def is_network_error(e: BaseException) -> bool:
    """Connection and timeout failures of requests (modelscope_hub) and httpx2 (huggingface_hub)."""
    return bool(_class_names(e) & {"ConnectionError", "TransportError", "TimeoutError", "NetworkError"})


def is_timeout(e: BaseException) -> bool:
    return bool(_class_names(e) & {"TimeoutError", "TimeoutException", "Timeout"})


def first_line(e: BaseException) -> str:
    """The server's own message when the client kept it apart (huggingface_hub), else the first line."""
    text = (getattr(e, "server_message", None) or str(e)).strip().splitlines()
    return text[0] if text else type(e).__name__
