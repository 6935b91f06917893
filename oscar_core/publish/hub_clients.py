"""The two hubs behind one small interface, each through its own client library.

A client checks its token, describes what a repo holds (Remote), reads one file, creates a repo,
commits files in one commit and deletes a repo it created. Endpoints come from the clients' own
settings: HF_ENDPOINT for huggingface_hub, MODELSCOPE_ENDPOINT for modelscope_hub.
"""

import base64
import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from oscar_core.errors import OscarError


@dataclass(frozen=True)
class RemoteFile:
    """What a hub reports about one file: its sha256 and/or its git blob id."""
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class Remote:
    """The files of an existing repo at the target revision (or its default branch, when that revision is new)."""
    files: dict[str, RemoteFile]
    revision_exists: bool
    head: str | None = None


class HfClient:
    default_revision = "main"

    def __init__(self, token: str):
        from huggingface_hub import HfApi

        self.api = HfApi(token=token)
        self.endpoint = self.api.endpoint

    def check_token(self) -> None:
        self.api.whoami()

    def remote(self, repo: str, revision: str | None) -> Remote | None:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            info, exists = self.api.model_info(repo, revision=revision, files_metadata=True), True
        except RepositoryNotFoundError:
            return None
        except RevisionNotFoundError:
            info, exists = self.api.model_info(repo, files_metadata=True), False
        files = {s.rfilename: RemoteFile(sha256=s.lfs.sha256 if s.lfs else None,
                                         git_sha1=None if s.lfs else s.blob_id) for s in info.siblings or []}
        return Remote(files, exists, info.sha)

    def read_file(self, repo: str, revision: str | None, path: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="oscar-hub-") as tmp:
            local = self.api.hf_hub_download(repo, path, revision=revision, cache_dir=tmp)
            return Path(local).read_bytes()

    def create_repo(self, repo: str, private: bool, revision: str | None) -> None:
        self.api.create_repo(repo, private=private, exist_ok=False)

    def commit(self, repo: str, revision: str | None, files, message: str, new_revision: bool) -> str:
        from huggingface_hub import CommitOperationAdd

        if new_revision:
            self.api.create_branch(repo, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=f.data) for f in files]
        try:
            return self.api.create_commit(repo, operations, commit_message=message, revision=revision).commit_url
        except BaseException:
            if new_revision:
                with contextlib.suppress(Exception):
                    self.api.delete_branch(repo, branch=revision)
            raise

    def url(self, repo: str, revision: str | None, remote: Remote) -> str:
        return f"{self.endpoint}/{repo}/commit/{remote.head}"

    def delete_repo(self, repo: str) -> None:
        self.api.delete_repo(repo)


class ModelScopeClient:
    default_revision = "master"
    lfs_suffixes = (".safetensors",)

    def __init__(self, token: str):
        from modelscope_hub import HubApi
        from modelscope_hub.config import HubConfig

        config = HubConfig(token=token)
        self.api = HubApi(config=config)
        self.endpoint = config.endpoint

    def check_token(self) -> None:
        self.api.whoami()

    def remote(self, repo: str, revision: str | None) -> Remote | None:
        from modelscope_hub.errors import NotExistError

        if not self.api.repo_exists(repo, "model"):
            return None
        try:
            listing, exists = self.api.list_repo_files(repo, "model", revision=revision), True
        except NotExistError:
            listing, exists = self.api.list_repo_files(repo, "model"), False
        return Remote({f.path: RemoteFile(sha256=f.sha256) for f in listing if not f.is_dir}, exists)

    def read_file(self, repo: str, revision: str | None, path: str) -> bytes:
        return self.api.legacy.download_stream(repo, "model", path, revision or self.default_revision).content

    def create_repo(self, repo: str, private: bool, revision: str | None) -> None:
        if revision not in (None, self.default_revision):
            raise OscarError(f"ModelScope creates {repo} with a {self.default_revision} branch only, and its API "
                             f"cannot add branch {revision}: push without --revision first")
        self.api.create_repo(repo, "model", visibility="private" if private else "public", license="apache-2.0")

    def commit(self, repo: str, revision: str | None, files, message: str, new_revision: bool) -> str:
        if new_revision:
            raise OscarError(f"{repo} has no branch {revision}, and ModelScope's API cannot create one: "
                             "create it on the hub first")
        legacy = self.api.legacy
        lfs = [f for f in files if f.path.endswith(self.lfs_suffixes)]
        if lfs:
            urls = legacy.validate_blobs(repo, "model", [{"oid": f.sha256, "size": f.size} for f in lfs])
            for f in lfs:
                if urls.get(f.sha256):
                    legacy.upload_blob(upload_url=urls[f.sha256], data=f.data, size=f.size)
        operations = [
            {"action": "create", "path": f.path, "type": "lfs", "size": f.size, "sha256": f.sha256,
             "content": "", "encoding": ""} if f in lfs else
            {"action": "create", "path": f.path, "type": "normal", "size": f.size, "sha256": "",
             "content": base64.b64encode(f.data).decode(), "encoding": "base64"}
            for f in files]
        legacy.create_commit(repo, "model", operations, message, revision=revision or self.default_revision)
        return self._files_url(repo, revision)

    def url(self, repo: str, revision: str | None, remote: Remote) -> str:
        return self._files_url(repo, revision)

    def _files_url(self, repo: str, revision: str | None) -> str:
        suffix = f"?Revision={revision}" if revision and revision != self.default_revision else ""
        return f"{self.endpoint}/models/{repo}/files{suffix}"

    def delete_repo(self, repo: str) -> None:
        self.api.delete_repo(repo, "model")
