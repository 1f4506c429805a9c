"""model.path from a Hugging Face hub repository, s3:// or gs:// (engines.model.io.sources, `rl fetch-model`), against
local stand-ins: a hub mirror (an HTTP server of this module answering the hub endpoints huggingface_hub calls,
HF_ENDPOINT pointed at it) and moto's S3 server behind a recording proxy that can break or corrupt a transfer.
References are computed here from the files themselves."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import boto3
import pytest

from checkpoint_engine.topology import free_port
from engines.model.io import sources
from engines.model.io.sources import MARKER, FetchError, SourceError, cached_dir, fetch_model, parse_source
from engines.model.text.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv
from rl.cli import main
from rl.config import parse_config
from rl.errors import CommandFailed, UserError

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY_LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _serve(handler) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", header or "")
    return (int(m[1]), int(m[2]) + 1 if m and m[2] else size) if m else (0, size)


# ---- the hub mirror ---------------------------------------------------------------------------------------------


class Mirror(BaseHTTPRequestHandler):
    """The hub endpoints snapshot_download and verify_repo_checksums use, for the repositories in ``repos``:
    repository info, the file tree (size, git blob id, LFS sha256) and /resolve/ with ranges. ``faults`` maps a
    file name to "500" (its GET fails) or "corrupt" (one byte flipped, size kept)."""

    protocol_version = "HTTP/1.1"
    repos: ClassVar[dict[str, Path]] = {}
    faults: ClassVar[dict[str, str]] = {}
    log: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, content_length: int | None = None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data) -> None:
        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _files(self, repo: str) -> dict[str, dict]:
        root, out = self.repos[repo], {}
        for p in sorted(root.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                entry = {"type": "file", "path": p.relative_to(root).as_posix(), "size": len(data),
                         "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                if p.suffix in (".safetensors", ".bin"):  # stored in LFS, as on the hub
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
                out[entry["path"]] = entry
        return out

    def do_GET(self):
        self.log.append((self.command, self.path))
        path = self.path.split("?")[0]
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path):
            repo, what, rev = m.groups()
            if repo not in self.repos:
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            if rev not in ("main", COMMIT):
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
            files = self._files(repo)
            if what == "revision":
                return self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]})
            return self._json(list(files.values()))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, rev, name = m.groups()
            entry = self._files(repo).get(name) if repo in self.repos else None
            if entry is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            data = bytearray((self.repos[repo] / name).read_bytes())
            if self.command == "GET" and self.faults.get(name) == "500":
                return self._send(500, b"mirror down")
            if self.command == "GET" and self.faults.get(name) == "corrupt":
                data[len(data) // 2] ^= 0xFF
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            start, end = _byte_range(self.headers.get("Range"), len(data))
            if self.command == "HEAD":
                return self._send(200, b"", headers, content_length=len(data))
            if self.headers.get("Range"):
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                return self._send(206, bytes(data[start:end]), headers)
            return self._send(200, bytes(data), headers)
        self._send(404, b"", {"X-Error-Code": "EntryNotFound"})

    do_HEAD = do_GET


def _tiny_model(d: Path) -> Path:
    """A model directory as the hub holds one: config.json and tokenizer.json (read by `rl check-config` and the
    run), weights (random bytes: nothing here loads them), a nested file, and a .bin copy the fetch skips."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    train_tokenizer([t.prompt for t in ArithmeticEnv.generate_tasks(50, seed=1)], 300).save(d)
    (d / "model.safetensors").write_bytes(os.urandom(300_000))
    (d / "pytorch_model.bin").write_bytes(os.urandom(1000))
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("a file in a folder\n")
    return d


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    Mirror.repos = {"org/tiny": _tiny_model(tmp_path_factory.mktemp("hub") / "tiny")}
    server = _serve(Mirror)
    yield _url(server)
    server.shutdown()


@pytest.fixture
def mirror(hub, monkeypatch):
    """The hub mirror as HF_ENDPOINT, its log emptied and no faults."""
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    Mirror.faults, Mirror.log = {}, []
    return Mirror


def _same_files(got: Path, want: Path, skipped=("pytorch_model.bin",)) -> None:
    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_file())
    for name in names:
        assert (got / name).is_file() != (name in skipped), name
        if name not in skipped:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


def _gets(log, name: str) -> int:
    return sum(1 for method, path in log if method == "GET" and path.split("?")[0].endswith("/" + name))


