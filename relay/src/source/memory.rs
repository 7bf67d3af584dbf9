//! An outbox in memory behind the [`Store`] boundary, for the relay loop's
//! tests with paused tokio time. It keeps what the loop's scheduling depends
//! on and nothing more:
//!
//! - a claim takes the oldest ready, unlocked rows, and a row only when no
//!   older row of its key is locked by another batch or waiting out a retry
//!   (the rows held back count as blocked);
//! - a claim stops at the batch's row and byte limits (a single larger row
//!   still goes alone);
//! - a batch's changes apply at commit; dropping it releases its rows;
//! - every statement can take a set (virtual) time, and the store can go
//!   down, ending every session.
//!
//! It does not keep partitions, the holds of blocked keys, retention or the
//! floor: a claim ignores them. Rows an outage left unanswered do wait out
//! their hold, as rows waiting out a retry do.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use uuid::Uuid;

use super::claim::{ClaimLimits, Claimed};
use super::store::{BatchTx, OpenError, Session, Settle, Store, StoreError};
use crate::envelope::Envelope;
use crate::source::floor::FloorAt;

/// The shared state; sessions and transactions all point at it.
#[derive(Clone, Default)]
pub(crate) struct MemoryStore {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    rows: BTreeMap<i64, Row>,
    next_seq: i64,
    next_tx: u64,
    /// Bumped when the store goes down: every older session is closed.
    generation: u64,
    down: bool,
    /// How long each statement takes.
    statement: Duration,
    /// Extra time the next claims take, one entry per claim.
    slow_claims: Vec<Duration>,
    /// When each claim ran, and how many rows it took.
    claims: Vec<(Instant, usize)>,
    /// When each look (`Session::ready`) ran, and what it said.
    looks: Vec<(Instant, bool)>,
    opens: usize,
}

struct Row {
    envelope: Envelope,
    locked_by: Option<u64>,
    ready_at: Instant,
}

impl MemoryStore {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes every statement take `d`.
    pub(crate) fn set_statement_time(&self, d: Duration) {
        self.state().statement = d;
    }

    /// Makes the next claim take `d` longer than a statement.
    pub(crate) fn slow_next_claim(&self, d: Duration) {
        self.state().slow_claims.push(d);
    }

    /// While down, sessions fail to open and every open session is lost.
    pub(crate) fn set_down(&self, down: bool) {
        let mut s = self.state();
        if down && !s.down {
            s.generation += 1;
        }
        s.down = down;
    }

    /// Adds a committed row for `key` with `bytes` of payload; returns its seq.
    pub(crate) fn enqueue(&self, key: &str, bytes: usize) -> i64 {
        let mut s = self.state();
        s.next_seq += 1;
        let seq = s.next_seq;
        let now = Instant::now();
        let envelope = Envelope {
            seq,
            message_id: Uuid::new_v4(),
            destination: "orders".into(),
            ordering_key: Some(key.to_owned()),
            routing_key: key.to_owned(),
            headers: Vec::new(),
            payload: vec![b'x'; bytes],
            content_type: None,
            event_type: None,
            created_at: SystemTime::now(),
            attempts: 0,
        };
        s.rows.insert(
            seq,
            Row {
                envelope,
                locked_by: None,
                ready_at: now,
            },
        );
        seq
    }

    /// Rows not yet settled.
    pub(crate) fn waiting(&self) -> usize {
        self.state().rows.len()
    }

    /// Rows locked by a batch right now.
    pub(crate) fn locked(&self) -> usize {
        self.state()
            .rows
            .values()
            .filter(|r| r.locked_by.is_some())
            .count()
    }

    /// When each claim ran and how many rows it took, in order.
    pub(crate) fn claims(&self) -> Vec<(Instant, usize)> {
        self.state().claims.clone()
    }

    /// When each look outside a transaction ran and what it said, in order.
    pub(crate) fn looks(&self) -> Vec<(Instant, bool)> {
        self.state().looks.clone()
    }

    /// Sessions opened or tried.
    pub(crate) fn opens(&self) -> usize {
        self.state().opens
    }

    /// Waits out one statement's time, then fails if the session is gone.
    async fn statement(&self, generation: u64, extra: Duration) -> Result<(), StoreError> {
        let d = self.state().statement + extra;
        if d.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(d).await;
        }
        let s = self.state();
        if s.down || s.generation != generation {
            return Err(StoreError::memory("memory store: connection lost"));
        }
        Ok(())
    }
}

/// One session: lost when the store goes down after it opened.
pub(crate) struct MemorySession {
    store: MemoryStore,
    generation: u64,
}

/// One batch: its rows stay locked until commit or drop.
pub(crate) struct MemoryTx {
    store: MemoryStore,
    generation: u64,
    id: u64,
    delete: Vec<i64>,
    retry: Vec<(i64, Duration)>,
    /// Rows the broker did not answer, set aside without an attempt.
    aside: Vec<(i64, Duration)>,
    dead: Vec<i64>,
}

impl Store for MemoryStore {
    type Session = MemorySession;

