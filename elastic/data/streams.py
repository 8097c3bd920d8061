"""Token streams read by byte range: text files, a byte a token, and token files, a flat
binary of token ids with no header (nanoGPT's; ``elastic prepare`` writes one, and a
Megatron pair's ``.bin`` is one). ``len`` takes only the files' sizes and a sample reads only
its own window: a local file by seek or memory map, any other URL by one ranged request.
"""

from __future__ import annotations

from functools import cached_property

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from checkpointing.storage import regular_file
from elastic.data.digests import content_identities
from elastic.data.kept import KeptFiles
from elastic.data.megatron import DTYPES
from elastic.data.windows import TokenWindows

_OPEN_FILES = 8  # local file handles a TextFiles keeps open, least recently used closed first

# Little-endian whatever the host: a token file is written on one machine and read on others.
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# What a token file may be read as: the above, and the integer dtypes of Megatron's .bin files.
STREAM_DTYPES = {**TOKEN_DTYPES, **{name: np.dtype(name).newbyteorder("<") for name in DTYPES.values()}}

# Windows a TokenFile reads through one memory map before it maps the file afresh. Each read
# maps its window's pages, and the kernel's fault-around maps neighbours (64 KiB a fault by
# default); unmapping drops them from the process's RSS (they stay in the page cache), so a
# rank that reads a file far larger than memory stays at about this many times 64 KiB.
_WINDOWS_PER_MAP = 256

# Printable ASCII and whitespace: what a text file is made of.
_TEXT_BYTES = bytes(range(32, 127)) + b"\t\n\r"


