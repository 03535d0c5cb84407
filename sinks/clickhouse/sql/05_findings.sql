-- Current state of each finding: one row per (job, finding_id) with the fields of its latest version.
-- Named like the findings JSON (job, rank, ranks, ... evidence) plus finding_id, status, version and
-- first/last seen. An 'update' is still open. Source columns are renamed in the inner query so the
-- outer aliases cannot shadow the argMax arguments.
CREATE OR REPLACE VIEW {database}.findings AS
SELECT
    job,
    finding_id,
    if(argMax(u_status, u_version) = 'closed', 'closed', 'open') AS status,
    max(u_version)                                               AS version,
    argMax(u_rank, u_version)                                    AS rank,
    argMax(u_ranks, u_version)                                   AS ranks,
    argMax(u_host, u_version)                                    AS host,
    argMax(u_category, u_version)                                AS category,
    argMax(u_function, u_version)                                AS function,
    argMax(u_metric, u_version)                                  AS metric,
    argMax(u_value, u_version)                                   AS value,
    argMax(u_peer_median, u_version)                             AS peer_median,
    argMax(u_score, u_version)                                   AS score,
    argMax(u_iteration_first, u_version)                         AS iteration_first,
    argMax(u_iteration_last, u_version)                          AS iteration_last,
    argMax(u_est_loss_ns, u_version)                             AS est_loss_ns,
    argMax(u_evidence, u_version)                                AS evidence,
    argMax(u_subject, u_version)                                 AS subject,
    argMax(u_reason, u_version)                                  AS reason,
    argMax(u_local_rank, u_version)                              AS local_rank,
    argMax(u_gpu_uuid, u_version)                                AS gpu_uuid,
    argMax(u_pci_bus_id, u_version)                              AS pci_bus_id,
    min(u_emitted_ns)                                            AS first_seen_ns,
    max(u_emitted_ns)                                            AS last_seen_ns,
    min(u_emitted_at)                                            AS first_seen,
    max(u_emitted_at)                                            AS last_seen
FROM
(
    SELECT
        job,
        finding_id,
        status          AS u_status,
        version         AS u_version,
        rank            AS u_rank,
        ranks           AS u_ranks,
        host            AS u_host,
        category        AS u_category,
        function        AS u_function,
        metric          AS u_metric,
        value           AS u_value,
        peer_median     AS u_peer_median,
        score           AS u_score,
        iteration_first AS u_iteration_first,
        iteration_last  AS u_iteration_last,
        est_loss_ns     AS u_est_loss_ns,
        evidence        AS u_evidence,
        subject         AS u_subject,
        reason          AS u_reason,
        local_rank      AS u_local_rank,
        gpu_uuid        AS u_gpu_uuid,
        pci_bus_id      AS u_pci_bus_id,
        emitted_ns      AS u_emitted_ns,
        emitted_at      AS u_emitted_at
    FROM {database}.finding_updates
)
GROUP BY job, finding_id
