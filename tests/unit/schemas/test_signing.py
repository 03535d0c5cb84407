"""Findings signed by the differential: what verifies and what is refused (pure, no broker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetscope.config import load_config
from fleetscope.schemas.signing import MAC_HEADER, findings_mac, signature_reason
from fleetscope.wiring import findings_key

KEY = b"k" * 32
TOPIC, JOB, VALUE = "fs.findings", b"job-a", b"\x00\x00\x00\x00\x07a finding"


def headers(key: bytes = KEY, topic: str = TOPIC, job: bytes = JOB, value: bytes = VALUE) -> list[tuple[str, bytes]]:
    return [(MAC_HEADER, findings_mac(key, topic, job, value))]


def test_a_finding_signed_with_the_key_verifies():
    assert signature_reason(KEY, TOPIC, JOB, VALUE, headers()) is None
    assert signature_reason(KEY, TOPIC, JOB, VALUE, dict(headers())) is None  # headers as a mapping


@pytest.mark.parametrize(
    ("what", "hdrs"),
    [
        ("unsigned", None),
        ("another key", headers(key=b"x" * 32)),
        ("altered value", headers(value=VALUE + b"!")),
        ("another job's key", headers(job=b"job-b")),
        ("another topic", headers(topic="fs.iterations")),
        ("two signatures", headers() * 2),
        ("a str header", [(MAC_HEADER, "abc")]),
    ],
)
def test_a_forged_or_moved_finding_is_refused_with_a_reason(what: str, hdrs: list[tuple[str, bytes]] | None):
    reason = signature_reason(KEY, TOPIC, JOB, VALUE, hdrs)
    assert reason is not None and reason.startswith("signature: "), what


def test_processes_of_one_data_dir_share_its_key_and_a_configured_key_wins(tmp_path: Path):
    config = load_config(env={}, overrides={"data_dir": str(tmp_path / "d")})
    first = findings_key(config)
    assert findings_key(config) == first and len(first) == 64
    assert (tmp_path / "d" / "findings.key").stat().st_mode & 0o777 == 0o600
    configured = load_config(env={"FLEETSCOPE__KAFKA__FINDINGS_KEY": "s" * 20}, overrides={"data_dir": str(tmp_path)})
    assert findings_key(configured) == b"s" * 20
    assert "s" * 20 not in repr(configured)
