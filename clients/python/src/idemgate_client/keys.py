"""Idempotency keys minted from the identity of an attempt.

A retry must send the key its first attempt sent, so the key is derived,
not drawn at random: from who asks (the tenant), which run of the agent or
job, which step of that run, and which tool the step calls. Never from the
model's ``tool_call_id`` (a model that re-plans gives the same call a new
one), a timestamp or a retry counter (each retry would be a new key), and
never from personal data (the key is sent to the server, and logged as a
hash prefix).

The encoding is the same in every idemgate client (see ``clients/README.md``):
SHA-256 over ``idemgate.derive_key.v1`` followed by each field's name and
value, each as a 4-byte big-endian length and its UTF-8 bytes, in the order
tenant, run, step, tool; the first 16 bytes of the digest, with the version
and variant bits of a UUIDv8 (RFC 9562), in the hyphenated form. So the key
passes a server that takes UUID keys only.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["derive_key", "DERIVE_KEY_TAG"]

DERIVE_KEY_TAG = b"idemgate.derive_key.v1"
"""What the digest starts with: the encoding's name and version."""

_FIELDS = ("tenant", "run", "step", "tool")


def _part(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def derive_key(*, tenant: str, run: str, step: str | int, tool: str) -> str:
    """The idempotency key of one attempt: the same for every retry of it.

    ``step`` may be an ``int`` (its decimal form is used). Every field must
    be non-empty: an empty run or step id is a bug upstream, and would make
    unrelated attempts share a key.
    """
    values = {"tenant": tenant, "run": run, "step": step, "tool": tool}
    digest = hashlib.sha256(DERIVE_KEY_TAG)
    for name in _FIELDS:
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(f"derive_key: {name} must be a str (step may be an int)")
        if isinstance(value, int):
            if name != "step":
                raise TypeError(f"derive_key: {name} must be a str")
            value = str(value)
        if value == "":
            raise ValueError(f"derive_key: {name} is empty")
        digest.update(_part(name.encode()))
        digest.update(_part(value.encode("utf-8")))
    raw = bytearray(digest.digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x80  # version 8: a custom, name-based UUID
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 9562 variant
    return str(uuid.UUID(bytes=bytes(raw)))
