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

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use tokio_postgres::types::{PgLsn, ToSql, Type};
use tokio_postgres::{Client, Row, Statement};
use uuid::Uuid;

use crate::envelope::{Envelope, Receipt};
use crate::source::floor::FloorAt;

mod statements;

pub use statements::HEADER_BYTES;

/// The statements a worker runs for every batch, prepared once per connection:
/// Postgres parses them once per session instead of once per batch.
#[derive(Debug, Clone)]
pub struct Prepared {
    lock: Statement,
    ready: Statement,
    probe: Statement,
    bodies: Statement,
    paused: Statement,
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
    /// How long a row blocked behind an older row of its key that is due
    /// but not in the claim is to be set aside, when it is (see
    /// [`Claimed::behind_due`]).
    pub due_recheck: Duration,
    /// Payload bytes above which the broker cannot take a message: a row
    /// larger is not read (see [`Claimed::too_large`]).
    pub max_payload: i64,
    /// Header bytes, as the claim reckons them (see [`Head`]), above which
    /// a row is not read either: twice the broker's limit, since the
    /// reckoning counts a few bytes a pair over and a frame carries the
    /// message's other properties too; headers a little over the limit are
    /// refused exactly once read.
    pub max_headers: i64,
}

/// What one claim found.
#[derive(Debug, Default)]
pub struct Claimed {
    /// Rows to publish, oldest first.
    pub batch: Vec<Envelope>,
    /// Rows of blocked keys to set aside, with until when.
    pub holds: Vec<(i64, SystemTime)>,
    /// Rows claimed but blocked behind an older row of their key (or a
    /// paused destination), by seq, oldest first.
    pub blocked: Vec<i64>,
    /// Those of `blocked` whose older row is due (its time has passed) and
    /// not in this claim, with until when to set them aside should the
    /// claims be stuck on them: `due_recheck` from the claim's `now()`,
    /// after that older row's time. They are left where they are
    /// otherwise: the older row may be in flight (taken by an earlier claim
    /// from the due rows), and setting its followers aside every time would
    /// rewrite a hot key's backlog once per batch.
    pub behind_due: Vec<(i64, SystemTime)>,
    /// Rows larger than `max_payload`, not read: the broker cannot take
    /// them, and reading one could take more memory than the relay has
    /// (plain SQL writers face no client limit). Their keys' later rows in
    /// this claim are left for the next claim, after them.
    pub too_large: Vec<TooLarge>,
    /// Rows whose body Postgres holds but the relay cannot read back (a
    /// plain-SQL writer's `{"n": 1e400}` in `headers`, JSON nested past the
    /// parser's depth), with why: dead letters, settled with this batch.
    /// Their keys' later rows in this claim are left for the next claim.
    pub unreadable: Vec<Unreadable>,
    /// Whether the claim locked rows it left out for the batch's row or
    /// byte limits: it took all a batch may hold, whatever the rows it
    /// kept turn out to weigh once read (their header bytes are reckoned
    /// before).
    pub left_out: bool,
    /// Whether the claim found the seq sequence restarted since the floor
    /// it used was computed (`TRUNCATE ... RESTART IDENTITY`, written past
    /// the floor again at once): the rows below that floor were not looked
    /// at, fresh or not, so a key's older row there could be overtaken.
    /// Nothing was kept; the caller drops the floor and claims again.
    pub stale_floor: bool,
    /// Whether every commit the claim could see is already durable, as the
    /// claim itself showed: by its second round trip the WAL was flushed
    /// past the insert position its locking scan read before locking any
    /// row, and the server names no synchronous standby that would also
    /// have to have it. A commit is inserted in the WAL before it becomes
    /// visible, so each one the scan saw ends below that position. When
    /// true, the batch needs no barrier (`source::durable`); when false, or
    /// for a claim that found nothing, it does. Under writers that commit
    /// with the server's default, the WAL is flushed at each of their
    /// commits, and the flush had passed that point for most claims
    /// (docs/benchmarks.md, "The barrier skipped when the claim shows its
    /// commits flushed").
    pub flushed: bool,
}

