"""A dead-letter reason is words: a cut-short message's reason names what failed, never an object's repr."""

from __future__ import annotations

import re

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import encode_event_batch
from fleetscope.streams.intake import intake
from fleetscope.streams.reasons import reason

WALL_NS = 1_767_225_600_000_000_000 + 30 * 86_400 * 10**9
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}|object at")


def test_a_truncated_message_is_refused_with_words_not_an_object_repr() -> None:
    """fastavro's EOFError reads ``cannot read double from <_io.BytesIO object at 0x7f...>``."""
    batches = simulate(SimulatorConfig(job="r", ranks=2, iterations=2))
    message = next(encode_event_batch(b) for b in batches if b.kind.value == "throughput")  # read by fastavro
    cuts = range(8, len(message), 7)
    refused = {intake(message[:cut], {}, 0, None, wall_ns=WALL_NS).reason for cut in cuts}
    refused.discard(None)
    assert refused, "a cut-short message is refused"
    assert [r for r in refused if r is not None and ADDRESS.search(r)] == []
    assert any(r is not None and r.startswith("schema: malformed Avro") and "from a BytesIO" in r for r in refused)


def test_a_reason_is_one_line_of_words_whatever_the_exception_holds() -> None:
    class Window:
        pass

    text = reason("windower", ValueError(f"bad {object()!r}\n in {Window()!r}"))
    assert text == "windower: bad a object in a Window"
    assert reason("schema", EOFError()) == "schema: EOFError"
