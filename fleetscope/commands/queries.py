"""Reading the store: ``sql``, ``findings`` and ``report``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence

from fleetscope.config import Config, ConfigError
from fleetscope.schemas import units
from fleetscope.schemas.categories import info, next_checks, sql_command
from fleetscope.schemas.fields import as_float_or_none
from fleetscope.tables import findings_json, format_cell, print_findings, print_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``sql``, ``findings`` and ``report``."""
    p = sub.add_parser(
        "sql",
        parents=[common],
        help="run a SQL query on the store",
        description="Run a query against the findings store (read-only unless --write). "
        "Use {name:Type} placeholders with --param name=value.",
    )
    p.add_argument("query", help='e.g. "SELECT count() FROM findings"')
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="query parameter")
    p.add_argument("--json", action="store_true", help="print rows as JSON objects")
    p.add_argument("--write", action="store_true", help="allow statements that modify the store")
    p.set_defaults(handler=cmd_sql)

    p = sub.add_parser(
        "findings",
        parents=[common],
        help="list findings from the store",
        description="List current findings (one row per finding, latest state), then what each category "
        "found means and what to check next: its likely causes, the NVML fields to look at and the "
        "fleetscope sql command that shows each finding in the store (in --json: meaning, next_checks).",
    )
    p.add_argument("--job", help="only this job")
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    p.set_defaults(handler=cmd_findings)

    p = sub.add_parser(
        "report",
        parents=[common],
        help="write a self-contained HTML report of one job",
        description="Query the store and write one HTML file (inline SVG, no external assets) with the "
        "job's findings, a rank x function deviation heatmap, iteration and compute time per rank, and "
        "collective bandwidth per rank.",
    )
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("-o", "--output", default="report.html", help="output file (default: report.html)")
    p.add_argument("--against", metavar="JOB", help="add what changed per iteration against this job (see diff)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a sentence")
    p.set_defaults(handler=cmd_report)


def cmd_sql(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.endpoint import open_store

    params: dict[str, str] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError([f"--param {item!r}: expected NAME=VALUE"])
        params[name] = value
    columns, rows = open_store(config, write=args.write).query(args.query, params or None, readonly=not args.write)
    if args.json:
        print(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str))
    elif len(columns) == 1 and len(rows) == 1:
        print(format_cell(rows[0][0]))
    else:
        print_table(columns, rows)
    return 0


def cmd_findings(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.endpoint import open_store

    findings = open_store(config).findings(job=args.job)
    if args.json:
        rows = findings_json(findings)
        print(json.dumps([row | next_checks(row) for row in rows], indent=2, default=str))
        return 0
    print_findings(findings, as_json=False)
    for line in next_checks_lines(findings):
        print(line)
    return 0


def next_checks_lines(findings: Sequence[Mapping[str, object]]) -> list[str]:
    """Below the table, per category found: what it means, its likely causes and NVML fields (once), and
    for each of its findings the command that shows it in the store."""
    by_category: dict[str, list[Mapping[str, object]]] = {}
    for f in findings:
        if info(str(f.get("category"))) is not None:
            by_category.setdefault(str(f["category"]), []).append(f)
    lines: list[str] = []
    for category, found in by_category.items():
        about = info(category)
        if about is None:
            continue
        lines += ["", f"{category}: {about.meaning}"]
        lines.append(f"  likely: {'; '.join(about.checks.likely_causes)}")
        lines.append(f"  NVML: {', '.join(about.checks.nvml)}")
        for f in found:
            lines.append(f"  {units.subject(f)}: {sql_command(next_checks(f)['next_checks'])}")
    return lines


def cmd_report(args: argparse.Namespace, config: Config) -> int:
    from fleetscope import verdict
    from fleetscope.endpoint import open_store
    from fleetscope.report import write_report
    from fleetscope.schemas import units

    store = open_store(config)
    t0 = time.monotonic()
    data = write_report(store, args.job, args.output, args.against)
    seconds = time.monotonic() - t0
    rank, function, gap = data.heatmap.top_outlier()
    lead = verdict.headline(data.findings)
    summary = {
        "path": args.output,
        "job": args.job,
        "ranks": len(data.ranks),
        "iterations": [data.first_iteration, data.last_iteration],
        "findings": len(data.findings),
        "open_findings": sum(f["status"] != "closed" for f in data.findings),
        "verdict": verdict.sentence(data.findings, data.median_iteration_ns),
        "headline": None
        if lead is None
        else {
            "subject": units.subject(lead),
            "category": lead["category"],
            "function": lead["function"],
            "est_loss_ns": lead["est_loss_ns"],
            "gpu": units.gpu(lead),
        },
        "top_deviation": {"rank": rank, "function": function, "gap": round(gap, 4)},
        "build_seconds": round(seconds, 3),
    }
    if data.diff is not None:
        summary["diff"] = data.diff.as_dict()
    if args.json:
        print(json.dumps(summary))
    else:
        if lead is None:
            head = f"no findings; largest deviation: rank {rank} {function} {gap:+.0%}"
        else:
            loss = units.duration(as_float_or_none(lead["est_loss_ns"]))
            head = f"headline: {units.subject(lead)} {lead['category']}, {loss} per iteration"
        print(
            f"wrote {args.output} in {seconds:.2f} s: job {args.job}, {len(data.ranks)} ranks, "
            f"{len(data.findings)} findings; {head}"
        )
    return 0
