-- Columns added by later schema versions (iterations.v2/v3, patterns.v2/v3, findings.v2), for stores created
-- before them: ADD COLUMN IF NOT EXISTS is a no-op on a store that already has them.
ALTER TABLE {database}.iterations ADD COLUMN IF NOT EXISTS profiled Bool DEFAULT false AFTER functions;
ALTER TABLE {database}.function_patterns ADD COLUMN IF NOT EXISTS profiled Bool DEFAULT false AFTER pcie_peak_bps;
ALTER TABLE {database}.finding_updates ADD COLUMN IF NOT EXISTS subject String DEFAULT '' AFTER emitted_ns;
ALTER TABLE {database}.finding_updates ADD COLUMN IF NOT EXISTS reason LowCardinality(String) DEFAULT '' AFTER subject;
ALTER TABLE {database}.finding_updates ADD COLUMN IF NOT EXISTS local_rank Int32 DEFAULT -1 AFTER reason;
ALTER TABLE {database}.finding_updates ADD COLUMN IF NOT EXISTS gpu_uuid LowCardinality(String) DEFAULT '' AFTER local_rank;
ALTER TABLE {database}.finding_updates ADD COLUMN IF NOT EXISTS pci_bus_id LowCardinality(String) DEFAULT '' AFTER gpu_uuid;
ALTER TABLE {database}.iterations ADD COLUMN IF NOT EXISTS local_rank Int32 DEFAULT -1 AFTER profiled;
ALTER TABLE {database}.iterations ADD COLUMN IF NOT EXISTS gpu_uuid LowCardinality(String) DEFAULT '' AFTER local_rank;
ALTER TABLE {database}.function_patterns ADD COLUMN IF NOT EXISTS local_rank Int32 DEFAULT -1 AFTER profiled;
ALTER TABLE {database}.function_patterns ADD COLUMN IF NOT EXISTS gpu_uuid LowCardinality(String) DEFAULT '' AFTER local_rank;
ALTER TABLE {database}.iterations ADD COLUMN IF NOT EXISTS cpu_wait_ns Int64 DEFAULT -1 CODEC(ZSTD(1)) AFTER gpu_uuid;
ALTER TABLE {database}.function_patterns ADD COLUMN IF NOT EXISTS cpu_wait_ns Int64 DEFAULT -1 CODEC(ZSTD(1)) AFTER gpu_uuid;
