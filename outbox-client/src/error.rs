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
    /// The schema name is not a plain lowercase SQL identifier.
    #[error(
        "invalid schema name {name:?}: use 1 to 63 of a-z, 0-9 and _, not starting with a digit"
    )]
    InvalidSchemaName {
        /// The name as given.
        name: String,
    },
    /// The outbox schema or table does not exist: the migrations have not run.
    #[error("outbox schema {schema:?} is missing its tables; run the migrations first")]
    SchemaMissing {
        /// The schema that was looked up.
        schema: String,
        /// The database's own error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A caller-chosen message id is already in the outbox.
    #[error("message id {message_id} is already in the outbox")]
    DuplicateMessageId {
        /// The id that collided (the first one, for a batch).
        message_id: MessageIdOrBatch,
        /// The database's own error.
        #[source]
        source: tokio_postgres::Error,
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
    /// Applying the migrations failed.
    #[error("migration failed")]
    Migration(#[source] refinery::Error),
}

impl Error {
    /// Maps a database error from a statement on `schema`'s tables.
    pub(crate) fn from_db(schema: &SchemaName, e: tokio_postgres::Error) -> Error {
        match e.code() {
            Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME => {
                Error::SchemaMissing {
                    schema: schema.to_string(),
                    source: e,
                }
            }
            Some(c) if *c == SqlState::UNIQUE_VIOLATION => Error::DuplicateMessageId {
                message_id: MessageIdOrBatch::Batch,
                source: e,
            },
            _ => Error::Database(e),
        }
    }

    /// Maps a database error from a statement that cannot violate a unique key
    /// (it uses `ON CONFLICT`): only a missing schema gets its own variant.
    pub(crate) fn from_db_no_conflict(schema: &SchemaName, e: tokio_postgres::Error) -> Error {
        match e.code() {
            Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME => {
                Error::SchemaMissing {
                    schema: schema.to_string(),
                    source: e,
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
                | Error::InvalidSchemaName { .. }
                | Error::EmptyKey { .. }
                | Error::Serialize(_)
        )
    }

    /// True when the database connection is gone; retrying on a new one may work.
    pub fn is_closed(&self) -> bool {
        match self {
            Error::Database(e) => e.is_closed(),
            _ => false,
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