# ---- sources -----------------------------------------------------------------------------------------------------


def test_a_source_is_a_directory_a_hub_repository_or_a_bucket_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    cases = {"models/mine": ("local", "models/mine", ""), "/abs/dir": ("local", "/abs/dir", ""),
             "./org/name": ("local", "org/name", ""), "gpt2": ("local", "gpt2", ""),
             "Qwen/Qwen3-8B": ("hub", "Qwen/Qwen3-8B", "main"), "org/m@v1.0": ("hub", "org/m", "v1.0"),
             "hf://org/m@refs/pr/1": ("hub", "org/m", "refs/pr/1"), "hf://gpt2": ("hub", "gpt2", "main"),
             "s3://my-bucket/a/b/": ("s3", "my-bucket", "a/b"), "gs://bkt": ("gs", "bkt", "")}
    for text, want in cases.items():
        src = parse_source(text)
        assert (src.kind, src.where, src.ref) == want, text
    assert parse_source("hf://org/m@refs/pr/1").cache_dir("/c") == Path("/c/hub/org/m/refs--pr--1")
    assert parse_source("s3://my-bucket/a/b").cache_dir("/c") == Path("/c/s3/my-bucket/a/b")
    for bad, why in {"ftp://x/y": "unknown scheme ftp://", "s3://": "not a bucket name",
                     "gs://Bad_Bucket/x": "not a bucket name", "s3://bkt/a/../../etc": "'..' component",
                     "hf://a/b/c": "org/name", "": "empty"}.items():
        with pytest.raises(SourceError, match=re.escape(why)):
            parse_source(bad)


def test_a_local_directory_is_returned_as_is_and_a_missing_one_named(tmp_path):
    assert fetch_model(str(tmp_path), tmp_path / "cache") == tmp_path
    assert not (tmp_path / "cache").exists()
    with pytest.raises(FetchError, match=f"model directory {tmp_path / 'nope'} does not exist"):
        fetch_model(str(tmp_path / "nope"), tmp_path / "cache")


def test_the_run_config_takes_a_remote_source_and_refuses_a_bad_one():
    assert parse_config({"model": {"path": "s3://models/qwen3"}}).model.path == "s3://models/qwen3"
    assert parse_config({"model": {"path": Path("/m")}}).model.path == "/m"
    with pytest.raises(UserError, match=r"model.path.*unknown scheme ftp://"):
        parse_config({"model": {"path": "ftp://host/m"}})


# ---- the hub -----------------------------------------------------------------------------------------------------


def test_a_hub_repository_is_fetched_once_checked_and_then_found_without_the_network(mirror, tmp_path):
    got = fetch_model("hf://org/tiny", tmp_path)
    assert got == tmp_path / "hub" / "org" / "tiny" / "main"
    _same_files(got, Mirror.repos["org/tiny"])
    assert _gets(mirror.log, "pytorch_model.bin") == 0  # weights in another format are not downloaded
    marker = json.loads((got / MARKER).read_text())
    want = hashlib.sha256((Mirror.repos["org/tiny"] / "model.safetensors").read_bytes()).hexdigest()
    assert marker["files"]["model.safetensors"] == {"size": 300_000, "checksum": f"sha256:{want}"}
    mirror.log.clear()
    assert fetch_model("org/tiny", tmp_path) == got == cached_dir("org/tiny", tmp_path)
    assert mirror.log == []  # complete: nothing asked of the hub
    (got / "extra" / "notes.txt").write_text("cut")  # a damaged copy is not presented: its file is fetched again
    assert cached_dir("org/tiny", tmp_path) is None
    fetch_model("org/tiny", tmp_path)
    _same_files(got, Mirror.repos["org/tiny"])
    assert _gets(mirror.log, "notes.txt") == 1 and _gets(mirror.log, "model.safetensors") == 0
    (got / "model.safetensors").write_bytes(os.urandom(300_000))  # the same size: caught by the hub's sha256
    (got / MARKER).unlink()
    mirror.log.clear()
    fetch_model("org/tiny", tmp_path)
    _same_files(got, Mirror.repos["org/tiny"])
    assert _gets(mirror.log, "model.safetensors") == 1