/// A claimed row too large for the broker, known by its size alone.
#[derive(Debug, Clone, PartialEq)]
pub struct TooLarge {
    /// The row's seq.
    pub seq: i64,
    /// Its message id.
    pub message_id: Uuid,
    /// Its destination.
    pub destination: String,
    /// Its attempts so far.
    pub attempts: i32,
    /// Its payload's bytes.
    pub bytes: i64,
    /// Its headers' bytes, about (see [`Head::headers`]).
    pub headers: i64,
}

/// A claimed row the relay cannot read (see [`Claimed::unreadable`]).
#[derive(Debug, Clone)]
pub struct Unreadable {
    /// The row's seq.
    pub seq: i64,
    /// Its message id.
    pub message_id: Uuid,
    /// Its destination.
    pub destination: String,
    /// Its attempts so far.
    pub attempts: i32,
    /// What reading it failed with.
    pub error: String,
}

/// The SQL text for one schema, built once.
#[derive(Debug, Clone)]
pub struct Queries {
    lock: String,
    ready: String,
    probe: String,
    bodies: String,
    paused: String,
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
    /// Its parameters: rows, partitions (`smallint[]`), floor, and the seqs
    /// other batches hold locked (`bigint[]`).
    pub fn lock_sql(&self) -> &str {
        &self.lock
    }

    /// The head-of-key probes, for EXPLAIN. Its parameters: the kept rows'
    /// keys (`text[]`) and each key's newest kept seq (`bigint[]`), the kept
    /// seqs (`bigint[]`), the floor's probe and scan seqs, and the ids of
    /// the writers it moved past (`bigint[]`, see [`FloorAt`]);
    /// [`Heads::probe_args`] gives the first three.
    pub fn probe_sql(&self) -> &str {
        &self.probe
    }

