use tokio_postgres::error::SqlState;

use crate::SchemaName;

/// Everything that can go wrong while recording or replaying an idempotent
/// request.
///
/// Validation errors ([`Error::is_invalid_input`]) are raised before any SQL is
/// sent, so the caller's transaction is untouched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key breaks the length or character rules.
    #[error("invalid idempotency key: {reason}")]
    InvalidKey {
        /// What rule it breaks.
        reason: &'static str,
    },
    /// The scope is empty.
    #[error("idempotency scope is empty")]
    EmptyScope,
    /// The scope is longer than [`super::MAX_SCOPE_LEN`] bytes: the table
    /// indexes it with the key.
    #[error("idempotency scope of {size} bytes exceeds the limit of {limit} bytes")]
    ScopeTooLong {
        /// Its size in bytes (UTF-8).
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The scope holds a NUL character, which Postgres text cannot store.
    #[error("idempotency scope contains a NUL character")]
    ScopeContainsNul,
    /// The response to store has a status outside 100..=999.
    #[error("response status {status} is not a valid http status")]
    InvalidStatus {
        /// The status as given.
        status: u16,
    },
    /// The schema name is not a plain lowercase SQL identifier.
    #[error(transparent)]
    Schema(crate::Error),
    /// The idempotency table does not exist: the migrations have not run.
    #[error("schema {schema:?} has no idempotency table; run the migrations first")]
    SchemaMissing {
        /// The schema that was looked up.
        schema: String,
        /// The database's own error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The record to complete is not visible in the given transaction: it was
    /// begun on another connection or transaction, or already completed.
    #[error("idempotency record for key {key:?} in scope {scope:?} is not in progress in this transaction")]
    NotInProgress {
        /// The record's scope.
        scope: String,
        /// The record's key.
        key: String,
    },
    /// A stored row could not be read back (a column that must be set is null).
    #[error("idempotency record for key {key:?} in scope {scope:?} is malformed")]
    Malformed {
        /// The record's scope.
        scope: String,
        /// The record's key.
        key: String,
    },
    /// A database error not covered by the variants above.
    #[error("database error")]
    Database(#[source] tokio_postgres::Error),
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
            _ => Error::Database(e),
        }
    }

    /// True for errors caused by the input itself; no SQL was sent for them.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey { .. }
                | Error::EmptyScope
                | Error::ScopeTooLong { .. }
                | Error::ScopeContainsNul
                | Error::InvalidStatus { .. }
                | Error::Schema(_)
        )
    }

    /// True when running the whole request again, in a new transaction, may
    /// succeed: a serialization failure or deadlock (under `REPEATABLE READ` or
    /// `SERIALIZABLE`, a key committed by another request after this
    /// transaction's snapshot surfaces as one), or a lost connection.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database(e) => crate::error::retryable(e),
            _ => false,
        }
    }

    /// True when the database connection is gone.
    pub fn is_closed(&self) -> bool {
        match self {
            Error::Database(e) => e.is_closed(),
            _ => false,
        }
    }
}
