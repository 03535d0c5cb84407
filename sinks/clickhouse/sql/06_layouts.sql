-- The layout of each job: one row per (job, rank) with its host, world size, tensor/pipeline/data-parallel
-- coordinates (from its latest iteration: producers derive them from the job's process groups) and the
-- job's sizes (the largest coordinate + 1; 1 while unknown). stage = pp_rank. Join on (job, rank), e.g.
-- findings by stage: SELECT l.stage, f.category FROM findings f JOIN layouts l ON f.job = l.job AND f.rank = l.rank.
-- Source columns are renamed in the inner queries so the outer aliases cannot shadow the arguments.
CREATE OR REPLACE VIEW {database}.layouts AS
SELECT
    r.job                      AS job,
    r.rank                     AS rank,
    r.l_host                   AS host,
    r.l_world_size             AS world_size,
    r.l_tp_rank                AS tp_rank,
    r.l_pp_rank                AS pp_rank,
    r.l_dp_rank                AS dp_rank,
    j.l_tp_size                AS tp_size,
    j.l_pp_size                AS pp_size,
    j.l_dp_size                AS dp_size,
    r.l_pp_rank                AS stage,
    r.l_first_iteration        AS first_iteration,
    r.l_last_iteration         AS last_iteration
FROM
(
    SELECT
        job,
        rank,
        argMax(i_host, i_iteration)       AS l_host,
        max(i_world_size)                 AS l_world_size,
        argMax(i_tp_rank, i_iteration)    AS l_tp_rank,
        argMax(i_pp_rank, i_iteration)    AS l_pp_rank,
        argMax(i_dp_rank, i_iteration)    AS l_dp_rank,
        min(i_iteration)                  AS l_first_iteration,
        max(i_iteration)                  AS l_last_iteration
    FROM
    (
        SELECT job, rank, host AS i_host, world_size AS i_world_size, tp_rank AS i_tp_rank,
               pp_rank AS i_pp_rank, dp_rank AS i_dp_rank, iteration AS i_iteration
        FROM {database}.iterations
    )
    GROUP BY job, rank
) AS r
INNER JOIN
(
    SELECT
        job,
        greatest(max(s_tp_rank) + 1, 1) AS l_tp_size,
        greatest(max(s_pp_rank) + 1, 1) AS l_pp_size,
        greatest(max(s_dp_rank) + 1, 1) AS l_dp_size
    FROM (SELECT job, tp_rank AS s_tp_rank, pp_rank AS s_pp_rank, dp_rank AS s_dp_rank FROM {database}.iterations)
    GROUP BY job
) AS j ON r.job = j.job
