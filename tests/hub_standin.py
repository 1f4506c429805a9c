"""A local stand-in for the Hugging Face hub's dataset endpoints (the hub cannot be reached here): an HTTP server
answering what ``datasets.load_dataset("org/name", ...)`` asks through huggingface_hub when ``HF_ENDPOINT`` points
at it — repository info, the file tree, paths-info and ``/resolve/`` downloads — for dataset repositories that are
local directories. Unknown repositories get the hub's 404 with ``X-Error-Code: RepoNotFound``."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "feedc0de" * 5


class HubStandIn(BaseHTTPRequestHandler):
    """Serves the dataset repositories in ``repos`` (``org/name`` -> directory); ``log`` records each request."""

    protocol_version = "HTTP/1.1"
    repos: ClassVar[dict[str, Path]] = {}
    log: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, length: int | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data) -> None:
        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _missing(self, code: str) -> None:
        self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                               "Content-Type": "application/json"})

    def _entries(self, repo: str) -> dict[str, dict]:
        root, out = self.repos[repo], {}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_dir():
                out[rel] = {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": 0}
            else:
                data = p.read_bytes()
                out[rel] = {"type": "file", "path": rel, "size": len(data),
                            "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        return out

    def _repo(self, repo: str, rev: str | None) -> bool:
        if repo not in self.repos:
            self._missing("RepoNotFound")
            return False
        if rev not in (None, "main", COMMIT):
            self._missing("RevisionNotFound")
            return False
        return True

    def do_GET(self):
        self.log.append((self.command, self.path))
        url = urlsplit(self.path)
        path = unquote(url.path)
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            repo, rev = m.groups()
            if self._repo(repo, rev):
                files = [e for e in self._entries(repo).values() if e["type"] == "file"]
                self._json({"id": repo, "sha": COMMIT, "private": False, "disabled": False, "gated": False,
                            "siblings": [{"rfilename": e["path"], "size": e["size"]} for e in files]})
            return None
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            repo, rev, sub = m.groups()
            if not self._repo(repo, rev):
                return None
            sub = (sub or "").strip("/")
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            entries = self._entries(repo)
            if sub and sub not in entries:
                return self._missing("EntryNotFound")
            prefix = f"{sub}/" if sub else ""
            return self._json([e for p, e in entries.items() if p.startswith(prefix)
                               and (recursive or "/" not in p[len(prefix):])])
        if m := re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, rev, name = m.groups()
            if not self._repo(repo, rev):
                return None
            entry = self._entries(repo).get(name)
            if entry is None or entry["type"] != "file":
                return self._missing("EntryNotFound")
            data = (self.repos[repo] / name).read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{entry["oid"]}"', "Accept-Ranges": "bytes"}
            rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if rng and self.command == "GET":
                start, end = int(rng[1]), int(rng[2]) + 1 if rng[2] else len(data)
                headers["Content-Range"] = f"bytes {start}-{min(end, len(data)) - 1}/{len(data)}"
                return self._send(206, data[start:end], headers)
            return self._send(200, data, headers, length=len(data))
        return self._missing("EntryNotFound")

    do_HEAD = do_GET

    def do_POST(self):
        self.log.append((self.command, self.path))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/paths-info/([^/]+)", unquote(urlsplit(self.path).path))
        if not m:
            return self._missing("EntryNotFound")
        repo, rev = m.groups()
        if not self._repo(repo, rev):
            return None
        try:
            paths = json.loads(body)["paths"]
        except (ValueError, KeyError):
            paths = parse_qs(body).get("paths", [])
        entries = self._entries(repo)
        return self._json([entries[p.strip("/")] for p in paths if p.strip("/") in entries])


def serve(repos: dict[str, Path]) -> tuple[ThreadingHTTPServer, str]:
    """The stand-in on a free local port, serving ``repos``: (server, its URL for HF_ENDPOINT)."""
    HubStandIn.repos, HubStandIn.log = dict(repos), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubStandIn)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
