"""The stream stages: raw event batches in, iterations, patterns and findings out.

In: Avro event batches from the raw topics (key ``job/rank``). Out: iteration and pattern records
(``<prefix>.iterations``, ``<prefix>.patterns``), rank stall records (``<prefix>.stalls``), findings
(``<prefix>.findings``) and profiling requests (``<prefix>.control``). ``windower`` and ``differential`` hold
each stage (a class without I/O, and its Faust agent), ``app`` declares the app, topics and agents,
``recovery`` saves and restores their state; ``analysis`` holds the pure maths they call. ``offline`` runs
the same stage classes without Kafka.
"""

STAGES = ("windower", "differential")
"""The stream stages, in data-flow order: a worker runs some or all of them (``StreamAppConfig.stages``)."""
