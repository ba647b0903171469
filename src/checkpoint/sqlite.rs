//! SqliteSaver tables (`langgraph-checkpoint-sqlite` 3.1): `checkpoints` holds the whole
//! checkpoint, channel values included, as one msgpack document; `writes` holds pending writes.

use std::str::FromStr;
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteRow};
use sqlx::{ConnectOptions, Row};

use super::{
    CheckpointDoc, DecodeError, MAX_VALUE_BYTES, Scanned, Shard, SkippedThread, StoreError,
    classify, parse_metadata, serde,
};

/// Latest root checkpoint per thread, kept when an interrupt is pending or an `update_state` edit
/// wrote it. Metadata is JSON text stored as a BLOB; the `CASE` keeps a malformed row from
/// failing the whole statement (it is returned and reported instead).
const PARKED_SQL: &str = r#"
SELECT t.thread_id, t.checkpoint_id, t.type, t.checkpoint, t.size, t.metadata, t.metadata_size,
       t.pending_interrupt
FROM (
    -- A document over ?1 bytes is not fetched, only its size.
    SELECT c.thread_id, c.checkpoint_id, c.type,
           CASE WHEN length(c.checkpoint) <= ?1 THEN c.checkpoint END AS checkpoint,
           length(c.checkpoint) AS size,
           -- Metadata is bounded the same way (a 40 MB document would be fetched whole).
           CASE WHEN length(c.metadata) <= ?1 THEN c.metadata END AS metadata,
           length(c.metadata) AS metadata_size, c.metadata AS whole_metadata,
           EXISTS (
               SELECT 1 FROM writes w
               WHERE w.thread_id = c.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = c.checkpoint_id
                 AND w.channel = '__interrupt__'
                 AND NOT EXISTS (
                     SELECT 1 FROM writes o
                     WHERE o.thread_id = w.thread_id AND o.checkpoint_ns = w.checkpoint_ns
                       AND o.checkpoint_id = w.checkpoint_id AND o.task_id = w.task_id
                       AND o.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
           ) AS pending_interrupt
    FROM (SELECT thread_id, max(checkpoint_id) AS checkpoint_id
          FROM checkpoints WHERE checkpoint_ns = '' GROUP BY thread_id) l
    JOIN checkpoints c
      ON c.thread_id = l.thread_id AND c.checkpoint_ns = '' AND c.checkpoint_id = l.checkpoint_id
) t
-- CASE, not OR: its branches run in order, so metadata over ?1 bytes is never parsed here (the
-- JSON functions run in custody's process; 64 MiB of metadata peaked at 300 MiB). Such a
-- thread is kept and reported as too large: whether an edit wrote it cannot be read.
WHERE CASE WHEN t.pending_interrupt OR t.metadata_size > ?1 THEN 1
           WHEN NOT json_valid(CAST(t.whole_metadata AS TEXT)) THEN 1
           ELSE json_extract(CAST(t.whole_metadata AS TEXT), '$.source') = 'update' END
ORDER BY t.thread_id
"#;

/// The connect options of a SqliteSaver DSN, a `sqlite:` URL or a file path, for the reader and
/// for custody's writable pool: the file must exist (a typo must not create an empty store).
/// sqlx's statement logging is off: it logs each statement slower than 1 s at WARN with its
/// whole SQL text, and a statement waits that long whenever another process holds the file's
/// lock, which custody waits out or reports as its own error.
///
/// # Errors
/// [`StoreError::Dsn`] for a URL sqlx cannot parse or one that names no file;
/// [`StoreError::File`] when the path names no SQLite database file ([`check_file`]).
pub(super) fn connect_options(dsn: &str) -> Result<SqliteConnectOptions, StoreError> {
    let options = if dsn.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(dsn).map_err(|e| StoreError::Dsn {
            backend: "sqlite",
            dsn: dsn.to_owned(),
            reason: super::config_text(&e),
        })?
    } else {
        SqliteConnectOptions::new().filename(dsn)
    };
    let file = options.get_filename();
    if file.as_os_str().is_empty() {
        return Err(StoreError::Dsn {
            backend: "sqlite",
            dsn: dsn.to_owned(),
            reason: "it names no file; write sqlite://PATH or a file path".to_owned(),
        });
    }
    let in_memory = file.as_os_str() == ":memory:" || dsn.contains("mode=memory");
    if !in_memory {
        check_file(file).map_err(StoreError::File)?;
    }
    Ok(options.create_if_missing(false).disable_statement_logging())
}

/// What SQLite itself would find at `file`, said with the absolute path: SQLite's own words are
/// "unable to open database file" for a missing file, "disk I/O error" for a directory and "file
/// is not a database" for any other file, none naming the path or what a relative path is
/// relative to. A file is a SQLite database when it is empty (a database with no tables yet) or
/// starts with the 16-byte header `SQLite format 3\0` (sqlite.org/fileformat.html, "Magic Header
/// String"), SQLite's own test; a shorter non-empty file is not one either.
///
/// # Errors
/// The sentence for the user.
fn check_file(file: &std::path::Path) -> Result<(), String> {
    use std::io::Read;
    let cwd = std::env::current_dir().unwrap_or_default();
    let path = cwd.join(file);
    let shown = path.display();
    let meta = match std::fs::metadata(&path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let hint = if file.is_relative() {
                format!(
                    " (a relative path is relative to the directory custody runs in, {})",
                    cwd.display()
                )
            } else {
                String::new()
            };
            return Err(format!("no file at {shown}{hint}"));
        }
        Err(e) => return Err(unreadable(&path, &e)),
    };
    if meta.is_dir() {
        return Err(format!(
            "{shown} is a directory, not a SQLite database file"
        ));
    }
    // Opening a FIFO would wait for a writer; no other kind of file holds a database.
    if !meta.is_file() {
        return Err(format!(
            "{shown} is not a regular file, so not a SQLite database file"
        ));
    }
    let mut header = Vec::with_capacity(16);
    std::fs::File::open(&path)
        .and_then(|f| f.take(16).read_to_end(&mut header))
        .map_err(|e| unreadable(&path, &e))?;
    if !header.is_empty() && header != b"SQLite format 3\0" {
        return Err(format!(
            "{shown} is not a SQLite database (its file header is not SQLite's \"SQLite format 3\")"
        ));
    }
    Ok(())
}

