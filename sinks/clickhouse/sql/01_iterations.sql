-- One row per (job, rank, iteration): every field of the IterationRecord (iterations.v1.avsc; later versions' fields: 04_added_columns.sql).
-- ReplacingMergeTree on the natural key: a replay after a crash adds no row once parts merge
-- (query with FINAL, or argMax, when an exact count matters before that).
CREATE TABLE IF NOT EXISTS {database}.iterations
(
    job                   LowCardinality(String),
    rank                  Int32,
    host                  LowCardinality(String),
    world_size            Int32,
    tp_rank               Int32 DEFAULT -1,
    pp_rank               Int32 DEFAULT -1,
    dp_rank               Int32 DEFAULT -1,
    iteration             Int64 CODEC(Delta, ZSTD(1)),
    detected_by           LowCardinality(String),
    start_ns              Int64 CODEC(Delta, ZSTD(1)),
    end_ns                Int64 CODEC(Delta, ZSTD(1)),
    duration_ns           Int64 CODEC(ZSTD(1)),
    gpu_busy_ns           Int64 CODEC(ZSTD(1)),
    compute_ns            Int64 CODEC(ZSTD(1)),
    collective_ns         Int64 CODEC(ZSTD(1)),
    exposed_collective_ns Int64 CODEC(ZSTD(1)),
    idle_ns               Int64 CODEC(ZSTD(1)),
    max_idle_gap_ns       Int64 CODEC(ZSTD(1)),
    kernels               Int32 CODEC(T64, ZSTD(1)),
    functions             Int32 CODEC(T64, ZSTD(1)),
    start_at              DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(start_ns, 'UTC') CODEC(Delta, ZSTD(1)),
    inserted_at           DateTime64(3) DEFAULT now64(3) CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(start_at)
ORDER BY (job, iteration, rank)
