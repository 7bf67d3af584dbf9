//! Idempotency keys for HTTP endpoints: a retried request applies once.
//!
//! A double click, a client that retries after a timeout that had in fact
//! succeeded, a proxy that resends: each runs the handler again. The classic
//! case is `POST /credits` with a 5 s client timeout against a handler that
//! takes 6 s; the client gives up, retries, and the credits are granted twice.
//! The defense is a key the client sends with the request (`Idempotency-Key`,
//! as Stripe and the IETF httpapi draft name it) and a record of it that the
//! server writes **in the same transaction as the effect**, together with the
//! response. A retry finds the record and gets the stored response; nothing
//! runs twice.
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::idempotency::{Fingerprint, Idempotency, IdempotencyKey, Reply, StoredResponse};
//! use outbox_client::Message;
//!
//! let idempotency = Idempotency::new("outbox")?; // build once, at start-up
//! let key = IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324")?;
//! let body = br#"{"amount":100}"#;
//! let fingerprint = Fingerprint::new("POST", "/credits", body);
//!
//! let outcome = idempotency
//!     .run(client, "user:42 POST /credits", &key, &fingerprint, |tx| {
//!         Box::pin(async move {
//!             tx.execute("UPDATE accounts SET credits = credits + 100 WHERE id = 42", &[])
//!                 .await?;
//!             outbox_client::enqueue(tx, &Message::builder("credits").json(&100).build()?).await?;
//!             // outbox_client::Error also wraps database errors, so `?` works for both
//!             Ok::<_, outbox_client::Error>(StoredResponse::new(
//!                 201,
//!                 vec![("content-type".into(), b"application/json".to_vec())],
//!                 br#"{"granted":100}"#.to_vec(),
//!             ))
//!         })
//!     })
//!     .await?;
//! match outcome {
//!     Reply::Executed(response) | Reply::Replayed(response) => { /* send it */ }
//!     Reply::InProgress { retry_after } => { /* 409, Retry-After */ }
//!     Reply::Mismatch => { /* 422 */ }
//! }
//! # Ok(()) }
//! ```
//!
//! With the `axum` feature, the `axum` submodule adds an extractor that reads
//! and checks the header and a helper that turns all of this into a response.
//!
//! # Why the record shares the effect's transaction
//!
//! Written before the effect in a transaction of its own, the record survives
//! a crash that the effect does not: the key is then taken and the request
//! never ran. Written after the effect, a crash in between leaves an applied
//! effect with no record, and the retry applies it again. In one transaction
//! the effect, its outbox messages and the stored response commit together or
//! not at all. A handler crash, an error or a lost connection rolls the record
//! back with everything else, so the key is free for the retry and nothing
//! stays stuck. The price is that the effect itself must live in this
//! database: anything the handler should cause elsewhere goes through the
//! outbox ([`crate::Outbox::enqueue`] on the same transaction), which is what
//! the outbox is for. A request that calls a payment provider directly from
//! the handler is not made safe by this module.
//!
//! # The state machine
//!
//! [`Idempotency::begin`] answers one of:
//!
//! | state of (scope, key)                          | answer               | HTTP |
//! |------------------------------------------------|----------------------|------|
//! | absent, or expired                             | [`Begin::New`]       | run the handler |
//! | completed, same fingerprint                    | [`Begin::Replay`]    | the stored response |
//! | completed, different fingerprint               | [`Begin::Mismatch`]  | 422 |
//! | another transaction is running it              | [`Begin::InProgress`]| 409 + `Retry-After` |
//!
//! On `New` the record is inserted as `in_progress`, visible only to this
//! transaction; [`Idempotency::complete`] stores the response and marks it
//! `completed`; the caller commits. A deferred trigger refuses to commit a
//! record still `in_progress`, so an effect can never commit without the
//! response its retries will replay.
//!
//! # Concurrency
//!
//! Two requests with one key are two transactions inserting the same primary
//! key. Postgres makes the second `INSERT` wait until the first commits or
//! rolls back, which would hold the second request (and its connection) for
//! as long as the first handler runs. So `begin` first takes a
//! transaction-scoped advisory lock on a hash of (schema, scope, key) with
//! `pg_try_advisory_xact_lock`, which never blocks:
//!
//! - lock taken: no other transaction is running this key, so the
//!   `INSERT ... ON CONFLICT` that follows does not wait; it either inserts
//!   (`New`) or finds a committed record (`Replay` or `Mismatch`);
//! - lock held elsewhere: [`WhenInProgress::Reject`] answers `InProgress` at
//!   once; [`WhenInProgress::Wait`] tries again with a short backoff up to its
//!   bound, then answers `InProgress`. Once the first transaction ends its lock
//!   is gone and its record is visible: the waiter gets `Replay` if it
//!   committed, `New` if it rolled back.
//!
//! The lock is released when the transaction ends, however it ends. Waiting
//! holds the caller's transaction open (and its pooled connection), hence the
//! bound. A hash collision between two different keys can only make one of
//! them wait or answer 409, never replay the other's response.
//!
//! Run the transaction at `READ COMMITTED` (Postgres' default). Under
//! `REPEATABLE READ` or `SERIALIZABLE`, a record committed after the
//! transaction's snapshot surfaces as a serialization failure
//! ([`Error::is_retryable`]); running the request again in a new transaction
//! then replays it.
//!
//! # Choosing the scope
//!
//! Keys are chosen by clients, so two clients can pick the same one. The scope
//! keeps them apart and decides who may replay what: include the authenticated
//! principal (tenant, user or API key) and the route, e.g.
//! `"tenant:7 user:42 POST /credits"`. Never use a scope that two principals
//! share, or one could read the other's stored response by guessing its key.
//! The fingerprint (method, path with query, body) catches a key reused for a
//! different request within one scope.
//!
//! # Expiry
//!
//! A record expires [`Idempotency::ttl`] after the request began (default
//! [`DEFAULT_TTL`], 24 h, as Stripe keeps keys). **A key reused after expiry
//! runs again: that is the contract.** Pick a window longer than any client's
//! retry horizon. Expired records are ignored as soon as they expire and are
//! deleted by [`Idempotency::cleanup`], a small batch per call, so that it can
//! run often without long locks or bloat spikes.