/// `cannot read PATH: CAUSE`, for a file custody could not stat or read.
fn unreadable(path: &std::path::Path, e: &std::io::Error) -> String {
    format!("cannot read {}: {}", path.display(), super::io_text(e))
}

/// Every SQLite pool this process opened, for [`close_open_pools`]: readers (`false`) and
/// writable pools (`true`).
///
/// Process-wide because a SIGTERM's handler must close pools owned deep inside a sweep that it
/// cannot reach otherwise: SQLite folds a `-wal` back into the file and removes it and the `-shm`
/// only in the last connection's close, and a pool merely dropped closes its connections on
/// threads the exiting process does not wait for. A closed pool stays listed (sqlx pools have no
/// identity to remove it by) and is skipped; a process opens one or two per store.
static OPEN_POOLS: std::sync::Mutex<Vec<(bool, SqlitePool)>> = std::sync::Mutex::new(Vec::new());

/// Lists `pool` for [`close_open_pools`]; `writable` for an acting sweep's writable pool.
pub(super) fn track(pool: &SqlitePool, writable: bool) {
    OPEN_POOLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((writable, pool.clone()));
}

/// Closes every SQLite pool this process opened and has not closed, readers first, so that a
/// writable pool's connection is the database's last and folds the `-wal` back (README "Crash
/// safety": what a sweep stopped by SIGTERM leaves). Waits for a connection in use to be
/// returned, at most `within` in all; a connection still busy then is left as a crash leaves it,
/// which SQLite recovers at the next open.
pub async fn close_open_pools(within: Duration) {
    let pools: Vec<(bool, SqlitePool)> = OPEN_POOLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .drain(..)
        .filter(|(_, p)| !p.is_closed())
        .collect();
    let close = async {
        for writable in [false, true] {
            for (_, pool) in pools.iter().filter(|(w, _)| *w == writable) {
                pool.close().await;
            }
        }
    };
    let _ = tokio::time::timeout(within, close).await;
}

/// A read-only pool on a SqliteSaver file.
pub struct Reader {
    pool: SqlitePool,
    /// Set when the file is read without SQLite's locking ([`Quiescent`]): the scan ends by
    /// checking that nothing wrote it meanwhile.
    quiescent: Option<Quiescent>,
}

/// How a sweep may open the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// An observing sweep, the controller's schema check: nothing is written next to the file.
    Observe,
    /// An acting sweep, which writes the file anyway (its writable pool creates `-wal`/`-shm`
    /// and removes them when it closes): SQLite's usual read-only open.
    Act,
}

