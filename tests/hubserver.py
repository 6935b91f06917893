"""A small stand-in for the Hugging Face Hub or ModelScope, for the push tests.

Run as a process: `python tests/hubserver.py --hub hf|modelscope --token TOKEN`. It listens on a free
port of 127.0.0.1 and prints `PORT <n>` once ready. It implements the endpoints that huggingface_hub
(with plain LFS, HF_HUB_DISABLE_XET=1) and modelscope_hub call to publish a repo, keeps repos in
memory, accepts only TOKEN, and logs every request. Test-only endpoints under /_fake/:
  GET  /_fake/state   repos (every file base64, every commit) and the request log
  POST /_fake/seed    {"repo", "branch", "files": {path: base64}}: a repo that already holds files
  POST /_fake/fail    {"method", "contains", "status"}: answer matching requests with that error status
"""

import argparse
import base64
import hashlib
import json
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DEFAULT_BRANCH = {"hf": "main", "modelscope": "master"}


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Store:
    """Repos as {repo_id: {"private", "branches": {name: {path: (bytes, lfs)}}, "heads", "commits"}}."""

    def __init__(self, hub: str):
        self.hub = hub
        self.lock = threading.Lock()
        self.repos: dict[str, dict] = {}
        self.blobs: dict[str, bytes] = {}
        self.log: list[dict] = []
        self.failures: list[dict] = []

    def create(self, repo_id: str, private: bool, files: dict[str, tuple[bytes, bool]] | None = None,
               branch: str | None = None) -> None:
        branch = branch or DEFAULT_BRANCH[self.hub]
        self.repos[repo_id] = {"private": private, "branches": {branch: {}}, "heads": {branch: "0" * 40},
                               "commits": []}
        initial = files if files is not None else (
            {".gitattributes": (b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False)}
            if self.hub == "hf" else {})
        if initial:
            self.commit(repo_id, branch, "initial commit", initial)

    def commit(self, repo_id: str, branch: str, message: str, files: dict[str, tuple[bytes, bool]]) -> str:
        repo = self.repos[repo_id]
        parent = repo["heads"][branch]
        digest = hashlib.sha1(parent.encode() + message.encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha256(files[path][0]).digest())
        sha = digest.hexdigest()
        repo["branches"][branch].update(files)
        repo["heads"][branch] = sha
        repo["commits"].append({"sha": sha, "branch": branch, "message": message, "files": sorted(files)})
        return sha

    def state(self) -> dict:
        repos = {}
        for repo_id, repo in self.repos.items():
            branches = {name: {"head": repo["heads"][name],
                               "files": {p: {"b64": base64.b64encode(d).decode(), "lfs": lfs}
                                         for p, (d, lfs) in files.items()}}
                        for name, files in repo["branches"].items()}
            repos[repo_id] = {"private": repo["private"], "branches": branches, "commits": repo["commits"]}
        return {"repos": repos, "requests": self.log}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Store
    token: str

    def log_message(self, *args) -> None:
        pass

    # --- plumbing -------------------------------------------------------------------------
    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json",
              headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _auth(self) -> str:
        """'valid', 'invalid' or 'none', from the Bearer header or ModelScope's session cookie."""
        header = self.headers.get("Authorization", "")
        presented = header[len("Bearer "):] if header.startswith("Bearer ") else None
        if presented is None:
            for part in self.headers.get("Cookie", "").split(";"):
                key, _, value = part.strip().partition("=")
                if key == "m_session_id" and value:
                    presented = value
        if presented is None:
            return "none"
        return "valid" if presented == self.token else "invalid"

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._body() if method in ("POST", "PUT", "DELETE") else b""
        if parts[:1] == ["_fake"]:
            return self._fake(method, parts[1:], body)
        auth = self._auth()
        with self.store.lock:
            self.store.log.append({"method": method, "path": url.path, "query": query, "auth": auth})
        for rule in self.store.failures:
            if rule["method"] == method and rule["contains"] in url.path:
                return self._json(rule["status"], {"error": "injected failure", "Message": "injected failure"})
        route = HfRoutes if self.store.hub == "hf" else MsRoutes
        try:
            with self.store.lock:
                route(self, auth).handle(method, parts, query, body)
        except BrokenPipeError:
            pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _fake(self, method: str, parts: list[str], body: bytes) -> None:
        store = self.store
        with store.lock:
            if method == "GET" and parts == ["state"]:
                return self._json(200, store.state())
            if method == "POST" and parts == ["seed"]:
                seed = json.loads(body)
                files = {p: (base64.b64decode(b), p.endswith(LFS_SUFFIXES)) for p, b in seed["files"].items()}
                store.create(seed["repo"], False, files, seed.get("branch"))
                return self._json(200, {"ok": True})
            if method == "POST" and parts == ["fail"]:
                store.failures.append(json.loads(body))
                return self._json(200, {"ok": True})
        self._json(404, {"error": "unknown control endpoint"})


