"""Cut the stored excerpt of a public Kineto trace: its steps' kernels, their launches and phase annotations.

Rule: keep the header, the ``ProfilerStep#N`` spans, the ``## forward/backward/optimizer ##`` annotations,
every kernel inside a step and the runtime call that launched it (by correlation), each event unchanged; drop
the rest (CPU operators, flows, memcpys), which the job builder (``tests/realtrace_jobs.py``) does not read.
Why: the source is 9.8 MB of JSON; the excerpt keeps what is real about its GPU work in a few hundred KB.
``python bench/real_trace_excerpt.py SOURCE.json[.gz] OUT.json.gz`` prints the sizes.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

PHASES = ("## forward ##", "## backward ##", "## optimizer ##")


def excerpt(doc: dict[str, Any]) -> dict[str, Any]:
    """The header and the events the rule keeps, in their source order."""
    events = doc["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]

    def in_step(e: dict[str, Any]) -> bool:
        return any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)

    kernels = [e for e in events if e.get("cat") == "kernel" and in_step(e)]
    launched = {e["args"]["correlation"] for e in kernels}
    keep = [
        e
        for e in events
        if e in steps
        or (e.get("cat") == "user_annotation" and e.get("name") in PHASES)
        or (e.get("cat") == "kernel" and in_step(e))
        or (e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in launched)
    ]
    head = {k: v for k, v in doc.items() if k not in ("traceEvents", "INFO")}
    return {**head, "traceEvents": keep}


def main(argv: list[str]) -> int:
    src, out = Path(argv[0]), Path(argv[1])
    raw = src.read_bytes()
    doc = json.loads(gzip.decompress(raw) if src.suffix == ".gz" else raw)
    cut = excerpt(doc)
    data = gzip.compress(json.dumps(cut, separators=(",", ":")).encode(), 9, mtime=0)
    out.write_bytes(data)
    print(f"{src}: {len(doc['traceEvents'])} events -> {len(cut['traceEvents'])} kept, {len(data) / 1024:.0f} KiB gz")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
