//! Operator commands: `status`, `dead-letters`, `locate`, `pause`, `resume`.
//!
//! Each reads the outbox schema directly, so it works whether or not a relay
//! is running, and returns a typed value; the CLI renders it as text or
//! JSON (`crate::cli`).

use std::time::SystemTime;

pub mod dead_letters;
pub mod locate;
pub mod status;

pub use dead_letters::{
    dead_letters, discard, pause, require_selection, resume, retry, DeadLetter, Filter, Payload,
};
pub use locate::{locate, Located, Location, Waiting};
pub use status::{status, Blocker, Status};

/// What went wrong in an operator command.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A database error (the server's message is part of this one's, so a
    /// report with its causes prints it once).
    #[error("postgres: {}", crate::source::PgError(.0))]
    Postgres(tokio_postgres::Error),
    /// The operator declined, or could not be asked.
    #[error("{0}")]
    NotConfirmed(String),
    /// The selection is empty or unsafe.
    #[error("{0}")]
    Selection(String),
}

impl From<tokio_postgres::Error> for OpsError {
    fn from(e: tokio_postgres::Error) -> Self {
        OpsError::Postgres(e)
    }
}

/// Seconds since `t`, by this host's clock.
fn age_secs(t: Option<SystemTime>) -> Option<f64> {
    t.and_then(|t| SystemTime::now().duration_since(t).ok())
        .map(|d| d.as_secs_f64())
}

/// `t` as RFC 3339 in UTC, for JSON beside the ages; Postgres's own
/// `-infinity` or `infinity` past the years RFC 3339 writes (a fresh row's
/// `next_attempt_at` is `'-infinity'`).
fn rfc3339(t: SystemTime) -> String {
    crate::timefmt::rfc3339(t).unwrap_or_else(|| {
        match t < SystemTime::UNIX_EPOCH {
            true => "-infinity",
            false => "infinity",
        }
        .to_owned()
    })
}

/// [`rfc3339`] of a nullable column.
fn at(t: Option<SystemTime>) -> Option<String> {
    t.map(rfc3339)
}
