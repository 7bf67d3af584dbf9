//! The claim floor: a seq below which no fresh row exists or can appear, so
//! the claim's scan of fresh rows starts there instead of at the start of
//! the index.
//!
//! Why it is needed: a confirmed row is deleted, but while any snapshot older
//! than the delete is open (a report, `pg_dump`, a forgotten `BEGIN`: the
//! pinned xmin horizon), its index entry cannot be marked dead, and a scan
//! from the start of the index visits every such row to learn that it is
//! gone. Each claim then costs as much as everything deleted since the
//! snapshot began, and a drain of a large backlog slows to a crawl.
//!
//! Why it is not a watermark: a transaction that commits late can make a
//! lower seq visible after higher ones were published, and `seq > last_seen`
//! would skip it. The floor only moves past a seq once no transaction that
//! could still commit a row with it is running. The proof, per step:
//!
//! 1. Read `m`, the sequence's last value. Every row with seq ≤ m was given
//!    its seq by an INSERT (or COPY) that already held a `RowExclusiveLock`
//!    on the table, since a statement locks its target table before it
//!    evaluates defaults. The sequence hands out values one at a time
//!    (`CACHE 1`, checked when the floor's session begins and again after
//!    every read of `m`; a cached sequence turns the floor off).
//! 2. Then list the transactions holding a `RowExclusiveLock` on the table:
//!    every one that could still commit a row with seq ≤ m is among them.
//!    Only that mode: a transaction holding a stronger one holds it too once
//!    it inserts (each mode is held, and listed, on its own), and one
//!    holding only another (VACUUM, ANALYZE, `CREATE INDEX CONCURRENTLY`,
//!    which can wait for a report's snapshot for as long as it runs) cannot
//!    have inserted.
//! 3. Later, list them again. When none of the first list is left, and no
//!    prepared transaction holds such a lock, every row with seq ≤ m is
//!    committed (and visible to any snapshot taken from now on) or gone for
//!    good. A transaction that ends releases its locks after it has left the
//!    running set, so a snapshot taken after step 3 sees what it committed.
//! 4. With a new snapshot, the floor becomes the lowest fresh seq ≤ m, or
//!    m + 1 when there is none.
//!
//! A long reader, however old its snapshot, holds no such lock and never
//! stops the floor. An open transaction that inserted into the outbox holds
//! it for [`PASS_AFTER`]; then the floor moves past that transaction's rows,
//! which nobody can see yet, and remembers the transaction and the floor it
//! had (its base). Step 3 then reads: every row with seq ≤ m is committed,
//! gone, or one of those transactions'; theirs lie at or above the base.
//! Every floor the tracker sets is at most one past a seq read before a list
//! of writers each of which has since ended or been passed, or lower than
//! such a floor (when it comes back, or on a new session); a writer passed
//! later was not on that list, so it took its seqs after that read. When one
//! of them ends, what it committed is visible, and the floor comes back to
//! the lowest fresh row from the base. Without this, such a transaction (it
//! also pins the horizon) made every claim walk the rows deleted since it
//! began, for as long as it ran.
//!
//! A floor never passes `m` by more than one, so a last value read below
//! the floor means the sequence was set back (`setval`, `TRUNCATE ...
//! RESTART IDENTITY`): it will give seqs below the floor, and the floor
//! starts again from 0. The sequence is read for that with every step,
//! and about once a second while claims take nothing, since rows below
//! the floor are never claimed and no step would run.
//!
//! A replica that owns some partitions and not all keeps a second floor,
//! for those partitions ([`Own`]), computed in the same step from the same
//! list: the lowest fresh seq among them. The fresh index is ordered by seq
//! alone, so without it such a replica read every fresh row of the others'
//! partitions above the shared floor (another replica's hot key, behind a
//! slow broker) at every poll. A claim uses it only for partitions it was
//! kept for, and it is computed again from the shared floor whenever that
//! comes back.
//!
//! Rows re-enter the outbox below the floor only through the relay's own
//! operations (retrying a dead letter, resuming a destination, releasing rows
//! set aside), and those put them on the due path, which the floor does not
//! bound. Against anything else (an old relay binary, a hand written
//! `UPDATE`), every `rescan` interval the floor is recomputed from the start
//! of the index, so such a row waits at most that long.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_client::SchemaName;
use tokio::time::Instant;
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use crate::source::ownership::{Owned, PARTITIONS};
use crate::supervise::{sleep_or_cancel, supervise_until_cancelled};

/// How often the floor is moved while claims are running.
pub const TICK: Duration = Duration::from_millis(100);