def test_a_failed_hub_download_names_the_file_and_the_next_call_fetches_only_what_is_missing(mirror, tmp_path):
    mirror.faults["model.safetensors"] = "500"
    with pytest.raises(FetchError, match=r"^hf://org/tiny: download failed: .*model\.safetensors"):
        fetch_model("hf://org/tiny", tmp_path)
    assert cached_dir("hf://org/tiny", tmp_path) is None
    assert not (tmp_path / "hub/org/tiny/main" / MARKER).exists()
    mirror.faults.clear()
    mirror.log.clear()
    got = fetch_model("hf://org/tiny", tmp_path)
    _same_files(got, Mirror.repos["org/tiny"])
    assert _gets(mirror.log, "model.safetensors") == 1 and _gets(mirror.log, "config.json") == 0


def test_a_corrupt_hub_file_is_named_removed_and_fetched_anew(mirror, tmp_path):
    mirror.faults["model.safetensors"] = "corrupt"
    with pytest.raises(FetchError, match=r"model\.safetensors is corrupt: its sha256 is .*, the hub says .*twice"):
        fetch_model("hf://org/tiny", tmp_path)
    assert _gets(mirror.log, "model.safetensors") == 2  # removed and fetched once more before giving up
    assert not (tmp_path / "hub/org/tiny/main/model.safetensors").exists()
    assert cached_dir("hf://org/tiny", tmp_path) is None
    mirror.faults.clear()
    _same_files(fetch_model("hf://org/tiny", tmp_path), Mirror.repos["org/tiny"])


def test_an_unknown_hub_repository_or_revision_is_one_line(mirror, tmp_path):
    with pytest.raises(FetchError, match=r"hf://org/none: no repository org/none at http://127\.0\.0\.1:\d+"):
        fetch_model("hf://org/none", tmp_path)
    with pytest.raises(FetchError, match=r"org/tiny has no revision 'v9'"):
        fetch_model("org/tiny@v9", tmp_path)


# ---- S3 and GCS: moto's S3 server behind a proxy ----------------------------------------------------------------


class Proxy(BaseHTTPRequestHandler):
    """Forwards every request to moto's server and records it; ``faults`` maps an object's file name to
    ("cut", offset): the body stops at that offset of the object and the connection closes (a transfer broken
    there, again at every attempt), or ("flip", 0): one byte of the body flipped on the way."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int] = ("127.0.0.1", 0)
    faults: ClassVar[dict[str, tuple[str, int]]] = {}
    log: ClassVar[list[dict]] = []

    def log_message(self, *args):
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.log.append({"method": self.command, "path": self.path, "range": self.headers.get("Range"),
                         "auth": self.headers.get("Authorization", "")})
        conn = http.client.HTTPConnection(*self.upstream)
        conn.request(self.command, self.path, body, dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        fault = self.faults.get(self.path.split("?")[0].rsplit("/", 1)[-1]) if self.command == "GET" else None
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                         else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault and fault[0] == "flip" and data:
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        if fault and fault[0] == "cut":
            start = _byte_range(self.headers.get("Range"), len(data))[0]
            self.wfile.write(data[:max(fault[1] - start, 0)])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


BIG = 5 * 2**20 + 300_000  # two parts of a multipart upload (S3's smallest part is 5 MiB)


@pytest.fixture(scope="module")
def s3_server():
    # moto's server in a process of its own: it is a Flask app, and Flask's context proxies left in the test process
    # raise on attribute access, which breaks vLLM's scan of loaded modules in later tests
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            assert time.time() < deadline and proc.poll() is None, "moto's server did not start"
            time.sleep(0.2)
    Proxy.upstream = ("127.0.0.1", port)
    proxy = _serve(Proxy)
    yield _url(proxy)
    proxy.shutdown()
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A client of the S3 stand-in (through the proxy, its log emptied, no faults), the environment `rl` reads
    pointed at it, and a bucket `models`."""
    for k, v in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "AKTEST", "AWS_SECRET_ACCESS_KEY": "secret",
                 "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sources, "_RETRY_PAUSE_S", 0.0)
    Proxy.faults, Proxy.log = {}, []
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket="models")
    return client


def _upload(client, prefix: str, files: dict[str, bytes], multipart: tuple[str, ...] = ()) -> None:
    for name, data in files.items():
        key = f"{prefix}/{name}"
        if name not in multipart:
            client.put_object(Bucket="models", Key=key, Body=data)
            continue
        upload = client.create_multipart_upload(Bucket="models", Key=key)["UploadId"]
        parts = [{"PartNumber": n + 1, "ETag": client.upload_part(Bucket="models", Key=key, PartNumber=n + 1,
                                                                   UploadId=upload, Body=data[i:i + 5 * 2**20])["ETag"]}
                 for n, i in enumerate(range(0, len(data), 5 * 2**20))]
        client.complete_multipart_upload(Bucket="models", Key=key, UploadId=upload, MultipartUpload={"Parts": parts})


