use std::fmt;

use tokio_postgres::error::SqlState;

use crate::{MessageId, SchemaName};

/// Everything that can go wrong while writing to the outbox or migrating it.
///
/// Validation errors ([`Error::is_invalid_input`]) are raised before any SQL is
/// sent, so the caller's transaction is untouched and can still commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message was built without a destination.
    #[error("message destination is empty")]
    EmptyDestination,
    /// A header name is not acceptable on every supported broker.
    #[error("invalid header name {name:?}: {reason}")]
    InvalidHeaderName {
        /// The name as given.
        name: String,
        /// What rule it breaks.
        reason: &'static str,
    },
    /// The payload is larger than the configured limit.
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
    /// A text field holds a NUL character, which Postgres text cannot store.
    #[error("{what} contains a NUL character")]
    ContainsNul {
        /// Which field, e.g. "ordering key".
        what: &'static str,
    },
    /// A key of the inbox, a checkpoint or a send-once notification is longer
    /// than [`crate::MAX_KEY_BYTES`].
    #[error("{what} of {size} bytes exceeds the limit of {limit} bytes")]
    KeyTooLong {
        /// Which key, e.g. "message id".
        what: &'static str,
        /// Its size in bytes (UTF-8).
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The ordering key is longer than [`crate::MAX_ORDERING_KEY_BYTES`].
    #[error("ordering key of {size} bytes exceeds the limit of {limit} bytes")]
    OrderingKeyTooLong {
        /// Key size in bytes (UTF-8).
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The schema name is not a plain lowercase SQL identifier.
    #[error(
        "invalid schema name {name:?}: use 1 to 63 of a-z, 0-9 and _, not starting with a digit"
    )]
    InvalidSchemaName {
        /// The name as given.
        name: String,
    },
    /// NOTIFY cannot be turned on for a schema name over 54 characters: its
    /// channel, `<schema>.messages`, would pass Postgres' 63-byte limit,
    /// and every insert into the outbox would fail. The relay polls.
    #[error(
        "cannot turn NOTIFY on for schema {schema:?}: its channel name would have {len} bytes, \
         over Postgres' limit of 63; keep NOTIFY off (the relay polls) or use a shorter schema name"
    )]
    NotifyChannelTooLong {
        /// The schema.
        schema: String,
        /// The channel name's length.
        len: usize,
    },
    /// The outbox schema, a table or a column does not exist: the migrations
    /// have not run, or not the latest ones.
    #[error("outbox schema {schema:?} is missing its tables or columns; run the migrations first")]
    SchemaMissing {
        /// The schema that was looked up.
        schema: String,
        /// The driver's own error (`tokio_postgres::Error` or `sqlx::Error`).
        #[source]
        source: BoxError,
    },
    /// A caller-chosen message id is already in the outbox. Its row was
    /// skipped and nothing failed: the transaction goes on, and a batch's
    /// other messages were written. Commit to keep them with your own
    /// writes (the message is enqueued already), or roll back.
    #[error("message id {message_id} is already in the outbox")]
    DuplicateMessageId {
        /// The id that collided (the first one, for a batch).
        message_id: MessageIdOrBatch,
        /// The driver's own error (`tokio_postgres::Error` or `sqlx::Error`).
        #[source]
        source: BoxError,
    },
    /// A batch too large for one statement: Postgres takes at most 1 GiB in
    /// one protocol message, and refuses a larger one by closing the
    /// connection. Nothing was sent; split the batch (in one transaction to
    /// keep it atomic).
    #[error("a batch of about {bytes} bytes exceeds the {limit} bytes one statement can carry; split it")]
    BatchTooLarge {
        /// The batch's size, as sent (payloads, headers and the other columns).
        bytes: usize,
        /// The most one statement carries.
        limit: usize,
    },
    /// Two messages of one batch carry the same caller-chosen id; neither
    /// was written.
    #[error("message id {message_id} is given to more than one message of the batch")]
    DuplicateInBatch {
        /// The id given twice.
        message_id: MessageId,
    },
    /// A key that identifies a delivery, notification, job or consumer is empty:
    /// an empty key would make unrelated work look like a duplicate.
    #[error("{what} is empty")]
    EmptyKey {
        /// Which key, e.g. "message id".
        what: &'static str,
    },
    /// A checkpointed batch was committed with a key that does not move the
    /// job forward; saving it would repeat or loop over rows.
    #[error(
        "checkpoint of job {job:?} would not advance: last key {last_key} is not above {position}"
    )]
    CheckpointNotAdvancing {
        /// The job.
        job: String,
        /// Its saved position.
        position: i64,
        /// The key given to commit.
        last_key: i64,
    },
    /// The payload could not be serialized to JSON.
    #[error("payload could not be serialized to json")]
    Serialize(#[source] serde_json::Error),
    /// A database error not covered by the variants above.
    #[error("database error")]
    Database(#[from] tokio_postgres::Error),
    /// A database error through sqlx not covered by the variants above.
    #[cfg(feature = "sqlx")]
    #[error("database error")]
    Sqlx(#[from] ::sqlx::Error),
    /// Applying the migrations failed.
    #[cfg(feature = "migrate")]
    #[error("migration failed")]
    Migration(#[source] refinery::Error),
    /// A pending migration could not take the table lock it needs: other
    /// transactions (the relay's batches, a long report, a forgotten
    /// `BEGIN`) held the table each time it tried, for as long as
    /// [`crate::migrate`] keeps trying. Nothing was applied.
    #[cfg(feature = "migrate")]
    #[error(
        "outbox schema {schema:?}: a pending migration could not lock its table in {waited:?} of \
         tries; find the long transactions in pg_stat_activity (or pause the relay) and run the \
         migrations again"
    )]
    MigrationLockBusy {
        /// The schema being migrated.
        schema: String,
        /// How long it kept trying.
        waited: std::time::Duration,
        /// The last lock timeout.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// A driver's error behind [`Error::SchemaMissing`] and
/// [`Error::DuplicateMessageId`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Error {
    /// Maps a database error from a statement on `schema`'s tables.
    pub(crate) fn from_db(schema: &SchemaName, e: tokio_postgres::Error) -> Error {
        match Cause::of(e.code().map(SqlState::code)) {
            Some(cause) => cause.error(schema, e.into()),
            None => Error::Database(e),
        }
    }

    /// [`Error::from_db`] for sqlx: the same variants for the same SQLSTATEs.
    #[cfg(feature = "sqlx")]
    pub(crate) fn from_sqlx(schema: &SchemaName, e: ::sqlx::Error) -> Error {
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned());
        match Cause::of(code.as_deref()) {
            Some(cause) => cause.error(schema, e.into()),
            None => Error::Sqlx(e),
        }
    }

    /// Maps a database error from a statement that cannot violate a unique key
    /// (it uses `ON CONFLICT`): only a missing schema gets its own variant.
    pub(crate) fn from_db_no_conflict(schema: &SchemaName, e: tokio_postgres::Error) -> Error {
        match e.code() {
            Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME => {
                Error::SchemaMissing {
                    schema: schema.to_string(),
                    source: e.into(),
                }
            }
            _ => Error::Database(e),
        }
    }

    /// True for errors caused by the input itself; no SQL was sent for them.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::EmptyDestination
                | Error::InvalidHeaderName { .. }
                | Error::PayloadTooLarge { .. }
                | Error::OrderingKeyTooLong { .. }
                | Error::ContainsNul { .. }
                | Error::KeyTooLong { .. }
                | Error::InvalidSchemaName { .. }
                | Error::NotifyChannelTooLong { .. }
                | Error::EmptyKey { .. }
                | Error::DuplicateInBatch { .. }
                | Error::BatchTooLarge { .. }
                | Error::Serialize(_)
        )
    }

    /// True when running the whole transaction again may succeed: a
    /// serialization failure or deadlock, or a lost connection. Under
    /// `REPEATABLE READ` or `SERIALIZABLE` (a database or role default, say),
    /// a key committed by a concurrent transaction after this one's snapshot
    /// surfaces as a serialization failure rather than as a duplicate: two
    /// consumers racing on one message id, two checkpoint runners, two
    /// send-once attempts. Run again, the inbox then answers `Duplicate`.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database(e) => retryable(e),
            #[cfg(feature = "sqlx")]
            Error::Sqlx(e) => match e {
                ::sqlx::Error::Database(d) => {
                    matches!(d.code().as_deref(), Some("40001") | Some("40P01"))
                }
                e => matches!(
                    e,
                    ::sqlx::Error::Io(_) | ::sqlx::Error::PoolClosed | ::sqlx::Error::WorkerCrashed
                ),
            },
            _ => false,
        }
    }

    /// True when the database connection is gone; retrying on a new one may work.
    pub fn is_closed(&self) -> bool {
        match self {
            Error::Database(e) => e.is_closed(),
            #[cfg(feature = "sqlx")]
            Error::Sqlx(e) => matches!(
                e,
                ::sqlx::Error::Io(_) | ::sqlx::Error::PoolClosed | ::sqlx::Error::WorkerCrashed
            ),
            _ => false,
        }
    }
}

