//! What the relay loop needs from where the rows live, as a boundary: a
//! [`Store`] opens sessions, a [`Session`] runs one batch transaction at a
//! time, and a [`BatchTx`] claims rows and settles them before it commits.
//! Dropping a `BatchTx` without committing rolls it back: every row it
//! claimed is released as it was.
//!
//! [`PgStore`] is the real one. The relay crate's own tests drive the loop
//! over an in-memory store with paused tokio time, so its scheduling (the
//! pauses, the hand-offs, the deadlines) is tested without a database.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::FutureExt;

use super::claim::{ClaimLimits, Claimed, Prepared, Queries};
use super::{Database, PgFault};
use crate::envelope::{Envelope, Receipt};
use crate::source::floor::FloorAt;

/// Where batches come from: one session per worker, reopened after a failure.
pub(crate) trait Store: Send + Sync + 'static {
    /// One worker's connection.
    type Session: Session;

    /// Connects and prepares what every batch runs.
    fn open(&self) -> impl Future<Output = Result<Self::Session, OpenError>> + Send + '_;
}

/// A connection that runs one batch transaction at a time.
pub(crate) trait Session: Send {
    /// A batch's transaction, borrowing the session until it ends.
    type Tx<'a>: BatchTx + 'a
    where
        Self: 'a;

    /// Starts a batch's transaction.
    fn begin(&mut self) -> impl Future<Output = Result<Self::Tx<'_>, StoreError>> + Send + '_;

    /// Whether a claim of `partitions` from `floor` would find anything,
    /// asked without a transaction: asked in place of a claim after one
    /// that found nothing, an idle poll costs one statement, not BEGIN, a
    /// claim and a ROLLBACK. A yes may still be followed by an empty claim
    /// (another replica holds the rows, or took them first); a no is as
    /// good as an empty claim's.
    fn ready<'a>(
        &'a mut self,
        partitions: &'a [i16],
        floor: &'a FloorAt,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send + 'a;

    /// Whether the connection is gone (a failed statement then means the
    /// session must be reopened, not just the batch retried).
    fn is_closed(&self) -> bool;
}

/// One batch's transaction. Every method's changes become visible only at
/// [`BatchTx::commit`].
pub(crate) trait BatchTx: Send {
    /// Locks and returns the oldest ready rows of `partitions`, up to
    /// `limits`; rows below `floor` are not looked at as fresh rows (see
    /// [`crate::source::floor`]). `locked` runs once the rows taken are
    /// locked, which may be before they have all been received: another
    /// claim can start from then on.
    fn claim<'a>(
        &'a mut self,
        limits: &'a ClaimLimits,
        partitions: &'a [i16],
        floor: FloorAt,
        locked: impl FnOnce() + Send + 'a,
    ) -> impl Future<Output = Result<Claimed, StoreError>> + Send + 'a;

    /// Settles a batch and commits, in one round trip where the store can:
    /// the confirmed rows go (or move to `published` with their receipts),
    /// the rejected ones wait out their retry delay, the dead ones move to
    /// the dead letters, and rows of blocked keys are set aside. Returns how
    /// many rows were set aside; an error means nothing was committed.
    fn settle_and_commit(
        self,
        settle: Settle<'_>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Records an outage's failure on rows the broker did not answer and,
    /// with a `hold`, sets them aside for that long, their keys behind
    /// them, without counting an attempt.
    fn note_batch_error<'a>(
        &'a mut self,
        seqs: &'a [i64],
        error: &'a str,
        hold: Option<Duration>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Deletes rows unconditionally (only the ack-before-confirm mutant does).
    fn delete<'a>(
        &'a mut self,
        seqs: &'a [i64],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Commits everything above.
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls back at once, releasing every row the claim locked. Dropping
    /// the transaction does the same, at the latest when its session runs
    /// its next statement.
    fn rollback(self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends a transaction that wrote nothing (a claim that found nothing to
    /// publish) without waiting for the server: the rollback is queued on
    /// the connection at once, so it runs before anything the session sends
    /// later, and the rows the claim locked are free as soon as the server
    /// reads it. An idle poll then costs one round trip, not two.
    fn release(self);
}

/// What a settle writes, from [`crate::engine`]'s settle plan.
pub(crate) struct Settle<'a> {
    /// Rows the broker confirmed, with its receipts.
    pub(crate) published: &'a [(&'a Envelope, Receipt)],
    /// Rows it refused: seq, reason, delay until the next attempt.
    pub(crate) failed: &'a [(i64, String, Duration)],
    /// Rows of blocked keys to set aside, until when.
    pub(crate) holds: &'a [(i64, SystemTime)],
    /// Rows that ran out of attempts: seq, final reason.
    pub(crate) dead: &'a [(i64, String)],
}

