-- Audit records of ambiguous MCP writes (issue 6). The agent inserts a row with status
-- 'pending' before a write tool call and completes it afterwards ('committed' with the server's
-- identifier, or 'not_committed'); a crash or a timeout leaves it pending. custody's acting sweep
-- settles rows still pending after CheckpointStore.spec.audit.graceSeconds by asking the server
-- (the MCPServer's reconciliation rule for the tool), and marks rows it cannot settle within
-- audit.maxAgeSeconds 'unknown' and escalates their thread. custody's own table, like
-- custody_actions; LangGraph never reads it. IF NOT EXISTS: an agent may create it with the
-- README's DDL (the same text) before custody's first acting sweep runs this migration.
CREATE TABLE IF NOT EXISTS custody_audit (
    id               BIGSERIAL PRIMARY KEY,
    thread_id        TEXT NOT NULL,
    checkpoint_ns    TEXT NOT NULL DEFAULT '',
    -- the model's tool call id (AIMessage.tool_calls[i].id)
    tool_call_id     TEXT NOT NULL,
    -- 'aud_' + the first 32 hex digits of SHA-256(thread_id || 0x00 || tool_call_id), UTF-8;
    -- sent to the write tool, so a retry of the same call cannot write twice
    idempotency_key  TEXT NOT NULL UNIQUE,
    -- MCPServer name (in the CheckpointStore's namespace) and the tool's name on that server
    server           TEXT NOT NULL,
    tool             TEXT NOT NULL,
    -- redacted arguments: secrets and tokens removed, PII masked, large values hashed
    argument_summary JSONB NOT NULL DEFAULT '{}',
    -- the user the call ran for
    principal        TEXT,
    status           TEXT NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'committed', 'not_committed', 'unknown')),
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- how it was settled: {"by": "agent"|"custody", "server_id": …, "detail": …, "at": …}
    resolution       JSONB
);

-- The sweep's query: pending rows older than the grace period, oldest first.
CREATE INDEX IF NOT EXISTS custody_audit_pending ON custody_audit (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS custody_audit_thread ON custody_audit (thread_id, checkpoint_ns);
