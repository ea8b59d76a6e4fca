"""The MAC of a frame entry: what proves an entry was sent by the holder of its lease.

Contract: the manager derives a key per lease (request, epoch) from a secret of its own and
hands it to the instance it leases to, on that instance's own subject; every
:class:`~shared.protocol.FrameEntry` the instance sends carries :func:`entry_mac` under it, and
the manager checks it before any commit. Knowing a request id and epoch is not enough to
produce it. Keyed BLAKE2b (a MAC by design, no inner and outer hash) rather than HMAC-SHA256:
the manager checks every entry of every frame.
"""

from __future__ import annotations

import hashlib

import msgspec

from shared.protocol import FrameEntry

MAC_KEY_MAX = 64  # bytes of a BLAKE2b key (a lease key is 32)
_encoder = msgspec.json.Encoder()


def entry_mac(lease_key: str, instance_id: str, entry: FrameEntry) -> str:
    """Keyed BLAKE2b-256 under the lease key (hex) over everything a commit of ``entry``
    depends on (the sending instance included), canonically encoded: its other fields as a
    JSON array (field order fixed, no whitespace), then the packed ids as they travel (the
    array ends where they begin, so no two entries share a body). Knowing a request id and
    epoch is not enough to produce it: the key is derived from a secret of the manager's."""
    try:
        key = bytes.fromhex(lease_key)
    except ValueError:
        key = b""
    return entry_digest(key if len(key) <= MAC_KEY_MAX else b"", instance_id, entry).hex()


def entry_digest(key: bytes, instance_id: str, entry: FrameEntry) -> bytes:
    """:func:`entry_mac` as raw bytes under a raw key (at most MAC_KEY_MAX bytes)."""
    fields: list[object] = [entry.request_id, instance_id, entry.epoch, entry.weight_version,
                            entry.offset, entry.final, entry.finish_reason]
    if entry.logprobs:  # their length in the head: where the ids end and they begin is fixed
        fields.append(len(entry.logprobs))
    head = _encoder.encode(fields)
    return hashlib.blake2b(head + entry.tokens + entry.logprobs, key=key,
                           digest_size=32).digest()