/// A store that failed, with what the server said.
#[derive(Debug)]
pub(crate) struct StoreError(Cause);

#[derive(Debug)]
enum Cause {
    /// The server said no, the connection failed, or nothing answered.
    Postgres(PgFault),
    #[cfg(test)]
    Memory(&'static str),
}

impl StoreError {
    /// A failure of the in-memory store of the loop's tests.
    #[cfg(test)]
    pub(crate) fn memory(what: &'static str) -> Self {
        StoreError(Cause::Memory(what))
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError(Cause::Postgres(e.into()))
    }
}

impl From<PgFault> for StoreError {
    fn from(e: PgFault) -> Self {
        StoreError(Cause::Postgres(e))
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Cause::Postgres(e) => e.fmt(f),
            #[cfg(test)]
            Cause::Memory(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for StoreError {}

/// Why a session could not open.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No connection.
    Connect(StoreError),
    /// Connected, but the batch statements would not prepare.
    Prepare(StoreError),
}

/// The outbox in Postgres: each session is its own connection with the
/// batch statements prepared on it.
pub(crate) struct PgStore {
    pg: Database,
    queries: Queries,
    hold_limit: Duration,
    held: Arc<Held>,
}

/// The seqs the relay's batch transactions hold locked, by transaction:
/// what a claim passes over by seq (see `claim::Queries::claim_beside`).
/// A transaction's entry goes when its [`PgTx`] does, however it ends.
#[derive(Debug, Default)]
struct Held {
    next: AtomicU64,
    by_tx: Mutex<HashMap<u64, Vec<i64>>>,
}

impl Held {
    fn by_tx(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<i64>>> {
        self.by_tx.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The oldest `most` seqs held now: the fresh scan meets them first.
    fn oldest(&self, most: usize) -> Vec<i64> {
        let mut seqs: Vec<i64> = self.by_tx().values().flatten().copied().collect();
        if seqs.len() > most {
            seqs.sort_unstable();
            seqs.truncate(most);
        }
        seqs
    }
}

/// How many held seqs a claim passes over at most: (pipeline + 1) claims
/// of two default batches each are 4,000. Past that (batches of thousands,
/// a long pipeline) the list would cost more to send and hash than the
/// lock attempts it saves; the rest are tried and skipped as before.
const HELD_PASSED_OVER: usize = 10_000;

impl PgStore {
    /// Sessions to `pg`, set up for `hold_limit` (see [`super::connect`]).
    pub(crate) fn new(pg: Database, queries: Queries, hold_limit: Duration) -> Self {
        PgStore {
            pg,
            queries,
            hold_limit,
            held: Arc::default(),
        }
    }
}

/// One worker's Postgres connection.
pub(crate) struct PgSession {
    client: super::Session,
    prepared: Prepared,
    queries: Queries,
    /// A batch transaction may still be open on the connection: one was
    /// begun and never seen to end (its `PgTx` was dropped). The next batch
    /// rolls it back first, in the same round trip as its BEGIN.
    dangling: bool,
    /// How long a claim or a settle waits for its answer before the server
    /// is asked whether it is still running it: the hold limit. By then
    /// the server has ended the statement (`statement_timeout`, at half)
    /// or the transaction (`idle_in_transaction_session_timeout`), unless
    /// it is a commit waiting for a synchronous standby; see
    /// [`super::Session::answered`].
    bound: Duration,
    /// A round trip went unanswered: the session is given up.
    unanswered: bool,
    /// The rows every session of the store holds locked.
    held: Arc<Held>,
}

/// One batch's Postgres transaction.
///
/// Nothing is sent at [`Session::begin`]: BEGIN goes out with the
/// transaction's first statement, and the confirmed rows' settle goes out
/// with COMMIT, so a batch the broker confirmed costs two round trips, not
/// four. Only statements prepared on the session may share a round trip
/// with a later one: a statement given as text is prepared first, so it
/// would be executed after what was sent beside it. Pipelining keeps
/// every guarantee of a transaction: Postgres runs the statements in order,
/// and once one fails, the rest fail and COMMIT rolls back.
pub(crate) struct PgTx<'a> {
    client: &'a super::Session,
    prepared: &'a Prepared,
    queries: &'a Queries,
    /// BEGIN has been sent.
    begun: bool,
    /// The session's flag: set while this transaction is open.
    dangling: &'a mut bool,
    /// The session's bound on each step's round trips.
    bound: Duration,
    /// The session's flag: set when a step went unanswered.
    unanswered: &'a mut bool,
    /// Where this transaction's locked rows are listed, under `id`.
    held: &'a Arc<Held>,
    id: u64,
}

impl Drop for PgTx<'_> {
    fn drop(&mut self) {
        // Ended, or dropped and rolled back before the session's next
        // statement: a later claim that passed over its rows would only
        // wait for them one claim longer.
        self.held.by_tx().remove(&self.id);
    }
}

impl Store for PgStore {
    type Session = PgSession;

    async fn open(&self) -> Result<PgSession, OpenError> {
        let client = super::connect(&self.pg, self.hold_limit)
            .await
            .map_err(|e| OpenError::Connect(e.into()))?;
        let prepared = client
            .answered(self.hold_limit / 2, self.queries.prepare(&client))
            .await
            .map_err(|e| match e.gave_up() {
                true => OpenError::Connect(e.into()),
                false => OpenError::Prepare(e.into()),
            })?;
        Ok(PgSession {
            client,
            prepared,
            queries: self.queries.clone(),
            dangling: false,
            bound: self.hold_limit,
            unanswered: false,
            held: Arc::clone(&self.held),
        })
    }
}

impl Session for PgSession {
    type Tx<'a> = PgTx<'a>;

    async fn begin(&mut self) -> Result<PgTx<'_>, StoreError> {
        Ok(PgTx {
            client: &self.client,
            prepared: &self.prepared,
            queries: &self.queries,
            begun: false,
            dangling: &mut self.dangling,
            bound: self.bound,
            unanswered: &mut self.unanswered,
            held: &self.held,
            id: self.held.next.fetch_add(1, Ordering::Relaxed),
        })
    }

    async fn ready(&mut self, partitions: &[i16], floor: &FloorAt) -> Result<bool, StoreError> {
        // A transaction left open (its batch dropped) is rolled back first,
        // in the same round trip, so that the look runs outside it.
        let rollback_first = std::mem::take(&mut self.dangling);
        // Read outside the claim lock: a claim running now may not have
        // listed its rows yet, and the look then says yes for them; the
        // claim that follows passes over them.
        let mine = self.held.oldest(HELD_PASSED_OVER);
        let (client, queries, prepared) = (&self.client, &self.queries, &self.prepared);
        let look = async {
            let (rolled_back, ready) = futures::join!(
                async {
                    match rollback_first {
                        true => client.batch_execute("ROLLBACK").await,
                        false => Ok(()),
                    }
                },
                queries.ready(client, prepared, partitions, floor.scan, &mine),
            );
            rolled_back?;
            ready
        };
        let done = self.client.answered(self.bound, look).await;
        if done.as_ref().is_err_and(PgFault::gave_up) {
            self.unanswered = true;
        }
        Ok(done?)
    }

    fn is_closed(&self) -> bool {
        self.unanswered || self.client.is_closed()
    }
}

impl PgTx<'_> {
    /// Runs `statement`, sending BEGIN (and the ROLLBACK of a transaction
    /// left open before it) ahead of it in the same round trip if this is
    /// the transaction's first.
    async fn run<T>(
        &mut self,
        statement: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StoreError> {
        if self.begun {
            return self.answered(statement).await;
        }
        self.begun = true;
        let rollback_first = std::mem::replace(self.dangling, true);
        let client = self.client;
        // join! polls in order, and each future sends its request on its
        // first poll: ROLLBACK, BEGIN, then the statement.
        let joined = async {
            Ok(futures::join!(
                async {
                    match rollback_first {
                        true => client.batch_execute("ROLLBACK").await,
                        false => Ok(()),
                    }
                },
                // READ COMMITTED whatever the server's default: the claim's
                // probes must see what committed after its rows were locked
                // (see `source::claim`).
                client.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED"),
                statement
            ))
        };
        let (rolled_back, begun, result) = self.answered(joined).await?;
        rolled_back?;
        begun?;
        Ok(result?)
    }

    /// `round_trip` within the session's bound; past it, the session is
    /// marked given up, and its transaction dangling.
    async fn answered<T>(
        &mut self,
        round_trip: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StoreError> {
        let done = self.client.answered(self.bound, round_trip).await;
        if done.as_ref().is_err_and(PgFault::gave_up) {
            *self.unanswered = true;
        }
        Ok(done?)
    }

    /// Ends the transaction with `end` (COMMIT or ROLLBACK).
    async fn end(mut self, end: &str) -> Result<(), StoreError> {
        if self.begun {
            let client = self.client;
            self.answered(client.batch_execute(end)).await?;
        }
        *self.dangling = false;
        Ok(())
    }
}

impl BatchTx for PgTx<'_> {
    async fn claim<'a>(
        &'a mut self,
        limits: &'a ClaimLimits,
        partitions: &'a [i16],
        floor: FloorAt,
        locked: impl FnOnce() + Send + 'a,
    ) -> Result<Claimed, StoreError> {
        let (q, client, prepared) = (self.queries, self.client, self.prepared);
        // Taken under the claim lock: every claim before this one has
        // listed what it locked.
        let mine = self.held.oldest(HELD_PASSED_OVER);
        let (held, id) = (Arc::clone(self.held), self.id);
        let claim = q.claim_beside(client, prepared, limits, partitions, floor, &mine, {
            move |seqs| {
                held.by_tx().entry(id).or_default().extend(seqs);
                locked()
            }
        });
        self.run(claim).await
    }