/// While claims take nothing, the sequence is read every this many ticks.
const IDLE_CHECK: u32 = 10;

/// How long a step of the floor's session may go unanswered: its
/// statement_timeout (30 s) twice over (see `super::answered`).
const BOUND: Duration = Duration::from_secs(60);

/// The floor shared by a relay's workers: the lowest seq a fresh row can
/// have. 0 (no floor) until it is first computed, and whenever it cannot be.
#[derive(Debug, Default)]
pub struct Floor {
    at: Mutex<FloorAt>,
    claims: AtomicU64,
}

/// Where a claim looks, as of one moment: fresh rows from `scan`, and an
/// older row of a key, any from `probe` and below it only the rows that
/// wait. They differ while the floor has moved past writers still running
/// (see [`Passed`]): a row one of them commits is fresh below `scan` until
/// the floor comes back for it, and must still hold back its key's later
/// rows meanwhile.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FloorAt {
    /// Where the scan for fresh rows starts.
    pub scan: i64,
    /// Where the head-of-key probe stops looking at every row. At most
    /// `scan`.
    pub probe: i64,
    /// The transaction ids (`xid8`) of the writers that put `probe` below
    /// `scan`, when each is known. While every one of them is still in
    /// progress, nothing it wrote is visible to the claim, and the probe
    /// looks from `scan` instead (see [`crate::source::claim`]): looking
    /// from `probe`, it walked each batch key's rows deleted since, which
    /// such a writer keeps from being marked dead. `None`: from `probe`.
    pub open: Option<Arc<[i64]>>,
    /// A higher seq for the fresh scan of the partitions this replica
    /// owns, when it owns some and not all (see [`Own`]).
    pub own: Option<Own>,
    /// The seq sequence's storage file the floor was computed against,
    /// when known. A claim that finds another (the sequence restarted by
    /// `TRUNCATE ... RESTART IDENTITY` since) keeps nothing: until the
    /// floor's next read of the sequence, it is a floor for rows that are
    /// gone, and new rows of a key below it would be overtaken by its rows
    /// above it.
    pub file: Option<i64>,
}

/// The floor of a set of partitions: the lowest seq a fresh row of one of
/// them can have. Above the shared floor when a partition this replica does
/// not own holds older fresh rows (another replica's hot key, behind a slow
/// broker): the fresh index is ordered by seq alone, so a scan of this
/// replica's partitions from the shared floor reads every one of those
/// rows to find none of its own, at every poll (at 100,000 such rows,
/// 55 ms and 14,500 buffers per look). Kept from the shared floor's proof
/// (see [`Tracker::confirm`]), it steps over them once per step instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Own {
    /// The partitions it holds for.
    pub partitions: Arc<Vec<i16>>,
    /// The seq their fresh scan starts from.
    pub scan: i64,
}

impl From<i64> for FloorAt {
    fn from(seq: i64) -> Self {
        FloorAt {
            scan: seq,
            probe: seq,
            open: None,
            own: None,
            file: None,
        }
    }
}

impl FloorAt {
    /// The ids of the writers whose progress lets the probe look from
    /// `scan`; empty when it must look from `probe`.
    pub fn open_writers(&self) -> &[i64] {
        self.open.as_deref().unwrap_or(&[])
    }
}

impl Floor {
    /// The seq the claim's fresh scan starts from.
    pub fn get(&self) -> i64 {
        self.at().scan
    }

