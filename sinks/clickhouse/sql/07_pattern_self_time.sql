-- patterns.v2 self_ns: a host function's own time (children and blocking calls left out), for stores
-- created before it; 0 where a producer predates it.
ALTER TABLE {database}.function_patterns ADD COLUMN IF NOT EXISTS self_ns Int64 DEFAULT 0 CODEC(ZSTD(1)) AFTER total_ns;
