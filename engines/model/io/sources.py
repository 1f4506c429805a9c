"""Where a model comes from: a local directory, a Hugging Face hub repository, or a prefix of an S3 or GCS bucket.

``fetch_model`` downloads a remote source once into a cache directory and returns the local model directory. A
download is resumable (files already fetched are kept; an object-store file continues from its partial copy with a
ranged GET), every file is checked against the store's checksum before it counts, and a copy counts as complete
only once its marker file, written last, lists its files. Credentials come from the environment: ``HF_TOKEN`` and
``HF_ENDPOINT`` for the hub; boto3's own chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a web identity, an
instance profile) with ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` for S3; for ``gs://``, Google Cloud Storage's
S3-compatible XML API with an HMAC key (``GOOGLE_HMAC_ACCESS_ID``/``GOOGLE_HMAC_SECRET``, else the ``AWS_*`` pair)
at ``GCS_ENDPOINT_URL`` (default https://storage.googleapis.com), through the same client code as S3.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MARKER = ".rl-complete.json"  # written last: its presence (and its files, at their sizes) makes a copy complete
_STATE = ".rl-fetch-state.json"  # object stores: the files already checked, by ETag (a later fetch skips them)
SHA256SUMS = "SHA256SUMS"  # an optional manifest beside a bucket's model (`sha256sum` output): checked when present
GCS_ENDPOINT = "https://storage.googleapis.com"
#: weights in formats the engines do not read (they load *.safetensors), skipped on the hub: many repositories
#: carry the same weights two or three times (pytorch_model.bin, consolidated .pth, GGUF, ONNX)
HUB_SKIPPED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot",
               "*.tflite", "*.mlmodel", "original/*"]
_HUB_REPO = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # org/name (a few legacy repositories have no org)
_STORE_THREADS = 8
_CHUNK = 8 << 20  # bytes hashed at a time
_STREAM_CHUNK = 1 << 20  # bytes written at a time: what a broken connection can lose of what it brought
_RETRY_PAUSE_S = 1.0  # first pause before an object-store download continues after a broken connection
_MAX_STALLS = 5  # attempts in a row that bring no new bytes before a file's download gives up

Log = Callable[[str], None]


class FetchError(RuntimeError):
    """A download or a check that failed; the one-line message names the source and the file."""


class SourceError(ValueError):
    """A model source that cannot be parsed (bad scheme, no bucket, a path escaping the cache)."""


@dataclass(frozen=True)
class Source:
    """A parsed model source: ``kind`` local, hub, s3 or gs; ``where`` the directory, repository or bucket;
    ``ref`` the hub revision or the bucket's key prefix."""

    kind: str
    where: str
    ref: str
    text: str

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    def cache_dir(self, cache: str | Path) -> Path:
        """The directory under ``cache`` a remote source is downloaded into."""
        if self.kind == "hub":
            return Path(cache) / "hub" / self.where / self.ref.replace("/", "--")
        return Path(cache) / self.kind / self.where / self.ref

    def __str__(self) -> str:
        return self.text


def parse_source(text: str | Path | Source) -> Source:
    """A local directory (one that exists, or a path starting with ``/``, ``.`` or ``~``), a hub repository
    (``org/name``, ``org/name@revision``, ``hf://org/name[@revision]``), ``s3://bucket/prefix`` or
    ``gs://bucket/prefix``."""
    if isinstance(text, Source):
        return text
    text = str(text).strip()
    if not text:
        raise SourceError("empty model source")
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme in ("s3", "gs"):
            bucket, _, prefix = rest.partition("/")
            prefix = prefix.strip("/")
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket):
                raise SourceError(f"model source {text}: {bucket!r} is not a bucket name "
                                  f"(expected {scheme}://bucket/prefix)")
            if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
                raise SourceError(f"model source {text}: the prefix has an empty, '.' or '..' component")
            return Source(scheme, bucket, prefix, text)
        if scheme == "hf":
            return _hub_source(rest, text)
        raise SourceError(f"model source {text}: unknown scheme {scheme}:// (a local directory, org/name, hf://, "
                          "s3:// or gs://)")
    path = Path(text).expanduser()
    repo = text.split("@", 1)[0]
    if path.exists() or text.startswith(("/", ".", "~")) or "/" not in repo or not _HUB_REPO.fullmatch(repo):
        return Source("local", str(path), "", text)
    return _hub_source(text, text)


