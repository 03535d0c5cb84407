"""Control requests: the Avro contract and validation."""

import pytest

from fleetscope.producers.control import ControlRequest
from fleetscope.schemas import decode, encode


def test_a_request_round_trips_through_the_catalog() -> None:
    request = ControlRequest(job="j", duration_s=20, start_at_ns=10**18, reason="slow", requested_by="ops")
    subject, record = decode(encode("control", request.to_record()))
    assert subject == "control"
    assert ControlRequest.from_record(record) == request
    assert request.end_at_ns == 10**18 + 20 * 10**9


def test_invalid_requests_report_every_problem() -> None:
    with pytest.raises(ValueError, match="job.*action.*duration_s"):
        ControlRequest(job="", action="reboot", duration_s=0, start_at_ns=0)
