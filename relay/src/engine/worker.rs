//! One worker's loop: claim a batch, publish it in waves, settle it, and
//! decide how long to pause; plus what it records about each batch.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::hooks;
use super::idle::{gather_cycle, Idle, STANDBY_RECHECK};
use super::plan::{publish_in_waves, settle_plan};
use super::record::record_settled;
use super::Settings;
use crate::backoff::Backoff;
use crate::envelope::Envelope;
use crate::health::{Event, Stats};
use crate::publish::Publisher;
use crate::source::claim::{ClaimLimits, TooLarge, Unreadable};
use crate::source::durable::Durable;
use crate::source::floor::Floor;
use crate::source::ownership::Owned;
use crate::source::store::{BatchTx, OpenError, Session, Settle, Store, StoreError};
use crate::supervise::{sleep_or_cancel, supervise};

/// How long a question to the broker (`Publisher::ready`) is waited for.
const BROKER_QUESTION: Duration = Duration::from_secs(5);

/// The broker's answer to [`Publisher::ready`], given up after
/// [`BROKER_QUESTION`] (a connection that stays silent). Asked by a worker
/// before it claims again after a failed batch, and by the relay's probe.
pub(super) async fn ask_broker<P: Publisher>(
    publisher: &P,
) -> Result<(), crate::publish::PublishError> {
    tokio::time::timeout(BROKER_QUESTION, publisher.ready())
        .await
        .unwrap_or_else(|_| {
            Err(crate::publish::PublishError::msg(format!(
                "broker did not answer within {BROKER_QUESTION:?}"
            )))
        })
}

pub(super) struct Worker<P: Publisher, S: Store> {
    pub(super) id: usize,
    pub(super) idle: Idle,
    /// Where the claim's scan of fresh rows starts.
    pub(super) floor: Arc<Floor>,
    /// Holds each batch back until its rows' commits are durable.
    pub(super) durable: Arc<Durable>,
    pub(super) owned: Owned,
    /// Where the rows are claimed and settled.
    pub(super) store: Arc<S>,
    pub(super) publisher: Arc<P>,
    pub(super) settings: Settings,
    pub(super) stats: Arc<Stats>,
    /// The confirm window: `pipeline` slots, each held by a batch from its
    /// publish until the broker has answered.
    pub(super) in_flight: Arc<tokio::sync::Semaphore>,
    /// The payload bytes all claimed batches share, in KiB: (pipeline + 1) x
    /// `batch_max_bytes`. A batch holds its share from claim to settle, so a
    /// message larger than one batch's limit (it goes alone) cannot be held
    /// by every worker at once.
    pub(super) payload_budget: Arc<tokio::sync::Semaphore>,
    /// The budget's size in KiB.
    pub(super) payload_budget_kib: u32,
}

/// KiB of the shared payload budget a batch of `bytes` takes (at least 1, at
/// most the whole budget).
fn budget_share(bytes: usize, budget_kib: u32) -> u32 {
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, budget_kib.max(1))
}

pub(super) enum BatchEnd {
    /// Nothing to publish; `behind` when rows are waiting behind another
    /// batch in flight (older rows of their keys), so work will be there as
    /// soon as it settles.
    Empty { behind: bool },
    /// A batch was settled; `more` when more is probably waiting: the claim
    /// took as much as a batch may hold, or left rows behind another batch.
    /// `late` when it took longer, from claim to settle, than the shortest
    /// pause. `cycle`: how far apart claims would find a trickle's batch
    /// each, at the rate this one found rows (see [`gather_cycle`]).
    Settled {
        more: bool,
        late: bool,
        cycle: Option<Duration>,
    },
}

