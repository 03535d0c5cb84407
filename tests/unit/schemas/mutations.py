"""Messages damaged the ways a network, a disk or a bad producer damages them: for decoders that must end
on them exactly as the reference decoder does."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, messages: Sequence[bytes]) -> bytes:
    """One of ``messages`` with 1-3 bits flipped, bytes replaced, cut, extended or bytes spliced in."""
    data = bytearray(draw(st.sampled_from(messages)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "extend", "splice"]))
        i = draw(st.integers(0, len(data) - 1)) if data else 0
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[i:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)
