"""What a finding says is wrong: each category and its properties, in one place.

Every other place reads them here: the detectors (which categories are causes, job-level, judged against
noise, blind under a profiler), the report's colours, the verdict's phrase, and what ``findings``, ``alerts``,
the webhook and ``report`` tell a person a finding means and what to check next. A category without one
of its properties fails ``tests/unit/test_architecture.py``.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


class Category(enum.StrEnum):
    """What a finding says is wrong. Stable names: alert consumers match on them. The one list: the
    findings schema, the report, the README and the simulator's expectations are checked against it."""

    GPU_SLOW = "gpu_slow"
    LINK_SLOW = "link_slow"
    HOST_SLOW = "host_slow"
    STRAGGLER = "straggler"
    STAGE_IMBALANCE = "stage_imbalance"
    JOB_REGRESSION = "job_regression"
    HANG = "hang"


class Noise(enum.StrEnum):
    """Against which noise a category's excess must stand out before it counts."""

    NONE = "none"
    """Not judged against noise: its own thresholds decide (a link's pace, a stage's margin, a silence)."""
    JOB = "job"
    """The job's own per-rank, per-function step-to-step noise (``noise.JobNoise``): host work and arrivals
    vary by step on a shared host, so an excess must be a level above it or a spike that comes back."""
    STAGE_COMPUTE = "stage_compute"
    """Its stage's compute noise: work that varies per step makes a different rank slowest each time, a slow
    GPU the same one."""
    HISTORY = "history"
    """The job's own iteration-time history: a sustained step of several standard errors of its noise."""


class Credit(enum.StrEnum):
    """Which what-if cause of the replay credits a category's signal: the rank's own work or its transfers."""

    WORK = "work"
    TRANSFER = "transfer"
    NONE = "none"
    """Not priced by the replay (job-level: no rank's change to try)."""


@dataclass(frozen=True, kw_only=True)
class NextChecks:
    """What to look at next: the store query that shows it, the NVML fields, the usual causes."""

    sql: str
    """A read-only query of the store's tables (``fleetscope sql``) with ``{job:String}``, and where it
    needs them ``{ranks:Array(Int32)}`` (the finding's ranks) and ``{function:String}`` placeholders."""
    nvml: tuple[str, ...]
    """Fields the NVML agent (``fleetscope agent``) samples that would confirm or rule out a cause."""
    likely_causes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CategoryInfo:
    """One category's properties."""

    category: Category
    meaning: str
    """One sentence: what the finding says about its subject (the README's line)."""
    phrase: str
    """The verdict's predicate after the subject, with ``{function}``, ``{gap}``, ``{numbers}``,
    ``{metric}``, ``{value}`` and ``{less_cpu_wait}`` filled from the finding."""
    cause: bool
    """Can make other ranks wait, with evidence on the rank itself: its victims are not stragglers."""
    job_level: bool
    """About the job as a whole, not some of its ranks: opens without the rank persistence rule."""
    noise: Noise
    credited_by: Credit
    claims_its_excess: bool
    """Judged by its own excess replayed (``attribution.claims``), not by its rank brought to its peers' level:
    its evidence is one part of its rank's work (a host function), whose saving the rank's whole work, varying
    by step, would drown. Priced, where its rank has peers, as any rank signal."""
    bounded_by_lateness: bool
    """Its time lost is at most the rank's arrival lateness: its peers gain only what they wait for it (a slow
    link paces every member instead, a straggler's loss is its lateness already)."""
    profiler_blind: bool
    """Not judged in iterations a profiler window disturbs: its evidence is host times or arrivals, which a
    profiler's per-op overhead changes by rank; kernels still compare."""
    color: str
    """The report's colour of it (``#rrggbb``)."""
    checks: NextChecks


