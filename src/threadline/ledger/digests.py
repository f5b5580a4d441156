"""Exact provider requests by digest, with a record of constant size.

stitchkit's ``provider/request`` lists the digest of every message sent, so a conversation's ledger grows
with the square of its length. threadline names the *settled prefix* of a request (the projection of
settled history, which only grows between requests) by a chained digest and a count, and lists only the
digests of the *live tail* (this run's inputs and draft). Each request record therefore has the same size
at 40 messages as at 2,000, and the journal stays linear; a request is still checkable by replaying the
bodies: :func:`chain` over the ``provider/message`` bodies in order gives the prefix digest, and each
request also names the digests ``added`` to an earlier request's prefix, so the journal alone orders every
body (:func:`check_provider_requests`).

A message body is the pydantic-ai ``ModelMessage`` as JSON without what is never sent to a provider
(the message's and its parts' timestamps, usage, run ids, ``None`` fields), binary content replaced by
``{binary, sha256, bytes}``. Its digest is the SHA-256 of its canonical JSON (:func:`canonical`: keys sorted,
no insignificant whitespace, UTF-8, orjson's number spelling). Not RFC 8785, which the archive uses: a digest
is computed for every message of every request, and orjson is two orders of magnitude cheaper than a
pure-Python RFC 8785 encoder; both are deterministic, and the journal's checker uses this one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from datetime import date, datetime
from typing import Any

import orjson
from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage

__all__ = [
    "EMPTY_CHAIN",
    "PrefixDigests",
    "chain",
    "check_provider_requests",
    "instructions_digest",
    "message_body",
    "message_digest",
]

EMPTY_CHAIN = hashlib.sha256(b"").hexdigest()
"""The chained digest of an empty prefix."""

_NOT_SENT = frozenset(
    {"timestamp", "usage", "run_id", "conversation_id", "state", "metadata", "history_digest", "failed_attempts"}
)
"""pydantic-ai bookkeeping no provider receives: left out of a body, so its digest names the content."""


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None and k not in _NOT_SENT}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return {"binary": True, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if isinstance(value, datetime | date):
        return value.isoformat()
    return value


def _binary(item: Any) -> Any:
    """A serialized ``BinaryContent`` as what a body records of it (its digest and size); anything else
    as it is."""
    if type(item) is dict and item.get("kind") == "binary" and "media_type" in item and type(item.get("data")) is str:
        try:
            data = base64.b64decode(item["data"], validate=True)
        except binascii.Error:  # a tool's own data that happens to look like it
            return item
        return {"binary": True, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return item


def _part(part: dict[str, Any]) -> dict[str, Any]:
    content = part.get("content")
    if type(content) is list:
        part["content"] = [_binary(item) for item in content]
    elif type(content) is dict:
        part["content"] = _binary(content)
    return part


_MESSAGE = TypeAdapter(ModelMessage)
_EXCLUDE = {**dict.fromkeys(_NOT_SENT, True), "parts": {"__all__": dict.fromkeys(_NOT_SENT, True)}}
"""What a body leaves out, told to the serializer: what is never written costs nothing (a response's usage
and timestamps were most of its serialization)."""


def message_body(message: ModelMessage) -> Any:
    """``message`` as the JSON value a ``provider/message`` record holds: pydantic-ai's JSON form of it
    without its ``None`` fields, and without the bookkeeping of the message and of each part
    (:data:`_NOT_SENT`); what a part carries (text, arguments, a tool's result) is kept exactly, binary
    content as its digest and size."""
    body = _MESSAGE.dump_python(message, mode="json", exclude_none=True, exclude=_EXCLUDE)
    body["parts"] = [_part(p) for p in body.get("parts", ())]
    return body


_CANONICAL = json.JSONEncoder(ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":"))


def canonical(value: Any) -> bytes:
    """``value`` (JSON data) as the canonical bytes a digest is taken of: orjson with sorted keys (a float
    that is not finite is written ``null``, as the stored body has it). What orjson cannot write (a lone
    surrogate, which a provider's message may carry; an integer beyond 64 bits) is written by the standard
    library's encoder instead, the surrogate kept as its bytes: the same value always takes the same path."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return _CANONICAL.encode(value).encode("utf-8", "surrogatepass")


def message_digest(body: Any) -> str:
    """The SHA-256 (hex) of a body's canonical bytes (:func:`canonical`)."""
    return hashlib.sha256(canonical(body)).hexdigest()


def chain(previous: str, sha256: str) -> str:
    """The prefix digest after appending one message digest: ``sha256(previous + sha256)``."""
    return hashlib.sha256((previous + sha256).encode()).hexdigest()


def chain_all(shas: Iterable[str], start: str = EMPTY_CHAIN) -> str:
    out = start
    for sha in shas:
        out = chain(out, sha)
    return out


def instructions_digest(instructions: Any) -> str:
    """SHA-256 of the effective instructions: their text, or their canonical JSON when not text."""
    if isinstance(instructions, str):
        return hashlib.sha256(instructions.encode()).hexdigest()
    return hashlib.sha256(canonical(_clean(instructions))).hexdigest()


class PrefixDigests:
    """The digests of one settled-prefix projection, kept as it grows (a projection only appends, or
    replaces its last message when a later one merges into it), plus the prefix this process last
    recorded in the conversation's ledger. One per conversation view; a new projection starts over."""

    def __init__(self) -> None:
        self.owner: object = None
        self.messages: list[ModelMessage] = []
        self.shas: list[str] = []
        self.chains: list[str] = [EMPTY_CHAIN]
        self.recorded: tuple[int, str] | None = None
        """(count, sha256) of the last prefix a committed request named."""
        self.bodies_recorded: set[str] = set()
        """Digests this process saw committed as ``provider/message`` bodies (bounded)."""
        self.tail: dict[int, tuple[ModelMessage, Any, str]] = {}
        """Live-tail messages digested by an earlier request, by identity (each keeps its message alive, so
        an id is never reused while it is here): a run of many steps sends the same tail objects again, and
        digesting each once keeps a run's requests linear in its length."""

    def tail_digest(self, message: ModelMessage) -> tuple[Any, str]:
        """The body and digest of a live-tail message, digested once per message object."""
        known = self.tail.get(id(message))
        if known is not None and known[0] is message:
            return known[1], known[2]
        if len(self.tail) >= 256:
            self.tail.clear()
        body = message_body(message)
        sha = message_digest(body)
        self.tail[id(message)] = (message, body, sha)
        return body, sha

    def update(self, owner: object, built: Sequence[ModelMessage], count: int) -> dict[str, Any]:
        """Bring the digests up to ``built[:count]`` (``owner``: the projection they belong to). Returns
        the bodies digested now, by digest."""
        if owner is not self.owner:
            self.owner, self.messages, self.shas, self.chains = owner, [], [], [EMPTY_CHAIN]
            self.tail.clear()
        n = len(self.messages)
        while n and (n > count or built[n - 1] is not self.messages[n - 1]):
            n -= 1
        del self.messages[n:], self.shas[n:], self.chains[n + 1 :]
        fresh: dict[str, Any] = {}
        for message in built[n:count]:
            body = message_body(message)
            sha = message_digest(body)
            fresh[sha] = body
            self.messages.append(message)
            self.shas.append(sha)
            self.chains.append(chain(self.chains[-1], sha))
        return fresh

    def base(self) -> tuple[int, str] | None:
        """The recorded prefix this one extends, if it still does."""
        if self.recorded is None:
            return None
        count, sha = self.recorded
        if count < len(self.chains) and self.chains[count] == sha:
            return self.recorded
        return None

    def note_bodies(self, shas: Iterable[str]) -> None:
        if len(self.bodies_recorded) > 50_000:
            self.bodies_recorded.clear()
        self.bodies_recorded.update(shas)


def check_provider_requests(events: Iterable[Any]) -> list[str]:
    """Check every ``provider/request`` of a journal (events in ``seq`` order, as envelopes or dicts)
    against the bodies before it: its ``added`` digests must chain a prefix named earlier (or the empty one)
    to its ``sha256``, and every digest it names must have a ``provider/message`` body whose canonical bytes
    hash to it. Returns the problems found (empty: every
    request is consistent)."""
    bodies: set[str] = set()
    prefixes: dict[int, set[str]] = {0: {EMPTY_CHAIN}}
    problems: list[str] = []
    for event in events:
        kind = event["kind"] if isinstance(event, dict) else event.kind
        payload = event["payload"] if isinstance(event, dict) else event.payload
        seq = event["seq"] if isinstance(event, dict) else event.seq
        if kind == "provider/message":
            if message_digest(payload["message"]) != payload["sha256"]:
                problems.append(f"seq {seq}: provider/message body does not hash to its sha256")
            bodies.add(payload["sha256"])
        elif kind == "provider/request":
            prefix = payload["prefix"]
            added = prefix.get("added", [])
            base = prefix["count"] - len(added)
            if base < 0 or not any(chain_all(added, start) == prefix["sha256"] for start in prefixes.get(base, ())):
                problems.append(f"seq {seq}: the prefix does not extend a prefix named before by its added digests")
            missing = [sha for sha in (*added, *payload.get("message_shas", [])) if sha not in bodies]
            if missing:
                problems.append(f"seq {seq}: no provider/message body for {len(missing)} digest(s)")
            prefixes.setdefault(prefix["count"], set()).add(prefix["sha256"])
    return problems
