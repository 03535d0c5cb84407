"""The CLI's simulated-job options reach the simulator: layouts (--tp/--pp) validated, hang as the help writes it."""

from __future__ import annotations

import pytest

from fleetscope.cli import build_parser
from fleetscope.commands.options import simulator_config


def sim(*argv: str) -> object:
    return simulator_config(build_parser().parse_args(["demo", *argv]))


def test_tp_and_pp_reach_the_simulator() -> None:
    cfg = sim("--pp", "4", "--fault", "stage_imbalance:2:1.3")
    assert (cfg.tp, cfg.pp) == (1, 4)  # type: ignore[attr-defined]
    cfg = sim("--tp", "4", "--pp", "2", "--ranks", "32")
    assert (cfg.tp, cfg.pp, cfg.ranks) == (4, 2, 32)  # type: ignore[attr-defined]


def test_a_layout_that_does_not_divide_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"multiple of tp \* pp"):
        sim("--tp", "5", "--ranks", "32")


def test_hang_without_start_stops_the_rank_halfway() -> None:
    (fault,) = sim("--fault", "hang:9", "--iterations", "40").faults  # type: ignore[attr-defined]
    assert (fault.kind, fault.rank, fault.start) == ("hang", 9, 20)
    (fault,) = sim("--fault", "hang:9@5").faults  # type: ignore[attr-defined]
    assert fault.start == 5


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("fleetscope ")


def test_undelivered_batches_fail_the_publishing_command() -> None:
    from fleetscope.demo import check_delivered
    from fleetscope.errors import BrokerUnreachable, describe
    from fleetscope.producers import PublisherStats

    check_delivered(PublisherStats(published=80, delivered=80), "127.0.0.1:1")
    with pytest.raises(BrokerUnreachable) as info:
        check_delivered(PublisherStats(published=80, delivered=0, spooled=80, spool_records=80), "127.0.0.1:1")
    assert "80 of 80 batches undelivered: 0 lost, 80 kept in the spool" in str(info.value)
    lines, status = describe(info.value, "simulate")
    assert status == 1 and len(lines) == 2 and lines[0].startswith("fleetscope simulate: no Kafka broker answers")
    with pytest.raises(BrokerUnreachable, match="3 lost"):
        check_delivered(PublisherStats(published=10, delivered=7, spool_dropped=3), "b:1")


def test_broker_down_notice_is_one_line_per_period(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from fleetscope.broker import BrokerDownNotice

    notice = BrokerDownNotice("alerts", "127.0.0.1:1", every_s=60)
    record = logging.LogRecord("rdkafka", logging.ERROR, "", 0, "Connect to ipv4#127.0.0.1:1 failed", None, None)
    for _ in range(50):
        notice.filter(record)
    assert capsys.readouterr().err.splitlines() == ["fleetscope alerts: broker 127.0.0.1:1 unreachable; retrying"]
