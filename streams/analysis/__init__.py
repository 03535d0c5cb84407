"""Pure functions and state machines of the stream stages (numpy in, records out; no I/O): iteration
windowing, pattern statistics, peer comparison and outlier scoring."""
