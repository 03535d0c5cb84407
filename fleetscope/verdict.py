"""The one sentence a report leads with: who, what, and how much time per iteration it costs.

The headline is the finding that costs the most time per iteration (open findings before closed ones),
not the largest percentage: a +51 % on a 20 µs kernel matters less than +15 % on the main GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fleetscope.schemas import categories, units
from fleetscope.schemas.fields import as_float, as_float_or_none
from fleetscope.schemas.vocabulary import CPU_WAIT_FUNCTION, ITERATION_LESS_CPU_WAIT, LAUNCH_WAIT_FUNCTION


def headline(findings: Sequence[Mapping[str, object]]) -> Mapping[str, object] | None:
    """The finding to lead with: open before closed, then the largest estimated loss per iteration."""
    if not findings:
        return None
    return max(findings, key=lambda f: (f.get("status") != "closed", as_float(f.get("est_loss_ns") or 0)))


def _what(f: Mapping[str, object]) -> str:
    """The predicate after the subject: the category's phrase (``schemas.categories``) filled from the finding;
    a host function that measures a wait (a CPU's, a launch's) says what it waited for."""
    metric = str(f.get("metric") or "")
    value, median = as_float_or_none(f.get("value")), as_float_or_none(f.get("peer_median"))
    gap = units.gap(value, median)
    function = f.get("function") or "?"
    numbers = f"{units.metric_value(metric, value)} vs {units.metric_value(metric, median)}" if median else ""
    category = f.get("category")
    if category == "host_slow" and function == CPU_WAIT_FUNCTION:
        return f"waits longer than its peers for a CPU: other processes take its host's cores ({gap}, {numbers})"
    if category == "host_slow" and function == LAUNCH_WAIT_FUNCTION:
        return f"leaves its GPU idle waiting for its host to launch kernels: launch-bound ({gap}, {numbers})"
    about = categories.info(str(category))
    if about is None:
        return f"differs from its peers in {function} ({gap})"
    return about.phrase.format(
        function=function,
        gap=gap,
        numbers=numbers,
        metric=units.metric_name(metric),
        value=units.metric_value(metric, value),
        less_cpu_wait=", its CPU wait left out" if metric == ITERATION_LESS_CPU_WAIT else "",
    )


def sentence(findings: Sequence[Mapping[str, object]], median_iteration_ns: float | None) -> str:
    """E.g. "Rank 7 (node000, GPU 3) runs its GPU kernels slower than its peers (gemm +52%, 2.13 ms vs
    1.40 ms) since iteration 0: it costs the job about 40.6 ms per iteration (3.4 % of a 1.20 s iteration)."""
    f = headline(findings)
    iteration = (
        f"{units.duration(median_iteration_ns)}"
        if median_iteration_ns and math.isfinite(median_iteration_ns)
        else "an unknown"
    )
    if f is None:
        return f"No findings: every rank behaves like its peers (median iteration {iteration})."
    who = units.subject(f)
    where = ", ".join(x for x in (str(f.get("host") or ""), units.gpu(f)) if x and x not in who)
    who = who[:1].upper() + who[1:] + (f" ({where})" if where else "")
    loss = as_float(f.get("est_loss_ns") or 0)
    share = ""
    if median_iteration_ns and math.isfinite(median_iteration_ns) and median_iteration_ns > 0:
        share = f" ({loss / median_iteration_ns:.1%} of a {units.duration(median_iteration_ns)} iteration)"
    since = f"since iteration {f.get('iteration_first')}"
    tense = "cost" if f.get("status") == "closed" else "costs"
    closed = f", until iteration {f.get('iteration_last')} (closed)" if f.get("status") == "closed" else ""
    others = len(findings) - 1
    more = f" {others} other finding{'s' if others != 1 else ''} below." if others else ""
    return (
        f"{who} {_what(f)} {since}{closed}: it {tense} the job about {units.duration(loss)} per iteration{share}.{more}"
    )
