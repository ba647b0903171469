-- Multiply the template threads that real LangGraph wrote (tests/bench/templates.py) into :n
-- threads, inside the database. Run on a database created WITH TEMPLATE lg_tpl:
--
--   psql -v ON_ERROR_STOP=1 -v n=100000 -d lg_100000 -f tests/bench/multiply.sql
--   psql -v ON_ERROR_STOP=1 -v n=1000000 -v parked_pct=1 -d lg_1000000_p1 -f tests/bench/multiply.sql
--
-- Thread g (1..n) copies template (g % 10): 0-2 tpl-pb1, 3-5 tpl-pb2, 6-7 tpl-pb4 (parked with a
-- basket: 80%), 8 tpl-nb (parked without one: 10%), 9 tpl-done (finished: 10%).
-- With -v parked_pct=P (0..100), the mostly-finished store of a production database instead:
-- thread g is parked when g % 100 < P, copying the parked templates in the proportions above
-- ((g / 100) % 9 as the kind 0-8); the others are finished, half tpl-done (resumed to the end:
-- its answered interrupts stay in checkpoint_writes) and half tpl-fin (finished without ever
-- being interrupted), by g % 2.
--  * thread_id = md5('t' || g) as a UUID string (the shape LangGraph Platform uses);
--  * every row of the template thread is copied: checkpoints, blobs, writes;
--  * checkpoint ids, task ids and interrupt ids are kept: they are unique per thread in the
--    primary keys, and LangGraph derives task/interrupt ids from the checkpoint id, the
--    namespace, the step and the node, not from the thread, so the copies stay consistent;
--  * the template's basket handle bsk_<16 hex> is rewritten to bsk_<g as 16 hex> wherever it
--    occurs (basket blob, interrupt values and task writes, the finished thread's verdict);
--    the length is unchanged, so every msgpack stays valid;
--  * rows go in step by step across 100 000-thread batches (heap order is time order, as when
--    many threads run at once), with the primary keys and indexes dropped during the load and
--    recreated afterwards under the same names and definitions; then the templates are deleted.
-- tests/bench/verify.py checks copies with LangGraph's own API.

\set ON_ERROR_STOP on
SET client_min_messages = warning;
SELECT set_config('bench.n', :'n', false) AS n_set \gset
\if :{?parked_pct}
\else
\set parked_pct -1
\endif
SELECT set_config('bench.parked_pct', :'parked_pct', false) AS p_set \gset

CREATE TEMP TABLE tpl_kind (kind int PRIMARY KEY, thread text NOT NULL);
INSERT INTO tpl_kind VALUES
  (0, 'tpl-pb1'), (1, 'tpl-pb1'), (2, 'tpl-pb1'),
  (3, 'tpl-pb2'), (4, 'tpl-pb2'), (5, 'tpl-pb2'),
  (6, 'tpl-pb4'), (7, 'tpl-pb4'),
  (8, 'tpl-nb'),
  (9, 'tpl-done'),
  (10, 'tpl-fin');

-- The template kind of thread g (see the top).
CREATE FUNCTION pg_temp.kind(g bigint, p int) RETURNS int
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p < 0 THEN (g % 10)::int
              WHEN g % 100 < p THEN ((g / 100) % 9)::int
              WHEN g % 2 = 0 THEN 9
              ELSE 10 END
$$;

DO $$
BEGIN
  IF current_setting('bench.parked_pct')::int >= 0
     AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE thread_id = 'tpl-fin') THEN
    RAISE EXCEPTION 'parked_pct needs the tpl-fin template: rebuild lg_tpl (tests/bench/templates.py)';
  END IF;
END $$;

-- The template's own handle, read from its basket blob (NULL for tpl-nb).
CREATE TEMP TABLE tpl_handle AS
SELECT k.kind, k.thread,
       (SELECT substring(b.blob FROM position('bsk_'::bytea IN b.blob) FOR 20)
        FROM checkpoint_blobs b
        WHERE b.thread_id = k.thread AND b.channel = 'basket' AND position('bsk_'::bytea IN b.blob) > 0
        LIMIT 1) AS handle
FROM tpl_kind k;

CREATE TEMP TABLE tpl_ck AS SELECT * FROM checkpoints WHERE thread_id LIKE 'tpl-%';
CREATE TEMP TABLE tpl_bl AS SELECT * FROM checkpoint_blobs WHERE thread_id LIKE 'tpl-%';
CREATE TEMP TABLE tpl_wr AS SELECT * FROM checkpoint_writes WHERE thread_id LIKE 'tpl-%';