def _hub_source(rest: str, text: str) -> Source:
    repo, _, revision = rest.partition("@")
    if not _HUB_REPO.fullmatch(repo) or ".." in repo:
        raise SourceError(f"model source {text}: a hub repository is org/name or hf://org/name[@revision]")
    if ".." in revision.split("/") or revision.startswith("/"):
        raise SourceError(f"model source {text}: bad revision {revision!r}")
    return Source("hub", repo, revision or "main", text)


def cached_dir(text: str | Path | Source, cache: str | Path) -> Path | None:
    """The model directory of ``text`` on this machine without downloading: a local directory as is (if it
    exists), a remote source's complete copy under ``cache``; None where there is none yet."""
    src = parse_source(text)
    if not src.remote:
        return Path(src.where) if Path(src.where).is_dir() else None
    d = src.cache_dir(cache)
    return d if _damage(d) is None else None


def fetch_model(text: str | Path | Source, cache: str | Path, log: Log | None = None) -> Path:
    """The local model directory of ``text``: a local directory as is; a remote source downloaded into
    ``cache`` unless a complete copy is there already (then nothing is downloaded; the copy's files are checked
    against its marker). Concurrent calls for one source wait for each other. Raises FetchError (one line)."""
    log = log or _stderr
    src = parse_source(text)
    if not src.remote:
        if not Path(src.where).is_dir():
            raise FetchError(f"model directory {src.where} does not exist")
        return Path(src.where)
    from filelock import FileLock

    dest = src.cache_dir(cache)
    if _damage(dest) is None:  # complete: no lock taken, so a read-only cache serves too
        log(f"{src}: complete in {dest}, nothing to download")
        return dest
    try:
        dest.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(dest.parent / f".{dest.name}.lock"))
        lock.acquire(timeout=0.1)
    except TimeoutError:  # filelock's Timeout; before OSError, of which TimeoutError is one
        log(f"{src}: another process is fetching it into {dest}; waiting")
        lock.acquire()
    except OSError as e:
        raise FetchError(f"{src}: cannot write the model cache {dest}: {e.strerror or e}") from None
    try:
        damage = _damage(dest)
        if damage is None:  # another process completed it while this one waited
            log(f"{src}: complete in {dest}, nothing to download")
            return dest
        if (dest / MARKER).exists():  # a file went missing or changed size since: fetch what is needed again
            log(f"{src}: the copy in {dest} is damaged ({damage}); fetching again")
            (dest / MARKER).unlink()
        log(f"{src}: downloading into {dest}")
        files = _fetch_hub(src, dest, log) if src.kind == "hub" else _fetch_store(src, dest, log)
        _write_json(dest / MARKER, {"source": src.text, "files": files})
        log(f"{src}: {len(files)} files, {sum(f['size'] for f in files.values()) / 2**30:.2f} GiB, checked")
        return dest
    except FetchError:
        if not any(dest.iterdir()):  # nothing came (a wrong name, no credentials): leave no empty directory
            dest.rmdir()
        raise
    except OSError as e:  # a full or read-only cache volume
        raise FetchError(f"{src}: cannot write {e.filename or dest}: {e.strerror or e}") from None
    finally:
        lock.release()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _damage(dest: Path) -> str | None:
    """None if ``dest`` holds a complete copy (its marker, and every file it lists at its size), else why not."""
    try:
        files = json.loads((dest / MARKER).read_text())["files"]
    except FileNotFoundError:
        return "not downloaded"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MARKER}: {e}"
    for rel, meta in files.items():
        path = dest / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{rel} has {path.stat().st_size} bytes, not {meta['size']}"
    return None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# ---- the Hugging Face hub -------------------------------------------------------------------------------------


