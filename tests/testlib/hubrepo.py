"""A model repository as the Hugging Face Hub holds one, for testlib.hubserver: files at commits,
branches and tags naming commits, who may read it, and the JSON the Hub's API gives about it.
No I/O: the server asks, this answers, or raises `HubError`, which the server sends the way the
Hub sends its errors (status, `X-Error-Code`, `X-Error-Message`, `{"error": ...}`).

Ids are git's, so they look and behave like the Hub's: a file's `oid` is its git blob sha1 (of
the LFS pointer, for an LFS file), a directory's its git tree sha1, a commit's the sha1 of a git
commit object with a fixed author and a date counted from 2024-01-01 — the same files committed in
the same order give the same ids in every run. A commit is a snapshot; none is ever changed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime, timedelta

import attrs

# The Hub's default .gitattributes sends these to LFS; GGUF repos add *.gguf themselves, and
# huggingface_hub uploads anything over 10 MB as LFS whatever its name.
DEFAULT_LFS_PATTERNS = (
    "*.gguf", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.onnx", "*.h5", "*.msgpack",
    "*.model", "*.npy", "*.npz", "*.zip", "*.gz", "*.tar", "*.parquet",
)  # fmt: skip
DEFAULT_LFS_THRESHOLD = 10 * 1024 * 1024
EPOCH = datetime(2024, 1, 1, tzinfo=UTC)
REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
HEX40 = re.compile(r"^[0-9a-f]{40}$")


class HubError(Exception):
    """An answer the Hub gives as an error: HTTP status, X-Error-Code (None: the Hub sends none)
    and the message, which goes to X-Error-Message and the body's "error"."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def git_oid(kind: str, body: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@attrs.frozen
class Blob:
    """One file's content and the ids the Hub shows for it."""

    content: bytes = attrs.field(repr=lambda c: f"<{len(c)} bytes>")
    lfs: bool
    sha256: str
    pointer: bytes | None  # the LFS pointer git stores instead of the content
    oid: str  # git blob sha1 of what git stores: the pointer for LFS, else the content

    @classmethod
    def of(cls, content: bytes, *, lfs: bool) -> Blob:
        sha256 = hashlib.sha256(content).hexdigest()
        pointer = lfs_pointer(sha256, len(content)) if lfs else None
        return cls(content, lfs, sha256, pointer, git_oid("blob", pointer if lfs else content))

    @property
    def size(self) -> int:
        return len(self.content)

    def lfs_json(self) -> dict:
        assert self.pointer is not None
        return {"size": self.size, "sha256": self.sha256, "pointerSize": len(self.pointer)}


@attrs.frozen
class Commit:
    sha: str
    parent: str | None
    files: Mapping[str, Blob]
    date: datetime
    message: str

    def last_modified(self) -> str:
        return self.date.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def tree_oid(files: Mapping[str, Blob], prefix: str = "") -> str:
    """The git tree sha1 of the directory `prefix` ("" for the root, else ending in "/")."""
    entries: dict[str, tuple[bytes, str]] = {}
    for path, blob in files.items():
        if not path.startswith(prefix):
            continue
        head, sep, _ = path[len(prefix) :].partition("/")
        if sep:
            entries[head + "/"] = (b"40000", tree_oid(files, prefix + head + "/"))
        else:
            entries[head] = (b"100644", blob.oid)
    # git sorts a tree's entries by name, a directory's name as if it ended in "/".
    body = b"".join(
        mode + b" " + name.rstrip("/").encode() + b"\0" + bytes.fromhex(oid)
        for name, (mode, oid) in sorted(entries.items())
    )
    return git_oid("tree", body)