    /// The kept rows' headers and payloads, for EXPLAIN. Its parameter: the
    /// kept seqs (`bigint[]`).
    pub fn bodies_sql(&self) -> &str {
        &self.bodies
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
        // Whether this session may read the WAL's positions (see
        // `statements::WAL_INSERTED`); refused, the claim goes without them.
        let wal = client
            .batch_execute(&format!(
                "SELECT {}, {}",
                statements::WAL_INSERTED,
                statements::WAL_FLUSHED
            ))
            .await;
        let without_wal = |sql: &str| match &wal {
            Ok(()) => sql.to_owned(),
            Err(e) => {
                tracing::debug!(error = %e, "the WAL's positions are refused: every batch waits for the durability barrier");
                sql.replace(statements::WAL_INSERTED, "NULL::pg_lsn")
                    .replace(statements::WAL_FLUSHED, "NULL::pg_lsn")
            }
        };
        let lock = client
            .prepare_typed(
                &without_wal(&self.lock),
                &[Type::INT8, Type::INT2_ARRAY, Type::INT8, Type::INT8_ARRAY],
            )
            .await?;
        let ready = client
            .prepare_typed(
                &self.ready,
                &[Type::INT2_ARRAY, Type::INT8, Type::INT8_ARRAY],
            )
            .await?;
        let probe = client
            .prepare_typed(
                &self.probe,
                &[
                    Type::TEXT_ARRAY,
                    Type::INT8_ARRAY,
                    Type::INT8_ARRAY,
                    Type::INT8,
                    Type::INT8,
                    Type::INT8_ARRAY,
                ],
            )
            .await?;
        let bodies = client
            .prepare_typed(&self.bodies, &[Type::INT8_ARRAY])
            .await?;
        let paused = client.prepare(&without_wal(&self.paused)).await?;
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
            ready,
            probe,
            bodies,
            paused,
            settle,
        })
    }

    /// Locks and returns the oldest ready rows of the `partitions` this
    /// replica owns, up to `limits`. `prepared` must come from the connection
    /// `tx` runs on. Rows of keys whose head is blocked come back as holds,
    /// to be set aside with [`Queries::hold`] in the same transaction.
    /// `floor` says where fresh rows can be, and where a key's older rows
    /// (see [`crate::source::floor`]); 0 when nothing is known.
    ///
    /// `locked` runs once every row this claim takes is locked: when the
    /// first statement answers, before the second round trip (probes and
    /// bodies) has gone out. A claim that follows from then on skips these
    /// rows, while this one still works out, receives and decodes them.
    pub async fn claim(
        &self,
        tx: &Client,
        prepared: &Prepared,
        limits: &ClaimLimits,
        partitions: &[i16],
        floor: impl Into<FloorAt>,
        locked: impl FnOnce(),
    ) -> Result<Claimed, tokio_postgres::Error> {
        self.claim_beside(tx, prepared, limits, partitions, floor, &[], |_| locked())
            .await
    }

    /// Whether a claim of `partitions` from `floor`, beside batches that
    /// hold the rows `mine`, would find a row; asked on `client` outside
    /// any transaction. It locks nothing, so a row another replica holds
    /// counts as found. `prepared` must come from the same connection.
    pub async fn ready(
        &self,
        client: &Client,
        prepared: &Prepared,
        partitions: &[i16],
        floor: i64,
        mine: &[i64],
    ) -> Result<bool, tokio_postgres::Error> {
        client
            .query_one(&prepared.ready, &[&partitions, &floor, &mine])
            .await?
            .try_get("ready")
    }

    /// [`Queries::claim`], beside other batches of the relay's that hold
    /// the rows `mine` locked: the claim passes over them by seq instead of
    /// trying each one's lock. `locked` is given the seqs this claim locked.
    #[allow(clippy::too_many_arguments)]
    pub async fn claim_beside(
        &self,
        tx: &Client,
        prepared: &Prepared,
        limits: &ClaimLimits,
        partitions: &[i16],
        floor: impl Into<FloorAt>,
        mine: &[i64],
        locked: impl FnOnce(Vec<i64>),
    ) -> Result<Claimed, tokio_postgres::Error> {
        let floor = floor.into();
        let rows = tx
            .query(
                &prepared.lock,
                &[&limits.rows, &partitions, &floor.scan, &mine],
            )
            .await;
        locked(match &rows {
            Ok(rows) => rows.iter().filter_map(|r| r.try_get("seq").ok()).collect(),
            Err(_) => Vec::new(),
        });
        let rows = rows?;
        let heads = Heads::from_rows(&rows, limits)?;
        if heads.rows.is_empty() {
            return Ok(Claimed::default());
        }
        // The earliest: read before this claim's locks wrote any WAL. None
        // where the session may not read it.
        let inserted = rows
            .iter()
            .map(|r| r.try_get::<_, Option<PgLsn>>("wal_inserted"))
            .try_fold(None, |min: Option<PgLsn>, l| {
                l.map(|l| match (min, l) {
                    (Some(m), Some(l)) => Some(m.min(l)),
                    (m, l) => m.or(l),
                })
            })?;
        let (keys, tops, kept) = heads.probe_args();
        // Rows too large for the broker are not read (see `too_large`).
        let fitting: Vec<i64>;
        let read: &[i64] = if heads.rows.iter().all(|h| h.fits(limits)) {
            &kept
        } else {
            fitting = heads
                .rows
                .iter()
                .filter(|h| h.fits(limits))
                .map(|h| h.seq)
                .collect();
            &fitting
        };
        let open = floor.open_writers();
        let probe_params: [&(dyn ToSql + Sync); 6] =
            [&keys, &tops, &kept, &floor.probe, &floor.scan, &open];
        let bodies_params: [&(dyn ToSql + Sync); 1] = [&read];
        // try_join! polls in order, and each query is sent at its first
        // poll: the three go out together, the bodies last, so that they
        // can be read one at a time as the envelopes are built instead of
        // all being held at once beside them.
        let (paused, found, bodies) = futures::try_join!(
            tx.query_one(&prepared.paused, &[]),
            async {
                if keys.is_empty() {
                    Ok(Vec::new())
                } else {
                    tx.query(&prepared.probe, &probe_params).await
                }
            },
            tx.query_raw(&prepared.bodies, bodies_params),
        )?;
        let mut probes = HashMap::with_capacity(found.len());
        for row in &found {
            probes.insert(
                row.try_get::<_, String>("key")?,
                Probe {
                    gap: row.try_get("gap")?,
                    gap_until: row.try_get("gap_until")?,
                    parked_from: row.try_get("parked_from")?,
                },
            );
        }
        let seq_file: Option<i64> = paused.try_get("seq_file")?;
        if floor.scan > 0 && floor.file.is_some_and(|f| seq_file != Some(f)) {
            return Ok(Claimed {
                stale_floor: true,
                ..Claimed::default()
            });
        }
        let now: SystemTime = paused.try_get("now")?;
        let wal_flushed: Option<PgLsn> = paused.try_get("wal_flushed")?;
        let flushed = paused.try_get::<_, bool>("no_sync_standby")?
            && inserted.zip(wal_flushed).is_some_and(|(l, f)| f >= l);
        let paused: HashSet<String> = paused
            .try_get::<_, Vec<String>>("paused")?
            .into_iter()
            .collect();
        let verdicts = too_large(
            &heads.rows,
            judge(&heads.rows, &probes, &paused, now, limits),
            limits,
        );
        // The bodies come in seq order, as the kept rows are: walk both.
        futures::pin_mut!(bodies);
        let mut body = bodies.try_next().await?;
        let seq_of = |b: &Option<Row>| b.as_ref().map(|b| b.try_get::<_, i64>(0)).transpose();
        let mut claimed = Claimed {
            left_out: heads.left_out,
            flushed,
            ..Claimed::default()
        };
        // Keys whose older row in this claim could not be read.
        let mut unread_keys: HashSet<String> = HashSet::new();
        for (head, verdict) in heads.rows.into_iter().zip(verdicts) {
            // Blocked rows' bodies are passed over.
            while seq_of(&body)?.is_some_and(|seq| seq < head.seq) {
                body = bodies.try_next().await?;
            }
            match verdict {
                Verdict::Go
                    if head
                        .ordering_key
                        .as_ref()
                        .is_some_and(|k| unread_keys.contains(k)) =>
                {
                    claimed.blocked.push(head.seq);
                }
                Verdict::Go if seq_of(&body)? == Some(head.seq) => {
                    let row = body.take().expect("a body was just seen");
                    // The row is in memory: what fails here is its values.
                    match read_body(&row) {
                        Ok((headers, payload)) => {
                            claimed.batch.push(envelope(head, headers, payload))
                        }
                        Err(e) => {
                            unread_keys.extend(head.ordering_key);
                            claimed.unreadable.push(Unreadable {
                                seq: head.seq,
                                message_id: head.message_id,
                                destination: head.destination,
                                attempts: head.attempts,
                                error: crate::source::PgError(&e).to_string(),
                            });
                        }
                    }
                    body = bodies.try_next().await?;
                }
                // Cannot happen while the row is locked; if it does, the row
                // stays in the outbox for the next claim.
                Verdict::Go => {
                    tracing::warn!(
                        seq = head.seq,
                        "a claimed row's payload was not found; leaving it for the next claim"
                    );
                    claimed.blocked.push(head.seq);
                }
                Verdict::Blocked(until) => {
                    claimed.blocked.push(head.seq);
                    if let Some(until) = until {
                        claimed.holds.push((head.seq, until));
                    }
                }
                Verdict::BehindDue(until) => {
                    claimed.blocked.push(head.seq);
                    claimed.behind_due.push((head.seq, until));
                }
                Verdict::TooLarge => claimed.too_large.push(TooLarge {
                    seq: head.seq,
                    message_id: head.message_id,
                    destination: head.destination,
                    attempts: head.attempts,
                    bytes: head.size,
                    headers: head.headers,
                }),
            }
        }
        // Read what is left (blocked rows' bodies) unless the stream has
        // ended: polled again after its end, it would fail as closed.
        if body.is_some() {
            while bodies.try_next().await?.is_some() {}
        }
        Ok(claimed)
    }

    /// Sets rows aside until the given times (never brings one forward),
    /// with the rows of their keys already set aside behind them that would
    /// come due sooner (see `statements::keep_behind`); returns how many of
    /// `holds` moved.
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
        counted(tx.query_one(self.hold.as_str(), &[&seqs, &until]).await)
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

    /// Records one attempt's failure per row and schedules the next attempt;
    /// the rows of their keys set aside behind them wait at least as long.
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
        counted(
            tx.query_one(self.fail.as_str(), &[&seqs, &errors, &delays])
                .await,
        )
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

    /// Records a failure of the broker's (unreachable, or a partition
    /// without a leader) on rows it did not answer and, with a `hold`, sets
    /// them aside for that long, their keys behind them, without counting
    /// an attempt: an outage is not the message's fault. The rows of their
    /// keys set aside behind them wait at least as long.
    pub async fn note_batch_error(
        &self,
        tx: &Client,
        seqs: &[i64],
        error: &str,
        hold: Option<Duration>,
    ) -> Result<u64, tokio_postgres::Error> {
        let hold = hold.map(|h| h.as_secs_f64());
        counted(
            tx.query_one(self.note_batch_error.as_str(), &[&seqs, &error, &hold])
                .await,
        )
    }
}

