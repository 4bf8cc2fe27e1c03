"""The Hugging Face Hub's API, the few calls the control plane makes of it (or of a mirror that
speaks it: `[hub] endpoint`).

    GET  /api/models/{repo}/revision/{revision}?blobs=true   a revision's commit and its files
    GET  /api/models?search=TEXT&full=true&limit=N          repositories matching a text
    GET  /{repo}/resolve/{commit}/{path}                    a file (redirected to storage for large ones)

Blocking, on the standard library's urllib (https, redirects, proxies from the environment), as
`llmgw.download` is: callers run these in a worker thread (`trio.to_thread.run_sync`). Why not
`huggingface_hub`: it is synchronous too, and brings requests, tqdm, PyYAML, fsspec, filelock and
the hf-xet binary into a release that ships as one zipapp per architecture, for three GETs.

Errors are the Hub's own, read from its `X-Error-Code` header where it sends one (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo), each a class saying what to do. A token goes in the
Authorization header of requests to the endpoint only, never to where a file is redirected (the
Hub's storage URLs are signed), and never into a message or the log.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import attrs

from llmgw.config import Secret
from llmgw.errors import LlmgwError, PeerError, UsageError, shown

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 30.0
MAX_JSON_BYTES = 32 << 20  # a model_info of a repository with thousands of files is a few MiB


class HubError(PeerError):
    """The Hub (or the mirror `[hub] endpoint` names) failed or answered what llmgw cannot use."""


class UnknownRepository(UsageError):
    """No repository of that name (or a private one this token cannot see)."""


class UnknownRevision(UsageError):
    """The repository has no such branch, tag or commit."""


class UnknownFile(UsageError):
    """The revision has no file of that path."""


class GatedRepository(UsageError):
    """The repository needs a token (or a token with access granted on the Hub)."""


@attrs.frozen(kw_only=True)
class HubFile:
    """One file of a revision, as the Hub's metadata gives it."""

    path: str  # in the repository: "model-00001-of-00002.safetensors", "original/params.json"
    size: int
    sha256: str = ""  # a large (LFS) file's SHA-256; "" for a small file the Hub hashes with git only
    blob_id: str = ""  # git's blob id (SHA-1)


@attrs.frozen(kw_only=True)
class RepoRevision:
    repo: str
    revision: str  # as asked: "main", a tag, a commit
    commit: str  # the 40-hex commit it resolved to
    files: tuple[HubFile, ...]
    gated: bool = False
    private: bool = False


@attrs.frozen(kw_only=True)
class RepoMatch:
    """A repository found by a search: its files' names (sizes come with `revision`)."""

    repo: str
    files: tuple[str, ...]
    downloads: int = 0
    likes: int = 0
    tags: tuple[str, ...] = ()


