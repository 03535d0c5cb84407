"""What reaches the operator's terminal and the logs: control characters shown as text, never obeyed;
secrets (webhook paths, passwords, tokens) reduced to where they lead."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetscope.cli import main
from fleetscope.tables import print_findings, print_table

HOSTILE = "flash_fwd\x1b]0;owned\x07\x1b[2J\x1b[H\x9b31m\x7f\u202e\r\nkernel"
"""A kernel name that retitles (OSC 0), clears (ED 2) and homes the terminal, with a C1 CSI, DEL, a
bidirectional override and a carriage return + newline to forge a line."""


def a_finding(function: str) -> dict[str, object]:
    return {
        "job": "j\x1b[5m", "rank": 3, "ranks": [3], "host": "node000", "category": "gpu_slow",
        "function": function, "metric": "mean_ns", "value": 6.8e5, "peer_median": 4.5e5, "score": 31.0,
        "iteration_first": 2, "iteration_last": 9, "est_loss_ns": 2_300_000, "status": "open",
    }  # fmt: skip


def controls(text: str) -> list[str]:
    return [ch for ch in text if not ch.isprintable() and ch != "\n"]


def test_findings_print_a_kernel_names_escape_sequences_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    print_findings([a_finding(HOSTILE)], as_json=False)
    out = capsys.readouterr().out
    assert controls(out) == []
    assert "flash_fwd\\x1b]0;owned\\x07\\x1b[2J" in out and "\\u202e" in out
    assert len(out.splitlines()) == 2, "the name's newline does not forge a row"


def test_json_output_stays_json_with_every_control_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    print_findings([a_finding(HOSTILE)], as_json=True)
    out = capsys.readouterr().out
    assert controls(out) == []
    assert json.loads(out)[0]["function"] == HOSTILE


def test_terminal_text_passes_newlines_and_escapes_the_rest() -> None:
    from fleetscope.tables import TerminalText

    raw = io.StringIO()
    stream = TerminalText(raw)  # what the CLI puts on sys.stdout: `alerts`, `sql`, `report`, `analyze`
    print_table(["a\x1b[2J"], [["x\ty"], [HOSTILE]], out=stream)
    stream.write("line\x1b[1A\n")
    assert controls(raw.getvalue()) == []
    assert raw.getvalue().endswith("line\\x1b[1A\n")


@pytest.mark.parametrize(
    ("text", "secrets", "kept"),
    [
        ("webhook https://hooks.slack.com/services/T0/B0/XyZsecret failed", ["T0/B0", "XyZsecret"], "hooks.slack.com"),
        ("GET http://u:pw1234@127.0.0.1:8123/?password=hunter2&q=1", ["pw1234", "hunter2", "q=1"], "127.0.0.1:8123"),
        ("sasl.password=hunter2 registry_password: s3cret token=abc123", ["hunter2", "s3cret", "abc123"], "password="),
        ("{'Authorization': 'Bearer eyJhbGci.x'} X-ClickHouse-Key: k3y", ["eyJhbGci", "k3y"], "Authorization"),
    ],
)  # fmt: skip
def test_redact_keeps_where_a_url_leads_and_hides_its_secrets(text: str, secrets: list[str], kept: str) -> None:
    from fleetscope import redaction

    shown = redaction.redact(text)
    assert [s for s in secrets if s in shown] == []
    assert kept in shown and redaction.HIDDEN in shown


@pytest.fixture
def redacting_log() -> Iterator[io.StringIO]:
    from fleetscope import redaction

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = logging.getLogger("fleetscope.test.redaction")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    redaction.install()
    try:
        yield out
    finally:
        redaction.uninstall()
        log.removeHandler(handler)


def test_every_log_record_is_redacted_and_printable(redacting_log: io.StringIO) -> None:
    """Whatever logger, whatever arguments or traceback: the one rule applies before any handler."""
    from fleetscope import redaction

    log = logging.getLogger("fleetscope.test.redaction")
    redaction.register_secret("store-token-Zq8Kx")
    log.warning("webhook %s: not delivered", "https://hooks.slack.com/services/T0/B0/XyZsecret")
    log.info("store token %s, kernel %s", "store-token-Zq8Kx", HOSTILE)
    try:
        raise ValueError("connect to http://127.0.0.1:9/?password=hunter2")
    except ValueError:
        log.exception("failed")
    text = redacting_log.getvalue()
    assert [s for s in ("XyZsecret", "Zq8Kx", "hunter2") if s in text] == []
    assert f"hooks.slack.com/{redaction.HIDDEN}" in text and "127.0.0.1:9/…" in text
    assert [ch for ch in text if not ch.isprintable() and ch not in "\n\t"] == []
    assert "\\r\\nkernel" in text, "the name's newline is shown, not obeyed: it cannot forge a log line"


def test_a_trace_files_name_cannot_drive_the_terminal_from_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``analyze``'s progress and skipped-file lines name the file: shown, not obeyed, on stderr too."""
    (tmp_path / "rank0\x1b]0;owned\x07\x1b[2J.json").write_text('{"traceEvents": [')
    main(["analyze", str(tmp_path)])
    captured = capsys.readouterr()
    assert "rank0\\x1b]0;owned\\x07\\x1b[2J.json" in captured.err
    assert controls(captured.err + captured.out) == []
