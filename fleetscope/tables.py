"""How the CLI prints rows: aligned tables, findings as a person reads them (units, subject) or as JSON.

Everything a command prints to the terminal goes through ``TerminalText`` (installed by ``fleetscope.cli``):
a kernel name, job id or error text from the store or a trace is shown, its control characters escaped by
``fleetscope.redaction.printable``, never obeyed. JSON output is JSON already: ``json.dumps`` escapes every
control character (``\u001b``), so it passes unchanged."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from fleetscope.redaction import printable
from fleetscope.schemas import units
from fleetscope.schemas.fields import as_float, as_float_or_none


class TerminalText:
    """A text stream that writes ``printable`` of everything to ``raw``, newlines kept: a cell cannot move
    the cursor, retitle or clear the terminal. Anything else (``isatty``, ``fileno``) is ``raw``'s."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(printable(text, keep="\n"))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


FINDING_FIELDS = (
    "job", "subject", "rank", "ranks", "host", "local_rank", "gpu_uuid", "pci_bus_id", "category", "function",
    "metric", "value", "peer_median", "score", "iteration_first", "iteration_last", "est_loss_ns", "evidence",
    "reason",
)  # fmt: skip
"""The fields of a finding in ``--json`` output (raw numbers: ns, bytes/s), plus its status."""


def format_cell(value: object) -> str:
    """One cell on one line: a newline in a value would break the table's rows."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ",".join(format_cell(v) for v in value)
    return printable(str(value))


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    columns = [format_cell(c) for c in columns]
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip() + "\n")
    for r in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")


def findings_json(findings: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    return [{k: f[k] for k in FINDING_FIELDS if k in f} | {"status": f.get("status")} for f in findings]


def finding_row(f: Mapping[str, object]) -> list[object]:
    """One finding as a person reads it: who, what, by how much, since when, what it costs."""
    metric = str(f.get("metric", ""))
    where = units.subject(f)
    device = units.gpu(f)
    value, median = as_float_or_none(f.get("value")), as_float_or_none(f.get("peer_median"))
    return [
        f["job"],
        where + (f" {device}" if device else ""),
        f.get("host") or "-",
        f["category"],
        f["function"],
        units.metric_name(metric),
        units.metric_value(metric, value),
        units.metric_value(metric, median) if median else "-",
        units.gap(value, median) or "-",
        f"{as_float(f.get('score') or 0.0):.1f}",
        f"{f['iteration_first']}-{f['iteration_last']}",
        units.duration(as_float_or_none(f.get("est_loss_ns"))),
        f.get("status", ""),
    ]


FINDING_COLUMNS = (
    "job", "subject", "host", "category", "function", "metric", "value", "peers", "gap", "score", "iterations",
    "loss/iter", "status",
)  # fmt: skip


def print_findings(findings: Sequence[Mapping[str, object]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(findings_json(findings), indent=2, default=str))
        return
    if not findings:
        print("no findings")
        return
    print_table(FINDING_COLUMNS, [finding_row(f) for f in findings])