    async fn settle_and_commit(mut self, settle: Settle<'_>) -> Result<u64, StoreError> {
        if !self.begun {
            // Nothing claimed, nothing to settle: there is no transaction.
            self.end("COMMIT").await?;
            return Ok(0);
        }
        let (q, client, prepared) = (self.queries, self.client, self.prepared);
        let steps = async {
            // Statements given as SQL text are prepared first, one round
            // trip each, and only then executed: pipelined beside COMMIT
            // they would run after it, outside the transaction. So the rare
            // parts (failed, held and dead rows) go one at a time; each
            // sends nothing when empty, as it is for a batch the broker
            // confirmed whole.
            q.fail(client, settle.failed).await?;
            let held = q.hold(client, settle.holds).await?;
            q.dead_letter(client, settle.dead).await?;
            // The confirmed rows' statement is prepared on the session, so
            // it goes out with COMMIT. If it fails, Postgres turns COMMIT
            // into a rollback: its error is the answer and nothing was
            // committed.
            let (published, committed) = futures::join!(
                q.settle_published(client, prepared, settle.published),
                client.batch_execute("COMMIT"),
            );
            published?;
            committed?;
            Ok(held)
        };
        let held = self.answered(steps).await?;
        *self.dangling = false;
        Ok(held)
    }

