-- One row per (job, rank, iteration, function): a PatternBatch (patterns.v1.avsc) exploded, its
-- per-batch fields repeated on every function row. Float64 columns hold NaN where a figure does not
-- apply (e.g. link throughput when no sample fell inside the function).
CREATE TABLE IF NOT EXISTS {database}.function_patterns
(
    job                LowCardinality(String),
    rank               Int32,
    host               LowCardinality(String),
    world_size         Int32,
    tp_rank            Int32 DEFAULT -1,
    pp_rank            Int32 DEFAULT -1,
    dp_rank            Int32 DEFAULT -1,
    iteration          Int64 CODEC(Delta, ZSTD(1)),
    iteration_start_ns Int64 CODEC(Delta, ZSTD(1)),
    iteration_ns       Int64 CODEC(ZSTD(1)),
    function           LowCardinality(String),
    kind               UInt8,
    kind_name          LowCardinality(String),
    calls              Int32 CODEC(T64, ZSTD(1)),
    total_ns           Int64 CODEC(ZSTD(1)),
    mean_ns            Float64 CODEC(ZSTD(1)),
    p50_ns             Float64 CODEC(ZSTD(1)),
    p99_ns             Float64 CODEC(ZSTD(1)),
    max_ns             Int64 CODEC(ZSTD(1)),
    cv                 Float64 CODEC(ZSTD(1)),
    share              Float64 CODEC(ZSTD(1)),
    nbytes             Int64 CODEC(T64, ZSTD(1)),
    algbw_gbps         Float64 CODEC(ZSTD(1)),
    busbw_gbps         Float64 CODEC(ZSTD(1)),
    nvlink_mean_bps    Float64 CODEC(ZSTD(1)),
    nvlink_cv          Float64 CODEC(ZSTD(1)),
    nvlink_peak_bps    Float64 CODEC(ZSTD(1)),
    pcie_mean_bps      Float64 CODEC(ZSTD(1)),
    pcie_cv            Float64 CODEC(ZSTD(1)),
    pcie_peak_bps      Float64 CODEC(ZSTD(1)),
    iteration_start    DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(iteration_start_ns, 'UTC') CODEC(Delta, ZSTD(1)),
    inserted_at        DateTime64(3) DEFAULT now64(3) CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(iteration_start)
ORDER BY (job, function, iteration, rank)
