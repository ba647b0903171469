-- Observed handle lifetimes (issue 19): per handle, the oldest age at which a probe found it
-- alive and the youngest age at which one found it gone, in seconds since its record's
-- minted_at, narrowed across sweeps (sweep::lifetime). custody's own table, like
-- custody_actions; LangGraph never reads it. Written by acting sweeps only (an observing sweep
-- opens the database read-only). At most sweep::lifetime::MAX_HANDLES rows per (handle_class,
-- server): a sweep deletes the rows seen least recently beyond that.
CREATE TABLE IF NOT EXISTS custody_handle_lifetimes (
    handle_class   TEXT NOT NULL,
    -- the MCPServer the class probes
    server         TEXT NOT NULL,
    -- hex SHA-256 of the handle value: handles can be bearer-like, so the value is not kept
    handle_hash    TEXT NOT NULL,
    alive_max_s    BIGINT,
    gone_min_s     BIGINT,
    -- the sweep's clock, Unix seconds: when a probe of this handle last answered
    last_seen_unix BIGINT NOT NULL,
    PRIMARY KEY (handle_class, server, handle_hash)
);

-- Eviction: the rows of one (handle_class, server) by how recently they were seen.
CREATE INDEX IF NOT EXISTS custody_handle_lifetimes_seen
    ON custody_handle_lifetimes (handle_class, server, last_seen_unix);