def _model_files() -> dict[str, bytes]:
    return {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(BIG),
            "tokenizer.json": os.urandom(3 * 2**20), "sub/notes.txt": b"nested\n"}


def _object_gets(name: str) -> list[dict]:
    return [r for r in Proxy.log if r["method"] == "GET" and r["path"].split("?")[0].endswith("/" + name)]


def test_a_bucket_prefix_is_fetched_once_checked_and_then_found_without_the_network(s3, tmp_path):
    files = _model_files()
    _upload(s3, "qwen", files, multipart=("model.safetensors",))
    assert s3.head_object(Bucket="models", Key="qwen/model.safetensors")["ETag"].endswith('-2"')  # multipart
    got = fetch_model("s3://models/qwen", tmp_path)
    assert got == tmp_path / "s3" / "models" / "qwen"
    assert {p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*")
            if p.is_file() and not p.name.startswith(".")} == files
    Proxy.log.clear()
    assert fetch_model("s3://models/qwen/", tmp_path) == got == cached_dir("s3://models/qwen", tmp_path)
    assert Proxy.log == []


@pytest.mark.parametrize("name, why", [("config.json", r"md5 \w+, the bucket's ETag says"),
                                       ("model.safetensors", r"multipart md5 \w+-2, the bucket's ETag says")])
def test_a_corrupt_object_is_named_and_not_kept(s3, tmp_path, name, why):
    _upload(s3, "corrupt", _model_files(), multipart=("model.safetensors",))
    Proxy.faults[name] = ("flip", 0)
    with pytest.raises(FetchError, match=rf"^s3://models/corrupt: {re.escape(name)} is corrupt: {why}"):
        fetch_model("s3://models/corrupt", tmp_path)
    assert cached_dir("s3://models/corrupt", tmp_path) is None
    assert not (tmp_path / "s3/models/corrupt" / name).exists()
    assert not list((tmp_path / "s3/models/corrupt").glob(f"{name}*.part"))


def test_an_interrupted_download_continues_where_it_stopped(s3, tmp_path):
    files = _model_files()
    _upload(s3, "resume", files)
    Proxy.faults["tokenizer.json"] = ("cut", 1_500_000)  # every attempt breaks there
    with pytest.raises(FetchError, match=r"^s3://models/resume: tokenizer\.json: the download stopped at 1500000 of "
                                         r"3145728 bytes .*run again to continue from there"):
        fetch_model("s3://models/resume", tmp_path)
    assert cached_dir("s3://models/resume", tmp_path) is None
    tries = _object_gets("tokenizer.json")
    assert [t["range"] for t in tries[:2]] == [None, "bytes=1500000-"]  # the same call continued once already
    del Proxy.faults["tokenizer.json"]
    Proxy.log.clear()
    got = fetch_model("s3://models/resume", tmp_path)
    assert [t["range"] for t in _object_gets("tokenizer.json")] == ["bytes=1500000-"]
    assert _object_gets("config.json") == []  # fetched and checked by the first call
    assert (got / "tokenizer.json").read_bytes() == files["tokenizer.json"]


def test_a_sha256sums_manifest_is_checked(s3, tmp_path):
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items())
    _upload(s3, "summed", {**files, "SHA256SUMS": sums.replace(hashlib.sha256(b"weights").hexdigest(), "0" * 64)})
    with pytest.raises(FetchError, match=r"model\.safetensors is corrupt: sha256 \w+…, SHA256SUMS says 0000"):
        fetch_model("s3://models/summed", tmp_path)
    _upload(s3, "summed", {"SHA256SUMS": sums.encode()})
    assert (fetch_model("s3://models/summed", tmp_path) / "model.safetensors").read_bytes() == b"weights"