REGISTRY: Mapping[Category, CategoryInfo] = MappingProxyType(
    {
        Category.GPU_SLOW: CategoryInfo(
            category=Category.GPU_SLOW,
            meaning="The rank's GPU runs the same kernels slower than the GPUs of the ranks doing the same work, "
            "so every collective it joins waits for it.",
            phrase="runs its GPU kernels slower than its peers ({function} {gap}, {numbers})",
            cause=True,
            job_level=False,
            noise=Noise.STAGE_COMPUTE,
            credited_by=Credit.WORK,
            claims_its_excess=False,
            bounded_by_lateness=True,
            profiler_blind=False,
            color="#d62728",
            checks=NextChecks(
                sql="SELECT function, round(avgIf(mean_ns, has({ranks:Array(Int32)}, rank)) / 1e6, 3) AS rank_ms, "
                "round(median(mean_ns) / 1e6, 3) AS peers_median_ms, round(rank_ms / peers_median_ms - 1, 3) AS gap "
                "FROM function_patterns WHERE job = {job:String} AND kind_name = 'compute' AND pp_rank IN "
                "(SELECT pp_rank FROM iterations WHERE job = {job:String} AND has({ranks:Array(Int32)}, rank)) "
                "GROUP BY function ORDER BY abs(rank_ms - peers_median_ms) DESC LIMIT 10",
                nvml=(
                    "sm_clock_mhz",
                    "sm_clock_max_mhz",
                    "throttle_reasons",
                    "power_mw",
                    "temperature_c",
                    "ecc_corrected",
                    "ecc_uncorrected",
                    "xid",
                ),  # fmt: skip
                likely_causes=(
                    "thermal or power throttling (throttle_reasons set, sm_clock_mhz below sm_clock_max_mhz)",
                    "a power cap or locked clocks on that GPU",
                    "a failing GPU (ECC errors, XID events)",
                    "another process or a smaller MIG slice on the same GPU",
                ),
            ),
        ),
        Category.LINK_SLOW: CategoryInfo(
            category=Category.LINK_SLOW,
            meaning="A link (NVLink, PCIe or the network) carries this rank's or this group's collectives slower "
            "than equivalent links, and every member of those collectives runs at its pace.",
            phrase="moves data over a slower link ({metric} {numbers}, {gap})",
            cause=True,
            job_level=False,
            noise=Noise.NONE,
            credited_by=Credit.TRANSFER,
            claims_its_excess=False,
            bounded_by_lateness=False,
            profiler_blind=False,
            color="#9467bd",
            checks=NextChecks(
                sql="SELECT rank, any(host) AS host, has({ranks:Array(Int32)}, rank) AS named, "
                "round(avgIf(busbw_gbps, isFinite(busbw_gbps) AND busbw_gbps > 0), 2) AS busbw_gbps, "
                "round(avgIf(nvlink_mean_bps, isFinite(nvlink_mean_bps)) / 1e9, 2) AS nvlink_gbps, "
                "round(avgIf(nvlink_cv, isFinite(nvlink_cv)), 3) AS nvlink_cv, "
                "round(avgIf(pcie_mean_bps, isFinite(pcie_mean_bps)) / 1e9, 2) AS pcie_gbps "
                "FROM function_patterns WHERE job = {job:String} AND function = {function:String} "
                "GROUP BY rank ORDER BY busbw_gbps LIMIT 16",
                nvml=(
                    "nvlink_tx_bytes_per_s",
                    "nvlink_rx_bytes_per_s",
                    "pcie_gen",
                    "pcie_gen_max",
                    "pcie_width",
                    "pcie_width_max",
                    "pcie_tx_bytes_per_s",
                    "pcie_rx_bytes_per_s",
                    "xid",
                ),  # fmt: skip
                likely_causes=(
                    "an NVLink down or degraded (a link's counters flat while the others carry traffic)",
                    "a PCIe link trained below its generation or width (pcie_gen < pcie_gen_max)",
                    "a congested or flapping NIC or switch port (a host's ranks stall together)",
                    "NCCL on a slower transport for that group (sockets instead of InfiniBand, P2P disabled)",
                ),
            ),
        ),
        Category.HOST_SLOW: CategoryInfo(
            category=Category.HOST_SLOW,
            meaning="The rank's host (Python, data loading, garbage collection, kernel launches, or a CPU that "
            "other processes take) spends longer than its peers' on the same work, so its GPU and its peers "
            "wait for it.",
            phrase="spends longer than its peers in the host function {function} ({gap}, {numbers})",
            cause=True,
            job_level=False,
            noise=Noise.JOB,
            credited_by=Credit.WORK,
            claims_its_excess=True,
            bounded_by_lateness=True,
            profiler_blind=True,
            color="#ff7f0e",
            checks=NextChecks(
                sql="SELECT i.rank AS rank, any(i.host) AS host, has({ranks:Array(Int32)}, i.rank) AS named, "
                "round(avg(p.self_ns) / 1e6, 3) AS function_self_ms, "
                "round(avgIf(i.cpu_wait_ns, i.cpu_wait_ns >= 0) / 1e6, 3) AS cpu_wait_ms, "
                "round(avg(i.idle_ns) / 1e6, 3) AS gpu_idle_ms FROM iterations AS i LEFT JOIN "
                "(SELECT rank, iteration, self_ns FROM function_patterns "
                "WHERE job = {job:String} AND function = {function:String}) AS p "
                "ON p.rank = i.rank AND p.iteration = i.iteration WHERE i.job = {job:String} "
                "GROUP BY i.rank ORDER BY function_self_ms DESC, cpu_wait_ms DESC LIMIT 16",
                nvml=("sm_util_pct",),
                likely_causes=(
                    "too few data-loader workers, or input I/O on slow storage",
                    "Python garbage collection pauses (gc.collect)",
                    "other processes on the node taking its cores (cpu_wait), or a wrong CPU/NUMA affinity",
                    "launch-bound code: many small kernels (gpu_launch_wait; CUDA graphs or torch.compile help)",
                ),
            ),
        ),
        Category.STRAGGLER: CategoryInfo(
            category=Category.STRAGGLER,
            meaning="The rank's peers wait for it at their collectives, and fixing its own work would save that "
            "time (whoever arrives last), while nothing measured on it (kernels, host functions, links) says why.",
            phrase="arrives last at the collectives ({value} late at {function})",
            cause=False,
            job_level=False,
            noise=Noise.JOB,
            credited_by=Credit.WORK,
            claims_its_excess=False,
            bounded_by_lateness=False,
            profiler_blind=True,
            color="#8c564b",
            checks=NextChecks(
                sql="SELECT rank, any(host) AS host, has({ranks:Array(Int32)}, rank) AS named, "
                "round(avg(exposed_collective_ns) / 1e6, 2) AS waiting_ms, "
                "round(avg(compute_ns) / 1e6, 2) AS compute_ms, round(avg(idle_ns) / 1e6, 2) AS gpu_idle_ms, "
                "round(avgIf(cpu_wait_ns, cpu_wait_ns >= 0) / 1e6, 2) AS cpu_wait_ms "
                "FROM iterations WHERE job = {job:String} GROUP BY rank ORDER BY waiting_ms LIMIT 16",
                nvml=("sm_clock_mhz", "throttle_reasons", "sm_util_pct"),
                likely_causes=(
                    "host work the profile does not see (checkpointing, logging or evaluation on that rank)",
                    "a step that starts late on that rank (input, OS jitter, preemption)",
                    "a hardware cause without samples to show it: run fleetscope agent for NVML",
                ),
            ),
        ),
        Category.STAGE_IMBALANCE: CategoryInfo(
            category=Category.STAGE_IMBALANCE,
            meaning="One pipeline stage computes longer than the others on every replica, so the other stages "
            "wait for it in their sends and receives: the model is split unevenly across stages.",
            phrase="computes longer than the other pipeline stages ({gap}, {numbers})",
            cause=False,
            job_level=False,
            noise=Noise.NONE,
            credited_by=Credit.WORK,
            claims_its_excess=False,
            bounded_by_lateness=False,
            profiler_blind=False,
            color="#17becf",
            checks=NextChecks(
                sql="SELECT pp_rank AS stage, uniqExact(rank) AS ranks, round(avg(compute_ns) / 1e6, 2) AS compute_ms, "
                "round(avg(exposed_collective_ns) / 1e6, 2) AS waiting_ms, "
                "round(avg(duration_ns) / 1e6, 2) AS iteration_ms FROM iterations WHERE job = {job:String} "
                "GROUP BY stage ORDER BY compute_ms DESC",
                nvml=("sm_util_pct", "mem_util_pct"),
                likely_causes=(
                    "an uneven split of layers between stages",
                    "the embedding or the loss and output layer on the first or last stage",
                    "activation recomputation or a larger micro-batch on some stages only",
                ),
            ),
        ),
        Category.JOB_REGRESSION: CategoryInfo(
            category=Category.JOB_REGRESSION,
            meaning="The whole job runs slower than its own earlier iterations while no rank differs from its "
            "peers: something common to all ranks changed.",
            phrase="runs slower than its own best iterations{less_cpu_wait} ({gap}, {numbers})",
            cause=False,
            job_level=True,
            noise=Noise.HISTORY,
            credited_by=Credit.NONE,
            claims_its_excess=False,
            bounded_by_lateness=False,
            profiler_blind=False,
            color="#1f77b4",
            checks=NextChecks(
                sql="SELECT iteration, round(median(duration_ns) / 1e6, 2) AS iteration_ms, "
                "round(median(compute_ns) / 1e6, 2) AS compute_ms, "
                "round(median(exposed_collective_ns) / 1e6, 2) AS waiting_ms, "
                "round(medianIf(cpu_wait_ns, cpu_wait_ns >= 0) / 1e6, 2) AS cpu_wait_ms, "
                "max(profiled) AS profiled FROM iterations WHERE job = {job:String} "
                "GROUP BY iteration ORDER BY iteration",
                nvml=("sm_clock_mhz", "throttle_reasons", "power_mw", "temperature_c"),
                likely_causes=(
                    "a software change (driver, container image, NCCL or PyTorch version, configuration)",
                    "the data changed (longer sequences, a new mix)",
                    "the fleet throttles (cooling, power capping) or shared storage or network slowed",
                    "more CPU contention on every host (cpu_wait grew with the steps)",
                ),
            ),
        ),
        Category.HANG: CategoryInfo(
            category=Category.HANG,
            meaning="The job stopped making progress: some ranks wait in a collective that others never entered, "
            "are stuck inside it, or disagree on what it is.",
            phrase="stopped making progress (silent for {value})",
            cause=False,
            job_level=True,
            noise=Noise.NONE,
            credited_by=Credit.NONE,
            claims_its_excess=False,
            bounded_by_lateness=False,
            profiler_blind=False,
            color="#111111",
            checks=NextChecks(
                sql="SELECT rank, any(host) AS host, has({ranks:Array(Int32)}, rank) AS named, "
                "max(iteration) AS last_iteration, fromUnixTimestamp64Nano(max(end_ns), 'UTC') AS last_step_end "
                "FROM iterations WHERE job = {job:String} "
                "GROUP BY rank ORDER BY last_iteration, last_step_end LIMIT 16",
                nvml=("xid", "sm_util_pct", "ecc_uncorrected"),
                likely_causes=(
                    "a rank that crashed, or is stuck in host code before the collective",
                    "ranks calling collectives in a different order (a collective under a rank-dependent branch)",
                    "members disagreeing on a collective's size or dtype (a desync)",
                    "a dead link or NIC, or a GPU lost to an XID error",
                ),
            ),
        ),
    }
)

CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)
CAUSES: tuple[str, ...] = tuple(c.value for c, i in REGISTRY.items() if i.cause)
"""Rank findings with evidence on the rank itself; a straggler has none (it only arrives late)."""
JOB_LEVEL: frozenset[str] = frozenset(c.value for c, i in REGISTRY.items() if i.job_level)
PROFILER_BLIND: tuple[str, ...] = tuple(c.value for c, i in REGISTRY.items() if i.profiler_blind)
"""Categories not judged in iterations a profiler window disturbs: a profiler's per-op overhead differs by
rank and op, so host times and arrivals there are no evidence; kernels still compare."""


def judged_against(noise: Noise) -> tuple[str, ...]:
    """The categories whose excess must stand out from ``noise``."""
    return tuple(c.value for c, i in REGISTRY.items() if i.noise is noise)


def info(category: str) -> CategoryInfo | None:
    """The properties of a category by its name; None for a name that is not one (a newer producer's)."""
    try:
        return REGISTRY[Category(category)]
    except ValueError:
        return None


_PLACEHOLDER = re.compile(r"\{(\w+):")


def check_params(finding: Mapping[str, Any], sql: str) -> dict[str, str]:
    """The parameters ``sql`` names, from the finding, as ``fleetscope sql --param`` takes them: ``ranks`` is
    the finding's ranks, or its one rank."""
    ranks = [int(r) for r in finding.get("ranks") or ()] or [int(finding.get("rank", -1))]
    values = {
        "job": str(finding.get("job") or ""),
        "ranks": "[" + ",".join(str(r) for r in ranks) + "]",
        "function": str(finding.get("function") or ""),
    }
    named = set(_PLACEHOLDER.findall(sql))
    return {name: value for name, value in values.items() if name in named}