    /// Both of the floor's seqs, read together.
    pub fn at(&self) -> FloorAt {
        self.at.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The floor for a claim of `partitions`: its scan starts from the
    /// floor of the partitions this replica owns when that floor holds for
    /// every one of them, and from the shared floor otherwise (ownership
    /// just grew, or the floor of the new set is not known yet). A floor
    /// kept for fewer partitions says nothing of the others: used for
    /// them, it would pass their fresh rows for good.
    pub fn at_for(&self, partitions: &[i16]) -> FloorAt {
        let mut at = self.at();
        if let Some(own) = at.own.take() {
            if own.scan > at.scan && partitions.iter().all(|p| own.partitions.contains(p)) {
                at.scan = own.scan;
            }
        }
        at
    }

    /// Counts a claim that took rows, so the floor moves only while there
    /// is work (and once per rescan interval while idle).
    pub fn note_claim(&self) {
        self.claims.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops the floor until the next step computes it: a claim found the
    /// sequence restarted under it (see [`FloorAt::file`]).
    pub fn drop_stale(&self) {
        self.set(0.into());
    }

    fn set(&self, at: FloorAt) {
        *self.at.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }
}

/// The statements for one schema's outbox.
#[derive(Debug, Clone)]
struct Statements {
    /// The sequence's cache size and last value (`CACHE 1` or no floor).
    sequence: String,
    /// Transactions holding a `RowExclusiveLock` on the outbox table (the
    /// lock an insert takes), each with its transaction id when it has one,
    /// and whether one of them is prepared (two-phase commit: it can commit
    /// later with no session).
    writers: String,
    /// The lowest fresh seq in [$1, $2], else $2 + 1.
    lowest_fresh: String,
    /// The same, and the lowest fresh seq of the partitions $4 in [$3, $2],
    /// else $2 + 1.
    lowest_fresh_own: String,
}

impl Statements {
    fn new(schema: &SchemaName) -> Self {
        let table = format!("{}.messages", schema.quoted());
        let literal = table.replace('\'', "''");
        // The lowest fresh seq in [`from`, $2] that meets `and`, else $2 + 1.
        let lowest = |from: &str, and: &str| {
            format!(
                "coalesce((SELECT seq FROM {table} \
                   WHERE next_attempt_at = '-infinity' {and} AND seq >= {from} AND seq <= $2 \
                   ORDER BY seq LIMIT 1), $2 + 1)"
            )
        };
        Statements {
            sequence: format!(
                "SELECT s.seqcache, coalesce(pg_sequence_last_value(s.seqrelid), s.seqstart - s.seqincrement), \
                        pg_relation_filenode(s.seqrelid)::bigint \
                 FROM pg_sequence s \
                 WHERE s.seqrelid = pg_get_serial_sequence('{literal}', 'seq')::regclass"
            ),
            // One read of the lock table, for both the writers and their
            // ids: one row per writer and id it holds an `ExclusiveLock` on
            // (its own, then its subtransactions'; none before its first
            // write), with the current snapshot's xmax to widen those ids
            // of 32 bits against (see [`widen`]).
            writers: format!(
                "WITH l AS MATERIALIZED (SELECT * FROM pg_locks), \
                      w AS ( \
                        SELECT virtualtransaction AS vxid, bool_or(pid IS NULL) AS prepared FROM l \
                        WHERE locktype = 'relation' \
                          AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                          AND relation = '{literal}'::regclass \
                          AND mode = 'RowExclusiveLock' \
                          AND pid IS DISTINCT FROM pg_backend_pid() \
                        GROUP BY virtualtransaction) \
                 SELECT w.vxid, w.prepared, t.transactionid::text::bigint AS xid, \
                        pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax \
                 FROM w LEFT JOIN l t ON t.locktype = 'transactionid' \
                   AND t.virtualtransaction = w.vxid AND t.mode = 'ExclusiveLock' AND t.granted"
            ),
            lowest_fresh: format!("SELECT {}", lowest("$1", "")),
            lowest_fresh_own: format!(
                "SELECT {}, {}",
                lowest("$1", ""),
                lowest("$3", "AND partition = ANY($4::smallint[])")
            ),
        }
    }
}

/// A seq every row at or below which was given before `writers` were listed.
#[derive(Debug)]
struct Candidate {
    upto: i64,
    writers: Vec<String>,
    listed: Instant,
}

/// How long a listed writer may keep the floor from moving before the
/// floor moves past its rows (see [`Passed`]). Longer than a writer's
/// usual transaction, so that the floor rarely has to come back.
pub const PASS_AFTER: Duration = Duration::from_millis(500);

/// A writer still running that the floor has moved past: a transaction
/// that wrote to the outbox and stays open (a long import, a forgotten
/// `BEGIN` after an insert) would otherwise hold the floor at its first row
/// for as long as it runs, and every claim would walk the rows deleted
/// since, the cost the floor exists to remove, since that transaction also
/// pins the horizon. Its rows are not visible yet, and lie at or above
/// `base`: the floor in use when it was passed, which it was not listed
/// under. When it ends, the floor comes back to the lowest fresh row from
/// `base`, which is then visible (see [`Tracker::confirm`]). Each keeps its
/// own base, so that writers passed one after another, each open a little
/// longer than [`PASS_AFTER`], do not hold the lowest base forever.
#[derive(Debug)]
struct Passed {
    writer: String,
    base: i64,
    /// Its transaction id, once one was seen (a transaction gets one at its
    /// first write, just after it takes its lock).
    xid: Option<i64>,
}

/// [`Statements`] prepared on the tracker's connection.
#[derive(Debug)]
struct Prepared {
    sequence: Statement,
    writers: Statement,
    lowest_fresh: Statement,
    lowest_fresh_own: Statement,
}

/// One relay's floor computation: what step 3 is waiting for.
#[derive(Debug)]
pub struct Tracker {
    statements: Statements,
    prepared: Option<Prepared>,
    candidate: Option<Candidate>,
    passed: Vec<Passed>,
    rescan: Duration,
    last_full: Option<Instant>,
    /// The sequence's cache size, once a step found it above 1.
    cached: Option<i64>,
    /// The partitions this replica owns, when it owns some and not all:
    /// their floor is kept beside the shared one.
    partitions: Option<Arc<Vec<i16>>>,
    /// Their floor, as of the last step that computed it.
    own: Option<Own>,
    /// The sequence's last value, as last read, and as of the last list of
    /// writers: a replica that owns some partitions steps when the
    /// sequence has moved since, claims or not (see [`Tracker::own_due`]).
    last_value: i64,
    listed_upto: i64,
    /// The sequence's storage file, as last read. `TRUNCATE ... RESTART
    /// IDENTITY` and `ALTER SEQUENCE ... RESTART` give it a new one, so a
    /// set-back is seen even when rows written since have taken the last
    /// value past the floor again (`setval` keeps the file: it is seen
    /// only by a last value below the floor).
    sequence_file: Option<i64>,
}

/// Why the floor cannot be used on this outbox.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    /// The sequence hands out values in blocks: a session can use a cached
    /// seq below the last value after the floor has passed it.
    #[error("the seq sequence caches {0} values per session; the claim floor needs CACHE 1")]
    CachedSequence(i64),
    /// The relay's role cannot read the sequence (`GRANT SELECT ON SEQUENCE`).
    #[error("cannot read the seq sequence: {}", super::PgError(.0))]
    Sequence(tokio_postgres::Error),
}

impl Tracker {
    /// A tracker for `schema` that recomputes the floor from the start of
    /// the index every `rescan`.
    pub fn new(schema: &SchemaName, rescan: Duration) -> Self {
        Tracker {
            statements: Statements::new(schema),
            prepared: None,
            candidate: None,
            passed: Vec::new(),
            rescan,
            last_full: None,
            cached: None,
            partitions: None,
            own: None,
            last_value: 0,
            listed_upto: 0,
            sequence_file: None,
        }
    }