def test_gs_goes_through_the_same_client_with_the_hmac_key(s3, tmp_path, s3_server, monkeypatch):
    """gs:// is GCS's S3-compatible XML API: the stand-in answers it as GCS_ENDPOINT_URL, signed with the HMAC key."""
    monkeypatch.setenv("GCS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("GOOGLE_HMAC_ACCESS_ID", "GOOGHMACKEY")
    monkeypatch.setenv("GOOGLE_HMAC_SECRET", "hmac-secret")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    files = _model_files()
    _upload(s3, "gcs", files)
    got = fetch_model("gs://models/gcs", tmp_path)
    assert got == tmp_path / "gs" / "models" / "gcs"
    assert (got / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    fetched = [r["auth"] for r in Proxy.log if r["method"] == "GET"]
    assert len(fetched) == 5 and all("Credential=GOOGHMACKEY/" in auth for auth in fetched)  # a listing, 4 files


def test_concurrent_fetches_of_one_source_download_it_once(s3, tmp_path):
    files = _model_files()
    _upload(s3, "shared", files)
    lines: list[str] = []
    results: list[Path] = []
    waiting = threading.Event()

    def log(line: str) -> None:
        # whichever fetch holds the lock downloads only once the other is waiting for it: without this, one
        # thread could finish before the other starts, and the race this test is about would not happen
        lines.append(line)
        if "another process is fetching it" in line:
            waiting.set()
        if "downloading into" in line:
            assert waiting.wait(30), "the second fetch never waited for the lock"

    threads = [threading.Thread(target=lambda: results.append(fetch_model("s3://models/shared", tmp_path, log)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "s3/models/shared"] * 2
    assert all(len(_object_gets(name.rsplit("/", 1)[-1])) == 1 for name in files)
    assert sum("another process is fetching it" in line for line in lines) == 1


def test_bucket_errors_are_one_line(s3, tmp_path):
    with pytest.raises(FetchError, match=r"^s3://models/nothing: no objects under it"):
        fetch_model("s3://models/nothing", tmp_path)
    with pytest.raises(FetchError, match=r"^s3://absent/m: cannot list the bucket: NoSuchBucket"):
        fetch_model("s3://absent/m", tmp_path)


# ---- `rl fetch-model`, `rl check-config` and the run's start -----------------------------------------------------


def _rl(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=120)


def test_rl_fetch_model_prints_the_directory_last_and_fails_in_one_line(mirror, tmp_path):
    env = {"HF_ENDPOINT": os.environ["HF_ENDPOINT"]}
    first = _rl("fetch-model", "hf://org/tiny", "--cache", str(tmp_path), env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1] == str(tmp_path / "hub" / "org" / "tiny" / "main")
    again = _rl("fetch-model", "hf://org/tiny", "--cache", str(tmp_path), env=env)
    assert again.stdout == first.stdout and "nothing to download" in again.stderr
    missing = _rl("fetch-model", "hf://org/none", "--cache", str(tmp_path), env=env)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.splitlines()[-1].startswith("error: rl fetch-model: hf://org/none: no repository org/none")
    assert "Traceback" not in missing.stderr and not (tmp_path / "hub" / "org" / "none" / "main").exists()
    bad = _rl("fetch-model", "ftp://host/m", "--cache", str(tmp_path), env=env)
    assert bad.returncode == 2 and "unknown scheme ftp://" in bad.stderr


def test_check_config_says_a_remote_model_is_fetched_at_start_and_estimates_a_fetched_one(
        mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RL_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "run.yaml").write_text(json.dumps({"model": {"path": "hf://org/tiny"},
                                                   "env": {"num_train": 30, "num_eval": 10}}))
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err
    assert "# memory per worker: not estimated, hf://org/tiny is not on this machine, fetched at start" in \
        capsys.readouterr().out
    assert mirror.log == []  # check-config downloads nothing
    fetch_model("hf://org/tiny", tmp_path / "cache")
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err
    assert "# memory per worker (1 workers" in capsys.readouterr().out


def test_the_run_resolves_a_remote_model_path_once_through_the_model_cache(mirror, tmp_path, monkeypatch):
    from rl.setup.warmstart import prepare_model

    monkeypatch.setenv("RL_MODEL_CACHE", str(tmp_path))
    cfg = parse_config({"model": {"path": "org/tiny"}})
    got = prepare_model(cfg)
    assert got == tmp_path / "hub" / "org" / "tiny" / "main"
    _same_files(got, Mirror.repos["org/tiny"])
    mirror.log.clear()
    assert prepare_model(cfg) == got and mirror.log == []  # what rl fetch-model or an earlier start fetched
    with pytest.raises(CommandFailed, match=r"^model\.path: hf://org/none: no repository org/none"):
        prepare_model(parse_config({"model": {"path": "hf://org/none"}}))