mod error;
mod key;

#[cfg(feature = "axum")]
pub mod axum;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::{Client, GenericClient, Transaction};

pub use error::Error;
pub use key::{Fingerprint, IdempotencyKey, MAX_KEY_LEN};

/// The longest scope [`Idempotency::begin`] takes, in bytes of UTF-8. The
/// table indexes the scope with the key (at most [`MAX_KEY_LEN`]), and a
/// Postgres btree entry holds at most 2,704 bytes of keys that do not
/// compress.
pub const MAX_SCOPE_LEN: usize = 1024;

use crate::SchemaName;

/// Default lifetime of a record: 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Longest record lifetime honoured: about a century; longer ones are capped.
const MAX_TTL_MS: i64 = 100 * 366 * 24 * 60 * 60 * 1000;

/// Default `Retry-After` for a request whose key is in progress: 1 second, about
/// as long as an ordinary handler runs.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Response headers stored by default: those that describe the body or point at
/// what the request created. Session and hop-by-hop headers (`set-cookie`,
/// `date`, `connection`, `content-length`, ...) are not replayed.
pub const DEFAULT_REPLAY_HEADERS: [&str; 7] = [
    "content-type",
    "content-encoding",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
];

/// Default limit on a stored response body: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// A boxed future borrowing the transaction, as returned by request handlers.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The longest [`WhenInProgress::Wait`] counts; a longer one (such as
/// `Duration::MAX`) waits this long.
const WAIT_CAP: Duration = Duration::from_secs(100 * 365 * 86_400);