    /// Whether the sequence's storage file (`file`, as just read) is not
    /// the one last read: the sequence was restarted since.
    fn restarted(&mut self, file: i64) -> bool {
        self.sequence_file.replace(file).is_some_and(|f| f != file)
    }

    /// The partitions this replica owns now. Their floor is kept when they
    /// are some and not all (all: it is the shared floor); a floor kept for
    /// another set is dropped at the next step that computes one.
    pub fn set_partitions(&mut self, partitions: &Arc<Vec<i16>>) {
        let some = !partitions.is_empty() && partitions.len() < PARTITIONS as usize;
        self.partitions = some.then(|| Arc::clone(partitions));
        if self.partitions.is_none() {
            self.own = None;
        }
    }

    /// Whether a step is due for the floor of this replica's partitions,
    /// whether or not its claims take rows: a replica whose claims find
    /// nothing would otherwise keep a floor below the rows other replicas'
    /// partitions gain, and walk them at every poll. Due when that floor
    /// is not known for the partitions owned now, or when the sequence has
    /// given seqs since the last list of writers.
    pub fn own_due(&self) -> bool {
        self.partitions.as_ref().is_some_and(|p| {
            self.own.as_ref().is_none_or(|o| o.partitions != *p)
                || self.last_value > self.listed_upto
        })
    }

    /// The sequence's cache size, if a step found that it hands out values
    /// in blocks: the floor is then unsafe and must go to 0. A tracker that
    /// found it moves the floor no more; [`Tracker::prepare`] on a new one
    /// says whether the sequence has been put back to `CACHE 1`.
    pub fn cached(&self) -> Option<i64> {
        self.cached
    }

    /// Whether the next floor computed must start from seq 0.
    pub fn rescan_due(&self) -> bool {
        self.last_full.is_none_or(|at| at.elapsed() >= self.rescan)
    }