/// A WAL-mode file that no connection has open (no `-wal` next to it: SQLite removes it when
/// the last connection closes, after copying its pages into the file). Such a file holds the
/// whole database, but SQLite cannot open it read-only without creating `-wal` and `-shm` next
/// to it (a read-only connection cannot remove them again, so they stay), and in a read-only
/// directory cannot open it at all (`SQLITE_CANTOPEN`, code 14). It is read with `immutable=1`
/// instead, which creates nothing and takes no locks; that is wrong only if a writer changes the
/// file during the read, and a writer cannot do so without a `-wal` file, which exists for as
/// long as it has the database open, and without changing the file's size or times when it
/// copies pages back. So the scan ends by checking both ([`Quiescent::unchanged`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Quiescent {
    path: std::path::PathBuf,
    /// `len`, `mtime`, `ctime` (ns) and inode of the file when it was opened.
    stamp: (u64, i128, i128, u64),
}

/// The `-wal` and `-shm` files SQLite keeps next to `path` in WAL mode.
fn companions(path: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let with = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        std::path::PathBuf::from(name)
    };
    (with("-wal"), with("-shm"))
}

fn stamp(meta: &std::fs::Metadata) -> (u64, i128, i128, u64) {
    use std::os::unix::fs::MetadataExt;
    let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
    (
        meta.len(),
        ns(meta.mtime(), meta.mtime_nsec()),
        ns(meta.ctime(), meta.ctime_nsec()),
        meta.ino(),
    )
}

/// Whether a file's header says WAL mode: file format write and read versions (bytes 18 and
/// 19 of the 100-byte header) both 2 (sqlite.org/fileformat.html, "File format version
/// numbers"). A file too short to have a header is not.
fn is_wal(path: &std::path::Path) -> std::io::Result<bool> {
    use std::io::Read;
    let mut header = [0u8; 20];
    let mut file = std::fs::File::open(path)?;
    match file.read_exact(&mut header) {
        Ok(()) => Ok(header[18] == 2 && header[19] == 2),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// How an observing sweep opens `path`: `Ok(Some(_))` to read it immutable (see [`Quiescent`]),
/// `Ok(None)` for SQLite's read-only open, which creates nothing here (rollback-journal mode, or
/// WAL mode with both `-wal` and `-shm` present, a writer's or left by one).
///
/// # Errors
/// A sentence for the one state SQLite cannot read without writing: WAL mode with a `-wal` file
/// but no `-shm` (SQLite would create the `-shm`; reading the file alone would miss the
/// transactions in the `-wal`).
fn observe_plan(path: &std::path::Path) -> Result<Option<Quiescent>, String> {
    if !is_wal(path).unwrap_or(false) {
        return Ok(None);
    }
    let (wal, shm) = companions(path);
    match (wal.exists(), shm.exists()) {
        (true, true) => Ok(None),
        (true, false) => Err(format!(
            "{} is in WAL mode and has a {} but no {}: SQLite cannot read it without creating \
             the -shm next to it, and an observing sweep writes nothing there. Let the agent \
             (or sqlite3 with write access) open and close the database once, which folds the \
             -wal back into the file; or copy the file and its -wal to a directory custody may \
             write and sweep the copy",
            path.display(),
            wal.display(),
            shm.display()
        )),
        (false, _) => {
            let meta = std::fs::metadata(path).map_err(|e| unreadable(path, &e))?;
            Ok(Some(Quiescent {
                path: path.to_owned(),
                stamp: stamp(&meta),
            }))
        }
    }
}

/// Whether the DSN itself asks for `immutable=1` (or `true`), SQLite's own URI parameter.
fn explicitly_immutable(dsn: &str) -> bool {
    url::Url::parse(dsn).is_ok_and(|u| {
        u.query_pairs()
            .any(|(k, v)| k == "immutable" && (v == "1" || v == "true"))
    })
}

impl Quiescent {
    /// Whether nothing wrote the file since it was opened: still no `-wal`, and the same size,
    /// times and inode.
    ///
    /// # Errors
    /// A sentence naming what changed.
    fn unchanged(&self) -> Result<(), String> {
        let (wal, _) = companions(&self.path);
        if wal.exists() {
            return Err(format!(
                "{} was opened by a writer while custody read it (read without locks, as no \
                 connection had it open: {} appeared); the read may be inconsistent, so it is \
                 not used: run the sweep again",
                self.path.display(),
                wal.display()
            ));
        }
        let now = std::fs::metadata(&self.path).map_err(|e| unreadable(&self.path, &e))?;
        if stamp(&now) != self.stamp {
            return Err(format!(
                "{} changed while custody read it (read without locks, as no connection had it \
                 open); the read may be inconsistent, so it is not used: run the sweep again",
                self.path.display()
            ));
        }
        Ok(())
    }
}

impl Reader {
    pub(super) async fn connect(dsn: &str, access: Access) -> Result<Self, StoreError> {
        let options = connect_options(dsn)?
            .read_only(true)
            .busy_timeout(Duration::from_secs(5));
        // An explicit `immutable=1` in the DSN is the user's (README); otherwise an observing
        // sweep decides from the files next to the database.
        let quiescent = match access {
            Access::Observe if !explicitly_immutable(dsn) => {
                observe_plan(options.get_filename()).map_err(StoreError::Schema)?
            }
            _ => None,
        };
        let options = if quiescent.is_some() {
            options.immutable(true)
        } else {
            options
        };
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .map_err(|source| StoreError::Connect {
                dsn: dsn.to_owned(),
                address: None,
                source,
            })?;
        track(&pool, false);
        // SQLite opens the file lazily: this first read is where a damaged file fails, so its
        // error names the DSN as a failed connect does, not as a failed query of nothing.
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('checkpoints', 'writes')",
        )
        .fetch_one(&pool)
        .await
        .map_err(|source| StoreError::Connect {
            dsn: dsn.to_owned(),
            address: None,
            source,
        })?;
        if tables != 2 {
            return Err(StoreError::Schema(format!(
                "{dsn}: no LangGraph SqliteSaver tables (expected checkpoints and writes); is this the SqliteSaver database?"
            )));
        }
        Ok(Self { pool, quiescent })
    }

    pub(super) async fn close(self) {
        self.pool.close().await;
    }

    pub(super) fn parked_threads<'a>(
        &'a self,
        channels: &'a [String],
        shard: Shard,
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        let rows = sqlx::query(PARKED_SQL)
            .bind(i64::try_from(MAX_VALUE_BYTES).unwrap_or(i64::MAX))
            .fetch(&self.pool)
            .filter_map(move |row| async move {
                match row {
                    // SQLite has no sha256(): the shard is checked on the thread id before the
                    // row is decoded (`Shard::contains`, the same split PostgreSQL computes).
                    Ok(row) => match row.try_get::<&str, _>("thread_id") {
                        Ok(id) if !shard.contains(id) => None,
                        _ => decode_row(&row, channels).transpose(),
                    },
                    Err(e) => Some(Err(StoreError::Query(e))),
                }
            });
        // An immutable read ends with its check: a file that changed under it fails the scan.
        let check = futures::stream::iter(self.quiescent.as_ref())
            .filter_map(|q| async move { q.unchanged().err().map(StoreError::Changed) });
        rows.map(Some)
            .chain(check.map(|e| Some(Err(e))))
            .filter_map(|item| async move { item })
            .boxed()
    }
}