class HubClient:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        token: Secret | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self.ssl_context = ssl_context
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"HubClient({self.endpoint!r}, token={'set' if self.token else 'none'})"

    def with_token(self, token: Secret | None) -> HubClient:
        return HubClient(self.endpoint, token=token, ssl_context=self.ssl_context, timeout_s=self.timeout_s)

    # -- the calls ---------------------------------------------------------------------------

    def revision(self, repo: str, revision: str = "main") -> RepoRevision:
        """`repo` at `revision`: the commit it names now, and every file with its size and hash."""
        check_repo_id(repo)
        url = f"{self.endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}?blobs=true"
        info = self._json(url, repo=repo, revision=revision)
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha"), str)
            or not isinstance(info.get("siblings"), list)
        ):
            raise HubError(
                f"{self.endpoint} answered {url} with no commit and file list; is it a Hub (or a mirror of it)?"
            )
        files = tuple(_file(s, url) for s in info["siblings"])
        return RepoRevision(
            repo=repo,
            revision=revision,
            commit=info["sha"],
            files=files,
            gated=bool(info.get("gated")),
            private=bool(info.get("private")),
        )

    def search(self, text: str, *, limit: int = 20) -> list[RepoMatch]:
        """Repositories whose name matches `text`, most downloaded first (the Hub's order)."""
        query = urlencode({"search": text, "full": "true", "limit": str(limit), "sort": "downloads"})
        found = self._json(f"{self.endpoint}/api/models?{query}", repo="", revision="")
        if not isinstance(found, list):
            raise HubError(f"{self.endpoint} answered a search with no list; is it a Hub (or a mirror of it)?")
        out = []
        for entry in found:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            siblings = entry.get("siblings") or []
            out.append(
                RepoMatch(
                    repo=entry["id"],
                    files=tuple(s["rfilename"] for s in siblings if isinstance(s, dict) and "rfilename" in s),
                    downloads=_count(entry.get("downloads")),
                    likes=_count(entry.get("likes")),
                    tags=tuple(t for t in entry.get("tags") or () if isinstance(t, str)),
                )
            )
        return out

    def file_url(self, repo: str, commit: str, path: str) -> str:
        return f"{self.endpoint}/{repo}/resolve/{quote(commit, safe='')}/{quote(path)}"

    def read(self, repo: str, commit: str, path: str, *, start: int = 0, length: int) -> bytes:
        """`length` bytes of a file from `start` (fewer at its end; a server that ignores the
        range is read up to them and no further)."""
        url = self.file_url(repo, commit, path)
        request = self._request(url)
        request.add_header("Range", f"bytes={start}-{start + length - 1}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.ssl_context) as response:
                if response.status == 200 and start:  # no ranges here: skip to the start
                    _skip(response, start)
                return response.read(length)
        except urllib.error.HTTPError as exc:
            if exc.code == 416:
                return b""
            raise self._error(exc, url, repo=repo, revision=commit, path=path) from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._unreachable(url, exc) from None
        except http.client.HTTPException as exc:  # not OSError: a status line that is not HTTP, a cut chunk
            raise self._not_http(url, exc) from None

    # -- plumbing ----------------------------------------------------------------------------

    def _request(self, url: str) -> urllib.request.Request:
        request = urllib.request.Request(url, headers={"User-Agent": "llmgw"})
        if self.token is not None:
            # Not on a redirect: the Hub sends a file to signed storage URLs of another host.
            request.add_unredirected_header("Authorization", f"Bearer {self.token.reveal()}")
        return request

    def _json(self, url: str, *, repo: str, revision: str) -> Any:
        try:
            with urllib.request.urlopen(
                self._request(url), timeout=self.timeout_s, context=self.ssl_context
            ) as response:
                body = response.read(MAX_JSON_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise self._error(exc, url, repo=repo, revision=revision) from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._unreachable(url, exc) from None
        except http.client.HTTPException as exc:  # not OSError: a status line that is not HTTP, a cut chunk
            raise self._not_http(url, exc) from None
        if len(body) > MAX_JSON_BYTES:
            raise HubError(f"{url} answered more than {MAX_JSON_BYTES >> 20} MiB of metadata; refusing it")
        try:
            return json.loads(body)
        except ValueError:
            raise HubError(
                f"{url} answered something that is not JSON; is {self.endpoint} a Hub (or a mirror of it)?"
            ) from None

    def _unreachable(self, url: str, exc: BaseException) -> HubError:
        reason = getattr(exc, "reason", exc)
        return HubError(
            f"cannot reach {self.endpoint} ({reason}) for {url}; check the control plane's network, or set "
            "[hub] endpoint in server.toml to a mirror it can reach"
        )

    def _not_http(self, url: str, exc: http.client.HTTPException) -> HubError:
        return HubError(
            f"{self.endpoint} answered {url} with something that is not HTTP ({type(exc).__name__}: "
            f"{shown(str(exc))}); is it a Hub (or a mirror of it)? Check [hub] endpoint in server.toml"
        )

    def _error(self, exc: urllib.error.HTTPError, url: str, *, repo: str, revision: str, path: str = "") -> LlmgwError:
        code = exc.headers.get("X-Error-Code", "") if exc.headers else ""
        told = (exc.headers.get("X-Error-Message", "") if exc.headers else "") or exc.reason
        with_token = self.token is not None
        if exc.code == 401 and not code and "invalid credentials" in str(told).lower():
            return GatedRepository(
                f"{self.endpoint} refuses the token given ({shown(str(told))}); give a valid token "
                "(--token-file, or [hub] token_file)"
            )
        if code == "GatedRepo" or (exc.code == 403 and repo):
            fix = (
                "request access to it on the Hub with the account the token belongs to"
                if with_token
                else "give a token of an account with access: `llmgw ctl models add ... --token-file FILE`, or "
                "[hub] token_file in server.toml"
            )
            return GatedRepository(f"{repo} is gated or private ({shown(str(told))}); {fix}")
        if code == "RepoNotFound" or (exc.code == 401 and repo and not code):
            hint = "" if with_token else " (or it is private: give a token with --token-file)"
            return UnknownRepository(
                f"{self.endpoint} has no repository {repo}{hint}; check the name, as ORG/NAME (`llmgw ctl models search TEXT`)"
            )
        if code == "RevisionNotFound":
            return UnknownRevision(
                f"{repo} has no revision {revision!r}; give a branch, a tag or a commit it has (--revision), or leave it out for main"
            )
        if code == "EntryNotFound" or (exc.code == 404 and path):
            return UnknownFile(
                f"{repo} at {revision} has no file {path!r}; check the path against the repository's files (--file)"
            )
        if exc.code == 404 and repo and not revision:
            return UnknownRepository(f"{self.endpoint} has no repository {repo}; check the name")
        if exc.code == 404 and repo:
            return UnknownRevision(f"{repo} has no revision {revision!r} (or no such repository) at {self.endpoint}")
        return HubError(f"{self.endpoint} answered HTTP {exc.code} {shown(str(told))} for {url}; try again later")


def check_repo_id(repo: str) -> str:
    """`repo` if it is ORG/NAME as the Hub names repositories, else a UsageError saying so."""
    parts = repo.split("/")
    ok = len(parts) == 2 and all(
        p and len(p) <= 96 and p not in (".", "..") and all(c.isascii() and (c.isalnum() or c in "-_.") for c in p)
        for p in parts
    )
    if not ok:
        raise UsageError(f"{shown(repo)} is not a Hub repository name; give it as ORG/NAME, e.g. Qwen/Qwen3-0.6B-GGUF")
    return repo


def _file(sibling: Mapping[str, Any], url: str) -> HubFile:
    name = sibling.get("rfilename") if isinstance(sibling, Mapping) else None
    if not isinstance(name, str):
        raise HubError(f"{url} lists a file with no name: {shown(sibling)}")
    lfs = sibling.get("lfs") if isinstance(sibling.get("lfs"), Mapping) else {}
    size = lfs.get("size", sibling.get("size"))
    if not isinstance(size, int) or size < 0:
        raise HubError(f"{url} gives no size for {name!r}: the Hub gives sizes with ?blobs=true; is this a Hub?")
    sha256 = lfs.get("sha256") or (lfs.get("oid") or "")
    return HubFile(path=name, size=size, sha256=str(sha256).lower(), blob_id=str(sibling.get("blobId") or ""))


def _count(value: object) -> int:
    """A count a mirror gives (downloads, likes): 0 when it is not a whole number."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _skip(response: Any, n: int) -> None:
    while n > 0:
        chunk = response.read(min(n, 1 << 20))
        if not chunk:
            return
        n -= len(chunk)