def _fetch_hub(src: Source, dest: Path, log: Log) -> dict[str, dict]:
    """Download a hub repository with huggingface_hub into ``dest`` (files already there and unchanged are kept;
    a file is written under a temporary name and renamed once whole) and check every file against the hub's
    checksums (sha256 of LFS files, git's blob hash of the rest) with huggingface_hub's own verification. The
    revision is resolved to its commit first, so that a branch moving meanwhile does not mix two versions."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read here: huggingface_hub reads it once, at import
    token = os.environ.get("HF_TOKEN") or None
    where = endpoint or "https://huggingface.co"
    api = HfApi(endpoint=endpoint, token=token)
    try:
        commit = api.model_info(src.where, revision=src.ref).sha  # pinned: a branch that moves mid-download
        tree = {f.path: f for f in api.list_repo_tree(src.where, revision=commit, recursive=True)
                if isinstance(f, RepoFile)}
        wanted = set(filter_repo_objects(tree, ignore_patterns=HUB_SKIPPED))
        for _ in range(2):  # a file that fails the check is removed and fetched once more
            snapshot_download(src.where, revision=commit, local_dir=dest, endpoint=endpoint, token=token,
                              ignore_patterns=HUB_SKIPPED)
            check = api.verify_repo_checksums(src.where, revision=commit, local_dir=dest, token=token)
            for bad in check.mismatches:
                (dest / bad["path"]).unlink()
            if not check.mismatches:
                break
    except GatedRepoError:
        raise FetchError(f"{src}: a gated repository; accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        local = " (and there is no directory of that name here)" if src.text == src.where else ""
        raise FetchError(f"{src}: no repository {src.where} at {where}, or it is private and HF_TOKEN is not set or "
                         f"cannot read it{local}") from None
    except RevisionNotFoundError:
        raise FetchError(f"{src}: repository {src.where} has no revision {src.ref!r}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise FetchError(f"{src}: download failed: {_first_line(e)}") from None
    except Exception as e:  # the HTTP client's own errors (connection refused, timeouts), whatever its version
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore", "h11", "ssl"):
            raise
        raise FetchError(f"{src}: cannot reach the hub at {where}: {_first_line(e)}") from None
    if check.mismatches:
        bad = check.mismatches[0]
        raise FetchError(f"{src}: {bad['path']} is corrupt: its {bad['algorithm']} is {bad['actual'][:16]}…, the hub "
                         f"says {bad['expected'][:16]}… (twice); removed it")
    if missing := sorted(wanted & set(check.missing_paths)):
        raise FetchError(f"{src}: {missing[0]} is missing after the download")
    log(f"{src}: revision {commit}, {check.checked_count} files match the hub's checksums")
    return {rel: {"size": tree[rel].size, "checksum": _hub_checksum(tree[rel])} for rel in sorted(wanted)}


def _hub_checksum(f) -> str:
    return f"sha256:{f.lfs.sha256}" if f.lfs is not None else f"git-sha1:{f.blob_id}"


# ---- S3 and GCS (its S3-compatible XML API) ---------------------------------------------------------------------


def store_client(src: Source):
    """A boto3 S3 client for ``src``'s store (S3, or GCS's XML API), configured from the environment."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise FetchError(f"{src}: s3:// and gs:// sources need boto3 (pip install boto3)") from None
    retries = {"max_attempts": 8, "mode": "standard"}
    if src.kind == "gs":
        # the XML API speaks S3 with HMAC keys; it knows none of the newer S3 checksum headers
        key, secret = os.environ.get("GOOGLE_HMAC_ACCESS_ID"), os.environ.get("GOOGLE_HMAC_SECRET")
        return boto3.session.Session().client(
            "s3", endpoint_url=os.environ.get("GCS_ENDPOINT_URL") or GCS_ENDPOINT, region_name="auto",
            aws_access_key_id=key or None, aws_secret_access_key=secret or None,
            config=Config(s3={"addressing_style": "path"}, retries=retries,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    # path-style for S3-compatible stores (MinIO, Ceph): their buckets rarely have DNS names
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=region,
        config=Config(s3={"addressing_style": "path"} if endpoint else {}, retries=retries))


def _fetch_store(src: Source, dest: Path, log: Log) -> dict[str, dict]:
    """Download every object under ``src``'s prefix into ``dest``, in parallel, each checked; see ``_get_object``."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    client = store_client(src)
    prefix = f"{src.ref}/" if src.ref else ""
    try:
        objects = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=src.where, Prefix=prefix):
            for o in page.get("Contents", []):
                rel = o["Key"][len(prefix):]
                if rel and not rel.endswith("/"):  # "directory" placeholder objects hold nothing
                    objects[rel] = (o["Size"], o["ETag"])
    except NoCredentialsError:
        raise FetchError(f"{src}: no credentials: set {_key_names(src)}") from None
    except ClientError as e:
        raise FetchError(f"{src}: cannot list the bucket: {_client_error(e, src)}") from None
    except BotoCoreError as e:
        raise FetchError(f"{src}: cannot list the bucket: {_first_line(e)}") from None
    if not objects:
        raise FetchError(f"{src}: no objects under it (is the bucket and prefix right?)")
    for rel in objects:
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise FetchError(f"{src}: object {prefix}{rel} would land outside the cache directory")
    state = _read_state(dest)
    guard, stop = threading.Lock(), threading.Event()
    sums: dict[str, str] = {}
    if SHA256SUMS in objects:
        _get_object(client, src, prefix, SHA256SUMS, *objects[SHA256SUMS], dest, {}, state, guard, stop, log)
        sums = _read_sums(dest / SHA256SUMS, src)

    def one(rel: str) -> None:
        if not stop.is_set():
            _get_object(client, src, prefix, rel, *objects[rel], dest, sums, state, guard, stop, log)

    errors: list[Exception] = []
    with ThreadPoolExecutor(_STORE_THREADS) as pool:
        for future in [pool.submit(one, rel) for rel in sorted(objects) if rel != SHA256SUMS]:
            try:
                future.result()
            except Exception as e:  # a failed file, a full disk: the others stop at their next chunk, their
                stop.set()  # partial copies kept for the next call
                errors.append(e)
    if errors:
        raise errors[0]
    return {rel: {"size": size, "checksum": f"etag:{etag.strip(chr(34))}"} for rel, (size, etag) in objects.items()}


def _key_names(src: Source) -> str:
    if src.kind == "gs":
        return "GOOGLE_HMAC_ACCESS_ID and GOOGLE_HMAC_SECRET (an HMAC key of the bucket's project)"
    return "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an S3-compatible store)"


def _client_error(e, src: Source) -> str:
    code = e.response.get("Error", {}).get("Code", "?")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401"):
        return f"{code}: check {_key_names(src)}"
    if code in ("NoSuchBucket", "404"):
        return f"{code}: no bucket {src.where} at this endpoint"
    return f"{code}: {e.response.get('Error', {}).get('Message', '')}".rstrip(": ")


def _read_state(dest: Path) -> dict[str, str]:
    try:
        return json.loads((dest / _STATE).read_text())
    except (OSError, ValueError):
        return {}


def _read_sums(path: Path, src: Source) -> dict[str, str]:
    sums = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            digest, _, name = line.strip().partition(" ")
            name = name.lstrip(" *").removeprefix("./")
            if not re.fullmatch(r"[0-9a-fA-F]{64}", digest) or not name:
                raise FetchError(f"{src}: {SHA256SUMS} line {n} is not `<sha256>  <file>`")
            sums[name] = digest.lower()
    return sums


def _get_object(client, src: Source, prefix: str, rel: str, size: int, etag: str, dest: Path, sums: dict,
                state: dict, guard: threading.Lock, stop: threading.Event, log: Log) -> None:
    """Download one object to ``dest/rel``: into a partial file named by its ETag (so a partial copy of another
    version of the object is never continued), continued with a ranged GET after a broken connection or in a
    later call, checked, then renamed into place."""
    from botocore.exceptions import BotoCoreError, ClientError

    target = dest / rel
    if state.get(rel) == etag and target.is_file() and target.stat().st_size == size:
        return  # fetched and checked by an earlier call
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{hashlib.sha1(etag.encode()).hexdigest()[:12]}.part")
    for stale in target.parent.glob(f"{target.name}.*.part"):
        if stale != part:
            stale.unlink()
    stalls, key = 0, prefix + rel
    while (have := part.stat().st_size if part.exists() else 0) < size and not stop.is_set():
        if stalls:
            time.sleep(min(_RETRY_PAUSE_S * 2 ** (stalls - 1), 30))
        args = {"Bucket": src.where, "Key": key} | ({"Range": f"bytes={have}-"} if have else {})
        try:
            resp = client.get_object(**args)
            if resp["ETag"].strip('"') != etag.strip('"'):
                part.unlink(missing_ok=True)
                raise FetchError(f"{src}: {rel} changed in the bucket during the download; run again")
            with open(part, "ab" if resp.get("ContentRange") else "wb") as f:  # a 200 to a ranged GET: from 0
                for chunk in resp["Body"].iter_chunks(_STREAM_CHUNK):
                    f.write(chunk)
                    if stop.is_set():
                        return
        except ClientError as e:
            raise FetchError(f"{src}: {rel}: {_client_error(e, src)}") from None
        except BotoCoreError as e:  # a broken or stalled connection: continue from what arrived
            now = part.stat().st_size if part.exists() else 0
            stalls = 0 if now > have else stalls + 1
            if stalls >= _MAX_STALLS:
                raise FetchError(f"{src}: {rel}: the download stopped at {now} of {size} bytes ({_first_line(e)}); "
                                 "run again to continue from there") from None
    if stop.is_set():
        return
    if problem := _check(client, src, key, rel, part, size, etag, sums):
        part.unlink()
        raise FetchError(f"{src}: {rel} is corrupt: {problem}; removed it (run again to download it anew)")
    os.replace(part, target)
    with guard:
        state[rel] = etag
        _write_state(dest, state)
    log(f"{src}: {rel} ({size / 2**20:.1f} MiB) checked")


def _write_state(dest: Path, state: dict) -> None:
    _write_json(dest / _STATE, state)


def _check(client, src: Source, key: str, rel: str, path: Path, size: int, etag: str, sums: dict) -> str | None:
    """Why ``path`` is not the object (None if it is, as far as the store lets us know): its size; then its sha256
    from SHA256SUMS if that lists it; else GCS's MD5 (x-goog-hash) or S3's ETag, which is the MD5 of the content
    for a single-part upload without KMS encryption, and the MD5 of the parts' MD5s for a multipart upload of
    equal parts (their size from the first part's HEAD)."""
    if (actual := path.stat().st_size) != size:
        return f"{actual} bytes, the bucket lists {size}"
    if rel in sums:
        digest = _digest(path, "sha256")
        return None if digest == sums[rel] else f"sha256 {digest[:16]}…, {SHA256SUMS} says {sums[rel][:16]}…"
    head = client.head_object(Bucket=src.where, Key=key)
    goog = head["ResponseMetadata"]["HTTPHeaders"].get("x-goog-hash")
    if goog is not None:  # GCS: an MD5 except for composite objects (those have CRC32C only: size checked)
        md5 = [base64.b64decode(h[4:]).hex() for h in goog.split(",") if h.strip().startswith("md5=")]
        if md5 and (digest := _digest(path, "md5")) != md5[0]:
            return f"md5 {digest}, the bucket's x-goog-hash says {md5[0]}"
        return None
    if head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm"):
        return None  # the ETag of an encrypted object is not a digest of its content
    tag = etag.strip('"')
    if re.fullmatch(r"[0-9a-f]{32}", tag):
        digest = _digest(path, "md5")
        return None if digest == tag else f"md5 {digest}, the bucket's ETag says {tag}"
    if m := re.fullmatch(r"([0-9a-f]{32})-(\d+)", tag):
        parts = int(m[2])
        part_size = client.head_object(Bucket=src.where, Key=key, PartNumber=1)["ContentLength"]
        if part_size <= 0 or -(-size // part_size) != parts:
            return None  # parts of different sizes: the ETag cannot be recomputed
        digest = f"{_multipart_md5(path, part_size)}-{parts}"
        return None if digest == tag else f"multipart md5 {digest}, the bucket's ETag says {tag}"
    return None


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _multipart_md5(path: Path, part_size: int) -> str:
    """S3's ETag of a multipart upload: the MD5 of the concatenated binary MD5s of its parts."""
    digests = hashlib.md5()
    with open(path, "rb") as f:
        while True:
            part, left = hashlib.md5(), part_size
            while left and (block := f.read(min(_CHUNK, left))):
                part.update(block)
                left -= len(block)
            if left == part_size:
                return digests.hexdigest()
            digests.update(part.digest())