#[derive(Debug, thiserror::Error)]
pub(super) enum BatchError {
    #[error("postgres: {0}")]
    Postgres(#[from] StoreError),
    #[error("broker: {0}")]
    Publish(#[from] crate::publish::PublishError),
}

/// How a worker's Postgres session ended.
enum SessionEnd {
    /// It could not connect.
    Connect(StoreError),
    /// It could not prepare the batch's statements.
    Prepare(StoreError),
    /// The connection was lost mid-batch.
    Lost(StoreError),
    /// A statement failed on a live connection.
    Failed(StoreError),
}

impl<P: Publisher, S: Store> Worker<P, S> {
    /// Runs Postgres sessions until `shutdown`: each connects, prepares the
    /// statements and runs batches until the session fails; [`supervise`]
    /// retries it with backoff.
    pub(super) async fn run(self, shutdown: CancellationToken) {
        let id = self.id;
        let stats = Arc::clone(&self.stats);
        let max = self.settings.reconnect_max;
        // One worker, one session at a time: the lock is only ever taken by
        // the session supervise is running.
        let worker = tokio::sync::Mutex::new(self);
        let (worker, stop) = (&worker, &shutdown);
        supervise(
            Duration::from_millis(100),
            max,
            &shutdown,
            || async move { worker.lock().await.session(stop).await },
            |end: &SessionEnd| match end {
                SessionEnd::Connect(e) | SessionEnd::Lost(e) => stats.note_postgres(id, Some(e)),
                SessionEnd::Prepare(e) => {
                    tracing::warn!(worker = id, error = %e, "cannot prepare the claim; retrying")
                }
                // A fresh session re-prepares the statements: one whose
                // cached plan went stale (a column changed type under it)
                // would fail the same way on every batch.
                SessionEnd::Failed(e) => {
                    tracing::warn!(worker = id, error = %e, "postgres error; batch will be retried")
                }
            },
        )
        .await;
    }

    /// One Postgres session: batches back to back, pausing as the outbox
    /// empties, until shutdown (Ok) or a Postgres error (Err). Broker
    /// failures are waited out here, on the same session.
    async fn session(&mut self, shutdown: &CancellationToken) -> Result<(), SessionEnd> {
        // Opening holds nothing a shutdown must finish, and a server that
        // accepts connections and answers nothing keeps it until its bound.
        let Some(opened) = shutdown.run_until_cancelled(self.store.open()).await else {
            return Ok(());
        };
        let mut db = opened.map_err(|e| match e {
            OpenError::Connect(e) => SessionEnd::Connect(e),
            OpenError::Prepare(e) => SessionEnd::Prepare(e),
        })?;
        self.stats.note_postgres(self.id, None);
        let mut broker = Backoff::new(Duration::from_millis(100), self.settings.reconnect_max);
        let mut idle = Backoff::new(self.settings.poll_min, self.settings.poll_interval);
        // Whether the last batch failed at the broker and the broker has not
        // answered a question since.
        let mut broker_failing = false;
        // Whether the last claim found nothing: the next poll looks before
        // it claims (see `Session::ready`).
        let mut look_first = false;
        while !shutdown.is_cancelled() {
            if broker_failing {
                // Asked before claiming again: while the broker cannot be
                // reached, a claim would only lock a batch, write the
                // failure onto each of its rows (a dead row version each,
                // for vacuum to clear) and release it.
                match self.ask_broker(shutdown).await {
                    None => return Ok(()),
                    Some(Ok(())) => broker_failing = false,
                    Some(Err(e)) => {
                        tracing::debug!(worker = self.id, error = %e, "broker still unavailable; not claiming");
                        if sleep_or_cancel(broker.next_delay(), shutdown).await {
                            return Ok(());
                        }
                        continue;
                    }
                }
            }
            let ended = self.batch_until_grace(&mut db, look_first, shutdown).await;
            look_first = matches!(ended, Some(Ok(BatchEnd::Empty { behind: false })));
            match ended {
                Some(Ok(BatchEnd::Settled { more: true, .. })) => {
                    broker.reset();
                    idle.reset();
                    // Probably more waiting: bring one more worker in.
                    self.idle.work.notify_one();
                }
                Some(Ok(BatchEnd::Settled {
                    more: false,
                    late: false,
                    cycle,
                })) => {
                    // A trickle: one worker at a time keeps the shortest
                    // pause, so its batches gather what arrives meanwhile,
                    // and ends it early once a trickle's batch is waiting
                    // (a stream faster than the pause needs).
                    broker.reset();
                    idle.reset();
                    let gather = self.idle.gather_pause(cycle);
                    self.poll_or_stand_by(&mut idle, true, gather, shutdown)
                        .await;
                }
                Some(Ok(BatchEnd::Settled {
                    more: false,
                    late: true,
                    cycle,
                })) => {
                    // Batches slower than the shortest pause (a slow broker,
                    // a busy database): one poller would hold every claim
                    // back behind its batch, so each worker keeps its own
                    // pause and the claims overlap the confirms.
                    broker.reset();
                    idle.reset();
                    let pause = idle.next_delay();
                    let gather = self.idle.gather_pause(cycle);
                    self.pause(gather.map_or(pause, |g| pause.min(g)), shutdown)
                        .await;
                }
                Some(Ok(BatchEnd::Empty { behind: true })) => {
                    // The batch ahead hands work over when it settles;
                    // the pause is only a floor under that. An empty
                    // claim says nothing of the broker: the backoff of
                    // one that keeps failing stays where it is.
                    self.pause(idle.next_delay(), shutdown).await;
                }
                Some(Ok(BatchEnd::Empty { behind: false })) => {
                    // Work handed over is there to claim: no need to look.
                    let handed = self
                        .poll_or_stand_by(&mut idle, false, None, shutdown)
                        .await;
                    look_first = !handed;
                }
                Some(Err(BatchError::Publish(e))) => {
                    // Stats::note_batch logged the change of state.
                    tracing::debug!(worker = self.id, error = %e, "broker unavailable; batch will be retried");
                    broker_failing = true;
                    if sleep_or_cancel(broker.next_delay(), shutdown).await {
                        return Ok(());
                    }
                }
                Some(Err(BatchError::Postgres(e))) => {
                    return Err(if db.is_closed() {
                        SessionEnd::Lost(e)
                    } else {
                        SessionEnd::Failed(e)
                    });
                }
                None => {
                    tracing::warn!(
                        worker = self.id,
                        grace = ?self.settings.shutdown_grace,
                        "batch still in flight after the shutdown grace; abandoned, its rows stay in the outbox"
                    );
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// [`ask_broker`], or `None` on shutdown.
    async fn ask_broker(
        &self,
        shutdown: &CancellationToken,
    ) -> Option<Result<(), crate::publish::PublishError>> {
        tokio::select! {
            _ = shutdown.cancelled() => None,
            answer = ask_broker(self.publisher.as_ref()) => Some(answer),
        }
    }

    /// Pauses before the next claim after one that was not full (`found`
    /// when it found rows): the next delay of `idle` if no other worker is
    /// pausing to poll, else on standby until work is handed over (or the
    /// standby recheck). Each worker keeping the shortest pause would claim
    /// a trickle in batches that many times smaller, each with its own
    /// round trips. A worker that found rows while another polls ends that
    /// poller's pause, which may have grown while the outbox was empty. A
    /// poller's pause ends after `gather` if sooner. Returns whether it
    /// ended because work was handed over.
    async fn poll_or_stand_by(
        &mut self,
        idle: &mut Backoff,
        found: bool,
        gather: Option<Duration>,
        shutdown: &CancellationToken,
    ) -> bool {
        match self.idle.poller.clone().try_lock_owned() {
            Ok(_polling) => {
                let poll_now = Arc::clone(&self.idle.poll_now);
                let pause = idle.next_delay();
                let pause = gather.map_or(pause, |g| pause.min(g));
                tokio::select! {
                    handed = self.pause(pause, shutdown) => handed,
                    _ = poll_now.notified() => {
                        idle.reset();
                        true
                    }
                }
            }
            Err(_) => {
                if found {
                    self.idle.poll_now.notify_one();
                }
                let standby = self.settings.poll_interval.max(STANDBY_RECHECK);
                self.pause(standby, shutdown).await
            }
        }
    }

    /// Waits `pause`, or less when work is handed over, ownership changes or
    /// the relay stops. Returns whether work was handed over (a full batch
    /// elsewhere, a notification).
    async fn pause(&mut self, pause: Duration, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = self.idle.work.notified() => true,
            _ = self.owned.changed() => false,
            _ = tokio::time::sleep(pause) => false,
        }
    }

    /// Says that `rows`, with their `reasons`, went to the dead letters.
    fn dead_lettered_unread(
        &self,
        rows: &[TooLarge],
        unreadable: &[Unreadable],
        reasons: &[(i64, String)],
    ) {
        self.stats
            .count(Event::DeadLettered, (rows.len() + unreadable.len()) as u64);
        // Never in a settled batch, so `record_settled` does not see them.
        super::record::record_dead_lettered(
            rows.iter()
                .map(|r| r.destination.as_str())
                .chain(unreadable.iter().map(|u| u.destination.as_str())),
        );
        for (row, (_, reason)) in rows.iter().zip(reasons) {
            log_dead_letter(&row.message_id, &row.destination, row.attempts, reason);
        }
        for u in unreadable {
            if let Some((_, reason)) = reasons.iter().find(|(seq, _)| *seq == u.seq) {
                log_dead_letter(&u.message_id, &u.destination, u.attempts, reason);
            }
        }
    }

    /// How long rows the broker left unanswered are set aside, their keys
    /// behind them: `retry_base`, or as long as their batch took if longer
    /// (up to `retry_max`). Rows that can cost a pipeline slot its whole
    /// confirm timeout (a partition without a leader) then take at most
    /// about half of that slot's time while the outage lasts, and the other
    /// keys the rest.
    fn outage_hold(&self, claimed_at: Instant) -> Duration {
        claimed_at.elapsed().clamp(
            self.settings.retry_base,
            self.settings.retry_max.max(self.settings.retry_base),
        )
    }

    /// Runs one batch to completion; only if shutdown was requested *and* the
    /// grace period ran out is it dropped (rolling back its transaction).
    async fn batch_until_grace(
        &self,
        db: &mut S::Session,
        look_first: bool,
        shutdown: &CancellationToken,
    ) -> Option<Result<BatchEnd, BatchError>> {
        let grace = self.settings.shutdown_grace;
        tokio::select! {
            biased;
            r = self.batch(db, look_first, shutdown) => Some(r),
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => None,
        }
    }

    /// One batch: claim, publish, settle. With `look_first` (the last
    /// claim found nothing), asks first whether a claim would find
    /// anything, and claims only if so.
    /// A batch still waiting for its rows to become durable when
    /// `shutdown` comes is released unpublished: the barrier's session ends
    /// with the shutdown, and nothing else could end that wait before the
    /// grace.
    async fn batch(
        &self,
        db: &mut S::Session,
        look_first: bool,
        shutdown: &CancellationToken,
    ) -> Result<BatchEnd, BatchError> {
        let partitions = Arc::clone(&self.owned.borrow());
        if partitions.is_empty() {
            return Ok(BatchEnd::Empty { behind: false });
        }
        if look_first
            && !db
                .ready(&partitions, &self.floor.at_for(&partitions))
                .await?
        {
            return Ok(BatchEnd::Empty { behind: false });
        }
        let mut tx = db.begin().await?;
        // A broker slower than the batches in flight can cross before their
        // deadline asks for smaller ones (see `Publisher::batch_bytes`).
        let max_bytes = self
            .publisher
            .batch_bytes()
            .map_or(self.settings.batch_max_bytes, |b| {
                self.settings
                    .batch_max_bytes
                    .min(i64::try_from(b).unwrap_or(i64::MAX))
            });
        // Read once: the limit a row is judged by names the reason too.
        let max_payload = self.publisher.max_payload_bytes();
        let max_headers = self.publisher.max_header_bytes();
        let limits = ClaimLimits {
            rows: self.settings.batch_size,
            bytes: max_bytes,
            park_recheck: self.settings.retry_max,
            due_recheck: self.settings.poll_min,
            max_payload: max_payload
                .map_or(i64::MAX, |(b, _)| i64::try_from(b).unwrap_or(i64::MAX)),
            // Twice the limit: see `ClaimLimits::max_headers`.
            max_headers: max_headers.map_or(i64::MAX, |(b, _)| {
                i64::try_from(b).unwrap_or(i64::MAX).saturating_mul(2)
            }),
        };
        let claiming = self.idle.claiming.lock().await;
        // Everything from the claim to the settle must end within half the
        // hold limit: past the full limit Postgres ends the session and
        // another replica may take the rows. Half leaves margin for the
        // settle and for the clocks of two machines. The clock starts when
        // this claim does, not before the wait for the claim lock: a slow
        // claim by another worker must not make this batch look stale. (The
        // wait itself cannot end the session: statement_timeout stops the
        // other claim at half the hold limit.)
        let claimed_at = Instant::now();
        let window = self.idle.claim_started(claimed_at);
        let deadline = claimed_at + self.settings.hold_limit / 2;
        // The next claim may start once this one's rows are locked, while
        // their verdicts are still being decided.
        let claimed = tx
            .claim(
                &limits,
                &partitions,
                self.floor.at_for(&partitions),
                move || {
                    drop(claiming);
                    metrics::histogram!(crate::metrics::CLAIM_LOCKING)
                        .record(claimed_at.elapsed().as_secs_f64());
                },
            )
            .await?;
        if claimed.stale_floor {
            tracing::info!(
                worker = self.id,
                "the outbox's seq sequence was restarted under the claim floor; claiming again from seq 0"
            );
            self.floor.drop_stale();
            tx.release();
            return Ok(BatchEnd::Settled {
                more: true,
                late: false,
                cycle: None,
            });
        }
        // Every commit the claim could see had been made by now.
        let seen = Instant::now();
        metrics::histogram!(crate::metrics::CLAIM).record(claimed_at.elapsed().as_secs_f64());
        if !claimed.batch.is_empty() || !claimed.blocked.is_empty() {
            self.floor.note_claim();
        }
        let mut holds = claimed.holds;
        // Rows the broker cannot take, known by their size and not read:
        // dead letters, settled with this batch.
        let mut too_large = too_large(&claimed.too_large, max_payload, max_headers);
        // Rows that cannot be read: dead letters too, or every claim would
        // fail on them.
        for u in &claimed.unreadable {
            let reason = format!(
                "the row cannot be read: {} (its headers must be a JSON object of \
                 strings; dead-lettered without being sent)",
                u.error
            );
            too_large.push((u.seq, reason));
        }
        let batch = hooks::claimed(claimed.batch);
        if batch.is_empty()
            && holds.is_empty()
            && !claimed.behind_due.is_empty()
            && self.stats.in_flight() == 0
        {
            // Every row this claim took waits behind an older row of its
            // key that is due, and nothing is at the broker: no batch ahead
            // will hand these keys over, and the next claim would take the
            // same rows. Set aside, they come due after those older rows,
            // which the next claim then reaches (see `claim::judge`).
            holds = claimed.behind_due;
        }
        let behind = claimed.blocked.len() > holds.len();
        let left_out = claimed.left_out;
        if batch.is_empty() {
            if holds.is_empty() && too_large.is_empty() {
                tx.release();
                return Ok(BatchEnd::Empty { behind });
            }
            // Rows set aside behind a blocked head leave the fresh path, so
            // the next claim reaches the other keys at once.
            let held = tx
                .settle_and_commit(Settle {
                    published: &[],
                    failed: &[],
                    holds: &holds,
                    dead: &too_large,
                })
                .await?;
            self.dead_lettered_unread(&claimed.too_large, &claimed.unreadable, &too_large);
            return Ok(if held > 0 || !too_large.is_empty() {
                BatchEnd::Settled {
                    more: true,
                    late: false,
                    cycle: None,
                }
            } else {
                BatchEnd::Empty { behind }
            });
        }
        if hooks::settles_before_confirm() {
            return self.settle_before_confirm(tx, &batch).await;
        }
        // The barrier that makes these rows durable, unless the claim
        // showed they are, runs while the batch waits for its budget and
        // slot.
        let flushed = claimed.flushed;
        if !flushed {
            self.durable.ask(seen);
        }
        // The batch's share of the payload budget, held until it settles.
        let bytes: usize = batch.iter().map(Envelope::bytes).sum();
        // The claim took all a batch may hold: by rows, or by bytes (the next
        // row, which the claim read but did not keep, would not have fit).
        let more = behind
            || left_out
            || batch.len() + holds.len() >= self.settings.batch_size as usize
            || bytes.saturating_mul(2) >= usize::try_from(max_bytes).unwrap_or(usize::MAX);
        let Ok(_share) = self
            .payload_budget
            .acquire_many(budget_share(bytes, self.payload_budget_kib))
            .await
        else {
            return Ok(BatchEnd::Settled {
                more: true,
                late: false,
                cycle: None,
            }); // closed: never, the relay owns it
        };
        // A row whose writer committed with less than the server's default
        // (`synchronous_commit = off` or `local`) is visible while a crash
        // or a failover can still take it back; its event waits until
        // neither can (see `source::durable`). A synchronous standby that
        // is missing makes that wait last: the rows go back unpublished
        // before another replica could take them.
        let durable = if flushed {
            Ok(true)
        } else {
            tokio::select! {
                durable = tokio::time::timeout_at(deadline, self.durable.wait(seen)) => durable,
                _ = shutdown.cancelled() => Ok(false),
            }
        };
        metrics::histogram!(crate::metrics::DURABLE_WAIT).record(seen.elapsed().as_secs_f64());
        match durable {
            Ok(true) => {}
            // The barrier's session reconnected since the claim (Postgres
            // restarted or failed over): claim again. Or the relay is
            // shutting down: the rows go back for the next run.
            Ok(false) => {
                tx.rollback().await?;
                return Ok(BatchEnd::Empty { behind: false });
            }
            Err(_) => {
                tracing::warn!(
                    worker = self.id,
                    waited = ?seen.elapsed(),
                    "the claimed rows' commits did not become durable (flushed, and on the synchronous standbys) within half the hold limit; batch released unpublished"
                );
                tx.rollback().await?;
                return Ok(BatchEnd::Empty { behind: false });
            }
        }
        // Wait for a slot: while `pipeline` batches are at the broker, this one
        // stays claimed and ready. The slot is the confirm window: it is given
        // back once the broker has answered, and the settle runs outside it.
        let Ok(slot) = self.in_flight.acquire().await else {
            return Ok(BatchEnd::Settled {
                more: true,
                late: false,
                cycle: None,
            }); // closed: never, the relay owns it
        };
        // A process stopped between claim and publish (SIGSTOP, a long GC-like
        // stall) may have lost its rows to another replica by now. Publishing
        // them would only make duplicates, so drop the batch.
        // The publisher answers a little before the deadline with what the
        // broker confirmed by then (a slow broker, still confirming), so
        // that those rows are settled rather than sent again; the deadline
        // itself is for a publisher that cannot answer at all. A batch with
        // no time left to publish in goes back the same way.
        let answer_by = deadline - self.settings.hold_limit / 20;
        if Instant::now() >= answer_by {
            self.stats.count(Event::StaleBatch, 1);
            tracing::warn!(worker = self.id, stalled = ?claimed_at.elapsed(), "stalled after claiming until too close to the hold limit to publish; batch dropped unpublished");
            return Ok(BatchEnd::Settled {
                more: true,
                late: false,
                cycle: None,
            });
        }
        // Half its time gone waiting for a slot (batches ahead of it on a
        // slow broker): it would likely be cut short at its deadline, and
        // what the broker had not confirmed by then sent again. Released
        // unpublished, its rows are claimed again with a full budget.
        if answer_by - Instant::now() < (answer_by - claimed_at) / 2 {
            tracing::debug!(worker = self.id, waited = ?claimed_at.elapsed(), "batch waited half its time for a slot; released unpublished");
            return Ok(BatchEnd::Settled {
                more: true,
                late: true,
                cycle: None,
            });
        }
        self.stats.add_in_flight(batch.len() as i64);
        let publish_started = Instant::now();
        let published = match tokio::time::timeout_at(
            deadline,
            publish_in_waves(self.publisher.as_ref(), &batch, answer_by),
        )
        .await
        {
            Ok(published) => published,
            Err(_) => {
                // Connecting, opening a channel, a broker that blocked the
                // connection (resource alarm) or confirms that never come:
                // whatever held it up, the batch is abandoned before its
                // rows can pass to another replica, and the publisher drops
                // whatever could still send it.
                self.publisher.abandon().await;
                Err(crate::publish::PublishError::msg(format!(
                    "batch not answered within {:?} of its claim (half the hold limit); abandoned",
                    self.settings.hold_limit / 2
                )))
            }
        };
        metrics::histogram!(crate::metrics::PUBLISH)
            .record(publish_started.elapsed().as_secs_f64());
        // Consumers can have the messages from here; the settle below is
        // the relay's own bookkeeping.
        let answered = std::time::SystemTime::now();
        self.stats.add_in_flight(-(batch.len() as i64));
        let outcomes = match published {
            Ok(o) => o,
            Err(e) if e.is_unsent() => {
                // Like a batch that waited half its time for a slot: its
                // rows are claimed again with a full budget.
                tracing::debug!(worker = self.id, error = %e, "batch released unpublished");
                tx.rollback().await?;
                return Ok(BatchEnd::Settled {
                    more: true,
                    late: true,
                    cycle: None,
                });
            }
            Err(e) => {
                self.stats.note_batch(Some(&e));
                let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
                self.stats.count(Event::BatchFailed, 1);
                metrics::counter!(crate::metrics::BATCH_FAILURES).increment(1);
                // A batch that waited out a timeout (a Kafka partition
                // without a leader, holding every row of the batch) is set
                // aside, its keys behind it, so that the next claims take
                // other keys and the rest of the outbox flows. One that
                // failed at once (the broker unreachable) is not: its
                // worker's backoff paces the retries. Recording the reason
                // is a courtesy to operators; if it fails, the rollback
                // releases the rows all the same, now rather than after the
                // broker's backoff.
                let hold = (claimed_at.elapsed() >= self.settings.retry_base)
                    .then(|| self.outage_hold(claimed_at));
                let noted = tx.note_batch_error(&seqs, &e.to_string(), hold).await;
                if noted.is_ok() {
                    // Rows too large for any broker need none to settle.
                    tx.settle_and_commit(Settle {
                        published: &[],
                        failed: &[],
                        holds: &[],
                        dead: &too_large,
                    })
                    .await?;
                    self.dead_lettered_unread(&claimed.too_large, &claimed.unreadable, &too_large);
                } else {
                    tx.rollback().await?;
                }
                return Err(e.into());
            }
        };
        hooks::after_ack();
        drop(slot);
        let plan = settle_plan(&batch, &outcomes, &self.settings);
        // The broker answered, if not for every row.
        self.stats.note_batch(None);
        // Rows it left unanswered while it confirmed the rest (a Kafka
        // partition without a leader) wait as long as their batch took (see
        // `outage_hold`) before a claim takes them again, their keys behind
        // them, with the failure as
        // their last error. No attempt is counted: it is an outage of part
        // of the broker, not a refusal, and the rest of the outbox flows.
        // Rows the publisher held back unsent (a Kafka partition known to be
        // silent) wait at least until it means to try them again.
        if let Some((_, reason)) = plan.unanswered.first() {
            let seqs: Vec<i64> = plan.unanswered.iter().map(|u| u.0).collect();
            let hold = self.outage_hold(claimed_at).max(
                plan.unanswered_wait
                    .min(self.settings.retry_max.max(self.settings.retry_base)),
            );
            tx.note_batch_error(&seqs, reason, Some(hold)).await?;
        }
        let dead = if too_large.is_empty() {
            std::borrow::Cow::Borrowed(&plan.dead)
        } else {
            std::borrow::Cow::Owned([plan.dead.as_slice(), &too_large].concat())
        };
        let settling = Instant::now();
        tx.settle_and_commit(Settle {
            published: &plan.published,
            failed: &plan.failed,
            holds: &holds,
            dead: &dead,
        })
        .await?;
        metrics::histogram!(crate::metrics::SETTLE).record(settling.elapsed().as_secs_f64());
        self.dead_lettered_unread(&claimed.too_large, &claimed.unreadable, &too_large);
        self.stats
            .count(Event::DeadLettered, plan.dead.len() as u64);
        for (seq, reason) in &plan.dead {
            if let Some(env) = batch.iter().find(|e| e.seq == *seq) {
                log_dead_letter(&env.message_id, &env.destination, env.attempts, reason);
            }
        }

        self.stats
            .count(Event::Published, plan.published.len() as u64);
        record_settled(&batch, &plan, answered);
        self.stats.count(Event::Rejected, plan.failed.len() as u64);
        self.stats.count(Event::HeldBack, plan.held as u64);
        for (seq, reason, delay) in &plan.failed {
            if let Some(env) = batch.iter().find(|e| e.seq == *seq) {
                tracing::warn!(
                    message_id = %env.message_id,
                    destination = %env.destination,
                    attempts = env.attempts + 1,
                    retry_in = ?delay,
                    reason = %reason,
                    "broker rejected message"
                );
            }
        }
        tracing::debug!(
            worker = self.id,
            published = plan.published.len(),
            rejected = plan.failed.len(),
            held = plan.held,
            "batch settled"
        );
        let late = claimed_at.elapsed() >= self.settings.poll_min;
        Ok(BatchEnd::Settled {
            more,
            late,
            cycle: gather_cycle(batch.len(), window),
        })
    }
}

/// Each row too large for the broker (a payload above `max_payload`, or
/// headers well above `max_headers`: each limit and its name), with the
/// reason its dead letter records.
fn too_large(
    rows: &[TooLarge],
    max_payload: Option<(usize, &str)>,
    max_headers: Option<(usize, &str)>,
) -> Vec<(i64, String)> {
    rows.iter()
        .filter_map(|r| {
            let over = match (max_payload, max_headers) {
                (Some((limit, what)), _) if r.bytes as u64 > limit as u64 => {
                    format!(
                        "message of {} bytes exceeds {what} of {limit} bytes",
                        r.bytes
                    )
                }
                (_, Some((limit, what))) => format!(
                    "headers of about {} bytes exceed {what} of {limit} bytes",
                    r.headers
                ),
                _ => return None,
            };
            Some((
                r.seq,
                format!("too large for the broker: {over} (dead-lettered without being read)"),
            ))
        })
        .collect()
}

/// The log line of a message moved to the dead letters after `attempts`
/// earlier ones.
fn log_dead_letter(message_id: &uuid::Uuid, destination: &str, attempts: i32, reason: &str) {
    tracing::error!(
        message_id = %message_id,
        destination = %destination,
        attempts = attempts + 1,
        reason = %reason,
        "message moved to dead letters"
    );
}