/// What [`Idempotency::begin`] does when another transaction is running the
/// same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenInProgress {
    /// Answer [`Begin::InProgress`] at once (HTTP 409 with `Retry-After`). The
    /// default: no request holds a connection while waiting for another.
    Reject,
    /// Wait up to this long for the other transaction to end, then answer as
    /// for a fresh request (usually a replay). Suits double clicks, where the
    /// second request would rather get the first one's answer than a 409.
    /// `Duration::MAX` waits for as long as it takes.
    Wait(Duration),
}

/// A response as stored with its key and replayed byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Selected headers, lowercase names, in order; values as raw bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A response to store.
    pub fn new(status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Self {
        StoredResponse {
            status,
            headers,
            body,
        }
    }
}

/// A record inserted as `in_progress` by [`Idempotency::begin`]; pass it to
/// [`Idempotency::complete`] in the same transaction before committing.
#[derive(Debug)]
#[must_use = "complete the request before committing, or roll back"]
pub struct Pending {
    scope: String,
    key: IdempotencyKey,
}

impl Pending {
    /// The record's scope.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The record's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

/// The answer of [`Idempotency::begin`].
#[derive(Debug)]
#[must_use]
pub enum Begin {
    /// First time (or first since expiry): run the handler in this transaction,
    /// then [`Idempotency::complete`], then commit.
    New(Pending),
    /// Already done: answer with the stored response; roll back.
    Replay(StoredResponse),
    /// Another transaction is running this key: answer 409 with `Retry-After`.
    InProgress {
        /// How long the client should wait before retrying.
        retry_after: Duration,
    },
    /// The key was used with a different request: answer 422.
    Mismatch,
}

/// What to answer the request, as [`Idempotency::run`] decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The handler ran and its effect committed with this response.
    Executed(StoredResponse),
    /// An earlier request with this key had committed; this is its response.
    Replayed(StoredResponse),
    /// Another request with this key is running: answer 409 with `Retry-After`.
    InProgress {
        /// How long the client should wait before retrying.
        retry_after: Duration,
    },
    /// The key was used with a different request: answer 422.
    Mismatch,
}

/// The old name of [`Reply`].
#[deprecated(since = "0.1.0", note = "renamed to `Reply`")]
pub type Outcome = Reply;

