-- custody's ledger: one row per action custody takes on a thread, written before any side
-- effect and completed after (issue 5). custody's own table in the checkpoint database, named
-- so it cannot collide with LangGraph's (checkpoints, checkpoint_blobs, checkpoint_writes,
-- checkpoint_migrations) or an application's; LangGraph never reads it.
CREATE TABLE custody_actions (
    -- digest of (thread_id, checkpoint_ns, checkpoint_id, handle class); also the mint call's
    -- idempotency key
    idempotency_key   TEXT PRIMARY KEY,
    thread_id         TEXT NOT NULL,
    checkpoint_ns     TEXT NOT NULL,
    -- the parked checkpoint the action is about; the append re-checks it is still the latest
    checkpoint_id     TEXT NOT NULL,
    handle_class      TEXT NOT NULL,
    action            TEXT NOT NULL CHECK (action IN ('remint', 'escalate', 'fail')),
    -- intent → minted → replayed → done (escalate and fail go intent → done)
    state             TEXT NOT NULL CHECK (state IN ('intent', 'minted', 'replayed', 'done')),
    -- everything needed to finish the action after a crash, without re-reading the thread
    plan              TEXT NOT NULL,
    new_handle        TEXT,
    -- replay calls rendered for new_handle; item i is in doubt while replay_started > replay_done
    replay_calls      TEXT,
    replay_started    INTEGER NOT NULL DEFAULT 0,
    replay_done       INTEGER NOT NULL DEFAULT 0,
    -- set with state = 'done': reminted | escalated | failed | moved | abandoned
    outcome           TEXT,
    detail            TEXT,
    new_checkpoint_id TEXT,
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL
);

CREATE INDEX custody_actions_unsettled ON custody_actions (created_at) WHERE state <> 'done';
