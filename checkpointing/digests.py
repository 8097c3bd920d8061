"""Size and sha256 of checkpoint files, taken from the bytes on their way to storage.

Hashing as the bytes pass costs no second read of what was just written (on S3, no second
download). DCP writes each file front to back and never seeks back, so the running digest
is the digest of the file.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

# A large write (a tensor) is hashed on a helper thread while the write itself runs: both
# release the GIL, so given a spare core the digest adds no time to the upload.
OVERLAP_BYTES = 1 << 20
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-digest")


class DigestingFileSystem:
    """Wraps a DCP storage writer's ``fs``; records ``{file name: (size, sha256)}`` of each
    file written through it, following renames (DCP writes ``.metadata`` as a temporary file
    and renames it)."""

    def __init__(self, inner):
        self.inner = inner
        self.files: dict[str, tuple[int, str]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        digesting = None
        with self.inner.create_stream(path, mode) as stream:
            if "w" in mode:
                stream = digesting = _DigestingStream(stream)
            yield stream
        if digesting is not None:
            self.files[_name(path)] = digesting.digest()

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)
        if _name(path) in self.files:
            self.files[_name(new_path)] = self.files.pop(_name(path))

    def rm_file(self, path) -> None:
        self.inner.rm_file(path)
        self.files.pop(_name(path), None)


class _DigestingStream:
    def __init__(self, inner):
        self.inner = inner
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.size += view.nbytes
        if view.nbytes < OVERLAP_BYTES:
            self.sha256.update(view)
            return self.inner.write(data)
        hashing = _HASHER.submit(self.sha256.update, view)
        try:
            return self.inner.write(data)
        finally:
            hashing.result()

    def seekable(self) -> bool:
        return False

    def seek(self, *_args):
        raise io.UnsupportedOperation("a digested stream is written front to back")

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def digest(self) -> tuple[int, str]:
        return self.size, self.sha256.hexdigest()


def _name(path) -> str:
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]