/// The count a statement built by `statements::keep_behind` returns.
fn counted(row: Result<Row, tokio_postgres::Error>) -> Result<u64, tokio_postgres::Error> {
    Ok(u64::try_from(row?.try_get::<_, i64>(0)?).unwrap_or(0))
}

/// What the claim's first statement returns of one locked row: all but its
/// headers and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    /// The row's seq.
    pub seq: i64,
    message_id: Uuid,
    destination: String,
    ordering_key: Option<String>,
    routing_key: String,
    content_type: Option<String>,
    event_type: Option<String>,
    created_at: SystemTime,
    attempts: i32,
    /// Payload bytes.
    size: i64,
    /// Header bytes: names and values, as they travel (exact when the
    /// headers are stored compressed, a few bytes a pair over when not; see
    /// [`HEADER_BYTES`]).
    headers: i64,
}

/// `None` for an empty string.
fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

impl Head {
    /// By position, in the lock statement's column order (by name, each
    /// column costs a search of the row's columns, twice per message).
    fn from_row(row: &Row) -> Result<Self, tokio_postgres::Error> {
        Ok(Head {
            seq: row.try_get(0)?,
            message_id: row.try_get(1)?,
            destination: row.try_get(2)?,
            ordering_key: row.try_get(3)?,
            routing_key: row.try_get(4)?,
            // Plain SQL may write '' (the client and enqueue() refuse it):
            // it means none, and a CloudEvent's `type` and `datacontenttype`
            // must not be empty.
            content_type: non_empty(row.try_get(5)?),
            event_type: non_empty(row.try_get(6)?),
            created_at: row.try_get(7)?,
            attempts: row.try_get(8)?,
            size: row.try_get(9)?,
            headers: row.try_get(10)?,
        })
    }