def list_files(path: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files a path, glob or fsspec URL names, in a fixed order: a directory's own files,
    but those named ``.*`` or ``_*`` (as pyarrow's datasets skip them: ``_SUCCESS``, ``.crc``
    and the like are no data); raises OSError naming the path."""
    try:
        fs, _, paths = fsspec.get_fs_token_paths(path, storage_options=storage_options)
    except Exception as error:  # fsspec raises many kinds for a bad URL
        raise OSError(f"{path!r} cannot be opened: {error}") from None
    files = []
    for found in paths:
        if fs.isfile(found):
            files.append(found)
        elif fs.isdir(found):
            files += sorted(entry["name"] for entry in fs.ls(found, detail=True) if entry["type"] == "file"
                            and not entry["name"].rstrip("/").rsplit("/", 1)[-1].startswith((".", "_")))
    if not files:
        raise OSError(f"{path!r} matches no readable file")
    return fs, files


def resolve_text_files(path: str, storage_options: dict | None = None) -> list[str]:
    """Expand a path, glob or fsspec URL into readable files; raises OSError naming the path."""
    fs, files = list_files(path, storage_options)
    for file in files:
        try:
            with fs.open(file, "rb") as handle:
                handle.read(1)
        except OSError as error:
            raise OSError(f"{path!r}: {file} is unreadable ({error})") from None
    return [fs.unstrip_protocol(p) for p in files]


def read_range(fs: fsspec.AbstractFileSystem, file: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a remote file by one ranged request; raises OSError when the
    server answers with more (it ignored the range, and would send the whole file a sample)."""
    data = fs.cat_file(file, start=start, end=end)  # by keyword: s3fs takes version_id second
    if len(data) > end - start:
        raise OSError(f"{fs.unstrip_protocol(file)} ignored a byte-range request (asked for {end - start} bytes, "
                      f"got {len(data)}); serve it from storage that answers Range requests, or copy it locally")
    return data


class TextFiles(TokenWindows):
    """Files joined by ``b"\\n"``, a byte a token, read by byte range: ``len`` needs only the file sizes.

    The layout (files and where each starts in the stream) is taken once, on the driver's
    ``len``, and travels in the pickle, so every rank reads the very stream the driver counted.
    Local files are read by seek and read through a few cached handles; other URLs by one
    ranged request per file a window touches (``fs.cat_file``), opened with
    ``storage_options`` (fsspec's keyword arguments: an S3 endpoint, retries). ``kept``: where
    a named run keeps its files' digests.
    """

    _transient = ("_fs", "_handles")

    def __init__(self, path: str, seq_len: int, storage_options: dict | None = None, kept: KeptFiles | None = None):
        super().__init__(seq_len)
        self.path = path
        self.storage_options = storage_options or {}
        self.kept = kept

    @cached_property
    def _layout(self) -> tuple[list[str], np.ndarray]:
        """The files, stripped of protocol, and ``starts``: file ``i`` holds stream bytes
        ``[starts[i], starts[i + 1] - 1)``, followed by its separator; ``starts[-1]`` is the
        stream size + 1 (the last file has no separator)."""
        fs, files = list_files(self.path, self.storage_options)
        sizes = fs.sizes(files)
        return files, np.cumsum([0] + [size + 1 for size in sizes], dtype=np.int64)

    @cached_property
    def _fs(self) -> fsspec.AbstractFileSystem:
        return url_to_fs(self.path, **self.storage_options)[0]

    def identity(self) -> dict[str, str]:
        return content_identities(self._fs, self._layout[0], self.kept)

    @cached_property
    def _handles(self) -> dict:
        return {}

    def n_tokens(self) -> int:
        return int(self._layout[1][-1]) - 1

    def where(self, position: int) -> str:
        files, starts = self._layout
        i = int(np.searchsorted(starts, position, side="right")) - 1
        return f"token {position} of the data, byte {position - int(starts[i])} of {files[i]}"

    def read(self, start: int, count: int) -> np.ndarray:
        files, starts = self._layout
        end, chunks = start + count, []
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while start < end:
            separator = int(starts[i + 1]) - 1
            if start < separator:
                stop = min(end, separator)
                chunks.append(self._read_file(files[i], start - int(starts[i]), stop - int(starts[i])))
                start = stop
            else:
                chunks.append(b"\n")
                start, i = start + 1, i + 1
        return np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def _read_file(self, file: str, start: int, end: int) -> bytes:
        if not isinstance(self._fs, LocalFileSystem):
            return read_range(self._fs, file, start, end)
        handle = self._handles.pop(file, None) or open(file, "rb")
        self._handles[file] = handle  # most recently used last
        if len(self._handles) > _OPEN_FILES:
            self._handles.pop(next(iter(self._handles))).close()
        handle.seek(start)
        return handle.read(end - start)


class TokenFile(TokenWindows):
    """A flat binary of ``dtype`` tokens (``"uint16"`` or ``"uint32"``, little-endian, no header).

    ``len`` needs one ``fs.size``, taken once on the driver and carried in the pickle. A local
    file is read through ``np.memmap``, mapped lazily on the reading process and mapped afresh
    every ``_WINDOWS_PER_MAP`` windows; any other URL by one ranged request a window
    (``fs.cat_file``), opened with ``storage_options``. ``kept``: where a named run keeps the
    file's digest.
    """

    _transient = ("_filesystem", "_map", "_map_reads")
    _map_reads = 0  # windows read through the current map

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", storage_options: dict | None = None,
                 kept: KeptFiles | None = None):
        super().__init__(seq_len)
        if dtype not in STREAM_DTYPES:
            raise ValueError(f"token dtype {dtype!r} is not one of {sorted(STREAM_DTYPES)}")
        self.path, self.dtype = path, dtype
        self.storage_options = storage_options or {}
        self.kept = kept

    @cached_property
    def _filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, file = url_to_fs(self.path, **self.storage_options)
        return fs, regular_file(file, fs)

    @cached_property
    def _n_tokens(self) -> int:
        fs, file = self._filesystem
        size, itemsize = fs.size(file), STREAM_DTYPES[self.dtype].itemsize
        if size % itemsize:
            raise ValueError(
                f"{self.path!r} holds {size} bytes, not a whole number of {self.dtype} tokens ({itemsize} bytes "
                "each); set data.token_dtype to the dtype the file was written with"
            )
        return size // itemsize

    def identity(self) -> dict[str, str]:
        fs, file = self._filesystem
        return content_identities(fs, [file], self.kept)

    def looks_like_text(self, sample_bytes: int = 65_536) -> bool:
        """Whether the file's first bytes are text (printable ASCII and whitespace, no NUL),
        which token ids almost never are: a text file named ``*.bin``."""
        fs, file = self._filesystem
        head = read_range(fs, file, 0, min(sample_bytes, fs.size(file)))
        other = len(head.translate(None, _TEXT_BYTES))  # the bytes that are not text
        return bool(head) and b"\0" not in head and other <= 0.05 * len(head)

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self._filesystem[1], dtype=STREAM_DTYPES[self.dtype], mode="r", shape=(self._n_tokens,))

    def n_tokens(self) -> int:
        return self._n_tokens

    def where(self, position: int) -> str:
        return f"token {position} of {self.path}"

    def read(self, start: int, count: int) -> np.ndarray:
        fs, file = self._filesystem
        dtype = STREAM_DTYPES[self.dtype]
        if not isinstance(fs, LocalFileSystem):
            data = read_range(fs, file, start * dtype.itemsize, (start + count) * dtype.itemsize)
            return np.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize)
        if self._map_reads == _WINDOWS_PER_MAP:
            self.__dict__.pop("_map")
            self._map_reads = 0
        window = np.array(self._map[start : start + count])  # a copy: the window outlives the map
        self._map_reads += 1
        return window
