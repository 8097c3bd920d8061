"""What a named run keeps of its data for its later legs, in its own storage
(``<run>/data/index/``): the data index (``elastic.data.packing``) and the data files' digests
(``elastic.data.digests``).

Each file is written whole or not at all (aside, then moved). With ``ELASTIC_CHECKPOINT_KEY``
set, each carries its HMAC-SHA256, bound to its name, in ``<name>.hmac`` beside it, and one
without a valid one is not read: it is made again from the data, as if it were not there.
Without the key the storage is trusted, as it is for the checkpoints' manifests."""

from __future__ import annotations

import hmac
import logging

from fsspec.core import url_to_fs

from checkpointing.signing import SIGNING_KEY_ENV, named_signature, signing_key_from_environment

log = logging.getLogger("elastic.data.kept")


class KeptFiles:
    """The files of ``directory``, read and written with ``storage_options`` (fsspec's
    keyword arguments: an S3 endpoint, retries), on the driver. Plain data: a dataset that
    holds it pickles small, and the signing key is read from the environment when it is
    used, never held."""

    def __init__(self, directory: str, storage_options: dict | None = None):
        self.directory = directory.rstrip("/")
        self.storage_options = storage_options or {}

    def url(self, name: str) -> str:
        return f"{self.directory}/{name}"

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when it is not there, or not signed with the run's key."""
        fs, path = url_to_fs(self.url(name), **self.storage_options)
        if not fs.exists(path):
            return None
        payload = fs.cat_file(path)
        key = signing_key_from_environment()
        if key is None:
            return payload
        try:
            signature = fs.cat_file(path + ".hmac").decode()
        except FileNotFoundError:
            signature = ""
        if not hmac.compare_digest(signature, named_signature(key, name, payload)):
            log.warning("%s is not signed with %s, or changed since it was: not trusted, made again from the data",
                        self.url(name), SIGNING_KEY_ENV)
            return None
        return payload

    def write(self, name: str, payload: bytes) -> None:
        """Keep the file; where it cannot be, a later leg makes it again from the data (the run
        itself may still write its storage, or fail there on its own terms)."""
        try:
            fs, path = url_to_fs(self.url(name), **self.storage_options)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            key = signing_key_from_environment()
            if key is not None:
                _write_whole(fs, path + ".hmac", named_signature(key, name, payload).encode())
            _write_whole(fs, path, payload)
        except OSError as error:
            log.warning("%s could not be kept (%s): a later leg will make it again from the data", self.url(name),
                        error)


def _write_whole(fs, path: str, payload: bytes) -> None:
    fs.pipe(path + ".writing", payload)
    fs.mv(path + ".writing", path)