    /// Whether the broker could take this row: a payload or headers larger
    /// than `limits` allow are never read.
    fn fits(&self, limits: &ClaimLimits) -> bool {
        self.size <= limits.max_payload && self.headers <= limits.max_headers
    }
}

/// The rows a claim keeps: the oldest prefix of the locked rows that fits
/// the batch's row and byte limits (one row always fits), so that every row
/// left out is younger than every row kept.
#[derive(Debug, Default)]
pub struct Heads {
    /// Oldest first.
    pub rows: Vec<Head>,
    /// Whether rows were locked and left out for the limits.
    pub left_out: bool,
}

impl Heads {
    /// Keeps the oldest of `rows` (the claim's first statement's answer, in
    /// any order) within `limits`.
    pub fn from_rows(rows: &[Row], limits: &ClaimLimits) -> Result<Self, tokio_postgres::Error> {
        let rows = rows.iter().map(Head::from_row).collect::<Result<_, _>>()?;
        Ok(Self::keep(rows, limits))
    }

    fn keep(mut rows: Vec<Head>, limits: &ClaimLimits) -> Self {
        rows.sort_unstable_by_key(|h| h.seq);
        let (mut n, mut bytes) = (0i64, 0i64);
        let kept = rows
            .iter()
            .take_while(|h| {
                n += 1;
                bytes = bytes.saturating_add(h.size).saturating_add(h.headers);
                n <= limits.rows && (n == 1 || bytes <= limits.bytes)
            })
            .count();
        let left_out = kept < rows.len();
        rows.truncate(kept);
        Heads { rows, left_out }
    }

