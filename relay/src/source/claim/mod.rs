//! Claiming and settling batches of outbox rows.
//!
//! A batch lives in one transaction: the claim locks rows with `FOR UPDATE SKIP
//! LOCKED`, the relay publishes them, and the same transaction deletes the
//! confirmed rows and records failures before committing. Consequences:
//!
//! - No watermark. Each claim starts from the oldest ready row, so a transaction
//!   that commits late with a low `seq` is found by the next claim.
//! - A relay that dies mid-batch releases its rows when its session ends; the
//!   next claim (by it after a restart, or by another replica) takes them again.
//!   Only that batch can be published twice.
//! - Per-key order: a row is claimed only when every older row of its key is in
//!   the same claim. An older row locked by another in-flight batch, or waiting
//!   out a retry backoff, holds back the rest of its key.

use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Statement};
use uuid::Uuid;

use crate::envelope::{Envelope, Receipt};

mod statements;

/// The statements a worker runs for every batch, prepared once per connection:
/// Postgres parses them once per session instead of once per batch.
#[derive(Debug, Clone)]
pub struct Prepared {
    lock: Statement,
    claim: Statement,
    /// Deletes confirmed rows, or in retention mode moves them to `published`.
    settle: Statement,
}

/// How much one claim may take.
#[derive(Debug, Clone, Copy)]
pub struct ClaimLimits {
    /// Rows per batch.
    pub rows: i64,
    /// Payload bytes per batch; a single larger row still goes alone.
    pub bytes: i64,
    /// How long the rows of a key parked behind a dead letter are set aside
    /// before a claim looks at them again (a retry or discard of the dead
    /// letter brings them back at once).
    pub park_recheck: Duration,
}

/// What one claim found.
#[derive(Debug, Default)]
pub struct Claimed {
    /// Rows to publish, oldest first.
    pub batch: Vec<Envelope>,
    /// Rows of blocked keys to set aside, with until when.
    pub holds: Vec<(i64, SystemTime)>,
    /// Rows claimed but blocked behind an older row of their key.
    pub blocked: usize,
}

/// The SQL text for one schema, built once.
#[derive(Debug, Clone)]
pub struct Queries {
    lock: String,
    claim: String,
    hold: String,
    delete: String,
    fail: String,
    dead_letter: String,
    note_batch_error: String,
    exists: String,
    retain: Option<String>,
    purge: String,
}

impl Queries {
    /// Fails with the database's error when the outbox table is missing.
    pub async fn check_schema(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<(), tokio_postgres::Error> {
        client.execute(self.exists.as_str(), &[]).await.map(|_| ())
    }

    /// The claim's first statement, which locks its rows, for EXPLAIN.
    /// Its parameters: rows, partitions (`smallint[]`), floor.
    pub fn lock_sql(&self) -> &str {
        &self.lock
    }

    /// The claim's second statement, which decides the locked rows'
    /// verdicts, for EXPLAIN; it reads the seqs [`Queries::lock_sql`] left
    /// in the transaction. Its parameters: rows, bytes, park recheck seconds,
    /// floor.
    pub fn claim_sql(&self) -> &str {
        &self.claim
    }

    /// Prepares the per-batch statements on `client`, after setting its
    /// session up to plan them by index whatever the table's statistics say.
    ///
    /// A table never analyzed (`autovacuum = off`, vacuum behind, a table
    /// just created) looks to the planner as if almost no row were fresh, and
    /// the generic plan a session makes at its first claim is kept for the
    /// session's life. Believing the fresh rows few, the planner fetched all
    /// of them with a bitmap scan and sorted them before taking a batch: the
    /// claim's cost grew with the backlog, through temporary files. Every
    /// statement a worker runs is meant to go by index (the claim's ordered
    /// scans and probes, the settles' lookups by seq), so its session turns
    /// bitmap and sequential scans off.
    pub async fn prepare(&self, client: &Client) -> Result<Prepared, tokio_postgres::Error> {
        client
            .batch_execute("SET enable_bitmapscan = off; SET enable_seqscan = off")
            .await?;
        let lock = client
            .prepare_typed(&self.lock, &[Type::INT8, Type::INT2_ARRAY, Type::INT8])
            .await?;
        let claim = client
            .prepare_typed(
                &self.claim,
                &[Type::INT8, Type::INT8, Type::FLOAT8, Type::INT8],
            )
            .await?;
        let settle = match &self.retain {
            Some(retain) => {
                client
                    .prepare_typed(retain, &[Type::INT8_ARRAY, Type::TEXT_ARRAY])
                    .await?
            }
            None => {
                client
                    .prepare_typed(&self.delete, &[Type::INT8_ARRAY])
                    .await?
            }
        };
        Ok(Prepared {
            lock,
            claim,
            settle,
        })
    }

    /// Locks and returns the oldest ready rows of the `partitions` this
    /// replica owns, up to `limits`. `prepared` must come from the connection
    /// `tx` runs on. Rows of keys whose head is blocked come back as holds,
    /// to be set aside with [`Queries::hold`] in the same transaction.
    /// `floor` is a seq below which no fresh row exists (see
    /// [`crate::source::floor`]); 0 when none is known.
    ///
    /// `locked` runs once every row this claim takes is locked: when the
    /// first statement answers, before the second has decided the rows'
    /// verdicts. A claim that follows from then on skips these rows, while
    /// this one still works out, receives and decodes them. Both statements
    /// go out at once, in one round trip.
    pub async fn claim(
        &self,
        tx: &Client,
        prepared: &Prepared,
        limits: &ClaimLimits,
        partitions: &[i16],
        floor: i64,
        locked: impl FnOnce(),
    ) -> Result<Claimed, tokio_postgres::Error> {
        let recheck = limits.park_recheck.as_secs_f64();
        let params: [&(dyn ToSql + Sync); 4] = [&limits.rows, &limits.bytes, &recheck, &floor];
        // join! polls in order, and each query is sent at its first poll:
        // the lock statement, then the verdicts.
        let (lock, rows) = futures::join!(
            async {
                let lock = tx
                    .query_one(&prepared.lock, &[&limits.rows, &partitions, &floor])
                    .await;
                locked();
                lock
            },
            tx.query_raw(&prepared.claim, params)
        );
        lock?;
        let rows = rows?;
        futures::pin_mut!(rows);
        let mut claimed = Claimed::default();
        while let Some(row) = rows.try_next().await? {
            if row.try_get::<_, bool>("blocked")? {
                claimed.blocked += 1;
                if let Some(until) = row.try_get::<_, Option<SystemTime>>("hold_until")? {
                    claimed.holds.push((row.try_get("seq")?, until));
                }
            } else {
                claimed.batch.push(envelope(&row)?);
            }
        }
        Ok(claimed)
    }

    /// Sets rows aside until the given times (never brings one forward).
    pub async fn hold(
        &self,
        tx: &Client,
        holds: &[(i64, SystemTime)],
    ) -> Result<u64, tokio_postgres::Error> {
        if holds.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = holds.iter().map(|h| h.0).collect();
        let until: Vec<SystemTime> = holds.iter().map(|h| h.1).collect();
        tx.execute(self.hold.as_str(), &[&seqs, &until]).await
    }

    /// Deletes rows the broker confirmed.
    pub async fn delete(&self, tx: &Client, seqs: &[i64]) -> Result<u64, tokio_postgres::Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        tx.execute(self.delete.as_str(), &[&seqs]).await
    }

