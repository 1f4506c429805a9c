"""Uploading a directory (a run's ``final/`` model, a checkpoint) to an S3 or GCS prefix: the way back of
``engines.model.io.sources``, through the same client and the same credentials from the environment.

Every file goes to ``<prefix>/<its path under the directory>`` with its SHA-256 in the object's metadata; an object
already there with the same size and SHA-256 is not sent again (a retried upload continues), and each upload is read
back (its size and metadata) before it counts. A ``SHA256SUMS`` manifest (``sha256sum`` output) is written last: its
presence means the upload is complete, and ``fetch_model`` checks every file against it when the prefix is a model
source later.

``python -m engines.model.io.uploads DIR URI`` uploads from a shell (a run's launch.sh); ``--newest-checkpoint`` takes
the newest complete ``iter_*`` checkpoint of DIR, and ``--credentials-dir`` reads the credentials from a mounted
Secret's files (one variable per file), so that they are in this process's environment only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engines.model.io.sources import SHA256SUMS, Log, SourceError, _key_names, parse_source, store_client

SHA256_METADATA = "sha256"  # the object's x-amz-meta-sha256
CHECKPOINT_SEAL = "complete.json"  # written last into a checkpoint directory (rl.loop.checkpoint): it is complete
_ITER = re.compile(r"^iter_(\d+)$")
_THREADS = 8
_CHUNK = 8 << 20
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class UploadError(RuntimeError):
    """An upload that failed; the one-line message names the target and the file."""


@dataclass
class Uploaded:
    """What ``upload_directory`` did: files sent, files found there already, bytes sent."""

    sent: int
    kept: int
    bytes: int


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def upload_directory(local: str | Path, uri: str, log: Log | None = None) -> Uploaded:
    """Upload every file under ``local`` to ``uri`` (``s3://bucket/prefix`` or ``gs://bucket/prefix``), then its
    ``SHA256SUMS``; files already there (same size and SHA-256) are kept. Raises UploadError (one line) or
    SourceError (a bad ``uri``)."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    src, root = parse_source(uri), Path(local)
    if src.kind not in ("s3", "gs"):
        raise SourceError(f"{uri}: an upload goes to s3://bucket/prefix or gs://bucket/prefix")
    if not root.is_dir():
        raise UploadError(f"{root}: no such directory to upload")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    files = [rel for rel in files if rel != SHA256SUMS]
    if not files:
        raise UploadError(f"{root}: nothing to upload (no files)")
    client, prefix = store_client(src), f"{src.ref}/" if src.ref else ""
    sums: dict[str, str] = {}

    def one(rel: str) -> tuple[bool, int]:
        path, key = root / rel, prefix + rel
        digest, size = _sha256(path), path.stat().st_size
        sums[rel] = digest
        if _stored(client, src.where, key) == (size, digest):
            return False, 0
        client.upload_file(str(path), src.where, key, ExtraArgs={"Metadata": {SHA256_METADATA: digest}})
        if _stored(client, src.where, key) != (size, digest):
            raise UploadError(f"{uri}: {rel} reads back with another size or checksum than was sent; run again")
        return True, size

    try:
        with ThreadPoolExecutor(_THREADS) as pool:
            results = list(pool.map(one, files))
        manifest = "".join(f"{sums[rel]}  {rel}\n" for rel in files).encode()
        client.put_object(Bucket=src.where, Key=prefix + SHA256SUMS, Body=manifest)
    except NoCredentialsError:
        raise UploadError(f"{uri}: no credentials: set {_key_names(src)}") from None
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        raise UploadError(f"{uri}: {code}: {e.response.get('Error', {}).get('Message', '')}".rstrip(": ")) from None
    except (BotoCoreError, S3UploadFailedError) as e:  # the transfer manager's: "... An error occurred (Code) ..."
        raise UploadError(f"{uri}: {str(e).splitlines()[0][:300]}") from None
    done = Uploaded(sent=sum(s for s, _ in results), kept=sum(not s for s, _ in results),
                    bytes=sum(n for _, n in results))
    log(f"uploaded {root} to {uri}: {done.sent} file(s) sent ({done.bytes / 2**20:.1f} MiB), {done.kept} there "
        f"already, {SHA256SUMS} written")
    return done


def _stored(client, bucket: str, key: str) -> tuple[int, str] | None:
    """(size, SHA-256 from its metadata) of an object, or None where there is none."""
    from botocore.exceptions import ClientError

    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return head["ContentLength"], (head.get("Metadata") or {}).get(SHA256_METADATA, "")


def newest_checkpoint(checkpoints: str | Path) -> Path | None:
    """The newest complete checkpoint (``iter_N`` with its seal) under ``checkpoints``, or None."""
    root = Path(checkpoints)
    found = [(int(m[1]), p) for p in (root.iterdir() if root.is_dir() else ())
             if (m := _ITER.match(p.name)) and (p / CHECKPOINT_SEAL).is_file()]
    return max(found)[1] if found else None


def load_credentials(directory: str | Path) -> list[str]:
    """Put each file of ``directory`` (a mounted Secret: one key per file) into this process's environment as the
    variable of its name; returns the names set."""
    names = []
    for path in sorted(Path(directory).iterdir()):
        if path.is_file() and _ENV_NAME.match(path.name):
            os.environ[path.name] = path.read_text().strip()
            names.append(path.name)
    return names


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module); one line and exit 1 on failure."""
    parser = argparse.ArgumentParser(prog="python -m engines.model.io.uploads",
                                     description="upload a directory to s3://bucket/prefix or gs://bucket/prefix")
    parser.add_argument("directory")
    parser.add_argument("uri")
    parser.add_argument("--newest-checkpoint", action="store_true",
                        help="DIRECTORY holds iter_N checkpoints: upload the newest complete one to URI/iter_N")
    parser.add_argument("--credentials-dir", help="a mounted Secret whose files are the credentials' variables")
    args = parser.parse_args(argv)
    try:
        if args.credentials_dir:
            load_credentials(args.credentials_dir)
        directory, uri = Path(args.directory), args.uri.rstrip("/")
        if args.newest_checkpoint:
            newest = newest_checkpoint(directory)
            if newest is None:
                print(f"no complete checkpoint in {directory}: nothing to upload", file=sys.stderr)
                return 0
            directory, uri = newest, f"{uri}/{newest.name}"
        upload_directory(directory, uri)
    except (UploadError, SourceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