    /// The probe's first three parameters: each key among the kept rows,
    /// the key's newest kept seq, and every kept seq.
    pub fn probe_args(&self) -> (Vec<&str>, Vec<i64>, Vec<i64>) {
        let mut tops: HashMap<&str, i64> = HashMap::new();
        for h in &self.rows {
            if let Some(key) = &h.ordering_key {
                // Oldest first, so the last seen is the newest.
                tops.insert(key, h.seq);
            }
        }
        let (keys, tops) = tops.into_iter().unzip();
        (keys, tops, self.rows.iter().map(|h| h.seq).collect())
    }
}

/// What the probe found for one key: the oldest older row of the key that
/// the claim did not keep, until when it waits (nothing when it is in
/// flight elsewhere), and the key's oldest dead letter when parking.
#[derive(Debug, Clone, Default, PartialEq)]
struct Probe {
    gap: Option<i64>,
    gap_until: Option<SystemTime>,
    parked_from: Option<i64>,
}

/// One kept row's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Publish it.
    Go,
    /// Blocked; set it aside until then, or (nothing) leave it for the next
    /// claim, its blocker being merely in flight.
    Blocked(Option<SystemTime>),
    /// Blocked by an older row that is due and not in this claim: left for
    /// the next claim, or set aside until then if the claims are stuck.
    BehindDue(SystemTime),
    /// Larger than the broker takes: dead-lettered unread.
    TooLarge,
}

/// `verdicts` with each row that would go but is larger than
/// `limits.max_payload` made [`Verdict::TooLarge`], and the later rows of
/// its key that would go left for the next claim: they follow it, and it
/// becomes a dead letter only when this claim settles.
fn too_large(heads: &[Head], mut verdicts: Vec<Verdict>, limits: &ClaimLimits) -> Vec<Verdict> {
    if heads.iter().all(|h| h.fits(limits)) {
        return verdicts;
    }
    let mut refused: HashSet<&str> = HashSet::new();
    for (h, v) in heads.iter().zip(verdicts.iter_mut()) {
        if *v != Verdict::Go {
            continue;
        }
        let key = h.ordering_key.as_deref();
        if key.is_some_and(|k| refused.contains(k)) {
            *v = Verdict::Blocked(None);
        } else if !h.fits(limits) {
            *v = Verdict::TooLarge;
            if let Some(k) = key {
                refused.insert(k);
            }
        }
    }
    verdicts
}

/// The kept rows' verdicts (`heads` oldest first). A row is blocked when its
/// destination is paused, when an older kept row of its key goes to a
/// paused destination, when an older row of its key was not kept (in flight
/// elsewhere, waiting out a retry, set aside: the probe's `gap`) or, when
/// parking, an older message of its key is dead-lettered. A row blocked by
/// a pause or a dead letter is set aside for `park_recheck` (or until its
/// gap's own time, if later); one blocked only by a waiting row, until that
/// row's time; one blocked by a row in flight, not at all. Rows without a
/// key are blocked only by their own destination's pause. `now` is the
/// claim transaction's `now()`.
///
/// A row blocked by an older row that is due (its time has passed) but not
/// in this claim comes back as [`Verdict::BehindDue`], with a time
/// `due_recheck` after the claim's `now()`: after its blocker's. Left where
/// it is every time, it could stop every claim: the scan of due rows goes
/// in order of time, and a key's later rows can come due before its head
/// (set aside behind it before the head was set aside again, for longer).
/// A batch's worth of them, taken first by every claim and each blocked,
/// would be all any claim ever found.
fn judge(
    heads: &[Head],
    probes: &HashMap<String, Probe>,
    paused: &HashSet<String>,
    now: SystemTime,
    limits: &ClaimLimits,
) -> Vec<Verdict> {
    let recheck = limits.park_recheck;
    // The oldest kept row of each key that goes to a paused destination.
    let mut paused_from: HashMap<&str, i64> = HashMap::new();
    if !paused.is_empty() {
        for h in heads {
            if let Some(key) = &h.ordering_key {
                if paused.contains(&h.destination) {
                    paused_from.entry(key).or_insert(h.seq);
                }
            }
        }
    }
    let none = Probe::default();
    heads
        .iter()
        .map(|h| {
            let own = paused.contains(&h.destination);
            let (probe, paused_from) = match &h.ordering_key {
                Some(key) => (
                    probes.get(key).unwrap_or(&none),
                    paused_from.get(key.as_str()).copied(),
                ),
                None => (&none, None),
            };
            let set_aside = own
                || paused_from.is_some_and(|p| p <= h.seq)
                || probe.parked_from.is_some_and(|p| p < h.seq);
            let behind = probe.gap.is_some_and(|g| g < h.seq);
            if set_aside {
                let recheck = now.checked_add(recheck).unwrap_or(now);
                Verdict::Blocked(Some(probe.gap_until.map_or(recheck, |u| u.max(recheck))))
            } else if behind {
                match probe.gap_until {
                    Some(u) if u > now => Verdict::Blocked(Some(u)),
                    Some(_) => {
                        Verdict::BehindDue(now.checked_add(limits.due_recheck).unwrap_or(now))
                    }
                    None => Verdict::Blocked(None),
                }
            } else {
                Verdict::Go
            }
        })
        .collect()
}

