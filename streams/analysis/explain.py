"""What a short trace shows when it cannot open a finding, and why it cannot.

A finding needs ``persist_iterations`` flagged iterations and ``min_peers`` ranks doing the same work;
a profiler capture often has one or two steps. The data still says which rank arrives last at each
collective (it waits least: its collective is the shortest) and which rank computes longest, and the
per-iteration signals still show who stands out; ``JobTally`` keeps that (compact, capped) per job and
``JobTally.reasons`` says, one line each, why no finding could open and what to collect instead.
``JobTally.limits`` says what the input cannot show at any length: without link throughput samples a slow
link shows only against equivalent groups (``links.score_transfers``): within its own ring it has no rank to
name, since a collective runs at its slowest link's pace on every member (all members' kernels lengthen
alike), and a member's longer kernel reads as a longer wait for the last arrival.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.outliers import score_iteration
from fleetscope.streams.analysis.signals import ScoringConfig

LINK_FAMILIES = ("nvlink", "pcie")

MAX_ITERATIONS = 64
"""Iterations per job the tally keeps (a short trace is what it is for; a long one opens findings)."""
_COMPUTE, _COLLECTIVE = int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE)


@dataclass(slots=True)
class _RankIteration:
    compute_ns: float
    collectives: dict[str, float]
    """Collective function -> mean duration on this rank (its own clock)."""
    stage: int


@dataclass
class JobTally:
    """One job's per-iteration arrival order and compute times, and its first iterations' records."""

    job: str
    keep_records: int = 3
    """Iterations whose records are kept whole, to score them again for signals that did not persist."""
    iterations: dict[int, dict[int, _RankIteration]] = field(default_factory=dict)
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    hosts: set[str] = field(default_factory=set)
    link_samples: bool = False
    """Some collective had link throughput samples (NVML, live jobs); traces have none."""

    def add(self, rec: Mapping[str, Any]) -> None:
        """One rank's pattern record of one iteration."""
        it = int(rec["iteration"])
        if it not in self.iterations and len(self.iterations) >= MAX_ITERATIONS:
            return
        kinds = np.asarray(rec["kind"])
        total = np.asarray(rec["total_ns"], dtype=np.float64)
        mean = np.asarray(rec["mean_ns"], dtype=np.float64)
        names = rec["function"]
        coll = np.flatnonzero(kinds == _COLLECTIVE).tolist()
        self.iterations.setdefault(it, {})[int(rec["rank"])] = _RankIteration(
            compute_ns=float(total[kinds == _COMPUTE].sum()),
            collectives={names[j]: float(mean[j]) for j in coll},
            stage=int(rec.get("pp_rank", -1)),
        )
        self.hosts.add(str(rec.get("host", "")))
        if coll and not self.link_samples:
            peaks = [np.asarray(rec.get(f"{f}_peak_bps", ()), dtype=np.float64) for f in LINK_FAMILIES]
            self.link_samples = any(p.size and np.isfinite(p[coll]).any() for p in peaks)
        if it in self.records or len(self.records) < self.keep_records:
            self.records.setdefault(it, []).append(dict(rec))

    def last_arrivals(self) -> list[dict[str, Any]]:
        """Per collective function: the rank that arrived last (waited least) most often, and how often."""
        counts: dict[str, Counter[int]] = {}
        seen: Counter[str] = Counter()
        for ranks in self.iterations.values():
            by_fn: dict[str, list[tuple[float, int]]] = {}
            for rank, ri in ranks.items():
                for fn, mean in ri.collectives.items():
                    if np.isfinite(mean):
                        by_fn.setdefault(fn, []).append((mean, rank))
            for fn, values in by_fn.items():
                if len(values) >= 2:
                    seen[fn] += 1
                    counts.setdefault(fn, Counter())[min(values)[1]] += 1
        out = []
        for fn in sorted(counts):
            rank, n = counts[fn].most_common(1)[0]
            out.append({"function": fn, "rank": rank, "iterations": n, "of": seen[fn]})
        return out

    def longest_compute(self) -> list[dict[str, Any]]:
        """Per pipeline stage: the rank that computed longest most often, its time and its peers' median."""
        by_stage: dict[int, Counter[int]] = {}
        sums: dict[int, dict[int, list[float]]] = {}
        for ranks in self.iterations.values():
            stages: dict[int, list[tuple[float, int]]] = {}
            for rank, ri in ranks.items():
                stages.setdefault(ri.stage, []).append((ri.compute_ns, rank))
                sums.setdefault(ri.stage, {}).setdefault(rank, []).append(ri.compute_ns)
            for stage, values in stages.items():
                if len(values) >= 2 and max(values)[0] > 0:  # a CPU job's ranks run no kernel: nobody computes longest
                    by_stage.setdefault(stage, Counter())[max(values)[1]] += 1
        out = []
        for stage in sorted(by_stage):
            rank, n = by_stage[stage].most_common(1)[0]
            means = {r: float(np.mean(v)) for r, v in sums[stage].items()}
            out.append({"stage": stage, "rank": rank, "iterations": n, "of": len(self.iterations),
                        "compute_ms": means[rank] / 1e6,
                        "peer_median_ms": float(np.median(list(means.values()))) / 1e6})  # fmt: skip
        return out

    def unopened_signals(self, scoring: ScoringConfig) -> list[dict[str, Any]]:
        """What each kept iteration flags, scored again: signals that were too few to open a finding."""
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for it in sorted(self.records):
            for sig in score_iteration(self.records[it], scoring):
                key = sig.key()
                row = found.setdefault(key, {"subject": key[0], "category": sig.category, "function": sig.function,
                                             "iterations": 0, "est_loss_ms": 0.0})  # fmt: skip
                row["iterations"] += 1
                row["est_loss_ms"] = max(row["est_loss_ms"], sig.loss_ns / 1e6)
        return sorted(found.values(), key=lambda r: -r["est_loss_ms"])

    def reasons(self, persist_iterations: int, min_peers: int) -> list[str]:
        """One line per reason no finding could open, with what to collect instead."""
        out: list[str] = []
        n_it = len(self.iterations)
        if n_it < persist_iterations:
            out.append(
                f"only {n_it} iteration(s) per rank: a finding opens after {persist_iterations} flagged iterations "
                f"(persist_iterations); profile at least {persist_iterations} steps (torch.profiler schedule "
                f"active={persist_iterations} or more), or lower streams.differential.lifecycle.persist_iterations"
            )
        sizes: Counter[int] = Counter()
        for ranks in self.iterations.values():
            sizes = Counter(ri.stage for ri in ranks.values())
            break
        small = {s: n for s, n in sizes.items() if n < min_peers}
        if small:
            where = ", ".join(f"{'all ranks' if s < 0 else f'stage {s}'}: {n}" for s, n in sorted(small.items()))
            out.append(
                f"fewer than min_peers={min_peers} ranks doing the same work ({where}): ranks are compared only "
                f"with peers of their role; collect traces of at least {min_peers} ranks per pipeline stage"
            )
        if self.iterations and not any(ri.collectives for ranks in self.iterations.values() for ri in ranks.values()):
            out.append(
                "no collective metadata (no NCCL kernels or collective ops): no arrival order, so no straggler or "
                "link finding; profile the GPU activity (ProfilerActivity.CUDA) with record_shapes=True"
            )
        return out

    def transfer_share(self) -> float | None:
        """Share of the collectives' kernel time that is transfer: per collective and iteration, the
        shortest member's kernel (the last to arrive waits for no one) over the members' mean; the rest
        is waiting for the last arrival. None without collectives seen by two ranks or more."""
        transfer = total = 0.0
        for ranks in self.iterations.values():
            by_fn: dict[str, list[float]] = {}
            for ri in ranks.values():
                for fn, mean in ri.collectives.items():
                    if np.isfinite(mean):
                        by_fn.setdefault(fn, []).append(mean)
            for values in by_fn.values():
                if len(values) >= 2:
                    transfer += min(values) * len(values)
                    total += sum(values)
        return transfer / total if total > 0 else None

    def limits(self) -> list[str]:
        """What this input cannot show however long it is, with what to collect instead."""
        share = self.transfer_share()
        if self.link_samples or share is None:
            return []
        return [
            "no link throughput samples (NVLink/PCIe): link_slow cannot be judged within a group, only by a "
            "group's transfer against at least 3 other groups doing the same collective (one per replica). A "
            "collective runs at its slowest link's pace on every member, so a slow link lengthens all members' "
            f"NCCL kernels alike and names no rank; here the transfer (each collective's shortest kernel) is "
            f"{100 * share:.0f}% of the NCCL kernel time and the rest is waiting for the last rank, so a longer "
            "kernel on one rank reads as a longer wait. Run the job with the fleetscope hook (NVML link "
            "samples) to judge each rank's links"
        ]


def tally_jobs(records: Sequence[Mapping[str, Any]], tallies: dict[str, JobTally], keep_records: int = 3) -> None:
    """Add pattern records to their jobs' tallies."""
    for rec in records:
        job = str(rec["job"])
        tally = tallies.get(job)
        if tally is None:
            tally = tallies[job] = JobTally(job, keep_records)
        tally.add(rec)
