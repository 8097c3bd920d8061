"""Storage URLs: a local directory or any fsspec URL (``s3://bucket/prefix`` through s3fs).

S3 settings come from the config (endpoint, region) on top of the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, credentials and profiles), which boto reads itself:
credentials never pass through this code, so they cannot end up in a log or a summary.
Transient S3 errors are retried with exponential backoff by s3fs and botocore's
``standard`` retry mode.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import fsspec

HASH_CHUNK = 8 << 20
# Bytes at each end of a file that its fingerprint hashes.
FINGERPRINT_BYTES = 65_536


def join_url(*parts: str) -> str:
    return "/".join([parts[0].rstrip("/"), *(p.strip("/") for p in parts[1:])])


def refuse_credentials(url: str) -> str:
    """``url``, unless it holds credentials (``scheme://user:secret@...``): ValueError. A client
    would take them for a host or bucket's name and print them in its error."""
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError("a URL with credentials in it (***@); give them through the environment "
                         "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), never in the URL")
    return url


def absolute_url(url: str) -> str:
    """A local path made absolute where it is given: the driver and the rank processes run
    in different working directories, and must all name the same files."""
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def check_writable(url: str) -> None:
    """Raise ValueError naming the fix when runs cannot be kept at ``url``: a protocol that
    ``check_protocol`` refuses, or a local directory that cannot be created or written."""
    check_protocol(url)
    if "://" in url:  # a remote store is not probed: that needs its credentials and a round trip
        return
    path = os.path.abspath(url)
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ValueError(f"{existing} is a file, not a directory; give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"cannot create or write {path}: {existing} is not writable; give a directory this process can write"
        )
    # Permissions do not tell everything (/proc and /sys refuse root too; a full disk takes no
    # byte): a byte written where the run would start writing does. Nothing is left behind.
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-probe-") as probe:
            probe.write(b"\0")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise ValueError(f"cannot create or write {path}: {error.strerror or error}; give a directory this "
                         "process can write") from None


def check_protocol(url: str) -> None:
    """Raise ValueError naming the fix when fsspec does not know a protocol of ``url`` or lacks
    the package for it; a local path has none."""
    if "://" not in url:
        return
    import fsspec

    for protocol in url.split("://", 1)[0].split("::"):  # a chained URL: cache::s3://...
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as error:
            raise ValueError(
                f"protocol {protocol!r} needs a package that is not installed ({error}); install it"
            ) from None
        except ValueError:
            raise ValueError(
                f"unknown protocol {protocol!r}; give a local path or an fsspec URL such as s3://bucket/prefix"
            ) from None


def in_ray_runtime_directory(url: str) -> bool:
    """Whether a local ``url`` lies in Ray's runtime-env directory of a session
    (``<Ray's temp dir>/session_*/runtime_resources/``), where ``ray job submit --working-dir``
    unpacks the job's files and starts its driver. Ray deletes it with the session, and a job
    submitted again gets a package of its own there: nothing kept in it is found again."""
    if "://" in url:
        return False
    parts = Path(url).parts
    return any(parent.startswith("session_") and part == "runtime_resources" for parent, part in zip(parts, parts[1:]))


def _nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists: where creating it would start."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


@dataclass(frozen=True)
class StorageOptions:
    """What a process needs to open the run's storage; plain data, so it travels to actors."""

    endpoint_url: str | None = None
    region: str | None = None
    max_attempts: int = 4

    def for_url(self, url: str) -> dict:
        if not is_s3(url):
            return {}
        client_kwargs = {}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        if self.region:
            client_kwargs["region_name"] = self.region
        retries = {"max_attempts": self.max_attempts, "mode": "standard"}
        return {
            "client_kwargs": client_kwargs,
            "config_kwargs": {"retries": retries, "connect_timeout": 5, "read_timeout": 60},
        }

    def writer_options(self, url: str) -> dict:
        """DCP ``FsspecWriter`` arguments for ``url``."""
        # fsync makes a local checkpoint durable before it is committed. S3 has no file to
        # sync, and DCP would fall back to os.sync(): flushing every disk of the node, per file.
        return {"sync_files": not is_s3(url), **self.for_url(url)}

    def filesystem(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        import fsspec  # here, so the options stay plain data the driver's pure core can carry

        fs, path = fsspec.core.url_to_fs(url, **self.for_url(url))
        # s3fs caches listings; checkpoints appear and vanish under our feet.
        fs.invalidate_cache()
        return fs, path


def regular_file(path: str, fs: fsspec.AbstractFileSystem | None = None) -> str:
    """``path`` on ``fs`` (None: the local disk), once it is known to be a regular file or a
    link to one; else FileNotFoundError or OSError naming it. Every file read from a user's
    path is checked here before it is opened: a FIFO blocks its reader until some writer
    comes, and a device such as ``/dev/zero`` never ends, so a read of it fills memory."""
    if fs is None:
        from fsspec.implementations.local import LocalFileSystem

        fs = LocalFileSystem()
    if fs.info(path)["type"] != "file":  # a path that is not there: its FileNotFoundError, as an open's
        raise OSError(f"{path} is not a regular file (a directory, FIFO or device?)")
    return path


def file_digest(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    """Size and sha256 of a stored file, read back from storage (so it checks what landed)."""
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def fingerprint(fs: fsspec.AbstractFileSystem, file: str) -> str:
    """What a file is, cheaply: its size and its ETag where the store keeps one (S3), else a
    sha256 of its first and last 64 KiB (all of a file up to 128 KiB)."""
    info = fs.info(regular_file(file, fs))
    size = int(info["size"])
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"{size} bytes, etag {str(etag).strip(chr(34))}"
    ends = fs.cat_file(file, start=0, end=min(size, FINGERPRINT_BYTES))
    if size > FINGERPRINT_BYTES:
        ends += fs.cat_file(file, start=max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES), end=size)
    return f"{size} bytes, sha256 of the ends {hashlib.sha256(ends).hexdigest()[:16]}"
