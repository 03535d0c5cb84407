"""The Kafka publisher every producer shares: ``EventBatch`` es in, Avro messages on the raw topics out.

``config``: settings and counters; ``core``: the ``Publisher`` and its background thread (delivery callbacks,
outage recovery); ``backlog`` and ``spool``: where messages wait, in order and bounded, while older ones or the
broker are not ready; ``client_log``: librdkafka's own log lines.
"""

from fleetscope.producers.publisher.config import PublisherConfig, PublisherStats
from fleetscope.producers.publisher.core import Publisher
from fleetscope.producers.publisher.disk_spool import DiskSpool
from fleetscope.producers.publisher.spool import MemorySpool, SpoolError, SpoolRecord

__all__ = ["DiskSpool", "MemorySpool", "Publisher", "PublisherConfig", "PublisherStats", "SpoolError", "SpoolRecord"]
