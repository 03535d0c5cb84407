"""Findings signed by the differential, verified by whoever trusts them (the sink, the alert follower).

The broker authenticates no producer unless a deployment makes it (SASL, ACLs): any process that reaches it
may write the findings topic. So the differential stage signs each finding message with a key that only it
and the findings' readers hold (HMAC-SHA256 over the topic, the message key and the value, in a header),
and a reader stores or alerts on a finding only if its signature verifies: a forged or altered finding is
refused with a reason, whatever it claims. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

MAC_HEADER = "fleetscope-mac"
"""The Kafka header that carries a finding message's HMAC-SHA256 (32 bytes)."""
MIN_KEY_BYTES = 16


def findings_mac(key: bytes, topic: str, msg_key: bytes | None, value: bytes) -> bytes:
    """HMAC-SHA256 of a finding message: topic, key and value, each length-prefixed, so no part can be
    moved into another (a signed finding copied to another topic or job key does not verify)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (topic.encode(), msg_key or b"", value):
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


Headers = Iterable[tuple[str, str | bytes | None]] | Mapping[str, str | bytes | None] | None
"""A message's headers as Kafka clients give them."""


def signature_reason(key: bytes, topic: str, msg_key: bytes | None, value: bytes, headers: Headers) -> str | None:
    """Why a finding message is not the differential's (a one-line reason), or None when it verifies."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    macs = [v for k, v in pairs if k == MAC_HEADER]
    if not macs:
        return f"signature: no {MAC_HEADER} header (not written by the differential stage)"
    if len(macs) > 1 or not isinstance(macs[0], bytes):
        return f"signature: {len(macs)} {MAC_HEADER} headers, expected one of bytes"
    if not hmac.compare_digest(macs[0], findings_mac(key, topic, msg_key, value)):
        return "signature: does not verify (another key, or the message was altered)"
    return None
