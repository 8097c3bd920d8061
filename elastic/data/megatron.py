"""A Megatron-LM ``.bin``/``.idx`` pair: the ``.bin`` is the token stream (documents end to
end, with the end-of-document token where its preprocessing appended one), the ``.idx``
its dtype and each sequence's length. Only the header and the lengths are read here; the
stream itself is read as a token file, window by window.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from checkpointing.storage import regular_file
from elastic.data.documents import DataError

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's DType codes, for the integer dtypes a token stream is written in.
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents


@dataclass(frozen=True)
class MegatronIndex:
    bin_url: str
    dtype: str
    sequences: int
    documents: int
    tokens: int


def pair_urls(path: str) -> tuple[str, str]:
    """The ``.bin`` and ``.idx`` of a pair named by its prefix or either file."""
    prefix = path[: -len(".bin")] if path.endswith(".bin") else path[: -len(".idx")] if path.endswith(".idx") else path
    return prefix + ".bin", prefix + ".idx"


def read_index(fs, path: str) -> MegatronIndex:
    """The pair's header and token count; ``DataError`` naming the file when it is not one."""
    bin_url, idx_url = pair_urls(path)
    try:
        header = fs.cat_file(regular_file(idx_url, fs), start=0, end=_HEADER.size)
    except OSError as error:
        raise DataError(f"{idx_url}: the Megatron index of {path} cannot be read ({error}); give the pair's prefix, "
                        "its .bin or its .idx") from None
    if len(header) < _HEADER.size or not header.startswith(MAGIC):
        raise DataError(f"{idx_url}: not a Megatron index (no MMIDIDX header)")
    _, version, code, sequences, documents = _HEADER.unpack(header)
    if version != 1 or code not in DTYPES:
        raise DataError(f"{idx_url}: Megatron index version {version}, dtype code {code}: only version 1 of "
                        f"integer tokens ({sorted(DTYPES)}) is read")
    # Weighed before it is read: a damaged header may claim more lengths than any file holds.
    held = max(0, (fs.size(idx_url) - _HEADER.size) // 4)
    if held < sequences:
        raise DataError(f"{idx_url}: the index is cut short ({held} of {sequences} sequence lengths)")
    lengths = np.frombuffer(fs.cat_file(idx_url, start=_HEADER.size, end=_HEADER.size + 4 * sequences), dtype="<i4")
    if len(lengths) and int(lengths.min()) < 0:
        sequence = int(np.argmax(lengths < 0))
        raise DataError(f"{idx_url}: sequence {sequence}'s length is {int(lengths[sequence])}, and no length is below "
                        "0: the index is damaged; write the pair again with Megatron's preprocessing")
    tokens = int(lengths.sum(dtype=np.int64))
    itemsize = np.dtype(DTYPES[code]).itemsize
    if fs.size(bin_url) != tokens * itemsize:
        raise DataError(f"{bin_url} holds {fs.size(bin_url)} bytes; its index counts {tokens} {DTYPES[code]} tokens "
                        f"({tokens * itemsize} bytes): the pair does not belong together")
    return MegatronIndex(bin_url, DTYPES[code], sequences, documents, tokens)