def next_checks(finding: Mapping[str, Any]) -> dict[str, Any]:
    """What a finding means and what to check next, as JSON (the webhook, ``findings --json``); empty for a
    category this version does not know."""
    about = info(str(finding.get("category")))
    if about is None:
        return {}
    c = about.checks
    return {
        "meaning": about.meaning,
        "next_checks": {
            "sql": c.sql,
            "params": check_params(finding, c.sql),
            "nvml": list(c.nvml),
            "likely_causes": list(c.likely_causes),
        },
    }


def sql_command(checks: Mapping[str, Any]) -> str:
    """The shell command that runs a ``next_checks`` query (its ``sql`` and ``params``) on the store."""
    params: Mapping[str, str] = checks.get("params") or {}
    args = "".join(f" --param {_shell_word(f'{k}={v}')}" for k, v in params.items())
    return f"fleetscope sql {_shell_word(str(checks.get('sql') or ''))}{args}"


_SHELL_PLAIN = re.compile(r"[\w@%+=:,./-]+")
_SHELL_SPECIAL_IN_DOUBLE_QUOTES = re.compile(r'[$`"\\!]')


def _shell_word(text: str) -> str:
    """One shell word that reads well: bare where safe, in double quotes where nothing in it is special
    there (SQL's single-quoted literals stay readable), else ``shlex.quote``."""
    if _SHELL_PLAIN.fullmatch(text):
        return text
    if not _SHELL_SPECIAL_IN_DOUBLE_QUOTES.search(text):
        return f'"{text}"'
    return shlex.quote(text)