/// A row's headers, as the envelope carries them.
type Headers = Vec<(String, String)>;

/// A body's headers and payload; fails on values Postgres holds and the
/// relay cannot read (see [`Claimed::unreadable`]).
fn read_body(body: &Row) -> Result<(Headers, Vec<u8>), tokio_postgres::Error> {
    // By position: seq, headers, payload, as the bodies statement says.
    let headers: serde_json::Value = body.try_get(1)?;
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
    Ok((headers, body.try_get(2)?))
}

fn envelope(head: Head, headers: Headers, payload: Vec<u8>) -> Envelope {
    Envelope {
        seq: head.seq,
        message_id: head.message_id,
        destination: head.destination,
        ordering_key: head.ordering_key,
        routing_key: head.routing_key,
        headers,
        payload,
        content_type: head.content_type,
        event_type: head.event_type,
        created_at: head.created_at,
        attempts: head.attempts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(seq: i64, key: Option<&str>, destination: &str, size: i64) -> Head {
        Head {
            seq,
            message_id: Uuid::nil(),
            destination: destination.to_owned(),
            ordering_key: key.map(str::to_owned),
            routing_key: String::new(),
            content_type: None,
            event_type: None,
            created_at: SystemTime::UNIX_EPOCH,
            attempts: 0,
            size,
            headers: 0,
        }
    }

    fn with_headers(mut head: Head, headers: i64) -> Head {
        head.headers = headers;
        head
    }

    fn limits(rows: i64, bytes: i64) -> ClaimLimits {
        ClaimLimits {
            rows,
            bytes,
            park_recheck: Duration::from_secs(60),
            due_recheck: Duration::from_millis(10),
            max_payload: i64::MAX,
            max_headers: i64::MAX,
        }
    }

    fn seqs(heads: &Heads) -> Vec<i64> {
        heads.rows.iter().map(|h| h.seq).collect()
    }

    #[test]
    fn a_row_too_large_for_the_broker_is_refused_and_its_keys_later_rows_wait() {
        let limits = ClaimLimits {
            max_payload: 100,
            max_headers: 100,
            ..limits(10, 1_000_000)
        };
        let heads = [
            head(1, Some("a"), "d", 10),
            head(2, Some("a"), "d", 101),
            head(3, Some("b"), "d", 10),
            head(4, Some("a"), "d", 10),
            head(5, None, "d", 500),
            head(6, None, "d", 10),
            // Blocked already (behind an older row in flight): stays so.
            head(7, Some("c"), "d", 500),
        ];
        let mut verdicts = vec![Verdict::Go; 6];
        verdicts.push(Verdict::Blocked(None));
        assert_eq!(
            too_large(&heads, verdicts, &limits),
            [
                Verdict::Go,
                Verdict::TooLarge,
                Verdict::Go,
                Verdict::Blocked(None),
                Verdict::TooLarge,
                Verdict::Go,
                Verdict::Blocked(None),
            ]
        );
        // At the limit it goes.
        let at = [head(1, Some("a"), "d", 100)];
        assert_eq!(too_large(&at, vec![Verdict::Go], &limits), [Verdict::Go]);
        // Headers larger than a message can be: the same, whatever the
        // payload.
        let heads = [
            with_headers(head(1, Some("a"), "d", 1), 101),
            head(2, Some("a"), "d", 1),
            with_headers(head(3, Some("b"), "d", 1), 100),
        ];
        assert_eq!(
            too_large(&heads, vec![Verdict::Go; 3], &limits),
            [Verdict::TooLarge, Verdict::Blocked(None), Verdict::Go]
        );
    }

    #[test]
    fn a_claims_byte_limit_counts_headers_as_well_as_payloads() {
        let rows = vec![
            with_headers(head(1, None, "d", 10), 500),
            head(2, None, "d", 10),
            head(3, None, "d", 10),
        ];
        let cut = Heads::keep(rows.clone(), &limits(10, 515));
        assert_eq!(seqs(&cut), [1]);
        // Left out by bytes reckoned before the rows were read: the batch
        // is full, whatever its payloads weigh.
        assert!(cut.left_out);
        let all = Heads::keep(rows, &limits(10, 530));
        assert_eq!(seqs(&all), [1, 2, 3]);
        assert!(!all.left_out);
    }

    #[test]
    fn a_claim_keeps_the_oldest_rows_that_fit_and_one_row_always() {
        let rows = || {
            vec![
                head(3, None, "d", 10),
                head(1, None, "d", 10),
                head(2, None, "d", 10),
            ]
        };
        assert_eq!(seqs(&Heads::keep(rows(), &limits(2, 1_000))), [1, 2]);
        assert_eq!(seqs(&Heads::keep(rows(), &limits(10, 20))), [1, 2]);
        assert_eq!(
            seqs(&Heads::keep(rows(), &limits(10, 5))),
            [1],
            "one row always goes"
        );
        // A large row stops the batch: nothing younger is kept past it.
        let rows = vec![
            head(1, None, "d", 10),
            head(2, None, "d", 100),
            head(3, None, "d", 1),
        ];
        assert_eq!(seqs(&Heads::keep(rows, &limits(10, 50))), [1]);
    }

    #[test]
    fn a_pause_holds_back_its_destination_and_the_later_rows_of_its_keys() {
        let heads = [
            head(1, Some("a"), "x", 1),
            head(2, Some("a"), "paused", 1),
            head(3, Some("a"), "x", 1),
            head(4, Some("b"), "x", 1),
            head(5, None, "paused", 1),
            head(6, None, "x", 1),
        ];
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let paused: HashSet<String> = ["paused".to_owned()].into();
        let verdicts = judge(&heads, &HashMap::new(), &paused, now, &limits(10, 1_000));
        let held = Verdict::Blocked(Some(now + Duration::from_secs(60)));
        assert_eq!(
            verdicts,
            [Verdict::Go, held, held, Verdict::Go, held, Verdict::Go]
        );
    }

    #[test]
    fn a_key_waits_behind_its_older_row_for_as_long_as_that_row_waits() {
        let heads = [head(5, Some("a"), "x", 1), head(7, Some("a"), "x", 1)];
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let later = now + Duration::from_secs(30);
        let probe = |gap, gap_until| {
            HashMap::from([(
                "a".to_owned(),
                Probe {
                    gap: Some(gap),
                    gap_until,
                    parked_from: None,
                },
            )])
        };
        let judged = |probes| judge(&heads, &probes, &HashSet::new(), now, &limits(10, 1_000));
        // Row 6 waits until `later`: row 7 is set aside until then, row 5 goes.
        assert_eq!(
            judged(probe(6, Some(later))),
            [Verdict::Go, Verdict::Blocked(Some(later))]
        );
        // Row 6 is in flight elsewhere: row 7 stays for the next claim.
        assert_eq!(
            judged(probe(6, None)),
            [Verdict::Go, Verdict::Blocked(None)]
        );
        // Row 6's time has passed and it is not in this claim: row 7 stays,
        // with a time after row 6's should the claims be stuck on it.
        assert_eq!(
            judged(probe(6, Some(now - Duration::from_secs(1)))),
            [
                Verdict::Go,
                Verdict::BehindDue(now + Duration::from_millis(10))
            ]
        );
    }
}
