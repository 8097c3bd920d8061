"""What a data file is, for a resume and for the data index's name: its size and the sha256 of
all its bytes, so that any byte changed anywhere in it changes it.

Reading a file whole costs (sha256 at about 1.5 GB/s on one idle core, from the page cache),
so each file is read once, and its digest kept with the run (``elastic.data.kept``: signed with the
run's key, if it has one) under the file's stamp: what the storage says of the file that
changes whenever its bytes do (a local file's modification and change times and inode, an
object's ETag, version or generation, a server's ETag or digest header). A later leg, or the
same process again, whose file has the same stamp takes the kept digest without reading
the file; any write gives it another stamp, and it is read again. A file whose storage
gives no such stamp (a server that sends no ETag) is read every time it is asked about.
"""

from __future__ import annotations

import json

import fsspec

from checkpointing.storage import file_digest, regular_file
from elastic.core.events import redact_credentials
from elastic.data.kept import KeptFiles

DIGESTS_NAME = "digests.json"

# The fields of a file's fsspec info that change whenever its bytes do: local files (ctime
# too, which no one can set back), S3, GCS, Azure, HTTP servers.
_STAMP_FIELDS = ("mtime", "created", "ino", "ETag", "etag", "VersionId", "version_id", "generation", "md5Hash",
                 "crc32c", "content_md5", "Content-MD5", "Digest")

# Digests taken in this process, by (file, stamp): the preflight and the run ask about the same files.
_TAKEN: dict[tuple[str, str], str] = {}


def stamp(info: dict) -> str | None:
    """What changes whenever the file's bytes do, from its fsspec info; None where the storage says nothing such."""
    found = {name: str(info[name]) for name in _STAMP_FIELDS if info.get(name) not in (None, "")}
    return json.dumps({"size": info.get("size"), **found}, sort_keys=True) if found else None


def content_identities(fs: fsspec.AbstractFileSystem, files: list[str], kept: KeptFiles | None) -> dict[str, str]:
    """Each of ``files`` (paths or URLs on ``fs``) by its size and the sha256 of its bytes."""
    stamps = {file: stamp(fs.info(regular_file(file, fs))) for file in files}  # a FIFO's digest would never end
    unknown = any(now is None or (file, now) not in _TAKEN for file, now in stamps.items())
    kept_before = _read(kept) if kept is not None and unknown else {}
    identities, taken = {}, {}
    for file, now in stamps.items():
        if (file, now) in _TAKEN:
            identities[file] = _TAKEN[file, now]
            continue
        record = kept_before.get(redact_credentials(file), {})
        if now is None or record.get("stamp") != now:
            size, sha256 = file_digest(fs, file)
            record = {"stamp": now, "identity": f"{size} bytes, sha256 {sha256}"}
            if now is not None:
                taken[redact_credentials(file)] = record
        identities[file] = record["identity"]
        if now is not None:
            _TAKEN[file, now] = record["identity"]
    if kept is not None and taken:
        kept.write(DIGESTS_NAME, json.dumps({**kept_before, **taken}, sort_keys=True, indent=1).encode())
    return identities


def _read(kept: KeptFiles) -> dict[str, dict]:
    """The digests an earlier leg kept, by redacted URL; empty when none are (or none trusted)."""
    payload = kept.read(DIGESTS_NAME)
    try:
        record = json.loads(payload) if payload is not None else {}
    except ValueError:  # not JSON: taken again, and written over
        return {}
    if not isinstance(record, dict):
        return {}
    return {file: entry for file, entry in record.items() if isinstance(entry, dict)
            and isinstance(entry.get("stamp"), str) and isinstance(entry.get("identity"), str)}


def data_identity(dataset) -> dict[str, str]:
    """Each file of a dataset read from files, and its size and digest; empty for the generated
    corpus (its settings say what it is) and for a dataset of the user's own. Redacted: it is
    stored in every manifest, and a presigned URL's signature is no part of what the data is."""
    identity = getattr(dataset, "identity", None)
    redacted: dict[str, list[str]] = {}
    for file, what in (identity() if callable(identity) else {}).items():
        # URLs that differ only in a secret (?key=a, ?key=b) share a name: it keeps each one's identity
        redacted.setdefault(redact_credentials(str(file)), []).append(redact_credentials(str(what)))
    return {file: "; ".join(identities) for file, identities in redacted.items()}