    async fn note_batch_error(
        &mut self,
        seqs: &[i64],
        error: &str,
        hold: Option<Duration>,
    ) -> Result<u64, StoreError> {
        let (q, client) = (self.queries, self.client);
        let statement = q.note_batch_error(client, seqs, error, hold);
        self.run(statement).await
    }

    async fn delete(&mut self, seqs: &[i64]) -> Result<u64, StoreError> {
        let (q, client) = (self.queries, self.client);
        let statement = q.delete(client, seqs);
        self.run(statement).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.end("COMMIT").await
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.end("ROLLBACK").await
    }

    fn release(self) {
        if self.begun {
            // The first poll queues the request on the connection; its
            // answer is read and dropped there. A connection that is gone
            // fails the session's next statement instead.
            let _ = self.client.batch_execute("ROLLBACK").now_or_never();
        }
        *self.dangling = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_passes_over_the_oldest_held_rows_up_to_a_bound() {
        let held = Held::default();
        held.by_tx().insert(1, vec![30, 10, 20]);
        held.by_tx().insert(2, vec![5, 40]);
        let mut all = held.oldest(100);
        all.sort_unstable();
        assert_eq!(all, vec![5, 10, 20, 30, 40]);
        assert_eq!(held.oldest(3), vec![5, 10, 20]);
        held.by_tx().remove(&1);
        assert_eq!(held.oldest(3), vec![5, 40]);
    }
}