    async fn open(&self) -> Result<MemorySession, OpenError> {
        let generation = {
            let mut s = self.state();
            s.opens += 1;
            if s.down {
                return Err(OpenError::Connect(StoreError::memory("memory store: down")));
            }
            s.generation
        };
        Ok(MemorySession {
            store: self.clone(),
            generation,
        })
    }
}

impl Session for MemorySession {
    type Tx<'a> = MemoryTx;

    async fn begin(&mut self) -> Result<MemoryTx, StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        let id = {
            let mut s = self.store.state();
            s.next_tx += 1;
            s.next_tx
        };
        Ok(MemoryTx {
            store: self.store.clone(),
            generation: self.generation,
            id,
            delete: Vec::new(),
            retry: Vec::new(),
            aside: Vec::new(),
            dead: Vec::new(),
        })
    }

    async fn ready(&mut self, _partitions: &[i16], _floor: &FloorAt) -> Result<bool, StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        let mut s = self.store.state();
        let now = Instant::now();
        let ready = s
            .rows
            .values()
            .any(|r| r.locked_by.is_none() && r.ready_at <= now);
        s.looks.push((now, ready));
        Ok(ready)
    }

    fn is_closed(&self) -> bool {
        let s = self.store.state();
        s.down || s.generation != self.generation
    }
}

impl BatchTx for MemoryTx {
    async fn claim<'a>(
        &'a mut self,
        limits: &'a ClaimLimits,
        _partitions: &'a [i16],
        _floor: FloorAt,
        locked: impl FnOnce() + Send + 'a,
    ) -> Result<Claimed, StoreError> {
        let extra = {
            let mut s = self.store.state();
            if s.slow_claims.is_empty() {
                Duration::ZERO
            } else {
                s.slow_claims.remove(0)
            }
        };
        self.store.statement(self.generation, extra).await?;
        let mut s = self.store.state();
        let now = Instant::now();
        let mut claimed = Claimed::default();
        let mut blocked_keys: HashSet<String> = HashSet::new();
        let mut bytes = 0usize;
        let limit_bytes = usize::try_from(limits.bytes).unwrap_or(usize::MAX);
        let mut taken = Vec::new();
        for (seq, row) in s.rows.iter() {
            let key = row.envelope.ordering_key.clone().unwrap_or_default();
            let free = row.locked_by.is_none() && row.ready_at <= now;
            if !free || blocked_keys.contains(&key) {
                // A row another batch holds, or one waiting out its retry,
                // holds back the rest of its key.
                if free {
                    claimed.blocked.push(*seq);
                }
                blocked_keys.insert(key);
                continue;
            }
            let size = row.envelope.bytes();
            if !taken.is_empty() && bytes + size > limit_bytes {
                break;
            }
            bytes += size;
            taken.push(*seq);
            if taken.len() as i64 >= limits.rows {
                break;
            }
        }
        for seq in &taken {
            let row = s.rows.get_mut(seq).expect("row just seen");
            row.locked_by = Some(self.id);
            claimed.batch.push(row.envelope.clone());
        }
        s.claims.push((now, taken.len()));
        locked();
        Ok(claimed)
    }

    async fn settle_and_commit(mut self, settle: Settle<'_>) -> Result<u64, StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        self.delete
            .extend(settle.published.iter().map(|(env, _)| env.seq));
        self.retry
            .extend(settle.failed.iter().map(|(seq, _, delay)| (*seq, *delay)));
        self.dead.extend(settle.dead.iter().map(|(seq, _)| *seq));
        self.commit().await?;
        Ok(settle.holds.len() as u64)
    }

    async fn note_batch_error(
        &mut self,
        seqs: &[i64],
        _error: &str,
        hold: Option<Duration>,
    ) -> Result<u64, StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        if let Some(hold) = hold {
            self.aside.extend(seqs.iter().map(|&seq| (seq, hold)));
        }
        Ok(seqs.len() as u64)
    }

    async fn delete(&mut self, seqs: &[i64]) -> Result<u64, StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        self.delete.extend_from_slice(seqs);
        Ok(seqs.len() as u64)
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        self.store
            .statement(self.generation, Duration::ZERO)
            .await?;
        let now = Instant::now();
        let mut s = self.store.state();
        for seq in self.delete.drain(..).chain(self.dead.drain(..)) {
            s.rows.remove(&seq);
        }
        for (seq, delay) in self.retry.drain(..) {
            if let Some(row) = s.rows.get_mut(&seq) {
                row.ready_at = now + delay;
                row.envelope.attempts += 1;
            }
        }
        for (seq, hold) in self.aside.drain(..) {
            if let Some(row) = s.rows.get_mut(&seq) {
                row.ready_at = row.ready_at.max(now + hold);
            }
        }
        Ok(())
    }

    async fn rollback(self) -> Result<(), StoreError> {
        Ok(()) // dropping releases the rows
    }

    fn release(self) {} // dropping releases the rows
}

impl Drop for MemoryTx {
    /// Commit or rollback alike: the batch's locks go with it.
    fn drop(&mut self) {
        let id = self.id;
        for row in self.store.state().rows.values_mut() {
            if row.locked_by == Some(id) {
                row.locked_by = None;
            }
        }
    }
}
