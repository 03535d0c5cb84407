"""The windower's Faust agent run through Faust's ``test_context`` (in-memory channels, no broker): a message
that is no event batch goes whole to the dead-letter topic with its reason and costs nothing else; a valid
batch is windowed and its message held until its iteration is emitted."""

from __future__ import annotations

import asyncio

import faust

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import Topics, encode_event_batch
from fleetscope.streams.counters import StageCounters
from fleetscope.streams.deadletter import DeadLetters
from fleetscope.streams.rebalance import Gate, InputClock
from fleetscope.streams.recovery import StateLog, WindowerRecovery
from fleetscope.streams.windower import WindowerAgent, WindowerStage

RAW = faust.Schema(key_serializer="raw", value_serializer="raw")
UNREACHABLE = "127.0.0.1:1"
"""No broker: nothing in this test may need one."""


def windower_app() -> tuple[faust.App, WindowerAgent, faust.ChannelT, faust.agents.AgentT]:
    """An app with the windower agent whose dead letters and stall reports go to in-memory channels; the
    state topic's partition 0 counts as read (empty), since reading it needs a broker."""
    app = faust.App("windower-test", broker=f"kafka://{UNREACHABLE}", store="memory://", web_enabled=False)
    counters = StageCounters()
    dead_letters = app.channel(schema=RAW)
    recovery = WindowerRecovery(StateLog(app, "t.windower-state", 1, UNREACHABLE))
    recovery._loaded.add(0)
    windower = WindowerAgent(
        app, WindowerStage(), recovery, topics=Topics(prefix="t"), stalls=app.channel(schema=RAW),
        counters=counters, dead=DeadLetters(dead_letters, counters, 1 << 20), gate=Gate(), clock=InputClock(),
    )  # fmt: skip

    async def windower_agent(stream: faust.StreamT) -> None:
        await windower.run(stream, max_events=100, within_s=0.05)

    agent = app.agent(app.channel(schema=RAW), name="windower")(windower_agent)
    return app, windower, dead_letters, agent


def test_the_agent_dead_letters_a_bad_message_and_windows_a_good_one() -> None:
    app, windower, dead_letters, agent = windower_app()
    first = next(iter(simulate(SimulatorConfig(ranks=2, iterations=2))))

    async def run() -> faust.EventT:
        refused = dead_letters.clone(is_iterator=True)  # subscribed before anything is sent
        async with agent.test_context(channel=app.channel(schema=RAW)) as tested:
            await tested.put(b"not avro", key=b"demo/0")
            await tested.put(encode_event_batch(first), key=b"demo/0")
            return await refused.get(timeout=5.0)

    dead = asyncio.run(run())
    assert (dead.key, dead.value) == (b"demo/0", b"not avro")  # whole, as it came
    assert dead.headers["reason"].startswith(b"schema:")
    assert windower.counters.per_reason == {"schema": 1}
    assert windower.counters.raw_batches == 1
    assert windower.counters.raw_events == len(first)
    assert set(windower.stage.windowers) == {(first.header.job, first.header.rank)}
    assert len(windower.recovery.unacked.owners()) == 1  # its iteration is open: replay still needs the message