    /// Prepares the tracker's statements on `client`, the connection every
    /// [`Tracker::step`] must then use. Refuses an outbox whose sequence
    /// makes the floor unsafe, or that the relay cannot read.
    pub async fn prepare(&mut self, client: &Client) -> Result<(), Unusable> {
        let sequence = client
            .prepare(&self.statements.sequence)
            .await
            .map_err(Unusable::Sequence)?;
        let row = client
            .query_one(&sequence, &[])
            .await
            .map_err(Unusable::Sequence)?;
        let cache: i64 = row.get(0);
        if cache != 1 {
            return Err(Unusable::CachedSequence(cache));
        }
        // A new session's first floor is computed from seq 0 anyway.
        self.sequence_file = Some(row.get(2));
        let writers = client
            .prepare(&self.statements.writers)
            .await
            .map_err(Unusable::Sequence)?;
        let lowest_fresh = client
            .prepare(&self.statements.lowest_fresh)
            .await
            .map_err(Unusable::Sequence)?;
        let lowest_fresh_own = client
            .prepare(&self.statements.lowest_fresh_own)
            .await
            .map_err(Unusable::Sequence)?;
        self.prepared = Some(Prepared {
            sequence,
            writers,
            lowest_fresh,
            lowest_fresh_own,
        });
        self.candidate = None;
        Ok(())
    }

    /// One step: [`Tracker::confirm`], then, if no list is pending, starts
    /// the next one. `current` is the floor in use now.
    pub async fn step(
        &mut self,
        client: &Client,
        current: i64,
    ) -> Result<Option<i64>, tokio_postgres::Error> {
        if self.cached.is_some() {
            return Ok(None);
        }
        let moved = self.confirm(client, current).await?;
        if self.candidate.is_none() {
            if let Some(prepared) = &self.prepared {
                // Order matters: the last value first, then the writers.
                //
                // The cache size is read again by a statement of its own,
                // sent with the writers' list, after the last value: a
                // sequence altered to cache values (`ALTER ... SET CACHE`)
                // while the relay runs hands out a block only once the
                // change has committed (the ALTER locks out `nextval` until
                // it does), so if `m` counts a block, the second statement's
                // snapshot, taken after `m` was read, sees the new size.
                // Checked only when the floor's session began, the cache let
                // every session's later rows from its block land below the
                // floor, to wait for the rescan
                // (`stalls::floor::a_sequence_cached_while_the_relay_runs_turns_the_floor_off`).
                let listed = async {
                    let row = client.query_one(&prepared.sequence, &[]).await?;
                    let upto: i64 = row.get(1);
                    let file: i64 = row.get(2);
                    self.last_value = upto;
                    self.listed_upto = upto;
                    let (again, writers) = futures::try_join!(
                        client.query_one(&prepared.sequence, &[]),
                        writers_now(client, prepared)
                    )?;
                    let cache = [row.get::<_, i64>(0), again.get(0)]
                        .into_iter()
                        .find(|&c| c != 1);
                    Ok::<_, tokio_postgres::Error>((
                        cache,
                        file,
                        Candidate {
                            upto,
                            writers: writers.vxids,
                            listed: Instant::now(),
                        },
                    ))
                }
                .await;
                match listed {
                    Ok((Some(cache), _, _)) => {
                        self.cached = Some(cache);
                        self.candidate = None;
                        self.passed.clear();
                        self.own = None;
                        return Ok(None);
                    }
                    Ok((None, file, candidate))
                        if self.restarted(file)
                            || candidate.upto < moved.unwrap_or(current) - 1 =>
                    {
                        return Ok(Some(self.went_back()));
                    }
                    Ok((None, _, candidate)) => self.candidate = Some(candidate),
                    // A floor that came back for a passed writer's rows
                    // (whose bases are forgotten by now) must be published
                    // first; the next step lists again.
                    Err(e) if moved.is_none() => return Err(e),
                    Err(_) => {}
                }
            }
        }
        Ok(moved)
    }

    /// Reads the sequence alone, as the floor's session does now and then
    /// while claims take nothing: the floor to use
    /// instead of `current` when the sequence is found behind it (see
    /// [`Tracker::went_back`]), or when it caches values
    /// ([`Tracker::cached`]: 0).
    pub async fn check_sequence(
        &mut self,
        client: &Client,
        current: i64,
    ) -> Result<Option<i64>, tokio_postgres::Error> {
        let Some(prepared) = &self.prepared else {
            return Ok(None);
        };
        let row = client.query_one(&prepared.sequence, &[]).await?;
        let (cache, last, file): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        self.last_value = last;
        if cache != 1 {
            self.cached = Some(cache);
            self.own = None;
            return Ok(Some(0));
        }
        let restarted = self.restarted(file);
        Ok((restarted || last < current - 1).then(|| self.went_back()))
    }

