"""A rank-iteration's functions within bounds (pure): whatever a producer sends, its pattern message fits the
topic, and the rows past the bounds are counted, not dropped."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind
from fleetscope.schemas.vocabulary import OTHER_FUNCTIONS

_SUMMED = ("calls", "total_ns", "self_ns", "share")


def capped_functions(
    names: list[str], columns: dict[str, npt.NDArray[Any]], max_functions: int, max_chars: int
) -> tuple[list[str], dict[str, npt.NDArray[Any]]]:
    """One rank-iteration's functions within its caps: at most ``max_functions`` rows and ``max_chars``
    characters of names, so its pattern message fits the topic whatever a producer sends. The longest by
    total time are kept, in their order; the rest become one ``OTHER_FUNCTIONS`` row at the end that sums
    their calls, times and shares (its longest call is theirs; its mean their total over their calls), with
    no statistics of a single function (p50, p99, CV, bandwidths: 0; links: NaN, no samples). Rows of
    names a full name table filed as ``OTHER_FUNCTIONS`` join that row."""
    if len(names) <= max_functions and sum(map(len, names)) <= max_chars and OTHER_FUNCTIONS not in names:
        return names, columns
    lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    filed = np.fromiter((n == OTHER_FUNCTIONS for n in names), dtype=bool, count=len(names))
    order = np.argsort(-columns["total_ns"], kind="stable")
    order = np.concatenate((order[~filed[order]], order[filed[order]]))  # rows filed as other stay other
    lengths[filed] = max_chars + 1
    fits = np.cumsum(lengths[order]) <= max_chars - len(OTHER_FUNCTIONS)
    n_kept = min(max_functions - 1, int(np.argmin(fits)) if not fits.all() else fits.size)
    kept, rest = np.sort(order[:n_kept]), order[n_kept:]
    other: dict[str, Any] = {key: np.sum(columns[key][rest]) for key in _SUMMED}
    other["max_ns"] = np.max(columns["max_ns"][rest])
    other["mean_ns"] = other["total_ns"] / max(int(other["calls"]), 1)
    other["kind"] = int(FunctionKind.MEMORY)
    out = {}
    for key, col in columns.items():
        value = other.get(key, np.nan if key.endswith(_LINK_SUFFIXES) else 0)
        out[key] = np.concatenate((col[kept], np.asarray([value], dtype=col.dtype)))
    return [names[j] for j in kept.tolist()] + [OTHER_FUNCTIONS], out


_LINK_SUFFIXES = ("_mean_bps", "_cv", "_peak_bps")