class Routes:
    """One request against the store; the subclasses speak each hub's dialect."""

    def __init__(self, handler: Handler, auth: str):
        self.h, self.auth, self.store = handler, auth, handler.store

    @property
    def base(self) -> str:
        host, port = self.h.server.server_address[:2]
        return f"http://{host}:{port}"

    def lfs_put(self, oid: str, body: bytes) -> bool:
        if hashlib.sha256(body).hexdigest() != oid:
            return False
        self.store.blobs[oid] = body
        return True

    def files_at(self, repo_id: str, revision: str) -> dict | None:
        repo = self.store.repos.get(repo_id)
        return None if repo is None else repo["branches"].get(revision)


class HfRoutes(Routes):
    def error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self.h._json(status, {"error": message}, headers)

    def handle(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        if self.auth == "invalid":
            return self.error(401, None, "Invalid credentials in Authorization header")
        if parts[:1] == ["_lfs"] and method == "PUT":
            return self.h._json(200, {}) if self.lfs_put(parts[1], body) else self.error(400, None, "bad oid")
        if parts[:1] == ["api"]:
            return self.api(method, parts[1:], query, body)
        if len(parts) >= 3 and parts[1].endswith(".git") and parts[2:4] == ["info", "lfs"]:
            return self.lfs(parts[0] + "/" + parts[1][:-4], parts[4:], body)
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self.resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), method == "HEAD")
        self.error(404, None, f"no route {method} /{'/'.join(parts)}")

    def api(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        if parts == ["whoami-v2"] and method == "GET":
            if self.auth != "valid":
                return self.error(401, None, "Unauthorized")
            return self.h._json(200, {"type": "user", "name": "alice", "auth": {"type": "access_token"}})
        if parts == ["validate-yaml"] and method == "POST":
            content = json.loads(body)["content"]
            try:
                meta = yaml.safe_load(content.split("---\n")[1]) if content.startswith("---\n") else {}
            except yaml.YAMLError as e:
                return self.h._json(400, {"errors": [{"message": str(e)}]})
            ok = isinstance(meta, dict)
            return self.h._json(200 if ok else 400, {"errors": [] if ok else [{"message": "not a mapping"}],
                                                     "warnings": []})
        if self.auth != "valid" and method != "GET":
            return self.error(401, None, "Unauthorized")
        if parts == ["repos", "create"] and method == "POST":
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}"
            if repo_id in self.store.repos:
                return self.error(409, None, "You already created this model repo")
            self.store.create(repo_id, req.get("visibility") == "private" or bool(req.get("private")))
            return self.h._json(200, {"url": f"{self.base}/{repo_id}"})
        if parts == ["repos", "delete"] and method == "DELETE":
            req = json.loads(body)
            self.store.repos.pop(f"{req['organization']}/{req['name']}", None)
            return self.h._json(200, {})
        if len(parts) < 3 or parts[0] != "models":
            return self.error(404, None, "no such endpoint")
        repo_id, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        repo = self.store.repos.get(repo_id)
        if repo is None:
            return self.error(404, "RepoNotFound", "Repository not found")
        revision = rest[1] if len(rest) > 1 else "main"
        if rest[:1] == ["branch"] and method == "POST":
            if revision in repo["branches"]:
                return self.error(409, None, "Branch already exists")
            repo["branches"][revision] = dict(repo["branches"]["main"])
            repo["heads"][revision] = repo["heads"]["main"]
            return self.h._json(200, {})
        if revision not in repo["branches"]:
            return self.error(404, "RevisionNotFound", "Invalid rev id")
        files = repo["branches"][revision]
        if method == "GET" and rest[:1] in ([], ["revision"]):
            return self.h._json(200, {"id": repo_id, "sha": repo["heads"][revision], "private": repo["private"],
                                      "siblings": [self.sibling(p, d, lfs) for p, (d, lfs) in sorted(files.items())]})
        if rest[:1] == ["preupload"] and method == "POST":
            out = []
            for f in json.loads(body)["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES)
                old = files.get(f["path"])
                oid = None if old is None else (hashlib.sha256(old[0]).hexdigest() if old[1] else git_sha1(old[0]))
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            return self.h._json(200, {"files": out})
        if rest[:1] == ["commit"] and method == "POST":
            return self.commit(repo_id, revision, body)
        self.error(404, None, "no such endpoint")

    @staticmethod
    def sibling(path: str, data: bytes, lfs: bool) -> dict:
        entry = {"rfilename": path, "size": len(data), "blobId": git_sha1(data)}
        if lfs:
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def commit(self, repo_id: str, revision: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        message, files = "", {}
        for item in lines:
            key, value = item["key"], item["value"]
            if key == "header":
                message = value["summary"]
            elif key == "file":
                files[value["path"]] = (base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                if value["oid"] not in self.store.blobs:
                    return self.error(422, None, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = (self.store.blobs[value["oid"]], True)
            else:
                return self.error(400, None, f"unsupported operation {key}")
        sha = self.store.commit(repo_id, revision, message, files)
        self.h._json(200, {"success": True, "commitOid": sha, "commitUrl": f"{self.base}/{repo_id}/commit/{sha}",
                           "hookOutput": ""})

    def lfs(self, repo_id: str, rest: list[str], body: bytes) -> None:
        if repo_id not in self.store.repos:
            return self.error(404, "RepoNotFound", "Repository not found")
        req = json.loads(body)
        if rest == ["objects", "verify"]:
            ok = self.store.blobs.get(req["oid"]) is not None
            return self.h._json(200 if ok else 404, {"ok": ok})
        objects = []
        for obj in req["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.store.blobs:
                entry["actions"] = {"upload": {"href": f"{self.base}/_lfs/{obj['oid']}"},
                                    "verify": {"href": f"{self.base}/{repo_id}.git/info/lfs/objects/verify"}}
            objects.append(entry)
        self.h._json(200, {"transfer": "basic", "objects": objects})

    def resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self.store.repos.get(repo_id)
        if repo is None:
            return self.error(404, "RepoNotFound", "Repository not found")
        if revision not in repo["branches"]:
            return self.error(404, "RevisionNotFound", "Invalid rev id")
        if path not in repo["branches"][revision]:
            return self.error(404, "EntryNotFound", "Entry not found")
        data, lfs = repo["branches"][revision][path]
        etag = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
        self.h._send(200, data, "application/octet-stream", head=head,
                     headers={"ETag": f'"{etag}"', "X-Repo-Commit": repo["heads"][revision]})


class MsRoutes(Routes):
    def reply(self, status: int, data=None, message: str = "") -> None:
        ok = status < 400
        self.h._json(status, {"Code": 200 if ok else status, "Data": data, "Message": message or "OK",
                              "Success": ok, "RequestId": uuid.uuid4().hex})

    def handle(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        if self.auth == "invalid":
            return self.reply(401, message="invalid token")
        if parts[:1] == ["_lfs"] and method == "PUT":
            return self.reply(200) if self.lfs_put(parts[1], body) else self.reply(400, message="bad oid")
        if parts[:2] == ["openapi", "v1"]:
            return self.openapi(method, parts[2:])
        if parts[:2] == ["api", "v1"]:
            return self.legacy(method, parts[2:], query, body)
        self.reply(404, message="no such endpoint")

    def openapi(self, method: str, parts: list[str]) -> None:
        def answer(status: int, data=None, code: str = "") -> None:
            self.h._json(status, {"success": status < 400, "data": data, "code": code,
                                  "message": code or "ok", "request_id": uuid.uuid4().hex})

        if parts == ["users", "me"] and method == "GET":
            return answer(200, {"username": "alice"}) if self.auth == "valid" else answer(401, code="Unauthorized")
        if parts[:1] == ["models"] and len(parts) == 3 and method == "GET":
            repo = self.store.repos.get(f"{parts[1]}/{parts[2]}")
            if repo is None:
                return answer(404, code="NotFound")
            return answer(200, {"id": f"{parts[1]}/{parts[2]}", "private": repo["private"]})
        answer(404, code="NotFound")

    def legacy(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        if method != "GET" and self.auth != "valid":
            return self.reply(401, message="login first")
        if parts == ["models"] and method == "POST":
            req = json.loads(body)
            repo_id = f"{req['Path']}/{req['Name']}"
            if repo_id in self.store.repos:
                return self.reply(400, message="model already exists")
            self.store.create(repo_id, req.get("Visibility") == 1)
            return self.reply(200, {"Path": req["Path"], "Name": req["Name"]})
        if parts[:2] == ["repos", "models"] and len(parts) >= 5:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if repo_id not in self.store.repos:
                return self.reply(404, message="model not found")
            if rest == ["info", "lfs", "objects", "batch"]:
                objects = [{"oid": o["oid"], "size": o["size"],
                            "actions": {"upload": {"href": f"{self.base}/_lfs/{o['oid']}"}}}
                           for o in json.loads(body)["objects"] if o["oid"] not in self.store.blobs]
                return self.reply(200, {"objects": objects})
            if rest[:1] == ["commit"] and len(rest) == 2:
                return self.commit(repo_id, rest[1], json.loads(body))
        if parts[:1] != ["models"] or len(parts) < 3:
            return self.reply(404, message="no such endpoint")
        repo_id, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        repo = self.store.repos.get(repo_id)
        if repo is None:
            return self.reply(404, message="model not found")
        if rest == [] and method == "GET":
            return self.reply(200, {"Path": parts[1], "Name": parts[2]})
        if rest == [] and method == "DELETE":
            del self.store.repos[repo_id]
            return self.reply(200)
        files = repo["branches"].get(query.get("Revision", "master"))
        if files is None:
            return self.reply(404, message="revision not found")
        if rest == ["repo", "files"] and method == "GET":
            listing = [{"Path": p, "Name": p.rsplit("/", 1)[-1], "Size": len(d), "Type": "blob", "IsLFS": lfs,
                        "Sha256": hashlib.sha256(d).hexdigest()} for p, (d, lfs) in sorted(files.items())]
            return self.reply(200, {"Files": listing})
        if rest == ["repo"] and method == "GET":
            entry = files.get(query.get("FilePath", ""))
            if entry is None:
                return self.reply(404, message="file not found")
            return self.h._send(200, entry[0], "application/octet-stream")
        self.reply(404, message="no such endpoint")

    def commit(self, repo_id: str, revision: str, req: dict) -> None:
        repo = self.store.repos[repo_id]
        if revision not in repo["branches"]:
            return self.reply(404, message="revision not found")
        files = {}
        for action in req["actions"]:
            if action["action"] != "create":
                return self.reply(400, message=f"unsupported action {action['action']}")
            if action["type"] == "lfs":
                if action["sha256"] not in self.store.blobs:
                    return self.reply(400, message=f"blob {action['sha256']} was never uploaded")
                files[action["path"]] = (self.store.blobs[action["sha256"]], True)
            else:
                files[action["path"]] = (base64.b64decode(action["content"]), False)
        sha = self.store.commit(repo_id, revision, req["commit_message"], files)
        self.reply(200, {"CommitId": sha})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", choices=("hf", "modelscope"), required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    Handler.store, Handler.token = Store(args.hub), args.token
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