    /// The sequence's last value lies below the floor: the sequence was
    /// set back (`setval`, `TRUNCATE ... RESTART IDENTITY`), and it will
    /// give seqs below the floor again. A floor never passes the last value
    /// by more than one otherwise. The floor goes to 0, and the next
    /// computation starts from seq 0. Without this, such rows waited for
    /// the rescan. (A new session of the floor's, as after a failover to a
    /// standby that had not received the last values given, already starts
    /// from seq 0: its first computation is a rescan.)
    fn went_back(&mut self) -> i64 {
        tracing::info!(
            "the seq sequence was set back below the claim floor; the floor starts again from 0"
        );
        self.candidate = None;
        self.passed.clear();
        self.last_full = None;
        self.own = None;
        0
    }

    /// Whether a list of writers is waiting for its transactions to end,
    /// or the floor has moved past writers that are still running: either
    /// way the tracker must look again at the next tick, claims or not.
    pub fn pending(&self) -> bool {
        self.candidate.is_some() || !self.passed.is_empty()
    }

    /// The seq the floor must come back to should this tracker's session
    /// end while writers it moved past still run: with the session, it
    /// would lose sight of them.
    pub fn passed_base(&self) -> Option<i64> {
        self.passed.iter().map(|p| p.base).min()
    }

    /// The floor to claim from, when the fresh scan may start at `scan`:
    /// the head-of-key probe looks at every row from the base of the
    /// writers moved past, if any, once one of them is no longer in
    /// progress (or any has no known id).
    pub fn at(&self, scan: i64) -> FloorAt {
        let open: Option<Vec<i64>> = self.passed.iter().map(|p| p.xid).collect();
        FloorAt {
            scan,
            probe: self.passed_base().map_or(scan, |b| b.min(scan)),
            open: open.filter(|ids| !ids.is_empty()).map(Arc::from),
            own: self.own.clone().filter(|o| o.scan > scan),
            file: self.sequence_file,
        }
    }

