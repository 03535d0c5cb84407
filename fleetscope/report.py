"""``fleetscope report``: one self-contained HTML page about one job, for people who did not run the query.

It answers, in order: which findings are open (table and timeline), which rank deviates from its peers in
which function (heatmap of each rank's mean duration against the peer median per function), whether the
job's iterations are steady (iteration and compute time per rank), and what the collectives achieve (bus
bandwidth and link throughput per rank); with a baseline job, what changed per iteration against it.
Everything is inline SVG and CSS: the file can be mailed or attached to a ticket and opened offline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope import svgcharts, verdict
from fleetscope.schemas import categories, units
from fleetscope.sinks.store import Store
from fleetscope.streams.analysis.rundiff import RunDiff

Array = npt.NDArray[np.float64]
MAX_FUNCTIONS = 40
MAX_RANKS = 128
MAX_POINTS = 400
LINES_UP_TO = 64
"""Up to this many ranks every rank gets its own line; beyond, a min-max band plus the flagged ranks."""


@dataclass(frozen=True)
class Heatmap:
    """``gap[f, r]``: rank ``ranks[r]``'s mean duration of ``functions[f]`` relative to the median over
    ranks of the same function (0.5 = 50 % slower than its peers)."""

    functions: list[str]
    kinds: list[str]
    ranks: list[int]
    gap: Array
    mean_ns: Array
    peer_median_ns: Array
    ranks_total: int

    def top_outlier(self, kind: str | None = None) -> tuple[int, str, float]:
        """(rank, function, gap) of the largest positive gap, optionally within one function kind."""
        rows = [i for i, k in enumerate(self.kinds) if kind is None or k == kind]
        sub = np.where(np.isfinite(self.gap[rows]), self.gap[rows], -np.inf)
        f, r = np.unravel_index(int(np.argmax(sub)), sub.shape)
        return self.ranks[r], self.functions[rows[f]], float(sub[f, r])


@dataclass(frozen=True)
class ReportData:
    job: str
    hosts: dict[int, str]
    iterations: int
    first_iteration: int
    last_iteration: int
    started: datetime | None
    heatmap: Heatmap
    iteration_x: Array
    iteration_ms: Array
    """(ranks, points): mean iteration time per bucket of ``iteration_step`` iterations, rows as ``ranks``."""
    compute_ms: Array
    iteration_step: int
    ranks: list[int]
    busbw_gbps: Array
    link_gbps: Array
    findings: list[dict[str, Any]]
    generated_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    diff: RunDiff | None = None
    """What changed per iteration against the baseline job (``collect``'s ``baseline``), if one was given."""

    @property
    def median_iteration_ns(self) -> float | None:
        if not np.isfinite(self.iteration_ms).any():
            return None
        return float(np.nanmedian(self.iteration_ms)) * 1e6

    @property
    def flagged_ranks(self) -> list[int]:
        """Ranks named by findings, biggest estimated loss first."""
        out: list[int] = []
        for f in self.findings:
            for r in [f["rank"], *f.get("ranks", [])]:
                if r >= 0 and r not in out:
                    out.append(r)
        return out


def _heatmap(store: Store, job: str, notes: list[str]) -> Heatmap:
    rows = store.function_means(job)
    if not rows:
        raise ValueError(f"job {job!r} has no function patterns in the store")
    total: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for function, kind, _rank, _mean, tot in rows:
        total[function] = total.get(function, 0.0) + float(tot)
        kinds[function] = str(kind)
    order = {"compute": 0, "memory": 1, "collective": 2, "python": 3}
    functions = sorted(total, key=lambda f: -total[f])[:MAX_FUNCTIONS]
    if len(total) > MAX_FUNCTIONS:
        notes.append(f"heatmap: the {MAX_FUNCTIONS} functions with the most time out of {len(total)}")
    functions.sort(key=lambda f: (order.get(kinds[f], 9), -total[f]))
    all_ranks = sorted({int(r[2]) for r in rows})
    f_index = {f: i for i, f in enumerate(functions)}
    r_index = {r: i for i, r in enumerate(all_ranks)}
    mean = np.full((len(functions), len(all_ranks)), np.nan)
    for function, _kind, rank, m, _tot in rows:
        if function in f_index:
            mean[f_index[function], r_index[int(rank)]] = float(m)
    with np.errstate(all="ignore"):
        median = np.nanmedian(mean, axis=1, keepdims=True)
        gap = mean / median - 1.0
    keep = list(range(len(all_ranks)))
    if len(all_ranks) > MAX_RANKS:
        worst = np.nanmax(np.abs(np.where(np.isfinite(gap), gap, 0.0)), axis=0)
        keep = sorted(np.argsort(-worst, kind="stable")[:MAX_RANKS].tolist())
        notes.append(f"heatmap: the {MAX_RANKS} most deviating ranks out of {len(all_ranks)}")
    return Heatmap(
        functions=functions,
        kinds=[kinds[f] for f in functions],
        ranks=[all_ranks[i] for i in keep],
        gap=gap[:, keep],
        mean_ns=mean[:, keep],
        peer_median_ns=np.repeat(median, len(keep), axis=1),
        ranks_total=len(all_ranks),
    )


def collect(store: Store, job: str, baseline: str | None = None) -> ReportData:
    """Read everything the report shows (a few aggregate reads of the ``Store``; no raw rows leave the
    store); with ``baseline``, the run-to-run diff of ``job`` against that job too."""
    t0 = time.monotonic()
    notes: list[str] = []
    heat = _heatmap(store, job, notes)
    diff = None
    if baseline is not None:
        from fleetscope.run_diff import store_steps
        from fleetscope.streams.analysis.rundiff import diff_runs

        diff = diff_runs(store_steps(store, baseline), store_steps(store, job))
    lo, hi, n, started = store.iteration_span(job)
    step = max(1, math.ceil((hi - lo + 1) / MAX_POINTS))
    it_rows = store.iteration_buckets(job, step)
    ranks = sorted({int(r[0]) for r in it_rows} | set(heat.ranks))
    hosts = {int(r[0]): str(r[1]) for r in it_rows}
    xs = np.array(sorted({int(r[2]) for r in it_rows}), dtype=np.float64)
    x_index = {int(x): i for i, x in enumerate(xs)}
    r_index = {r: i for i, r in enumerate(ranks)}
    it_ms = np.full((len(ranks), xs.size), np.nan)
    comp_ms = np.full((len(ranks), xs.size), np.nan)
    for rank, _host, it, dur, comp in it_rows:
        it_ms[r_index[int(rank)], x_index[int(it)]] = dur
        comp_ms[r_index[int(rank)], x_index[int(it)]] = comp
    bw = store.collective_bandwidth(job)
    busbw = np.full(len(ranks), np.nan)
    link = np.full(len(ranks), np.nan)
    for rank, b, lk in bw:
        if int(rank) in r_index:
            busbw[r_index[int(rank)]] = float(b)
            link[r_index[int(rank)]] = float(lk)
    return ReportData(
        job=job,
        hosts=hosts,
        iterations=n,
        first_iteration=lo,
        last_iteration=hi,
        started=started,
        heatmap=heat,
        iteration_x=xs,
        iteration_ms=it_ms,
        compute_ms=comp_ms,
        iteration_step=step,
        ranks=ranks,
        busbw_gbps=busbw,
        link_gbps=link,
        findings=store.findings(job=job),
        generated_s=time.monotonic() - t0,
        notes=notes,
        diff=diff,
    )


def _colors(data: ReportData) -> dict[int, str]:
    palette = svgcharts.HIGHLIGHTS
    return {r: palette[i % len(palette)] for i, r in enumerate(data.flagged_ranks[: len(palette)])}


def _per_rank_lines(data: ReportData, values: Array, y_label: str) -> str:
    colors = _colors(data)
    series: list[svgcharts.Series] = []
    band = None
    many = len(data.ranks) > LINES_UP_TO
    if many:
        with np.errstate(all="ignore"):
            band = svgcharts.Band(np.nanmin(values, 0), np.nanmedian(values, 0), np.nanmax(values, 0))
    for i, rank in enumerate(data.ranks):
        color = colors.get(rank)
        if color is None and many:
            continue
        name = f"rank {rank} ({data.hosts.get(rank, '?')})"
        series.append(svgcharts.Series(name, values[i], color or svgcharts.GREY, 2.0 if color else 1.0))
    step = f" (mean per {data.iteration_step} iterations)" if data.iteration_step > 1 else ""
    return svgcharts.line_chart(data.iteration_x, series, band=band, x_label="iteration" + step, y_label=y_label)


def _bars(data: ReportData, values: Array, unit: str, missing: str) -> str:
    if not np.isfinite(values).any() or not np.nanmax(np.abs(values), initial=0.0) > 0:
        return f"<p class='note'>{escape(missing)}</p>"
    colors = _colors(data)
    labels = [str(r) for r in data.ranks]
    tips = [f"rank {r} ({data.hosts.get(r, '?')}): {v:.3g} {unit}" for r, v in zip(data.ranks, values, strict=True)]
    fill = [colors.get(r, svgcharts.GREY) for r in data.ranks]
    return svgcharts.bar_chart(labels, values, fill, y_label=unit, x_label="rank", tips=tips)


def _timeline(data: ReportData) -> str:
    spans = []
    for f in sorted(data.findings, key=lambda f: (f["iteration_first"], f["rank"])):
        where = units.subject(f)
        metric = str(f["metric"])
        peers = f" vs peers {units.metric_value(metric, f['peer_median'])}" if f["peer_median"] else ""
        tip = (
            f"{f['category']} on {where} ({f['host']}): {f['function']} {units.metric_name(metric)} "
            f"{units.metric_value(metric, f['value'])}{peers}, score {f['score']:.1f}, iterations "
            f"{f['iteration_first']}-{f['iteration_last']}, {f['status']}"
        )
        spans.append(
            svgcharts.Span(
                label=f"{where} {f['category']}",
                start=f["iteration_first"],
                end=f["iteration_last"],
                color=svgcharts.CATEGORY_COLORS.get(f["category"], "#555"),
                open=f["status"] != "closed",
                tip=tip,
            )
        )
    return svgcharts.timeline(spans, data.first_iteration, data.last_iteration + 1, x_label="iteration")


def _findings_table(data: ReportData) -> str:
    if not data.findings:
        return "<p class='ok'>No findings: every rank behaves like its peers.</p>"
    head = (
        "<tr><th>status</th><th>subject</th><th>host / GPU</th><th>category</th><th>function</th>"
        "<th>metric</th><th>value</th><th>peer median</th><th>gap</th><th>score</th><th>iterations</th>"
        "<th>est. loss / iteration</th></tr>"
    )
    rows = []
    for f in sorted(data.findings, key=lambda f: (f["status"] == "closed", -float(f["est_loss_ns"] or 0))):
        color = svgcharts.CATEGORY_COLORS.get(f["category"], "#555")
        metric = str(f["metric"])
        place = ", ".join(x for x in (str(f["host"] or ""), units.gpu(f)) if x) or "-"
        median = units.metric_value(metric, f["peer_median"]) if f["peer_median"] else "-"
        rows.append(
            f"<tr><td>{escape(f['status'])}</td><td>{escape(units.subject(f))}</td><td>{escape(place)}</td>"
            f"<td><span class='dot' style='background:{color}'></span>{escape(f['category'])}</td>"
            f"<td class='fn'>{escape(f['function'])}</td><td>{escape(units.metric_name(metric))}</td>"
            f"<td>{escape(units.metric_value(metric, f['value']))}</td><td>{escape(median)}</td>"
            f"<td>{escape(units.gap(f['value'], f['peer_median']) or '-')}</td>"
            f"<td>{f['score']:.1f}</td><td>{f['iteration_first']}-{f['iteration_last']}</td>"
            f"<td>{escape(units.duration(f['est_loss_ns']))}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _diff_section(diff: RunDiff | None) -> str:
    """The run-to-run diff against the baseline job: the iteration time, then the listed changes."""
    if diff is None:
        return ""
    from fleetscope.run_diff import iteration_line, role_label, varying_dims

    head, rows = iteration_line(diff), []
    dims = varying_dims(diff)
    for c in diff.changes[:MAX_FUNCTIONS]:
        rel = f"{c.relative:+.1%}" if math.isfinite(c.relative) else "new"
        rows.append(
            f"<tr><td>{escape(role_label(c.role, dims))}</td><td class='fn'>{escape(c.function)}</td>"
            f"<td>{escape(c.kind)}</td><td>{escape(units.duration(c.a_ns))}</td>"
            f"<td>{escape(units.duration(c.b_ns))}</td><td>{escape(units.duration(c.delta_ns))}</td>"
            f"<td>{escape(rel)}</td></tr>"
        )
    table = (
        "<table><tr><th>role</th><th>function</th><th>kind</th><th>baseline / iteration</th>"
        f"<th>this job / iteration</th><th>change</th><th>relative</th></tr>{''.join(rows)}</table>"
        if rows
        else "<p class='ok'>No function or kernel changed beyond both runs' iteration-to-iteration noise.</p>"
    )
    return (
        f"<h2>Changes against job {escape(diff.a.name)}</h2>"
        "<p class='cap'>Time per iteration of one rank of each role (pipeline stage, tensor slot) over each "
        "run's steady iterations; listed only when the change stands out of both runs' own noise.</p>"
        f"<p>{escape(head)}</p>{table}"
    )


def _next_checks(data: ReportData) -> str:
    """Per category found, biggest loss first: what it means, its likely causes, the NVML fields to look at,
    and the command that shows its costliest finding in the store."""
    costliest: dict[str, dict[str, Any]] = {}
    for f in sorted(data.findings, key=lambda f: -float(f["est_loss_ns"] or 0)):
        costliest.setdefault(str(f["category"]), f)
    parts = []
    for category, f in costliest.items():
        about = categories.info(category)
        if about is None:
            continue
        causes = "".join(f"<li>{escape(c)}</li>" for c in about.checks.likely_causes)
        command = categories.sql_command(categories.next_checks(f)["next_checks"])
        parts.append(
            f"<div class='meaning'><p><span class='dot' style='background:{about.color}'></span>"
            f"<b>{escape(category)}</b>: {escape(about.meaning)}</p><p>Likely causes:</p><ul>{causes}</ul>"
            f"<p>NVML fields to look at (<code>fleetscope agent</code>): "
            f"<code>{escape(', '.join(about.checks.nvml))}</code></p>"
            f"<p>What shows it in the store ({escape(units.subject(f))}):</p><pre>{escape(command)}</pre></div>"
        )
    return "".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1d232b;margin:24px 32px;
max-width:1180px}h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 4px}
.sub{color:#5b6570;margin:0 0 14px}.cap{color:#5b6570;font-size:13px;margin:2px 0 8px;max-width:1000px}
.kpi{display:inline-block;margin:6px 26px 6px 0}.kpi b{display:block;font-size:20px}
.kpi span{color:#5b6570;font-size:12px}table{border-collapse:collapse;font-size:12.5px;margin-top:6px}
th,td{border-bottom:1px solid #e3e6ea;padding:4px 8px;text-align:left;white-space:nowrap}th{background:#f5f6f8}
td.fn{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11.5px}.ok{color:#2a7d2a}
.dot{display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px}
.note{color:#8a5a00;font-size:12px}.verdict{font-size:16px;line-height:1.45;background:#fff6e5;
border-left:4px solid #d08a00;padding:10px 14px;margin:8px 0 14px;max-width:1000px}
svg{display:block;margin:4px 0 6px}.meaning{max-width:1000px;font-size:13px}.meaning ul{margin:2px 0}
.meaning pre{white-space:pre-wrap;background:#f5f6f8;padding:6px 8px;font-size:11.5px}
footer{color:#8a939e;font-size:11px;margin-top:30px}
"""


def render_html(data: ReportData) -> str:
    """The report page for ``collect``'s data."""
    heat = data.heatmap
    flagged = frozenset(i for i, r in enumerate(heat.ranks) if r in data.flagged_ranks)
    col_labels = [str(r) for r in heat.ranks]
    open_n = sum(f["status"] != "closed" for f in data.findings)
    median_ns = data.median_iteration_ns
    profiled = "compute" in heat.kinds or "memory" in heat.kinds
    no_kernels = (
        "<p class='note'>No GPU kernels were profiled for this job, so there is no per-kernel or compute "
        f"view: open a window with <code>fleetscope profile --job {escape(data.job)} --seconds 20</code> "
        "while it runs.</p>"
    )
    hosts = len(set(data.hosts.values()))
    started = data.started.strftime("%Y-%m-%d %H:%M UTC") if data.started else "?"
    kpis = [
        (str(len(data.ranks)), f"ranks on {hosts} host{'s' if hosts != 1 else ''}"),
        (f"{data.first_iteration}-{data.last_iteration}", "iterations"),
        (units.duration(median_ns), "median iteration"),
        (str(open_n), f"open findings ({len(data.findings)} in all)"),
    ]
    lead = verdict.headline(data.findings)
    if lead is not None and units.gpu(lead):
        kpis.append((units.gpu(lead), f"GPU of {units.subject(lead)}"))
    kpi_html = "".join(f"<div class='kpi'><b>{escape(v)}</b><span>{escape(k)}</span></div>" for v, k in kpis)
    notes = "".join(f"<p class='note'>{escape(n)}</p>" for n in data.notes)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    sections = [
        f"<h1>fleetscope report: job {escape(data.job)}</h1>",
        f"<p class='sub'>started {started}; generated {generated}</p>",
        f"<p class='verdict'>{escape(verdict.sentence(data.findings, median_ns))}</p>",
        kpi_html,
        "<h2>Findings</h2>",
        "<p class='cap'>One row per finding (latest state). <i>gap</i> is the rank's value against the "
        "median of its peers; <i>est. loss</i> is what the job loses per iteration because of it.</p>",
        _findings_table(data),
        *(["<h2>What the findings mean, what to check next</h2>", _next_checks(data)] if data.findings else []),
        "<h2>Findings timeline</h2>",
        "<p class='cap'>When each finding was flagged, by iteration; faded bars are closed findings.</p>",
        _timeline(data),
        _diff_section(data.diff),
        "<h2>Rank x function deviation</h2>",
        "<p class='cap'>Each cell: a rank's mean duration of a function against the median over all "
        "ranks (red slower, blue faster, clipped at &plusmn;50 %). In synchronous training a slow GPU shows "
        "red on its compute kernels and blue on its collectives (it arrives last and never waits); a slow "
        "host shows red on Python functions. Outlined columns are ranks named by findings.</p>",
        notes,
        svgcharts.heatmap(heat.functions, col_labels, heat.gap, highlight_cols=flagged, row_notes=heat.kinds),
        "" if profiled else no_kernels,
        "<h2>Iteration time per rank</h2>",
        "<p class='cap'>Collectives make every rank finish an iteration together, so a slow rank slows "
        "all of them alike: compare with the compute time below, which tells the ranks apart.</p>",
        _per_rank_lines(data, data.iteration_ms, "iteration time (ms)"),
        "<h2>Compute time per rank</h2>",
        _per_rank_lines(data, data.compute_ms, "GPU compute time (ms)") if profiled else no_kernels,
        "<h2>Collective bus bandwidth per rank</h2>",
        "<p class='cap'>Mean NCCL bus bandwidth over the job's collectives (bytes moved per second of "
        "collective time, normalised as in nccl-tests). A rank that waits less (it arrived last) shows a "
        "higher figure; a degraded link lowers every member's.</p>",
        _bars(data, data.busbw_gbps, "bus bandwidth (GB/s)", "No collective with a known size was recorded."),
        "<h2>Link throughput during collectives per rank</h2>",
        "<p class='cap'>Mean NVLink throughput sampled while collectives ran: a degraded link runs low and steady.</p>",
        _bars(data, data.link_gbps, "NVLink throughput (GB/s)", "No NVLink samples (run `fleetscope agent`)."),
        f"<footer>fleetscope; data gathered from the store in {data.generated_s * 1000:.0f} ms.</footer>",
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>fleetscope report: {escape(data.job)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(sections)
        + "</body></html>"
    )


def write_report(store: Store, job: str, path: str | Path, baseline: str | None = None) -> ReportData:
    """Collect, render and write the report; returns the data behind it."""
    data = collect(store, job, baseline)
    Path(path).write_text(render_html(data), encoding="utf-8")
    return data