fn decode_row(row: &SqliteRow, channels: &[String]) -> Result<Option<Scanned>, StoreError> {
    let thread_id: String = row.try_get("thread_id")?;
    let checkpoint_id: String = row.try_get("checkpoint_id")?;
    let type_: Option<String> = row.try_get("type")?;
    let checkpoint: Option<Vec<u8>> = row.try_get("checkpoint")?;
    let size: Option<i64> = row.try_get("size")?;
    let metadata: Option<Vec<u8>> = row.try_get("metadata")?;
    let metadata_size: Option<i64> = row.try_get("metadata_size")?;
    let pending: bool = row.try_get("pending_interrupt")?;

    let skip = |error: DecodeError| {
        Ok(Some(Scanned::Skipped(SkippedThread::new(
            thread_id.clone(),
            checkpoint_id.clone(),
            None,
            error,
        ))))
    };
    if let (None, Some(size)) = (&metadata, metadata_size) {
        return skip(DecodeError::too_large(
            "the checkpoint metadata",
            usize::try_from(size).unwrap_or(usize::MAX),
        ));
    }
    let metadata = match parse_metadata(metadata.as_deref()) {
        Ok(m) => m,
        Err(e) => return skip(e),
    };
    let bytes = match (checkpoint, size) {
        (Some(bytes), _) => bytes,
        (None, Some(size)) => {
            return skip(DecodeError::too_large(
                "the checkpoint document",
                usize::try_from(size).unwrap_or(usize::MAX),
            ));
        }
        (None, None) => return skip(DecodeError::malformed("checkpoint column is NULL")),
    };
    let decoded = match type_.as_deref() {
        Some("msgpack") => {
            serde::read(&bytes).and_then(|doc| CheckpointDoc::from_msgpack(&doc, channels))
        }
        // Legacy rows: SqliteSaver reads them through `loads_typed` (UTF-8 JSON), and so does the
        // PostgreSQL reader for a `json` blob.
        Some("json") => serde::decode_typed("json", Some(&bytes)).and_then(|doc| {
            CheckpointDoc::from_json_with_values(&doc.unwrap_or_default(), channels)
        }),
        Some(other) => Err(DecodeError::unsupported(format!(
            "checkpoint serialized as {other}; custody reads msgpack and json"
        ))),
        None => Err(DecodeError::unsupported(
            "checkpoint has no serializer type; custody reads msgpack and json",
        )),
    };
    match decoded {
        Ok((doc, found)) => {
            Ok(classify(thread_id, doc, metadata, pending, found).map(Scanned::Parked))
        }
        Err(e) => skip(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each file SQLite cannot read as a database is said with its path and what it is; the
    /// relative-path hint comes only with a relative path.
    #[test]
    fn files_that_are_no_database_are_named_with_what_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().canonicalize().unwrap();
        let shown = path.display();
        assert_eq!(
            check_file(&path),
            Err(format!(
                "{shown} is a directory, not a SQLite database file"
            ))
        );
        for (name, bytes) in [
            ("notes.txt", &b"hello, not a database\n"[..]),
            ("short", b"SQL"),
        ] {
            std::fs::write(path.join(name), bytes).unwrap();
            assert_eq!(
                check_file(&path.join(name)),
                Err(format!(
                    "{shown}/{name} is not a SQLite database (its file header is not SQLite's \"SQLite format 3\")"
                ))
            );
        }
        assert_eq!(
            check_file(&path.join("notes.txt/c.sqlite")),
            Err(format!(
                "cannot read {shown}/notes.txt/c.sqlite: Not a directory"
            ))
        );
        // an empty file is an empty database (no tables: the caller says so)
        std::fs::write(path.join("empty.sqlite"), b"").unwrap();
        assert_eq!(check_file(&path.join("empty.sqlite")), Ok(()));
        let mut header = b"SQLite format 3\0".to_vec();
        header.resize(100, 0);
        std::fs::write(path.join("db.sqlite"), &header).unwrap();
        assert_eq!(check_file(&path.join("db.sqlite")), Ok(()));

        assert_eq!(
            check_file(&path.join("nope.sqlite")),
            Err(format!("no file at {shown}/nope.sqlite"))
        );
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            check_file(std::path::Path::new("custody-no-such.sqlite")),
            Err(format!(
                "no file at {}/custody-no-such.sqlite (a relative path is relative to the directory custody runs in, {})",
                cwd.display(),
                cwd.display()
            ))
        );
    }

    #[test]
    fn a_quiescent_read_is_refused_when_a_writer_came_or_the_file_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.sqlite");
        let mut header = vec![0u8; 100];
        header[18] = 2;
        header[19] = 2;
        std::fs::write(&path, &header).unwrap();
        let plan = observe_plan(&path)
            .unwrap()
            .expect("no -wal: read immutable");
        assert_eq!(plan.unchanged(), Ok(()));
        let gone = Quiescent {
            path: dir.path().join("gone.sqlite"),
            stamp: plan.stamp,
        };
        assert_eq!(
            gone.unchanged(),
            Err(format!(
                "cannot read {}: No such file or directory",
                gone.path.display()
            ))
        );

        let (wal, shm) = companions(&path);
        std::fs::write(&wal, b"").unwrap();
        assert!(plan.unchanged().unwrap_err().contains("appeared"));
        std::fs::write(&shm, b"").unwrap();
        assert_eq!(
            observe_plan(&path),
            Ok(None),
            "-wal and -shm: SQLite's read-only open"
        );
        std::fs::remove_file(&shm).unwrap();
        assert!(observe_plan(&path).unwrap_err().contains("but no"));
        std::fs::remove_file(&wal).unwrap();

        std::fs::write(&path, [header.as_slice(), b"more"].concat()).unwrap();
        assert!(
            plan.unchanged()
                .unwrap_err()
                .contains("changed while custody read it")
        );

        header[18] = 1;
        header[19] = 1;
        std::fs::write(&path, &header).unwrap();
        assert_eq!(observe_plan(&path), Ok(None), "rollback-journal mode");
    }
}