    /// When a writer the floor moved past has ended, brings the floor back
    /// to the lowest fresh row from that writer's base. Otherwise, when
    /// the transactions listed last time have all ended, or those still
    /// running have held the floor for [`PASS_AFTER`] (and are then moved
    /// past), computes the new floor and returns it; starts no new list.
    /// `current` is the floor in use now.
    pub async fn confirm(
        &mut self,
        client: &Client,
        current: i64,
    ) -> Result<Option<i64>, tokio_postgres::Error> {
        let Some(prepared) = &self.prepared else {
            return Ok(None);
        };
        if self.candidate.is_none() && self.passed.is_empty() {
            return Ok(None);
        }
        let listed = writers_now(client, prepared).await?;
        for p in &mut self.passed {
            p.xid = p.xid.or_else(|| listed.xid(&p.writer));
        }
        let writers = &listed.vxids;
        if listed.two_phase {
            // A prepared transaction can commit at any time later, with no
            // session behind it, and may be one the floor moved past while
            // it was still an ordinary one: the floor goes back to the base
            // and waits there, as for any prepared transaction.
            let base = self.passed_base();
            self.passed.clear();
            if base.is_some() {
                self.own = None;
            }
            return Ok(base.map(|b| b.min(current)));
        }
        let ended = self
            .passed
            .iter()
            .filter(|p| !writers.contains(&p.writer))
            .map(|p| p.base)
            .min();
        if let Some(base) = ended {
            // What it committed is visible now: a transaction leaves the
            // running set before it releases its locks. Every other row
            // between `base` and the floor is committed, gone, or another
            // passed writer's. The ended writers are forgotten only once
            // the floor to come back to is known: should the query fail,
            // their bases are what the session's end falls back to.
            let row = client
                .query_one(&prepared.lowest_fresh, &[&base, &(current - 1)])
                .await?;
            self.passed.retain(|p| writers.contains(&p.writer));
            // The floor of this replica's partitions may lie above that
            // writer's rows too: it is computed again from the shared one.
            self.own = None;
            return Ok(Some(row.get(0)));
        }
        let Some(candidate) = &self.candidate else {
            return Ok(None);
        };
        let running: Vec<&String> = candidate
            .writers
            .iter()
            .filter(|w| writers.contains(w))
            .collect();
        if !running.is_empty() {
            let passed_already = running
                .iter()
                .all(|w| self.passed.iter().any(|p| p.writer == **w));
            if !passed_already && candidate.listed.elapsed() < PASS_AFTER {
                return Ok(None);
            }
            // Every row up to the candidate's seq is committed, gone, or
            // one of these writers'; theirs lie at or above the floor in
            // use, which they were not listed under.
            for w in running {
                if !self.passed.iter().any(|p| p.writer == *w) {
                    tracing::debug!(
                        writer = %w,
                        base = current,
                        "claim floor moves past a transaction that wrote to the outbox and is still open"
                    );
                    self.passed.push(Passed {
                        writer: w.clone(),
                        base: current,
                        xid: listed.xid(w),
                    });
                }
            }
        }
        let full = self.rescan_due();
        let from = if full { 0 } else { current };
        let row = match &self.partitions {
            // The floor of this replica's partitions, by the same proof:
            // every row up to the candidate's seq is committed, gone, or a
            // passed writer's (whose end brings both floors back). It starts
            // from its last value when that was kept for the same
            // partitions, since no fresh row of theirs lay below it; from
            // the shared floor's start otherwise.
            Some(partitions) => {
                let own_from = match &self.own {
                    Some(o) if !full && o.partitions == *partitions => o.scan.max(from),
                    _ => from,
                };
                let row = client
                    .query_one(
                        &prepared.lowest_fresh_own,
                        &[&from, &candidate.upto, &own_from, &**partitions],
                    )
                    .await?;
                self.own = Some(Own {
                    partitions: Arc::clone(partitions),
                    scan: row.get(1),
                });
                row
            }
            None => {
                self.own = None;
                client
                    .query_one(&prepared.lowest_fresh, &[&from, &candidate.upto])
                    .await?
            }
        };
        if full {
            self.last_full = Some(Instant::now());
        }
        self.candidate = None;
        Ok(Some(row.get(0)))
    }
}

/// The writers holding a `RowExclusiveLock` on the outbox at one moment.
#[derive(Debug)]
struct Writers {
    /// Their virtual transaction ids.
    vxids: Vec<String>,
    /// Each one's transaction id (`xid8`), if it has one yet.
    xids: Vec<Option<i64>>,
    /// Whether one is a prepared transaction.
    two_phase: bool,
}

impl Writers {
    fn xid(&self, vxid: &str) -> Option<i64> {
        let i = self.vxids.iter().position(|w| w == vxid)?;
        self.xids.get(i).copied().flatten()
    }
}

/// The writers holding a lock on the outbox now.
async fn writers_now(
    client: &Client,
    prepared: &Prepared,
) -> Result<Writers, tokio_postgres::Error> {
    let rows = client.query(&prepared.writers, &[]).await?;
    let mut writers = Writers {
        vxids: Vec::new(),
        xids: Vec::new(),
        two_phase: false,
    };
    for row in rows {
        let vxid: String = row.try_get(0)?;
        writers.two_phase |= row.try_get::<_, bool>(1)?;
        let xid = row
            .try_get::<_, Option<i64>>(2)?
            .map(|x| widen(x, row.get(3)));
        match writers.vxids.iter().position(|w| *w == vxid) {
            // Its own id is the lowest: it was given before any of its
            // subtransactions' ids.
            Some(i) => writers.xids[i] = writers.xids[i].into_iter().chain(xid).min(),
            None => {
                writers.vxids.push(vxid);
                writers.xids.push(xid);
            }
        }
    }
    Ok(writers)
}

/// A transaction id of 32 bits (as `pg_locks` gives it) as the 64-bit
/// `xid8` it stands for, given `xmax`, a snapshot's xmax (`xid8`) taken
/// while that transaction ran: the two are less than 2^31 apart, either
/// way, since ids are never reused within that distance of a running one.
fn widen(xid: i64, xmax: i64) -> i64 {
    let delta = (xid - xmax).rem_euclid(1 << 32);
    let delta = if delta >= 1 << 31 {
        delta - (1 << 32)
    } else {
        delta
    };
    xmax + delta
}

/// Keeps `floor` moving while claims take rows, and recomputes it from seq 0
/// every rescan interval even while idle, until `shutdown`. When the floor
/// cannot be used it stays at 0, said once. While Postgres is lost it keeps
/// its last value, which stays true.
pub async fn run(
    pg: super::Database,
    schema: SchemaName,
    floor: Arc<Floor>,
    owned: Owned,
    rescan: Duration,
    reconnect_max: Duration,
    shutdown: CancellationToken,
) {
    // Whether the floor is off for a cached sequence, so that it is said
    // once each time it turns off or on, not at every check.
    let off = std::sync::atomic::AtomicBool::new(false);
    let session = || async {
        let client = super::connect(&pg, Duration::from_secs(60)).await?;
        let mut tracker = Tracker::new(&schema, rescan);
        'tracking: loop {
            loop {
                let Ok(prepared) = tokio::time::timeout(BOUND, tracker.prepare(&client)).await
                else {
                    return Err(super::PgFault::Unanswered(BOUND));
                };
                match prepared {
                    Ok(()) => break,
                    // Anything but a missing grant (a lost connection, a server
                    // shutting down) is tried again on a new session.
                    Err(Unusable::Sequence(e))
                        if e.code()
                            != Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
                    {
                        return Err(e.into())
                    }
                    // It may be put back to `CACHE 1`: asked again every rescan
                    // interval.
                    Err(e @ Unusable::CachedSequence(_)) => {
                        floor.set(0.into());
                        if !off.swap(true, Ordering::Relaxed) {
                            tracing::warn!(error = %e, "claim floor off: claims scan fresh rows from the start of the index");
                        }
                        if sleep_or_cancel(rescan, &shutdown).await {
                            return Ok(());
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "claim floor off: claims scan fresh rows from the start of the index");
                        shutdown.cancelled().await;
                        return Ok(());
                    }
                }
            }
            if off.swap(false, Ordering::Relaxed) {
                tracing::info!(
                    "claim floor on: the seq sequence hands out values one at a time again"
                );
            }
            let mut seen = u64::MAX;
            let mut idle_ticks = 0u32;
            loop {
                // Claims that took rows start a new list of writers; once they
                // stop, the list pending is still confirmed, so the floor
                // catches up with the last rows claimed, and then the tracker
                // rests until claims resume or a rescan is due (or a writer
                // the floor moved past ends).
                let claims = floor.claims.load(Ordering::Relaxed);
                tracker.set_partitions(&owned.borrow());
                let moved = if claims != seen || tracker.rescan_due() || tracker.own_due() {
                    seen = claims;
                    client
                        .answered(BOUND, tracker.step(&client, floor.get()))
                        .await
                } else if tracker.pending() {
                    client
                        .answered(BOUND, tracker.confirm(&client, floor.get()))
                        .await
                } else {
                    // Rows given seqs below the floor by a sequence set
                    // back are never claimed, so no step would run: the
                    // sequence is read about once a second while idle.
                    idle_ticks += 1;
                    if idle_ticks.is_multiple_of(IDLE_CHECK) {
                        client
                            .answered(BOUND, tracker.check_sequence(&client, floor.get()))
                            .await
                    } else {
                        Ok(None)
                    }
                };
                if let Some(cache) = tracker.cached() {
                    floor.set(0.into());
                    if !off.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            error = %Unusable::CachedSequence(cache),
                            "claim floor off: claims scan fresh rows from the start of the index"
                        );
                    }
                    // A new tracker asks, every rescan interval, until it is put back.
                    tracker = Tracker::new(&schema, rescan);
                    continue 'tracking;
                }
                match moved {
                    Ok(Some(seq)) => floor.set(tracker.at(seq)),
                    Ok(None) => {}
                    // The floor in use stays valid without a session, unless
                    // it moved past writers still running: the next session
                    // would not know to come back for their rows.
                    Err(e) => {
                        if let Some(base) = tracker.passed_base() {
                            // The sequence's file stays: a claim still
                            // checks it while the session reconnects.
                            let at = floor.at();
                            floor.set(FloorAt {
                                scan: at.scan.min(base),
                                probe: at.probe.min(base),
                                open: None,
                                own: None,
                                file: at.file,
                            });
                        }
                        return Err(e);
                    }
                }
                if sleep_or_cancel(TICK, &shutdown).await {
                    return Ok(());
                }
            }
        }
    };
    supervise_until_cancelled(
        Duration::from_millis(200),
        reconnect_max,
        &shutdown,
        session,
        // Quiet: the workers report Postgres; the floor only waits for it.
        |e: &super::PgFault| tracing::debug!(error = %e, "claim floor session ended; reconnecting"),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::widen;

    #[test]
    fn a_32_bit_id_is_widened_to_the_epoch_it_runs_in() {
        let epoch = |e: i64, x: i64| (e << 32) + x;
        // Below the snapshot's xmax, in the same epoch.
        assert_eq!(widen(40_000, epoch(3, 40_500)), epoch(3, 40_000));
        // Given after the snapshot was taken: just above its xmax.
        assert_eq!(widen(40_700, epoch(3, 40_500)), epoch(3, 40_700));
        // Begun before the counter wrapped, the snapshot after.
        assert_eq!(
            widen(u32::MAX as i64 - 5, epoch(3, 10)),
            epoch(2, u32::MAX as i64 - 5)
        );
        // Given after the wrap, the snapshot before it.
        assert_eq!(widen(3, epoch(2, u32::MAX as i64 - 5)), epoch(3, 3));
        // In the first epoch.
        assert_eq!(widen(740, 741), 740);
    }
}
