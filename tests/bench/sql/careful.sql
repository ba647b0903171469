-- (c) the careful Python sweeper's one query, as in runs 1 and 2: threads whose latest root
-- checkpoint has a pending interrupt (LangGraph's rule, _task_status.py), returning only what the
-- answer needs: thread, the basket blob, or the inline value when the channel has no blob. It
-- does not find threads parked by an update_state edit (custody does; careful_same_rule.sql is
-- this query with custody's whole rule). The benchmark data holds no edited threads, so both
-- find the same threads here.
WITH latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
    GROUP BY thread_id
)
SELECT l.thread_id, bl.type, bl.blob, c.checkpoint -> 'channel_values' -> 'basket' AS inline
FROM latest l
CROSS JOIN LATERAL (
    SELECT w.task_id FROM checkpoint_writes w
    WHERE w.thread_id = l.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id
    GROUP BY w.task_id
    HAVING bool_or(w.channel = '__interrupt__')
       AND NOT bool_or(w.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
    LIMIT 1
) p
CROSS JOIN LATERAL (
    SELECT x.checkpoint FROM checkpoints x
    WHERE x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id
    OFFSET 0
) c
LEFT JOIN LATERAL (
    SELECT b.type, b.blob FROM checkpoint_blobs b
    WHERE b.thread_id = l.thread_id AND b.checkpoint_ns = '' AND b.channel = 'basket'
      AND b.version = c.checkpoint -> 'channel_versions' ->> 'basket'
    OFFSET 0
) bl ON true
ORDER BY l.thread_id