/// Whether running the transaction again may get past `e`: a serialization
/// failure, a deadlock, or a lost connection.
pub(crate) fn retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.is_closed()
        || matches!(
            e.code(),
            Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
        )
}

/// A database error with a variant of its own, whichever driver reported it.
enum Cause {
    SchemaMissing,
}

impl Cause {
    fn of(sqlstate: Option<&str>) -> Option<Cause> {
        let missing = [
            SqlState::UNDEFINED_TABLE.code(),
            SqlState::INVALID_SCHEMA_NAME.code(),
            // A column a later migration adds (event_type).
            SqlState::UNDEFINED_COLUMN.code(),
        ];
        match sqlstate {
            Some(c) if missing.contains(&c) => Some(Cause::SchemaMissing),
            // Not a unique violation: an id the caller chose that is in the
            // outbox already is skipped by the insert (see
            // `rows::insert_sql`), and one on another key (`seq`, after the
            // sequence was set back by hand) is no duplicate message.
            _ => None,
        }
    }

    fn error(self, schema: &SchemaName, source: BoxError) -> Error {
        match self {
            Cause::SchemaMissing => Error::SchemaMissing {
                schema: schema.to_string(),
                source,
            },
        }
    }
}

/// The id named by [`Error::DuplicateMessageId`]: known for a single enqueue,
/// not for a batch (the database reports the conflicting row, not its position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageIdOrBatch {
    /// The single message's id.
    Message(MessageId),
    /// One of the batch's ids.
    Batch,
}

impl fmt::Display for MessageIdOrBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageIdOrBatch::Message(id) => id.fmt(f),
            MessageIdOrBatch::Batch => f.write_str("(one of the batch)"),
        }
    }
}
