"""A job's iterations scored apart from its history (``score_records``: pure) and tracked in order
(``JobDifferential.apply``) give what scoring them as they complete gives: the cut that lets a job's
iterations be scored by other processes."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import decode, encode
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential, score_records
from fleetscope.streams.offline import OfflinePipeline

JOBS = {
    "gpu+host, flat": dict(ranks=16, faults=("slow_gpu:6:1.4", "host_slow:11:1.5")),
    "link+pcie, tp2 pp2": dict(ranks=16, tp=2, pp=2, faults=("slow_link:9:1.3", "pcie_downgrade:12:1.5")),
    "stage + stall, pp4": dict(ranks=16, pp=4, faults=("stage_imbalance:2:1.3", "dataloader_stall:5:1.5")),
    "healthy, dp2 tp2 pp2": dict(ranks=8, tp=2, pp=2, faults=()),
}
PINNED = {
    "gpu+host, flat": (
        "88763d02c13b9297179c29f81e59f3ad9c3046668b1867e5969424e715417268",
        "295b8751da714a6255dbe4b994b573e03531e4d2134808efe91181db1f8da683",
    ),
    "link+pcie, tp2 pp2": (
        "611a0cfcbf8e3a8c7eb4c4eac64761868dcf7fc8cbe75226aa265bbea0d0859c",
        "d6a2e032a628011fc822dcf5320527b16ba9d256f208c043384564a70f32e5aa",
    ),
    "stage + stall, pp4": (
        "461a28cffe10d0ae525786bc996c6b2a6f2d2f2da052e62a0a5e60635d25dcc5",
        "46136cba330ccf87ef674021097ee8dacc767f561b16c6feb8db5ea0cad71324",
    ),
    "healthy, dp2 tp2 pp2": (
        "252701544a3c2fd4a77312805498976f9fbb953c521caf7b59672adaa92fa984",
        "b0d45f68e2cd72bd9f13975c3930d3db7f826e16df81c495b32f3e3b5178aa73",
    ),
}
"""Per job: SHA-256 of its iterations' scores (``canonical``, in iteration order) and of its finding updates
(less ``emitted_ns``): pinned so that a change made for speed is seen to keep the scoring's results bit for
bit. A change of the simulator, the windower or a rule changes them on purpose: re-pin from the message."""


def patterns(name: str) -> list[dict[str, Any]]:
    spec = JOBS[name]
    cfg = SimulatorConfig(
        job="cut", iterations=24, seed=7, **{**spec, "faults": tuple(map(parse_fault, spec["faults"]))}
    )
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    return pipeline.patterns


def canonical(value: Any) -> str:
    """Every value as exact text: floats by their bits (``float.hex``), arrays by dtype, shape and bytes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={canonical(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    if hasattr(value, "__slots__") and not isinstance(value, (tuple, np.ndarray)):
        fields = ",".join(f"{s}={canonical(getattr(value, s))}" for s in value.__slots__)
        return f"{type(value).__name__}({fields})"
    if isinstance(value, np.ndarray):
        data = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return f"array({value.dtype},{value.shape},{data})"
    if isinstance(value, (float, np.floating)):
        return float(value).hex()
    if isinstance(value, (bool, np.bool_)):
        return repr(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, dict):
        return "{" + ",".join(f"{canonical(k)}:{canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(canonical(v) for v in value)) + ")"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}(" + ",".join(canonical(v) for v in value) + ")"
    if value is None or isinstance(value, str):
        return repr(value)
    raise TypeError(f"no canonical form for {type(value).__name__}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _updates(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in u.items() if k != "emitted_ns"} for u in found]


@pytest.mark.parametrize("name", list(JOBS))
def test_iterations_scored_out_of_order_elsewhere_and_tracked_in_order_find_what_inline_scoring_finds(
    name: str,
) -> None:
    records = patterns(name)
    inline = JobDifferential("cut")
    expected = [u for rec in records for u in inline.add(rec)] + inline.flush()
    if "healthy" not in name:
        assert any(u["status"] == "open" for u in expected)  # a fault to find: the comparison compares something
    by_iteration: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        by_iteration.setdefault(int(rec["iteration"]), []).append(rec)
    config = DifferentialConfig()
    # newest first, each as decoded from Avro (the worker's records) and its score through pickle (as to another
    # process and back)
    scores = {
        it: pickle.loads(pickle.dumps(score_records([decode(encode("patterns", r))[1] for r in recs], config)))
        for it, recs in sorted(by_iteration.items(), reverse=True)
    }
    tracked = JobDifferential("cut")
    got = [u for it in sorted(scores) for u in tracked.apply(it, scores[it])] + tracked.flush()
    assert _updates(got) == _updates(expected)
    assert tracked.iterations_scored == 0 and inline.iterations_scored == len(by_iteration)
    digests = (_digest("".join(canonical(scores[it]) for it in sorted(scores))), _digest(canonical(_updates(got))))
    assert digests == PINNED[name], f"{name}: scores or findings changed, digests now {digests}"
