"""The digest of a step's training data, and token ids as Redis stores them.

Contract: the manager (at the barrier, from what Redis holds) and the trainer (over what it
trained on) compute a step's :class:`~shared.protocol.Digest` with these functions alone, in
one format, so equal digests mean the same responses, each once, with the same tokens
(invariant 3). The digest is order-independent and covers ids, weight versions and tokens, a
multi-turn sample's turns (:func:`turns_json`) and an asynchronous response's per-token versions
(:func:`versions_text`): turns decide which tokens are trained and versions whether a token may
be trained at a step (the staleness bound) and how it is corrected, so two steps that differ only
in them trained on different data. A sample without turns or versions hashes as it did before
either existed.
"""

from __future__ import annotations

import hashlib

import msgspec

from shared.protocol import Digest, Sample
from shared.turns import Turn

_encoder = msgspec.json.Encoder()


# One response's part of a Digest: (prompt index, sample index, SHA-256 of the response's row,
# its token count). Kept by the manager for each response a completed group announced, so the
# barrier hashes those without reading them back (a done response never changes).
RowDigest = tuple[int, int, bytes, int]


def sample_digest(samples: list[Sample]) -> Digest:
    """Digest of a step's training data: order-independent, over ids, tokens and turns.

    Both the manager (at the barrier) and the trainer (over what it trained on) compute it in
    this one format, so equality means the same responses, each once, with the same tokens.
    """
    return rows_digest([row_digest(s.prompt_index, s.sample_index, s.weight_version,
                                   token_csv(s.prompt_token_ids), token_csv(s.response_token_ids),
                                   turns_json(s.turns), versions_text(s.token_versions))
                        for s in samples])


def versions_text(token_versions: list[list[int]]) -> str:
    """An asynchronous response's per-token versions as the digest hashes them: "start:version"
    per run of tokens, comma-separated ("" for a synchronous response, which hashes as before)."""
    return ",".join(f"{start}:{version}" for start, version in token_versions)


def turns_json(turns: list[Turn]) -> str:
    """A sample's turns as the digest hashes them: their JSON array, fields in declaration
    order ("" for none). The manager, once it stores turns, passes the same text to
    :func:`row_digest`."""
    return _encoder.encode(turns).decode() if turns else ""


def token_json(ids: list[int]) -> bytes:
    """Token ids as a JSON array, "[1,2,3]": around what Redis stores (:func:`token_csv`);
    the manager encodes each entry's ids once, and splices the array's inside into its commit."""
    return _encoder.encode(ids)


def token_csv(ids: list[int]) -> str:
    """Token ids as Redis stores them, "1,2,3": msgspec prints the list as JSON, in one C call
    rather than a join over str() (the manager does this for every entry it commits)."""
    return _encoder.encode(ids)[1:-1].decode()


def csv_digest(rows: list[tuple[int, int, int, str, str]]) -> Digest:
    """:func:`sample_digest` of single-turn (prompt index, sample index, weight version, prompt
    tokens, response tokens) rows whose tokens are comma-separated text, as Redis stores them."""
    return rows_digest([row_digest(*row) for row in rows])


def row_digest(p: int, s: int, version: int, prompt: str, response: str,
               turns: str = "", versions: str = "") -> RowDigest:
    """One row of :func:`csv_digest`: its hash covers the ids, the version, every token and,
    for a multi-turn sample, its :func:`turns_json`, for an asynchronous one its
    :func:`versions_text` (a synchronous single-turn row hashes as before)."""
    tail = (f"|{turns}" if turns else "") + (f"|v{versions}" if versions else "")
    body = f"{p}:{s}:{version}|{prompt}|{response}{tail};".encode()
    tokens = response.count(",") + 1 if response else 0
    return p, s, hashlib.sha256(body).digest(), tokens


def rows_digest(rows: list[RowDigest]) -> Digest:
    """The digest of a step from its rows' parts, whatever their order: the hash of their
    hashes in (prompt, sample) order, and the totals."""
    h = hashlib.sha256()
    for _, _, row_hash, _ in sorted(rows, key=lambda r: (r[0], r[1])):
        h.update(row_hash)
    return Digest(responses=len(rows), tokens=sum(r[3] for r in rows), sha256=h.hexdigest())
