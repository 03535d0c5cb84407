"""Crash recovery of the stream stages: acks held until replay is harmless, state records for the rest.

Why: Faust acks a source message (and commits it soon after) as soon as an agent has seen it, but the
windower keeps a rank's events in memory until their iteration closes, and the differential keeps a
job's history (persistence windows, rolling medians, open findings) for as long as the job runs. A
worker killed in between would resume after offsets whose contribution was never emitted.

1. Each stage takes the acks of its messages over and acks a message only when replaying it could
   change nothing: the windower once the rank's emitted iterations end after every event of the
   message, the differential once the message's iteration is scored. Faust commits only the
   contiguous run of acked offsets, so the committed offset never passes a message that in-memory
   state still needs.
2. What replay cannot rebuild in bounded time goes to a state topic, one record per rank or job
   (latest wins, compacted, partition = the source partition): the windower's last emitted
   iteration, the differential's job state without the pattern records still waiting for ranks.
   A record is written after the outputs it covers were delivered and before the messages it covers
   are acked, and Faust flushes its producer before it commits offsets. So the newest record after a
   crash is never older than the committed offsets imply, and every output it covers exists.
3. After a restart or a rebalance a stage reads its partition's state records before it touches the
   partition's first message, re-reads from the committed offsets and skips what the records cover.
   Re-emitted outputs repeat the first ones' natural keys, and the sink stores each key once.

``statelog`` reads and writes the state topics, ``holds`` keeps the un-acked messages, ``windower`` and
``differential`` hold each stage's side. What a rebalance changes (epochs, the input clock, acks) is in
``fleetscope.streams.rebalance``.
"""

from fleetscope.streams.recovery.differential import DifferentialRecovery, JobState, dump_job_state, load_job_state
from fleetscope.streams.recovery.statelog import RecoveryError, StateLog
from fleetscope.streams.recovery.unacked import EARLIEST, UnackedMessages
from fleetscope.streams.recovery.windower import RankId, WindowerRecovery

__all__ = [
    "EARLIEST", "DifferentialRecovery", "JobState", "RankId", "RecoveryError", "StateLog", "UnackedMessages",
    "WindowerRecovery", "dump_job_state", "load_job_state",
]  # fmt: skip
