//! The idle hand-off between a relay's workers: who polls, who stands by,
//! and the one claim at a time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How the workers share the waiting while the outbox is idle: one of them at
/// a time (the holder of `poller`) claims at pauses that grow from
/// `poll_min` to `poll_interval`, and keeps the shortest pause while its
/// claims find rows (shorter still once a stream would fill a [`GATHER`]
/// sooner); the others stand by until `work` hands them something. A full
/// batch, a notification (NOTIFY) or an ownership change wakes one more
/// worker, never all of them for one row.
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
    /// When the latest claim of any worker started: how long rows had to
    /// arrive before the next one.
    last_claim: Arc<Mutex<Option<Instant>>>,
}

impl Idle {
    /// Notes a claim starting `at` (under the claim lock, so claims note in
    /// order) and returns how long after the one before it.
    pub(super) fn claim_started(&self, at: Instant) -> Option<Duration> {
        let mut last = self.last_claim.lock().unwrap_or_else(|p| p.into_inner());
        let since = last.map(|l| at.saturating_duration_since(l));
        *last = Some(at);
        since
    }

    /// How long from now until `cycle` has passed since the latest claim of
    /// any worker: the pause after which the next claim would find about
    /// [`GATHER`] rows. Timed from the latest claim, not the worker's own,
    /// so that workers pausing each on their own (batches slower than the
    /// shortest pause) do not each claim a [`GATHER`] that another has
    /// just taken.
    pub(super) fn gather_pause(&self, cycle: Option<Duration>) -> Option<Duration> {
        let cycle = cycle?;
        let last = (*self.last_claim.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some((last + cycle).saturating_duration_since(Instant::now()))
    }
}

/// The batch a trickle's pause aims to gather. A batch's fixed cost (its
/// round trips and wake-ups) was about six messages' worth where it was
/// fitted (docs/benchmarks.md, "One poller for a trickle": about 200 µs a
/// batch, 33 µs a message), so at 32 it is a sixth of the batch's cost or
/// less. While a stream is slow enough that `poll_min` gathers fewer (below
/// about 3,000 msg/s at the default 10 ms), the pause is `poll_min` as
/// before; a faster stream is claimed as soon as about this many rows are
/// waiting, instead of holding them for the rest of the pause.
pub(super) const GATHER: usize = 32;

/// How long apart claims would find about [`GATHER`] rows each, at the
/// rate a claim found `found` rows in the `window` since the claim before
/// it; `None` when that claim says nothing of the rate (no rows, or no
/// claim before it).
pub(super) fn gather_cycle(found: usize, window: Option<Duration>) -> Option<Duration> {
    let window = window?;
    if found == 0 {
        return None;
    }
    Some(window.mul_f64(GATHER as f64 / found as f64))
}

/// How long a standing-by worker waits at least before it claims anyway (or
/// the poll interval, if longer): a floor under every hand-off, in case one
/// is missed.
pub(super) const STANDBY_RECHECK: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_cycle_is_as_long_as_the_rate_takes_to_bring_a_gather() {
        // 13 rows in 13 ms (1,000 a second): 32 take 32 ms.
        assert_eq!(gather_cycle(13, Some(13 * MS)), Some(32 * MS));
        // 80 rows in 16 ms (5,000 a second): 32 take 6.4 ms.
        let cycle = gather_cycle(80, Some(16 * MS)).expect("a rate");
        assert!(cycle > 6 * MS && cycle < 7 * MS, "{cycle:?}");
    }

    #[test]
    fn no_rate_is_guessed_without_rows_or_a_claim_before() {
        assert_eq!(gather_cycle(0, Some(16 * MS)), None);
        assert_eq!(gather_cycle(10, None), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_pause_is_timed_from_the_latest_claim_of_any_worker() {
        let idle = Idle::default();
        let other = idle.clone();
        assert_eq!(idle.gather_pause(Some(10 * MS)), None, "no claim yet");
        idle.claim_started(Instant::now());
        tokio::time::sleep(4 * MS).await;
        assert_eq!(idle.gather_pause(Some(10 * MS)), Some(6 * MS));
        // Another worker claimed since: the cycle starts over from there.
        other.claim_started(Instant::now());
        tokio::time::sleep(MS).await;
        assert_eq!(idle.gather_pause(Some(10 * MS)), Some(9 * MS));
        // Past the cycle: no pause.
        tokio::time::sleep(20 * MS).await;
        assert_eq!(idle.gather_pause(Some(10 * MS)), Some(Duration::ZERO));
        assert_eq!(idle.gather_pause(None), None);
    }

    #[test]
    fn claims_are_timed_from_the_one_before_whoever_made_it() {
        let idle = Idle::default();
        let other = idle.clone();
        let t0 = Instant::now();
        assert_eq!(idle.claim_started(t0), None);
        assert_eq!(other.claim_started(t0 + 5 * MS), Some(5 * MS));
        assert_eq!(idle.claim_started(t0 + 7 * MS), Some(2 * MS));
    }
}
