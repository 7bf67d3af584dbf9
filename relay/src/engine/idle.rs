//! The idle hand-off between a relay's workers: who polls, who stands by,
//! and the one claim at a time.

use std::sync::Arc;
use std::time::Duration;

/// How the workers share the waiting while the outbox is idle: one of them at
/// a time (the holder of `poller`) claims at pauses that grow from
/// `poll_min` to `poll_interval`, and keeps the shortest pause while its
/// claims find rows; the others stand by until `work` hands them something. A full batch, a notification (NOTIFY) or an ownership
/// change wakes one more worker, never all of them for one row.
#[derive(Clone, Default)]
pub(super) struct Idle {
    pub(super) poller: Arc<tokio::sync::Mutex<()>>,
    pub(super) work: Arc<tokio::sync::Notify>,
    /// Held by the worker whose claim is running. Two claims of one relay at
    /// once would each lock rows the other then finds blocked behind them
    /// (older rows of the same keys): with a few hot keys every claim came
    /// back empty while the rows piled up. One at a time, each claim takes
    /// what the batches in flight left free.
    pub(super) claiming: Arc<tokio::sync::Mutex<()>>,
    /// Ends the poller's pause: another worker found rows while the poller
    /// waited out a pause that had grown while the outbox was empty.
    pub(super) poll_now: Arc<tokio::sync::Notify>,
}

/// How long a standing-by worker waits at least before it claims anyway (or
/// the poll interval, if longer): a floor under every hand-off, in case one
/// is missed.
pub(super) const STANDBY_RECHECK: Duration = Duration::from_secs(1);
