"""librdkafka's own log lines, routed into ``logging`` (not stderr) and thinned out.

While a broker is away, librdkafka reports every reconnect attempt; one line of each kind per ``interval_s``
says enough, and the publisher's counters carry the rest.
"""

from __future__ import annotations

import logging

from fleetscope.telemetry import RepeatFilter

CLIENT_LOGGER = logging.getLogger("fleetscope.producers.publisher.librdkafka")
CLIENT_LOGGER.addFilter(RepeatFilter(30.0))
