-- Shard :shard_i of :shard_n of best.sql, for the proposed `custody sweep --shard I/N`
-- (driver.py substitutes :shard_i and :shard_n).
WITH latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
    GROUP BY thread_id
), mine AS (
    -- Stable shard of a thread: the first 4 bytes of sha256(thread_id), unsigned, modulo N
    -- (Rust: u32::from_be_bytes(sha256(id)[..4]) % n). Computed once per thread, after the
    -- grouping, so each shard still reads the whole primary key of checkpoints (cheap, index
    -- only) but fetches rows, writes and blobs of its own threads only.
    SELECT * FROM latest
    WHERE ('x' || encode(substr(sha256(convert_to(thread_id, 'UTF8')), 1, 4), 'hex'))::bit(32)::bigint % :shard_n = :shard_i
)
SELECT l.thread_id, l.checkpoint_id, c.checkpoint, c.metadata,
       (p.task_id IS NOT NULL) AS pending_interrupt,
       bl.channels, bl.types, bl.blobs
FROM mine l
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
