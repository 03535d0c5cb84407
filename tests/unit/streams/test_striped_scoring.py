"""The head's and the scorers' sides of scoring across workers (``streams.striped_scoring``), without the
broker: frames cut and joined, stripes spread, a duplicate score ignored, an overdue request sent again, and
a frame that is no request's refused with its reason. Over the real broker:
tests/integration/test_striped_scoring.py."""

from __future__ import annotations

import os
import pickle
import struct

import pytest

from fleetscope.config import ConfigError, load_config
from fleetscope.schemas import SchemaError
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.striped_scoring import (
    KafkaScoring,
    Reassembly,
    StripeScorer,
    encode_request,
    frame_head,
    frame_headers,
    frame_refused,
    frames,
    load_body,
    stripe_of,
)
from tests.unit.streams.test_scoring_pool import messages

Sent = list[tuple[int, bytes, bytes]]


def test_a_body_cut_into_frames_comes_back_whole_in_any_order_and_a_stray_frame_is_refused() -> None:
    body = os.urandom(10_000)
    cut = frames(b"Q", b"r" * 16, [body[:3333], body[3333:3334], body[3334:]], 1024)  # pieces across frames
    assert len(cut) == 10 and all(len(f) <= 1024 + 29 for f in cut)
    joined = Reassembly(b"Q")
    assert [joined.take(f) for f in reversed(cut[1:])] == [None] * 9
    assert joined.take(cut[0]) == (b"r" * 16, body)
    one, other = frames(b"Q", b"t" * 16, [body], 4096), frames(b"Q", b"t" * 16, [body[::-1]], 4096)
    mixed = [joined.take(f) for pair in zip(one, other, strict=True) for f in pair]  # two copies, interleaved
    assert [m for m in mixed if m is not None] == [(b"t" * 16, body), (b"t" * 16, body[::-1])]
    with pytest.raises(SchemaError, match="scoring frame"):
        Reassembly(b"S").take(cut[0])  # a request's frame is no score's
    with pytest.raises(SchemaError, match="head"):
        joined.take(b"Q1")


def test_a_request_that_would_run_code_is_refused_with_its_reason() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    head = pickle.dumps({"job": "j", "reply": 0, "sizes": [-1], "records": [Evil()]})
    value = struct.pack(">c16s4sII", b"Q", b"x" * 16, b"copy", 0, 1) + struct.pack(">I", len(head)) + head
    with pytest.raises(SchemaError, match="does not unpickle"):
        StripeScorer(DifferentialConfig(), 1024).take(value)


def test_a_jobs_consecutive_iterations_go_to_every_stripe_in_turn() -> None:
    for stripes in (1, 2, 3, 8):
        got = [stripe_of("job-a", i, stripes) for i in range(4 * stripes)]
        assert sorted(got) == sorted(list(range(stripes)) * 4)
        assert all(got[i] != got[i + 1] for i in range(len(got) - 1)) or stripes == 1


def _score(sent: Sent) -> tuple[bytes, object, object, float]:
    """A score's request id and what it says of the ranks."""
    request, body = Reassembly(b"S").take(sent[0][2]) or (b"", b"")
    score = load_body(body, "score")["score"].score
    return request, score.signals, score.hosts, score.iteration_ns


def _heads(sent: Sent) -> list[tuple[int, bytes, tuple[bytes, int, int]]]:
    """Where each frame went, and its request id and place."""
    return [(p, k, frame_head(v, b"Q")) for p, k, v in sent]


def _scoring(sent: Sent, now: list[float]) -> KafkaScoring:
    return KafkaScoring(lambda p, k, v: sent.append((p, k, v)), 4, 8192, lambda job: 2, 10.0, clock=lambda: now[0])


def test_the_first_score_of_a_request_is_taken_and_a_duplicate_or_a_stranger_is_ignored() -> None:
    batch = messages("gpu+host, flat", iterations=2)
    sent: Sent = []
    scoring = _scoring(sent, [0.0])
    future = scoring.submit("pool", batch[:16], {})
    assert {p for p, _, _ in sent} == {stripe_of("pool", 0, 4)} and len(sent) > 1  # one stripe, several frames
    scorer = StripeScorer(DifferentialConfig(), 8192)
    scores: Sent = [s for _, _, v in sent for s in scorer.take(v, 0)]
    assert {p for p, _, _ in scores} == {2}  # the job's patterns partition: its head
    again = [s for _, _, v in sent for s in scorer.take(v, 0)]  # re-delivered: scored again, to the same score
    assert _score(again) == _score(scores)
    taken = [scoring.receive(v) for _, _, v in scores]
    assert taken[-1] and not any(taken[:-1]) and future.done()
    assert [scoring.receive(v) for _, _, v in again] == [False] * len(again)
    other = StripeScorer(DifferentialConfig(), 8192)
    stranger = [s for v in encode_request("pool", b"s" * 16, 2, batch[:16], 8192) for s in other.take(v)]
    assert stranger and not any(scoring.receive(v) for _, _, v in stranger)  # a request not sent here
    assert scoring.duplicates == len(again) + len(stranger) and scoring.in_flight() == 0


def test_an_overdue_request_is_sent_again_later_each_time_and_a_cancelled_one_is_forgotten() -> None:
    batch = messages("gpu+host, flat", iterations=2)
    sent: Sent = []
    now = [0.0]
    scoring = _scoring(sent, now)
    first = scoring.submit("pool", batch[:16], {})
    frames_sent = len(sent)
    now[0] = 9.0
    assert scoring.resend_overdue() == 0
    now[0] = 10.0
    assert scoring.resend_overdue() == 1 and _heads(sent[frames_sent:]) == _heads(sent[:frames_sent])  # again
    now[0] = 29.0
    assert scoring.resend_overdue() == 0  # twice as long: due at 30 s
    now[0] = 30.0
    assert scoring.resend_overdue() == 1
    first.cancel()  # the job's partition moved: the stage forgets its iterations
    assert scoring.in_flight() == 0 and scoring.resend_overdue() == 0


def test_scoring_across_workers_is_refused_with_scoring_processes_or_without_the_differential() -> None:
    assert load_config(env={}, overrides={"streams.score_across_workers": True}).streams.score_across_workers
    for clash in ({"streams.scoring_processes": 2}, {"streams.stages": ["windower"]}):
        with pytest.raises(ConfigError, match="score_across_workers needs the differential stage"):
            load_config(env={}, overrides={"streams.score_across_workers": True, **clash})


def test_a_frame_without_the_workers_signature_is_refused_and_a_signed_one_only_on_its_own_topic() -> None:
    """A score decides findings, and a request decides its score: with the findings' key set, a frame that
    anyone could write to either topic never reaches a scorer or a head."""
    secret, value = b"k" * 32, frames(b"Q", b"r" * 16, [b"payload"], 1024)[0]
    headers = frame_headers(secret, "p.score-requests", b"job", value)
    assert frame_refused(secret, "p.score-requests", b"job", value, headers) is None
    assert "no fleetscope-mac header" in (frame_refused(secret, "p.score-requests", b"job", value, []) or "")
    assert "does not verify" in (frame_refused(secret, "p.scores", b"job", value, headers) or "")
    assert (
        frame_headers(b"", "p.scores", b"job", value) == [] and frame_refused(b"", "p.scores", b"j", value, []) is None
    )
