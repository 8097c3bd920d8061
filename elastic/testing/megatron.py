"""A Megatron-LM ``.bin``/``.idx`` pair as its indexed dataset builder writes it (version 1):
for tests and benchmarks that read one."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from elastic.data.megatron import DTYPES, MAGIC


def write_megatron_pair(prefix: Path, sequences: list, dtype: str = "uint16") -> None:
    """``prefix``.bin holding ``sequences`` end to end in ``dtype``, and ``prefix``.idx."""
    code = next(code for code, name in DTYPES.items() if name == dtype)
    item = np.dtype(dtype).newbyteorder("<")
    prefix.with_name(prefix.name + ".bin").write_bytes(np.concatenate(sequences).astype(item).tobytes())
    lengths = np.array([len(sequence) for sequence in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * item.itemsize]).astype("<i8")
    header = MAGIC + struct.pack("<QBQQ", 1, code, len(sequences), len(sequences) + 1)
    documents = np.arange(len(sequences) + 1, dtype="<i8")
    prefix.with_name(prefix.name + ".idx").write_bytes(header + lengths.tobytes() + pointers.tobytes()
                                                       + documents.tobytes())
