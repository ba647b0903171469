-- (c, same rule) careful.sql with custody's whole parked rule: a pending interrupt, or an
-- update_state edit (metadata source 'update'; custody then checks that a node is still due,
-- which needs the document, as custody's own statement does). The edit rule costs a lookup of
-- the latest checkpoint of every thread without a pending interrupt, finished ones included.
WITH latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
    GROUP BY thread_id
)
SELECT l.thread_id, bl.type, bl.blob, c.checkpoint -> 'channel_values' -> 'basket' AS inline
FROM latest l
LEFT JOIN LATERAL (
    SELECT w.task_id FROM checkpoint_writes w
    WHERE w.thread_id = l.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id
    GROUP BY w.task_id
    HAVING bool_or(w.channel = '__interrupt__')
       AND NOT bool_or(w.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
    LIMIT 1
) p ON true
CROSS JOIN LATERAL (
    SELECT x.checkpoint, x.metadata FROM checkpoints x
    WHERE x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id
    OFFSET 0
) c
LEFT JOIN LATERAL (
    SELECT b.type, b.blob FROM checkpoint_blobs b
    WHERE b.thread_id = l.thread_id AND b.checkpoint_ns = '' AND b.channel = 'basket'
      AND b.version = c.checkpoint -> 'channel_versions' ->> 'basket'
    OFFSET 0
) bl ON true
WHERE p.task_id IS NOT NULL OR c.metadata ->> 'source' = 'update'
ORDER BY l.thread_id
