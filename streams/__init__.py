"""The stream stages: raw event batches in, iterations, patterns and findings out.

In: Avro event batches from the raw topics (key ``job/rank``). Out: iteration and pattern records
(``<prefix>.iterations``, ``<prefix>.patterns``), findings (``<prefix>.findings``) and profiling requests
(``<prefix>.control``). ``app`` declares the Faust agents; ``analysis`` holds the pure maths they call,
which ``offline`` runs without Kafka.
"""

STAGES = ("windower", "differential")
"""The stream stages, in data-flow order: a worker runs some or all of them (``StreamAppConfig.stages``)."""