    /// Settles rows the broker confirmed: deletes them, or in retention mode
    /// moves them to `published` with their receipts.
    pub async fn settle_published(
        &self,
        tx: &Client,
        prepared: &Prepared,
        published: &[(&Envelope, Receipt)],
    ) -> Result<u64, tokio_postgres::Error> {
        if published.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = published.iter().map(|p| p.0.seq).collect();
        if self.retain.is_none() {
            return tx.execute(&prepared.settle, &[&seqs]).await;
        }
        let receipts: Vec<String> = published
            .iter()
            .map(|(env, receipt)| receipt.to_json(env).to_string())
            .collect();
        tx.execute(&prepared.settle, &[&seqs, &receipts]).await
    }

    /// Deletes up to `limit` published rows older than `retention`; returns
    /// how many went.
    pub async fn purge_published(
        &self,
        client: &tokio_postgres::Client,
        retention: Duration,
        limit: i64,
    ) -> Result<u64, tokio_postgres::Error> {
        client
            .execute(self.purge.as_str(), &[&retention.as_secs_f64(), &limit])
            .await
    }

    /// Records one attempt's failure per row and schedules the next attempt.
    pub async fn fail(
        &self,
        tx: &Client,
        failures: &[(i64, String, Duration)],
    ) -> Result<u64, tokio_postgres::Error> {
        if failures.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = failures.iter().map(|f| f.0).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.1.as_str()).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.2.as_secs_f64()).collect();
        tx.execute(self.fail.as_str(), &[&seqs, &errors, &delays])
            .await
    }

    /// Moves rows to the dead letters with their final error.
    pub async fn dead_letter(
        &self,
        tx: &Client,
        rows: &[(i64, String)],
    ) -> Result<u64, tokio_postgres::Error> {
        if rows.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let errors: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
        tx.execute(self.dead_letter.as_str(), &[&seqs, &errors])
            .await
    }

    /// Records a whole-batch failure (broker unreachable) without counting an
    /// attempt: an outage is not the message's fault.
    pub async fn note_batch_error(
        &self,
        tx: &Client,
        seqs: &[i64],
        error: &str,
    ) -> Result<u64, tokio_postgres::Error> {
        tx.execute(self.note_batch_error.as_str(), &[&seqs, &error])
            .await
    }
}

fn envelope(row: &Row) -> Result<Envelope, tokio_postgres::Error> {
    let headers: serde_json::Value = row.try_get("headers")?;
    let headers = match headers {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    serde_json::Value::String(s) => s,
                    // Rows written by hand may hold non-string values; forward
                    // their JSON text rather than dropping them.
                    other => other.to_string(),
                };
                (k, v)
            })
            .collect(),
        _ => Vec::new(),
    };
    Ok(Envelope {
        seq: row.try_get("seq")?,
        message_id: row.try_get::<_, Uuid>("message_id")?,
        destination: row.try_get("destination")?,
        ordering_key: row.try_get("ordering_key")?,
        routing_key: row.try_get("routing_key")?,
        headers,
        payload: row.try_get("payload")?,
        content_type: row.try_get("content_type")?,
        event_type: row.try_get("event_type")?,
        created_at: row.try_get::<_, SystemTime>("created_at")?,
        attempts: row.try_get("attempts")?,
    })
}