/// A failure of [`Idempotency::run`]: its own, or the handler's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// Recording or replaying failed; nothing was committed.
    #[error("idempotency record failed")]
    Idempotency(#[from] Error),
    /// The handler returned an error; its transaction was rolled back, so the
    /// key is free and a retry runs the handler again.
    #[error("request handler failed")]
    Handler(#[source] E),
}

/// Records idempotency keys in one schema. Cheap to clone; build one at
/// start-up.
#[derive(Debug, Clone)]
pub struct Idempotency {
    schema: SchemaName,
    ttl: Duration,
    when_in_progress: WhenInProgress,
    retry_after: Duration,
    replay_headers: Arc<[String]>,
    max_response_bytes: usize,
    sql: Arc<Sql>,
}

#[derive(Debug)]
struct Sql {
    insert: String,
    select: String,
    complete: String,
    cleanup: String,
}

impl Default for Idempotency {
    fn default() -> Self {
        Idempotency::with_schema(SchemaName::default())
    }
}

impl Idempotency {
    /// Records in schema `schema`, validated as an identifier.
    pub fn new(schema: &str) -> Result<Self, Error> {
        Ok(Idempotency::with_schema(
            SchemaName::new(schema).map_err(Error::Schema)?,
        ))
    }

    /// Records in an already validated schema.
    pub fn with_schema(schema: SchemaName) -> Self {
        let t = format!("{}.idempotency_keys", schema.quoted());
        // An expired record is as good as absent: the upsert takes it over, so a
        // reused key runs again even before cleanup has deleted it.
        let insert = format!(
            "INSERT INTO {t} AS r (scope, key, fingerprint, state, expires_at) \
             VALUES ($1, $2, $3, 'in_progress', now() + $4::bigint * interval '1 millisecond') \
             ON CONFLICT (scope, key) DO UPDATE \
               SET fingerprint = excluded.fingerprint, state = 'in_progress', \
                   response_status = NULL, response_header_names = NULL, \
                   response_header_values = NULL, response_body = NULL, \
                   created_at = excluded.created_at, completed_at = NULL, \
                   expires_at = excluded.expires_at \
               WHERE r.expires_at <= now() \
             RETURNING true"
        );
        let select = format!(
            "SELECT fingerprint, state, response_status, response_header_names, \
                    response_header_values, response_body \
             FROM {t} WHERE scope = $1 AND key = $2"
        );
        let complete = format!(
            "UPDATE {t} SET state = 'completed', response_status = $3, \
                 response_header_names = $4, response_header_values = $5, \
                 response_body = $6, completed_at = now() \
             WHERE scope = $1 AND key = $2 AND state = 'in_progress'"
        );
        // By primary key rather than ctid: the nested loop on the index is a
        // plan Postgres always picks, and SKIP LOCKED steps over records that a
        // request is taking over right now.
        let cleanup = format!(
            "DELETE FROM {t} WHERE (scope, key) IN ( \
               SELECT scope, key FROM {t} WHERE expires_at <= now() \
               ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
        Idempotency {
            schema,
            ttl: DEFAULT_TTL,
            when_in_progress: WhenInProgress::Reject,
            retry_after: DEFAULT_RETRY_AFTER,
            replay_headers: DEFAULT_REPLAY_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            sql: Arc::new(Sql {
                insert,
                select,
                complete,
                cleanup,
            }),
        }
    }

    /// How long a record is kept after its request began (default
    /// [`DEFAULT_TTL`], capped at a century). A key reused after this runs
    /// again.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// What to do when another transaction is running the same key (default
    /// [`WhenInProgress::Reject`]).
    pub fn when_in_progress(mut self, when: WhenInProgress) -> Self {
        self.when_in_progress = when;
        self
    }

    /// The `Retry-After` suggested with [`Begin::InProgress`] (default
    /// [`DEFAULT_RETRY_AFTER`]).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Response headers to store and replay, case-insensitive (default
    /// [`DEFAULT_REPLAY_HEADERS`]). Used by the framework integrations.
    pub fn replay_headers<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.replay_headers = names
            .into_iter()
            .map(|n| n.as_ref().to_ascii_lowercase())
            .collect();
        self
    }

    /// Largest response body the framework integrations buffer and store
    /// (default [`DEFAULT_MAX_RESPONSE_BYTES`]); a larger one fails the request
    /// and rolls it back.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// The schema the records live in.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// The configured record lifetime.
    pub fn configured_ttl(&self) -> Duration {
        self.ttl
    }

    /// The configured limit on a stored response body.
    pub fn configured_max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// True when `name` (any case) is one of the headers to store.
    pub fn is_replay_header(&self, name: &str) -> bool {
        self.replay_headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name))
    }

    /// Starts an idempotent request inside `client`'s transaction.
    ///
    /// `client` must be a transaction that will also carry the request's
    /// effect; see the [module docs](self) for the states and the locking. On
    /// any answer other than [`Begin::New`] nothing was written and the caller
    /// should roll back (which also releases the key's advisory lock at once).
    /// `scope` takes 1 to [`MAX_SCOPE_LEN`] bytes, without NUL characters.
    pub async fn begin(
        &self,
        client: &impl GenericClient,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Begin, Error> {
        if scope.is_empty() {
            return Err(Error::EmptyScope);
        }
        if scope.len() > MAX_SCOPE_LEN {
            return Err(Error::ScopeTooLong {
                size: scope.len(),
                limit: MAX_SCOPE_LEN,
            });
        }
        if scope.contains('\0') {
            return Err(Error::ScopeContainsNul);
        }
        if !self.lock(client, scope, key).await? {
            return Ok(Begin::InProgress {
                retry_after: self.retry_after,
            });
        }
        // Postgres intervals end near 178 million years; a century is "forever"
        // for a key and keeps now() + ttl representable.
        let ttl_ms = i64::try_from(self.ttl.as_millis())
            .unwrap_or(i64::MAX)
            .min(MAX_TTL_MS);
        // With the lock held no other transaction has an uncommitted record for
        // this key, so the insert does not wait. The loop covers a record that
        // expires and is cleaned up between the two statements.
        for _ in 0..2 {
            let inserted = client
                .query_opt(
                    self.sql.insert.as_str(),
                    &[
                        &scope,
                        &key.as_str(),
                        &fingerprint.as_bytes().as_slice(),
                        &ttl_ms,
                    ],
                )
                .await
                .map_err(|e| Error::from_db(&self.schema, e))?;
            if inserted.is_some() {
                tracing::debug!(scope, key = %key, "idempotency key is new");
                return Ok(Begin::New(Pending {
                    scope: scope.to_owned(),
                    key: key.clone(),
                }));
            }
            let Some(row) = client
                .query_opt(self.sql.select.as_str(), &[&scope, &key.as_str()])
                .await
                .map_err(|e| Error::from_db(&self.schema, e))?
            else {
                continue;
            };
            let stored_fingerprint: &[u8] = row.try_get(0).map_err(Error::Database)?;
            if stored_fingerprint != fingerprint.as_bytes().as_slice() {
                tracing::debug!(scope, key = %key, "idempotency key reused with another request");
                return Ok(Begin::Mismatch);
            }
            let state: &str = row.try_get(1).map_err(Error::Database)?;
            if state != "completed" {
                // Our own record, begun earlier in this same transaction: the
                // commit-time trigger keeps any other 'in_progress' row invisible.
                return Ok(Begin::InProgress {
                    retry_after: self.retry_after,
                });
            }
            let malformed = || Error::Malformed {
                scope: scope.to_owned(),
                key: key.to_string(),
            };
            let status: Option<i32> = row.try_get(2).map_err(Error::Database)?;
            let names: Option<Vec<String>> = row.try_get(3).map_err(Error::Database)?;
            let values: Option<Vec<Vec<u8>>> = row.try_get(4).map_err(Error::Database)?;
            let body: Option<Vec<u8>> = row.try_get(5).map_err(Error::Database)?;
            let (Some(status), Some(names), Some(values), Some(body)) =
                (status, names, values, body)
            else {
                return Err(malformed());
            };
            let status = u16::try_from(status).map_err(|_| malformed())?;
            tracing::debug!(scope, key = %key, status, "idempotency key replayed");
            return Ok(Begin::Replay(StoredResponse {
                status,
                headers: names.into_iter().zip(values).collect(),
                body,
            }));
        }
        Ok(Begin::InProgress {
            retry_after: self.retry_after,
        })
    }

    /// Tries the key's advisory lock, polling up to the configured bound in
    /// [`WhenInProgress::Wait`] mode.
    async fn lock(
        &self,
        client: &impl GenericClient,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<bool, Error> {
        // Advisory locks are database-wide: the schema keeps two outboxes apart,
        // and the scope's length keeps "a:" + "b" apart from "a" + ":b".
        let lock_key = format!(
            "outbox-idempotency:{}:{}:{scope}:{key}",
            self.schema,
            scope.len()
        );
        let deadline = match self.when_in_progress {
            WhenInProgress::Reject => None,
            // `Wait(Duration::MAX)` means no limit: a deadline past what
            // the clock can add is as good as none.
            WhenInProgress::Wait(max) => {
                let now = tokio::time::Instant::now();
                Some(now.checked_add(max).unwrap_or(now + WAIT_CAP))
            }
        };
        let mut pause = Duration::from_millis(10);
        loop {
            let locked: bool = client
                .query_one(
                    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))",
                    &[&lock_key],
                )
                .await
                .map_err(Error::Database)?
                .try_get(0)
                .map_err(Error::Database)?;
            if locked {
                return Ok(true);
            }
            let Some(deadline) = deadline else {
                return Ok(false);
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Stores `response` for a request begun with [`Idempotency::begin`] in the
    /// same transaction. Commit afterwards: effect, outbox messages and the
    /// response then commit together.
    pub async fn complete(
        &self,
        client: &impl GenericClient,
        pending: Pending,
        response: &StoredResponse,
    ) -> Result<(), Error> {
        if !(100..=999).contains(&response.status) {
            return Err(Error::InvalidStatus {
                status: response.status,
            });
        }
        let names: Vec<&str> = response.headers.iter().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&[u8]> = response.headers.iter().map(|(_, v)| v.as_slice()).collect();
        let updated = client
            .execute(
                self.sql.complete.as_str(),
                &[
                    &pending.scope,
                    &pending.key.as_str(),
                    &i32::from(response.status),
                    &names,
                    &values,
                    &response.body,
                ],
            )
            .await
            .map_err(|e| Error::from_db(&self.schema, e))?;
        if updated != 1 {
            return Err(Error::NotInProgress {
                scope: pending.scope,
                key: pending.key.to_string(),
            });
        }
        Ok(())
    }

    /// Runs `handler` idempotently in a new transaction on `client`.
    ///
    /// Begins the transaction, calls [`begin`](Self::begin), and on
    /// [`Begin::New`] runs `handler` with the transaction, stores its response
    /// and commits: the handler's writes, its outbox messages and the response
    /// commit together. If the handler returns an error or panics, or the
    /// future is dropped, the transaction rolls back and the key stays free.
    /// Any other answer rolls back at once and is returned as an [`Reply`].
    ///
    /// `client` can be any pooled connection that dereferences to a
    /// [`Client`] (deadpool-postgres, bb8-postgres).
    pub async fn run<F, E>(
        &self,
        client: &mut Client,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        handler: F,
    ) -> Result<Reply, RunError<E>>
    where
        F: for<'t> FnOnce(&'t Transaction<'t>) -> BoxFuture<'t, Result<StoredResponse, E>>,
    {
        let tx = client.transaction().await.map_err(Error::Database)?;
        let answer = match self.begin(&tx, scope, key, fingerprint).await? {
            Begin::New(pending) => Ok(pending),
            Begin::Replay(r) => Err(Reply::Replayed(r)),
            Begin::InProgress { retry_after } => Err(Reply::InProgress { retry_after }),
            Begin::Mismatch => Err(Reply::Mismatch),
        };
        let pending = match answer {
            Ok(pending) => pending,
            Err(outcome) => {
                rollback(tx).await;
                return Ok(outcome);
            }
        };
        let response = match handler(&tx).await {
            Ok(response) => response,
            Err(e) => {
                rollback(tx).await;
                return Err(RunError::Handler(e));
            }
        };
        self.complete(&tx, pending, &response).await?;
        tx.commit().await.map_err(Error::Database)?;
        Ok(Reply::Executed(response))
    }

    /// Deletes up to `batch` expired records and returns how many it deleted.
    ///
    /// Call it periodically, in a loop while it returns `batch`: small batches
    /// keep each delete short. Records being taken over by a request at the
    /// moment are skipped, never waited for.
    pub async fn cleanup(&self, client: &impl GenericClient, batch: u32) -> Result<u64, Error> {
        client
            .execute(self.sql.cleanup.as_str(), &[&i64::from(batch)])
            .await
            .map_err(|e| Error::from_db(&self.schema, e))
    }
}

/// Rolls back, logging (not returning) a failure: the server rolls back on its
/// own when the connection is gone, and the caller's answer does not change.
async fn rollback(tx: Transaction<'_>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback of an idempotent request failed");
    }
}
