//! Deliberately broken relay behaviours and a crash failpoint, for testing the
//! correctness checker itself: if the checker passes a relay that does these,
//! the checker is wrong.
//!
//! Compiled only with the `mutants` feature (the test crate turns it on), and
//! even then inert unless selected by environment variable:
//!
//! - `OUTBOX_TEST_MUTANT=ack-before-confirm`: delete and commit the claimed rows,
//!   then publish, ignoring the broker's answer (loses messages on any failure).
//! - `OUTBOX_TEST_MUTANT=watermark`: only claim rows above the highest seq seen
//!   so far (loses rows whose transaction commits late with a lower seq).
//! - `OUTBOX_TEST_FAILPOINT=crash-after-ack:N`: abort the process once the
//!   broker has confirmed the Nth batch, before the rows are deleted.
//! - `OUTBOX_TEST_FAILPOINT=panic-in-ownership:N`: panic in the ownership
//!   task at its Nth heartbeat (standing in for any bug that ends one of the
//!   relay's own tasks).
//! - `OUTBOX_TEST_FAILPOINT=panic-in-worker:N`: panic in the worker whose
//!   batch is the Nth the broker answered, before its rows are settled.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::envelope::Envelope;

/// A broken behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// Settle before the broker confirms.
    AckBeforeConfirm,
    /// Poll with an `seq > last_seen` watermark.
    Watermark,
}

/// The mutant selected by `OUTBOX_TEST_MUTANT`, if any.
pub fn active() -> Option<Mutant> {
    static ACTIVE: OnceLock<Option<Mutant>> = OnceLock::new();
    *ACTIVE.get_or_init(|| match std::env::var("OUTBOX_TEST_MUTANT").as_deref() {
        Ok("ack-before-confirm") => Some(Mutant::AckBeforeConfirm),
        Ok("watermark") => Some(Mutant::Watermark),
        _ => None,
    })
}

static WATERMARK: AtomicI64 = AtomicI64::new(0);

/// Under the watermark mutant: forgets rows at or below the watermark (they
/// stay in the outbox, never published) and raises it past the rest.
pub fn apply_watermark(batch: Vec<Envelope>) -> Vec<Envelope> {
    if active() != Some(Mutant::Watermark) {
        return batch;
    }
    let mark = WATERMARK.load(Ordering::SeqCst);
    let kept: Vec<Envelope> = batch.into_iter().filter(|e| e.seq > mark).collect();
    if let Some(max) = kept.iter().map(|e| e.seq).max() {
        WATERMARK.fetch_max(max, Ordering::SeqCst);
    }
    kept
}

/// The count at which the failpoint `OUTBOX_TEST_FAILPOINT=<name>:N` is
/// due, if that one is selected.
fn failpoint(name: &str) -> Option<u64> {
    std::env::var("OUTBOX_TEST_FAILPOINT").ok().and_then(|v| {
        v.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|n| n.parse().ok())
    })
}

/// A failpoint's calls, counted: it is due at the Nth when
/// `OUTBOX_TEST_FAILPOINT=<name>:N` selects it.
struct Failpoint {
    name: &'static str,
    calls: AtomicU64,
    at: OnceLock<Option<u64>>,
}

impl Failpoint {
    const fn new(name: &'static str) -> Self {
        Failpoint {
            name,
            calls: AtomicU64::new(0),
            at: OnceLock::new(),
        }
    }

    /// Counts this call; its number if it is the one the failpoint is due at.
    fn due(&self) -> Option<u64> {
        let at = (*self.at.get_or_init(|| failpoint(self.name)))?;
        (self.calls.fetch_add(1, Ordering::SeqCst) + 1 == at).then_some(at)
    }
}

static CRASH_AFTER_ACK: Failpoint = Failpoint::new("crash-after-ack");
static PANIC_IN_OWNERSHIP: Failpoint = Failpoint::new("panic-in-ownership");
static PANIC_IN_WORKER: Failpoint = Failpoint::new("panic-in-worker");

/// Aborts the process, or panics the worker, if either failpoint is due;
/// called once the broker has answered for a batch.
pub fn after_ack() {
    if let Some(at) = CRASH_AFTER_ACK.due() {
        eprintln!("failpoint crash-after-ack:{at} reached; aborting");
        std::process::abort();
    }
    if let Some(at) = PANIC_IN_WORKER.due() {
        panic!("failpoint panic-in-worker:{at} reached");
    }
}

/// Panics if the ownership failpoint is due; called at each heartbeat.
pub fn ownership_beat() {
    if let Some(at) = PANIC_IN_OWNERSHIP.due() {
        panic!("failpoint panic-in-ownership:{at} reached");
    }
}
