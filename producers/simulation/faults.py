"""Injected faults: what each kind touches, when it is active, and the CLI spec grammar.

Why: the quality bench and the demo describe scenarios as short strings (``slow_gpu:7:1.2@10/3``); one
parser with precise errors keeps those scenarios honest, and one ``Fault`` type carries them to the physics.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

HOST_FUNCTIONS = ("dataloader.next", "forward", "backward", "optimizer.step")
GC_FUNCTION = "gc.collect"
CHECKPOINT_FUNCTION = "checkpoint.save"

RANK_KINDS = (
    "slow_gpu",
    "slow_link",
    "host_slow",
    "pcie_downgrade",
    "dataloader_stall",
    "cpu_contention",
    "hang",
)
FAULT_KINDS = (*RANK_KINDS[:-1], "net_congestion", "stage_imbalance", "job_slowdown", "hang")
TARGETS = {kind: "rank" for kind in RANK_KINDS} | {
    "net_congestion": "host",
    "stage_imbalance": "stage",
    "job_slowdown": "job",
}
DEFAULT_FACTORS = {
    "slow_gpu": 1.5,
    "slow_link": 2.0,
    "host_slow": 1.2,
    "pcie_downgrade": 2.0,
    "dataloader_stall": 1.2,
    "cpu_contention": 2.0,
    "net_congestion": 2.0,
    "stage_imbalance": 1.5,
    "job_slowdown": 1.2,
    "hang": 1.0,
}
CATEGORIES = {
    "slow_gpu": "gpu_slow",
    "slow_link": "link_slow",
    "pcie_downgrade": "link_slow",
    "host_slow": "host_slow",
    "dataloader_stall": "host_slow",
    "cpu_contention": "host_slow",
    "net_congestion": "link_slow",
    "stage_imbalance": "stage_imbalance",
    "job_slowdown": "job_regression",
    "hang": "hang",
}
HOST_FAULT_KINDS = ("host_slow", "dataloader_stall")
"""Kinds whose magnitude is defined on the iteration: they add (factor - 1) x the healthy iteration time."""

GRAMMAR = "kind:target[:factor[:function]][@start][/every]"
_SPEC_RE = re.compile(r"^(?P<body>[^@/]*)(?:@(?P<start>[^@/]*))?(?:/(?P<every>[^@/]*))?$")
_HOST_RE = re.compile(r"^(?:node)?(\d+)$")


def host_name(index: int) -> str:
    """Host names: ranks ``i * gpus_per_host`` to ``(i + 1) * gpus_per_host - 1`` live on ``node{i:03d}``."""
    return f"node{index:03d}"


def host_index(name: str) -> int | None:
    """``node007``, ``node7`` or ``7`` -> 7; anything else -> None."""
    m = _HOST_RE.match(name.strip())
    return int(m.group(1)) if m else None


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault; ``factor`` (> 1) defaults per kind (``DEFAULT_FACTORS``).

    The target depends on the kind: ``rank`` for rank faults, ``host`` (``node001`` or ``1``) for
    ``net_congestion``, ``stage`` for ``stage_imbalance``, none for ``job_slowdown``. The fault is active on
    iteration i (counted from the run's first iteration) iff ``i >= start and (i - start) % every == 0``;
    ``every > 1`` makes it intermittent. ``hang`` stops the rank during iteration ``start`` for good.
    ``function`` applies to ``host_slow`` only: the host function that gets the extra time, by default a
    ``gc.collect`` pause inserted between the backward launch and ``optimizer.step``.
    """

    kind: str
    rank: int = -1
    factor: float | None = None
    """None means the kind's default; always a float after construction."""
    function: str = ""
    """host_slow only; empty means ``gc.collect``."""
    start: int = 0
    every: int = 1
    host: str = ""
    """net_congestion only; normalised to ``node{index:03d}``."""
    stage: int = -1
    """stage_imbalance only: the pipeline stage (pp rank)."""

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"invalid fault: unknown fault kind {self.kind!r} (valid: {', '.join(FAULT_KINDS)})")
        target = TARGETS[self.kind]
        if target == "rank":
            if not _is_int(self.rank) or self.rank < 0:
                p.append(f"rank must be an integer >= 0, got {self.rank!r}")
        elif self.rank != -1:
            p.append(f"rank applies to rank faults only, not {self.kind!r} (it targets a {target})")
        if target == "host":
            index = host_index(self.host) if isinstance(self.host, str) else None
            if index is None:
                p.append(f"host must be a host name like node001 or an index, got {self.host!r}")
            else:
                object.__setattr__(self, "host", host_name(index))
        elif self.host:
            p.append(f"host applies to net_congestion faults only, not {self.kind!r}")
        if target == "stage":
            if not _is_int(self.stage) or self.stage < 0:
                p.append(f"stage must be an integer >= 0, got {self.stage!r}")
        elif self.stage != -1:
            p.append(f"stage applies to stage_imbalance faults only, not {self.kind!r}")
        if self.kind == "hang":
            if self.factor not in (None, 1.0):
                p.append("hang takes no factor")
            object.__setattr__(self, "factor", 1.0)
        elif self.factor is None:
            object.__setattr__(self, "factor", DEFAULT_FACTORS[self.kind])
        factor = self.factor
        if self.kind != "hang" and (not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 1.0):
            p.append(f"factor must be a finite slowdown > 1, got {factor!r}")
        if self.kind == "host_slow":
            if not self.function:
                object.__setattr__(self, "function", GC_FUNCTION)
            elif self.function not in (GC_FUNCTION, *HOST_FUNCTIONS):
                valid = ", ".join((GC_FUNCTION, *HOST_FUNCTIONS))
                p.append(f"unknown host function {self.function!r} (valid: {valid})")
        elif self.function:
            p.append(f"function applies to host_slow faults only, not {self.kind!r}")
        if not _is_int(self.start) or self.start < 0:
            p.append(f"start must be an integer >= 0, got {self.start!r}")
        if not _is_int(self.every) or self.every < 1:
            p.append(f"every must be an integer >= 1, got {self.every!r}")
        elif self.kind == "hang" and self.every != 1:
            p.append("a hang is not intermittent (every must be 1)")
        if p:
            raise ValueError("invalid fault: " + "; ".join(p))

    @property
    def slowdown(self) -> float:
        """The resolved factor as a plain float."""
        return float(self.factor if self.factor is not None else DEFAULT_FACTORS[self.kind])

    @property
    def category(self) -> str:
        """The finding category a detector should report for this fault."""
        return CATEGORIES[self.kind]

    def active(self, iteration: int) -> bool:
        """Whether the fault acts on this iteration (0-based index within the run)."""
        return iteration >= self.start and (iteration - self.start) % self.every == 0

    def target_key(self) -> tuple[str, Any]:
        """What the fault targets, to reject two faults of one kind on one target."""
        target = TARGETS[self.kind]
        value = {"rank": self.rank, "host": self.host, "stage": self.stage, "job": None}[target]
        return target, value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_fault(spec: str) -> Fault:
    """Parse a CLI fault spec: ``kind:target[:factor[:function]][@start][/every]``.

    - ``target``: a rank for slow_gpu, slow_link, host_slow, pcie_downgrade, dataloader_stall,
      cpu_contention and hang; a host (``node001`` or ``1``) for net_congestion; a pipeline stage for
      stage_imbalance; ``-`` for job_slowdown (it hits every rank).
    - ``factor``: a slowdown > 1 (the kind's default when omitted); hang takes none.
    - ``function``: host_slow only, the host function that gets the extra time (default gc.collect).
    - ``@start``: first active iteration (default 0); for hang, the iteration in which the rank stops.
    - ``/every``: active every N iterations from start (default 1: every iteration).

    Examples: ``slow_gpu:7:1.5``, ``slow_link:12``, ``host_slow:3``, ``slow_gpu:7:1.2@10/3``,
    ``net_congestion:node001:1.5``, ``stage_imbalance:1:1.3``, ``job_slowdown:-:1.1@60``, ``hang:5@12``.
    """
    text = spec.strip()

    def bad(problem: str) -> ValueError:
        return ValueError(f"bad fault spec {spec!r}: {problem}")

    m = _SPEC_RE.match(text)
    if m is None:
        raise bad(f"expected {GRAMMAR}")
    parts = m.group("body").split(":")
    if not 2 <= len(parts) <= 4 or not all(parts):
        raise bad(f"expected {GRAMMAR}")
    kind, target_text, *rest = parts
    if kind not in FAULT_KINDS:
        raise bad(f"unknown kind {kind!r} (valid: {', '.join(FAULT_KINDS)})")
    kwargs: dict[str, Any] = {"kind": kind}
    target = TARGETS[kind]
    if target == "job":
        if target_text != "-":
            raise bad(f"{kind} targets the whole job: write '-' as its target, not {target_text!r}")
    elif target == "host":
        kwargs["host"] = target_text
    else:
        try:
            kwargs[target] = int(target_text)
        except ValueError:
            raise bad(f"{target} {target_text!r} is not an integer") from None
    if rest:
        if kind == "hang":
            raise bad(f"hang takes no factor, got {rest[0]!r} (write hang:RANK@START)")
        try:
            kwargs["factor"] = float(rest[0])
        except ValueError:
            raise bad(f"factor {rest[0]!r} is not a number") from None
    if len(rest) == 2:
        kwargs["function"] = rest[1]
    for key in ("start", "every"):
        value = m.group(key)
        if value is None:
            continue
        try:
            kwargs[key] = int(value)
        except ValueError:
            sign = "@" if key == "start" else "/"
            raise bad(f"{key} {value!r} after '{sign}' is not an integer (expected {GRAMMAR})") from None
    try:
        return Fault(**kwargs)
    except ValueError as exc:
        raise bad(str(exc).removeprefix("invalid fault: ")) from None
