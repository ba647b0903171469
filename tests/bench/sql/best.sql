-- (d) and the proposed PARKED_SQL for src/checkpoint/postgres.rs: custody's current statement
-- with one change, OFFSET 0 in the lateral that fetches the latest checkpoint row. Without it
-- PostgreSQL pulls the subquery up into a hash join (parallel seq scan of all of checkpoints,
-- then an external merge sort of the wide rows for ORDER BY); with it every thread is one
-- primary-key lookup in thread order and the ORDER BY is free. Channels inlined as '{basket}'
-- (custody binds them as $1::text[]). Same columns as custody reads.
WITH latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
    GROUP BY thread_id
)
SELECT l.thread_id, l.checkpoint_id, c.checkpoint, c.metadata,
       (p.task_id IS NOT NULL) AS pending_interrupt,
       bl.channels, bl.types, bl.blobs
FROM latest l
CROSS JOIN LATERAL (
    SELECT x.checkpoint, x.metadata FROM checkpoints x
    WHERE x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id
    OFFSET 0
) c
LEFT JOIN LATERAL (
    SELECT w.task_id FROM checkpoint_writes w
    WHERE w.thread_id = l.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id
    GROUP BY w.task_id
    HAVING bool_or(w.channel = '__interrupt__')
       AND NOT bool_or(w.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
    LIMIT 1
) p ON true
LEFT JOIN LATERAL (
    SELECT array_agg(b.channel) AS channels, array_agg(b.type) AS types, array_agg(b.blob) AS blobs
    FROM unnest('{basket}'::text[]) AS ch(name)
    JOIN checkpoint_blobs b
      ON b.thread_id = l.thread_id AND b.checkpoint_ns = '' AND b.channel = ch.name
     AND b.version = c.checkpoint -> 'channel_versions' ->> ch.name
) bl ON true
WHERE p.task_id IS NOT NULL OR c.metadata ->> 'source' = 'update'
ORDER BY l.thread_id
