"""Documents laid end to end and cut into samples: ``seq_len + 1`` tokens each, the same cut
on every rank and in every run over the same data and tokenizer.

The index (each document's token count, separator included) is built once, on the driver,
by ``scan``ning every file and tokenizing every document; it travels with the dataset to
the ranks, which read and tokenize only the documents a sample spans, and keep the tokens of
the last they read (``_CACHED_TOKEN_BYTES``): each of a long document's windows reads and
tokenizes it once on a rank while it stays there, not once a window. A document whose
tokens differ from the index's count when a rank reads it means the data or the tokenizer
changed under the run: the read fails rather than train on a shifted stream.

Conversations carry labels: a sample is then ``{"input_ids", "labels"}``, the labels
``IGNORE_INDEX`` outside the assistant's turns (``workers.train_step.sample_ids`` reads it).
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property

import numpy as np

from elastic.data.digests import content_identities
from elastic.data.documents import DataError, DocumentFile
from elastic.data.kept import KeptFiles
from elastic.data.tokenizing import IGNORE_INDEX, ByteTokens, HuggingFaceTokens
from elastic.data.windows import TokenWindows

log = logging.getLogger("elastic.data.packing")

# Indexes built in this process, by what they index (the files as they are now, the tokenizer,
# the column): the preflight and the run read the same data once.
_BUILT: dict[tuple, tuple[list[DocumentFile], list[np.ndarray]]] = {}
_KEPT_INDEXES = 4

# The tokens (and labels) of the documents a rank read last, least recently used dropped first,
# in the narrowest integers that hold them: a 64 MiB text's take 16 to 64 MiB.
_CACHED_TOKEN_BYTES = 256 * 2**20

Encoded = tuple[np.ndarray, np.ndarray | None]  # a document's tokens, and its labels if it has any


def _narrowed(values: np.ndarray) -> np.ndarray:
    """``values`` in the narrowest integer type that holds them all (a window widens them again)."""
    if not len(values):
        return values
    low, high = int(values.min()), int(values.max())
    for dtype in (np.uint8, np.uint16, np.int16, np.int32):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return values.astype(dtype)
    return values


class _TokenCache:
    """Documents' tokens by document, in at most ``budget`` bytes; a document larger than
    the whole budget is not kept."""

    def __init__(self, budget: int):
        self.budget, self.held = budget, 0
        self.documents: OrderedDict[int, Encoded] = OrderedDict()

    @staticmethod
    def _bytes(encoded: Encoded) -> int:
        return sum(part.nbytes for part in encoded if part is not None)

    def get(self, document: int) -> Encoded | None:
        if document in self.documents:
            self.documents.move_to_end(document)
        return self.documents.get(document)

    def put(self, document: int, encoded: Encoded) -> None:
        size = self._bytes(encoded)
        if size > self.budget:
            return
        self.documents[document] = encoded
        self.held += size
        while self.held > self.budget:
            self.held -= self._bytes(self.documents.popitem(last=False)[1])


class PackedDocuments(TokenWindows):
    """The documents of ``files``, tokenized by ``tokenizer`` and packed into windows. ``kept``:
    where a named run keeps its data index and its files' digests for its later legs."""

    _transient = ("_starts", "_tokens")

    def __init__(self, files: Sequence[DocumentFile], tokenizer: ByteTokens | HuggingFaceTokens, seq_len: int,
                 document_masking: bool = False, kept: KeptFiles | None = None):
        super().__init__(seq_len)
        self.files, self.tokenizer, self.document_masking = list(files), tokenizer, document_masking
        self.kept = kept
        self.lengths: list[np.ndarray] | None = None  # per file, each document's tokens: the index

    def build_index(self) -> None:
        """Count every document's tokens: the driver's one pass over the data, or the index an
        earlier leg of the run kept (named by a digest of what it indexes: the files' contents,
        the tokenizer, the columns), where it is kept in turn."""
        if self.lengths is not None:
            return
        key = (tuple(sorted(self.identity().items())), tuple((file.url, file.column, file.chat) for file in self.files))
        if key in _BUILT:
            self.files, self.lengths = _BUILT[key]
            return
        name = f"{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.npz"
        if self.kept is not None and self._restore(name):
            _BUILT[key] = (self.files, self.lengths)
            return
        began, lengths, trained, at = time.perf_counter(), [], [], 0
        for file in self.files:
            counts = []
            for batch in file.scan():
                for ids, labels in self.tokenizer.encode(batch, file.where, len(counts)):
                    if labels is not None:  # the windows it gives a target to train on
                        targets = at + np.flatnonzero(labels != IGNORE_INDEX)
                        trained.append(np.unique((targets[targets > 0] - 1) // self.seq_len))
                    counts.append(len(ids))
                    at += len(ids)
            if not counts:
                raise DataError(f"{file.url} holds no documents; remove it from the data or fill it")
            lengths.append(np.array(counts, dtype=np.int32))
        if trained:
            self._check_trained(np.unique(np.concatenate(trained)), at)
        self.lengths = lengths
        if self.kept is not None:
            self._keep(name)
        _BUILT[key] = (self.files, lengths)
        while len(_BUILT) > _KEPT_INDEXES:
            _BUILT.pop(next(iter(_BUILT)))
        log.info("indexed %d documents, %d tokens, in %d files in %.1f s", sum(map(len, lengths)),
                 int(sum(int(c.sum()) for c in lengths)), len(self.files), time.perf_counter() - began)

    def _check_trained(self, trained: np.ndarray, n_tokens: int) -> None:
        """Conversations' windows (their targets: a window's tokens after its first) without an
        assistant token, whose loss is 0 and gradient none: said, and refused if every window
        is one. ``trained``: the windows with one, in order."""
        windows = (n_tokens - 1) // self.seq_len
        untrained = windows - int(np.searchsorted(trained, windows))
        if not untrained or windows < 1:
            return
        data = self.files[0].url if len(self.files) == 1 else f"{len(self.files)} files from {self.files[0].url}"
        if untrained == windows:
            raise DataError(f"{data}: none of its {windows} windows of data.seq_len {self.seq_len} tokens holds an "
                            "assistant token to train on (the prompts fill them), so every step would train on "
                            "nothing; raise data.seq_len, or shorten the prompts")
        log.warning("%d of the %d windows of %s (data.seq_len %d tokens) hold no assistant token to train on (the "
                    "prompts fill them): they take their share of each step and train nothing; raise data.seq_len, "
                    "or shorten the prompts", untrained, windows, data, self.seq_len)

    def _keep(self, name: str) -> None:
        """Write the index beside the run's checkpoints."""
        arrays = {}
        for i, (file, lengths) in enumerate(zip(self.files, self.lengths)):
            arrays[f"{i}.lengths"] = lengths
            arrays.update({f"{i}.{field}": getattr(file, field) for field in file.indexed
                           if getattr(file, field) is not None})
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        self.kept.write(name, buffer.getvalue())

    def _restore(self, name: str) -> bool:
        """Whether an earlier leg's index was there (and signed, with the run's key), read
        (arrays only: nothing in it is unpickled). One that cannot be read (cut short by a full
        disk, damaged) is as if it were not there: made again from the data, and kept anew."""
        payload = self.kept.read(name)
        if payload is None:
            return False
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as kept:
                lengths = [kept[f"{i}.lengths"] for i in range(len(self.files))]
                fields = [{field: kept[f"{i}.{field}"] if f"{i}.{field}" in kept.files else None
                           for field in file.indexed} for i, file in enumerate(self.files)]
        except (zipfile.BadZipFile, ValueError, KeyError, EOFError) as error:
            log.warning("the data index %s cannot be read (%s): made again from the data", self.kept.url(name),
                        error)
            return False
        self.lengths = lengths
        for file, indexed in zip(self.files, fields):
            for field, value in indexed.items():
                setattr(file, field, value)
        log.info("the data index of %d files was read from %s", len(self.files), self.kept.url(name))
        return True

    @cached_property
    def _starts(self) -> tuple[np.ndarray, np.ndarray]:
        """Where each document starts in the stream (and the end), and where each file's first document is."""
        self.build_index()
        counts = np.concatenate(self.lengths)
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        first = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in self.lengths], out=first[1:])
        return starts, first

    @property
    def labelled(self) -> bool:
        return any(file.chat for file in self.files)

    def identity(self) -> dict[str, str]:
        identity = content_identities(self.files[0]._fs, [file.url for file in self.files], self.kept)
        return {**identity, "data.tokenizer": self.tokenizer.identity()}

    def n_tokens(self) -> int:
        return int(self._starts[0][-1])

    def _file_row(self, document: int) -> tuple[int, int]:
        """The file that holds ``document``, and its row there."""
        file_starts = self._starts[1]
        file = int(np.searchsorted(file_starts, document, side="right")) - 1
        return file, document - int(file_starts[file])

    def where(self, position: int) -> str:
        file, row = self._file_row(int(np.searchsorted(self._starts[0], position, side="right")) - 1)
        return f"token {position} of the data, in {self.files[file].where(row)}"

    def positions(self, start: int, count: int) -> np.ndarray:
        """Each of the stream's tokens ``[start, start + count)``'s place in its document,
        counted from the window's start for the document the window begins inside."""
        starts = self._starts[0]
        inside = starts[(starts > start) & (starts < start + count)] - start
        begun = np.zeros(count, dtype=np.int64)
        begun[inside] = inside
        return np.arange(count, dtype=np.int64) - np.maximum.accumulate(begun)

    @cached_property
    def _tokens(self) -> _TokenCache:
        return _TokenCache(_CACHED_TOKEN_BYTES)

    def _documents(self, first: int, stop: int) -> list[Encoded]:
        """Documents ``[first, stop)``'s tokens and labels: from the cache, or read and tokenized
        a run of neighbours at a time (a file's read takes a range), each checked against the
        index and kept."""
        documents = {doc: self._tokens.get(doc) for doc in range(first, stop)}
        file_starts = self._starts[1]
        doc = first
        while doc < stop:
            if documents[doc] is not None:
                doc += 1
                continue
            file, row = self._file_row(doc)
            run_stop = doc + 1
            while run_stop < min(stop, int(file_starts[file + 1])) and documents[run_stop] is None:
                run_stop += 1
            encoded = self.tokenizer.encode(self.files[file].read(row, row + run_stop - doc), self.files[file].where,
                                            row)
            for offset, (tokens, labels) in enumerate(encoded):
                if len(tokens) != self.lengths[file][row + offset]:
                    raise DataError(f"{self.files[file].where(row + offset)} tokenizes to {len(tokens)} tokens, the "
                                    f"index counted {self.lengths[file][row + offset]}: the data or the tokenizer "
                                    "changed under the run")
                documents[doc + offset] = (_narrowed(tokens), None if labels is None else _narrowed(labels))
                self._tokens.put(doc + offset, documents[doc + offset])
            doc = run_stop
        return [documents[doc] for doc in range(first, stop)]

    def _stream(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens ``[start, start + count)`` of the packed stream, and their labels if it has any."""
        starts = self._starts[0]
        end = start + count
        first = int(np.searchsorted(starts, start, side="right")) - 1
        stop = int(np.searchsorted(starts, end, side="left"))
        ids, labels = [], []
        for doc, (tokens, labelled) in zip(range(first, stop), self._documents(first, stop)):
            part = slice(max(start - int(starts[doc]), 0), end - int(starts[doc]))  # the window's share of it
            ids.append(tokens[part])
            labels.append((tokens if labelled is None else labelled)[part])
        stream = np.concatenate(ids).astype(np.int64)
        return stream, (np.concatenate(labels).astype(np.int64) if self.labelled else None)

    def read(self, start: int, count: int) -> np.ndarray:
        return self._stream(start, count)[0]

    def __getitem__(self, index: int):
        if not (self.labelled or self.document_masking):
            return super().__getitem__(index)
        self.check_index(index)
        start = index * self.seq_len
        tokens, labels = self._stream(start, self.seq_len + 1)
        import torch  # here, not at the top: a config refused for its data never loads torch

        sample = {"input_ids": torch.from_numpy(self.checked(index, tokens))}
        if labels is not None:
            sample["labels"] = torch.from_numpy(labels)
        if self.document_masking:
            sample["positions"] = torch.from_numpy(self.positions(start, self.seq_len + 1))
        return sample