-- Replace the (single) occurrence of a handle in a bytea, if any.
CREATE FUNCTION pg_temp.swap(b bytea, old bytea, new bytea) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN old IS NULL OR b IS NULL OR position(old IN b) = 0 THEN b
              ELSE overlay(b PLACING new FROM position(old IN b)) END
$$;

-- Keep every index definition, drop them for the load, recreate them afterwards.
CREATE TEMP TABLE saved_idx AS
SELECT c.relname AS tbl, i.relname AS name, con.conname, pg_get_indexdef(i.oid) AS def,
       pg_get_constraintdef(con.oid) AS condef
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class c ON c.oid = x.indrelid
LEFT JOIN pg_constraint con ON con.conindid = i.oid AND con.contype = 'p'
WHERE c.relname IN ('checkpoints', 'checkpoint_blobs', 'checkpoint_writes');

SELECT format('ALTER TABLE %I DROP CONSTRAINT %I', tbl, conname) FROM saved_idx WHERE conname IS NOT NULL
UNION ALL
SELECT format('DROP INDEX %I', name) FROM saved_idx WHERE conname IS NULL
\gexec

DO $$
DECLARE
  n bigint := current_setting('bench.n')::bigint;
  p int := current_setting('bench.parked_pct')::int;
  lo bigint := 1;
  hi bigint;
BEGIN
  WHILE lo <= n LOOP
    hi := least(lo + 99999, n);
    INSERT INTO checkpoints
    SELECT md5('t' || g)::uuid::text, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.type,
           CASE WHEN h.handle IS NOT NULL AND strpos(c.checkpoint::text, convert_from(h.handle, 'UTF8')) > 0
                THEN replace(c.checkpoint::text, convert_from(h.handle, 'UTF8'), 'bsk_' || lpad(to_hex(g), 16, '0'))::jsonb
                ELSE c.checkpoint END,
           c.metadata
    FROM generate_series(lo, hi) g
    JOIN tpl_handle h ON h.kind = pg_temp.kind(g, p)
    JOIN tpl_ck c ON c.thread_id = h.thread
    ORDER BY c.checkpoint_id, g;

    INSERT INTO checkpoint_blobs
    SELECT md5('t' || g)::uuid::text, b.checkpoint_ns, b.channel, b.version, b.type,
           pg_temp.swap(b.blob, h.handle, convert_to('bsk_' || lpad(to_hex(g), 16, '0'), 'UTF8'))
    FROM generate_series(lo, hi) g
    JOIN tpl_handle h ON h.kind = pg_temp.kind(g, p)
    JOIN tpl_bl b ON b.thread_id = h.thread
    ORDER BY b.version, g;

    INSERT INTO checkpoint_writes
    SELECT md5('t' || g)::uuid::text, w.checkpoint_ns, w.checkpoint_id, w.task_id, w.idx, w.channel, w.type,
           pg_temp.swap(w.blob, h.handle, convert_to('bsk_' || lpad(to_hex(g), 16, '0'), 'UTF8')),
           w.task_path
    FROM generate_series(lo, hi) g
    JOIN tpl_handle h ON h.kind = pg_temp.kind(g, p)
    JOIN tpl_wr w ON w.thread_id = h.thread
    ORDER BY w.checkpoint_id, w.task_id, w.idx, g;

    RAISE NOTICE 'threads % .. % copied', lo, hi;
    lo := hi + 1;
  END LOOP;
END $$;

DELETE FROM checkpoints WHERE thread_id LIKE 'tpl-%';
DELETE FROM checkpoint_blobs WHERE thread_id LIKE 'tpl-%';
DELETE FROM checkpoint_writes WHERE thread_id LIKE 'tpl-%';

SELECT CASE WHEN conname IS NOT NULL
            THEN format('ALTER TABLE %I ADD CONSTRAINT %I %s', tbl, conname, condef)
            ELSE def END
FROM saved_idx ORDER BY conname IS NULL
\gexec

-- No template handle may survive the rewrite.
DO $$
DECLARE left_over bigint;
BEGIN
  SELECT count(*) INTO left_over FROM checkpoint_blobs b JOIN tpl_handle h ON position(h.handle IN b.blob) > 0;
  IF left_over > 0 THEN RAISE EXCEPTION '% blobs still hold a template handle', left_over; END IF;
  SELECT count(*) INTO left_over FROM checkpoint_writes w JOIN tpl_handle h ON position(h.handle IN w.blob) > 0;
  IF left_over > 0 THEN RAISE EXCEPTION '% writes still hold a template handle', left_over; END IF;
END $$;