class HubRepo:
    """A model repository. `files` (path -> bytes) is the first commit, on main; `commit`, `tag`,
    `branch` and `open_pr` make more revisions. `tokens` (or `token`) may read it when it is
    private, or download from it when it is gated; `gated` is False, "auto" or "manual", as the
    Hub's model_info says. Which files are LFS: those whose name matches `lfs_patterns` (as in
    .gitattributes: by base name) or larger than `lfs_threshold` bytes."""

    def __init__(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | None = None,
        *,
        gated: bool | str = False,
        private: bool = False,
        disabled: bool = False,
        token: str | None = None,
        tokens: Collection[str] = (),
        tags: Iterable[str] = (),
        pipeline_tag: str | None = None,
        library_name: str | None = None,
        lfs_patterns: Iterable[str] = DEFAULT_LFS_PATTERNS,
        lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
    ) -> None:
        if not REPO_ID.match(repo_id):
            raise ValueError(f"repo id {repo_id!r} is not 'namespace/name' (letters, digits, '-', '_', '.')")
        if gated not in (False, "auto", "manual"):
            raise ValueError(f"gated={gated!r}: the Hub's values are False, 'auto' and 'manual'")
        self.repo_id = repo_id
        self.gated = gated
        self.private = private
        self.disabled = disabled
        self.tokens = frozenset(tokens) | ({token} if token else set())
        self.tags = list(tags)
        self.pipeline_tag = pipeline_tag
        self.library_name = library_name
        self.lfs_patterns = tuple(lfs_patterns)
        self.lfs_threshold = lfs_threshold
        self.commits: dict[str, Commit] = {}  # in the order made
        self.branches: dict[str, str] = {}  # name -> commit sha; pull requests are refs/pr/N here
        self.tag_refs: dict[str, str] = {}
        if files is not None:
            self.commit(files)

    @property
    def author(self) -> str | None:
        return self.repo_id.split("/")[0] if "/" in self.repo_id else None

    def is_lfs(self, path: str, content: bytes) -> bool:
        name = path.rsplit("/", 1)[-1]
        return len(content) > self.lfs_threshold or any(fnmatch.fnmatch(name, p) for p in self.lfs_patterns)

    # -- making revisions

    def commit(
        self,
        files: Mapping[str, bytes] = {},  # (never changed)
        *,
        branch: str = "main",
        delete: Iterable[str] = (),
        replace: bool = False,
        message: str | None = None,
    ) -> str:
        """A new commit on `branch` (made from main's head if the branch is new): its parent's
        files (none with `replace`), updated with `files`, without `delete`. Its sha."""
        parent = self.branches.get(branch, self.branches.get("main"))
        commit = self.add_commit(files, parent=parent, delete=delete, replace=replace, message=message)
        self.branches[branch] = commit.sha
        return commit.sha

    def add_commit(
        self,
        files: Mapping[str, bytes],
        *,
        parent: str | None,
        delete: Iterable[str] = (),
        replace: bool = False,
        message: str | None = None,
    ) -> Commit:
        """A commit on no branch (`commit`, `tag` and `branch` name it)."""
        base = {} if replace or parent is None else dict(self.commits[parent].files)
        for path, content in files.items():
            if not path or path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"file path {path!r} in {self.repo_id}: give a relative path like 'dir/name'")
            base[path] = Blob.of(content, lfs=self.is_lfs(path, content))
        for path in delete:
            if base.pop(path, None) is None:
                raise ValueError(f"cannot delete {path!r} from {self.repo_id}: no such file at {parent}")
        message = message or f"commit {len(self.commits) + 1}"
        date = EPOCH + timedelta(hours=len(self.commits))
        stamp = f"{int(date.timestamp())} +0000"
        body = f"tree {tree_oid(base)}\n" + (f"parent {parent}\n" if parent else "")
        body += (
            f"author llmgw tests <tests@llmgw.invalid> {stamp}\ncommitter llmgw tests <tests@llmgw.invalid> {stamp}\n"
        )
        body += f"\n{message}\n"
        sha = git_oid("commit", body.encode())
        commit = Commit(sha=sha, parent=parent, files=base, date=date, message=message)
        self.commits.setdefault(sha, commit)
        return self.commits[sha]

    def tag(self, name: str, revision: str = "main") -> str:
        self.tag_refs[name] = self.resolve(revision).sha
        return self.tag_refs[name]

    def branch(self, name: str, revision: str = "main") -> str:
        self.branches[name] = self.resolve(revision).sha
        return self.branches[name]

    def open_pr(self, files: Mapping[str, bytes], *, base: str = "main", delete: Iterable[str] = ()) -> str:
        """A pull request's commit on `base`'s head; its ref, "refs/pr/N" (N counts from 1)."""
        number = 1 + sum(1 for b in self.branches if b.startswith("refs/pr/"))
        ref = f"refs/pr/{number}"
        parent = self.resolve(base).sha
        self.branches[ref] = self.add_commit(files, parent=parent, delete=delete).sha
        return ref

    # -- reading

    def resolve(self, revision: str) -> Commit:
        """The commit a revision names: a branch, then a tag, then a full commit sha, as the Hub
        looks them up."""
        sha = self.branches.get(revision) or self.tag_refs.get(revision)
        if sha is None and HEX40.match(revision) and revision in self.commits:
            sha = revision
        if sha is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return self.commits[sha]

    def blob_by_sha256(self, sha256: str) -> Blob | None:
        for commit in reversed(list(self.commits.values())):
            for blob in commit.files.values():
                if blob.sha256 == sha256:
                    return blob
        return None

    def check_access(self, token: str | None, *, content: bool) -> None:
        """Raises as the Hub answers one who may not see this repo (private: it does not exist
        for them, 401 without a token and 404 with one) or may not download from it (gated: the
        metadata and file list are public, the files are not: 401 without a token, 403 with one
        not granted)."""
        granted = token is not None and token in self.tokens
        if self.private and not granted:
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        if not content:
            return
        if self.disabled:
            raise HubError(403, None, "Access to this resource is disabled.")
        if self.gated and not granted:
            if token is None:
                why = "You must have access to it and be authenticated to access it. Please log in."
                raise HubError(401, "GatedRepo", f"Access to model {self.repo_id} is restricted. {why}")
            why = f"Visit https://huggingface.co/{self.repo_id} to ask for access."
            raise HubError(
                403,
                "GatedRepo",
                f"Access to model {self.repo_id} is restricted and you are not in the authorized list. {why}",
            )

    # -- the Hub's JSON

    def summary_json(self, *, full: bool) -> dict:
        """An item of GET /api/models (full=true adds what model_info says, siblings by name)."""
        head = self.resolve("main")
        item = {
            "_id": hashlib.sha1(self.repo_id.encode()).hexdigest()[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "likes": 0,
            "trendingScore": 0,
            "private": self.private,
            "downloads": 0,
            "tags": self.all_tags(head),
            "library_name": self.library_name,
            "pipeline_tag": self.pipeline_tag,
            "createdAt": next(iter(self.commits.values())).last_modified(),
        }
        if full:
            item |= {
                "author": self.author,
                "sha": head.sha,
                "lastModified": head.last_modified(),
                "gated": self.gated,
                "disabled": self.disabled,
                "siblings": [{"rfilename": path} for path in sorted(head.files)],
            }
        return {k: v for k, v in item.items() if v is not None}

    def info_json(self, commit: Commit, *, blobs: bool) -> dict:
        """GET /api/models/{id}[/revision/{rev}][?blobs=true]."""
        info = self.summary_json(full=True) | {"sha": commit.sha, "lastModified": commit.last_modified()}
        info["tags"] = self.all_tags(commit)
        siblings = []
        for path, blob in sorted(commit.files.items()):
            sibling: dict = {"rfilename": path}
            if blobs:
                sibling |= {"blobId": blob.oid, "size": blob.size}
                if blob.lfs:
                    sibling["lfs"] = blob.lfs_json()
            siblings.append(sibling)
        info["siblings"] = siblings
        if blobs:
            info["usedStorage"] = sum(b.size for b in commit.files.values())
        if config := self.config_summary(commit):
            info["config"] = config
        return info

    def tree_json(self, commit: Commit, path: str, *, recursive: bool) -> list[dict]:
        """GET /api/models/{id}/tree/{rev}[/{path}]: the entries under `path`, by path."""
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        under = {p: b for p, b in commit.files.items() if p.startswith(prefix)}
        if prefix and not under:
            raise HubError(404, "EntryNotFound", f'{path} does not exist on "{commit.sha}"')
        entries: dict[str, dict] = {}
        for file_path, blob in under.items():
            parts = file_path[len(prefix) :].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):
                directory = prefix + "/".join(parts[:i])
                entries[directory] = {
                    "type": "directory",
                    "oid": tree_oid(commit.files, directory + "/"),
                    "size": 0,
                    "path": directory,
                }
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": blob.oid, "size": blob.size, "path": file_path}
                if blob.lfs:
                    entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(blob.pointer or b"")}
                entries[file_path] = entry
        return [entries[p] for p in sorted(entries)]

    def all_tags(self, commit: Commit) -> list[str]:
        found = [kind for kind in ("gguf", "safetensors") if any(p.endswith("." + kind) for p in commit.files)]
        return list(dict.fromkeys([*self.tags, *found, "region:us"]))

    @staticmethod
    def config_summary(commit: Commit) -> dict | None:
        """What model_info's "config" shows of config.json (architectures, model_type)."""
        blob = commit.files.get("config.json")
        if blob is None:
            return None
        try:
            config = json.loads(blob.content)
        except ValueError:
            return None
        if not isinstance(config, dict):
            return None
        return {k: config[k] for k in ("architectures", "model_type") if k in config}
