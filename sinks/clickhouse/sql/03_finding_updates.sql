-- Every state change of every finding (findings.v1.avsc): open, update, closed. The version is in
-- the key, so only a replayed copy of the same change collapses; the `findings` view reads the latest.
CREATE TABLE IF NOT EXISTS {database}.finding_updates
(
    finding_id      String,
    status          LowCardinality(String),
    version         Int64,
    job             LowCardinality(String),
    rank            Int32,
    ranks           Array(Int32),
    host            LowCardinality(String),
    category        LowCardinality(String),
    function        LowCardinality(String),
    metric          LowCardinality(String),
    value           Float64,
    peer_median     Float64,
    score           Float64,
    iteration_first Int64,
    iteration_last  Int64,
    est_loss_ns     Int64,
    evidence        String CODEC(ZSTD(3)),
    emitted_ns      Int64,
    emitted_at      DateTime64(3, 'UTC') DEFAULT fromUnixTimestamp64Nano(emitted_ns, 'UTC'),
    inserted_at     DateTime64(3) DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (job, finding_id, version)
