"""The run's signing key: ``ELASTIC_CHECKPOINT_KEY`` in the driver's environment, never
stored with what it signs. With it, what the run keeps in its storage carries an HMAC-SHA256:
its manifests (``checkpointing.manifest``) and what it keeps of its data between legs
(``elastic.data.kept``). Whoever can write the bucket but lacks the key can then change none
of it unnoticed."""

from __future__ import annotations

import hashlib
import hmac
import os

SIGNING_KEY_ENV = "ELASTIC_CHECKPOINT_KEY"


def signing_key_from_environment() -> bytes | None:
    key = os.environ.get(SIGNING_KEY_ENV, "")
    return key.encode() if key else None


def named_signature(key: bytes, name: str, payload: bytes) -> str:
    """The HMAC-SHA256 of ``payload`` bound to ``name``: a file signed under one name does not
    verify under another (an index of other data moved over this one's)."""
    named = name.encode()
    return hmac.new(key, len(named).to_bytes(4, "big") + named + payload, hashlib.sha256).hexdigest()
