//! How large a batch a slow link can carry in time.
//!
//! A link to the broker slower than the batches in flight (a saturated
//! network, RabbitMQ reading slowly under flow control) cuts them short at
//! their deadline. What the broker had not confirmed by then is sent again
//! later, and whatever of it had already left arrives twice. Sent again as
//! large, every batch would be cut the same way. So a publisher that sees
//! a batch cut short while the broker was still confirming asks for smaller
//! batches ([`super::Publisher::batch_bytes`]), and for larger ones again as
//! batches go through with time to spare.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The smallest batch, in payload bytes, that a slow link is paced down to
/// (a larger message still goes alone).
const MIN_BYTES: usize = 16 * 1024;

/// What to do about a message of `bytes`, sent alone, that the broker did
/// not confirm within `timeout`: nothing pacing can do when it is above the
/// floor, for a link that carries less than it in the timeout never will.
/// (A broker that stopped answering shows the same, hence the "if".)
pub fn alone_too_slow(bytes: usize, timeout: Duration) -> Option<String> {
    (bytes > MIN_BYTES).then(|| {
        format!(
            "a message of {bytes} bytes, sent alone, was not confirmed within \
             --confirm-timeout ({timeout:?}); if the broker is up and this repeats, the link \
             carries less than it in that time and never will: raise --confirm-timeout \
             past the time the link takes to carry it, and --hold-limit to 2.5 times that"
        )
    })
}

/// Past this, pacing no longer limits any batch the relay's flags allow.
const UNLIMITED_FROM: usize = 1 << 30;

/// A publisher's batch size limit in payload bytes, none until a batch is
/// cut short.
#[derive(Debug, Default)]
pub struct Pace {
    bytes: AtomicUsize,
}

impl Pace {
    /// The limit, if any.
    pub fn limit(&self) -> Option<usize> {
        match self.bytes.load(Ordering::Relaxed) {
            0 => None,
            bytes => Some(bytes),
        }
    }

    /// A batch was cut short with `delivered` payload bytes through: later
    /// batches carry a quarter of that (the pipeline's other batches shared
    /// the link with this one), never more than the limit already set.
    /// `broker` names it in the log line.
    pub fn slow_down(&self, delivered: usize, broker: &str) {
        if let Some(bytes) = self.lower_to(delivered / 4) {
            tracing::warn!(
                batch_bytes = bytes,
                delivered,
                "{broker} takes messages slower than the batches in flight can wait; smaller batches until it keeps up"
            );
        }
    }

    /// A batch timed out whole, with nothing of its `sent` payload bytes
    /// confirmed: later batches carry half of it, never more than the
    /// limit already set. A link too slow to carry even the first answer
    /// in time looks like this; so does a broker that stopped answering,
    /// where smaller batches cost nothing. Without it, a batch the broker
    /// confirms all at once (a Kafka partition's records, one produce
    /// request) that the link cannot carry in time would be sent again as
    /// large, and time out whole, forever.
    pub fn timed_out_whole(&self, sent: usize, broker: &str) {
        if let Some(bytes) = self.lower_to(sent / 2) {
            tracing::warn!(
                batch_bytes = bytes,
                sent,
                "{broker} confirmed none of a batch before it timed out; smaller batches until it keeps up"
            );
        }
    }

    /// Lowers the limit to `bytes`, not below the floor: the new limit, or
    /// `None` if it was already that low.
    fn lower_to(&self, bytes: usize) -> Option<usize> {
        let bytes = bytes.max(MIN_BYTES);
        let before = self.bytes.load(Ordering::Relaxed);
        (before == 0 || bytes < before).then(|| {
            self.bytes.store(bytes, Ordering::Relaxed);
            bytes
        })
    }

    /// A batch of `carried` payload bytes went through whole in `took` of
    /// the `allowed` time: under a quarter of it, the limit grows by a
    /// quarter, and is lifted once past any batch the relay would claim.
    /// Only a batch of at least half the limit counts: a trickle of small
    /// batches says nothing of how a full one fares, and would lift the
    /// limit before the next burst, to be cut again.
    pub fn speed_up(&self, carried: usize, took: Duration, allowed: Duration) {
        let bytes = self.bytes.load(Ordering::Relaxed);
        if bytes == 0 || took >= allowed / 4 || carried < bytes / 2 {
            return;
        }
        let next = bytes + bytes / 4;
        let next = if next >= UNLIMITED_FROM { 0 } else { next };
        let _ = self
            .bytes
            .compare_exchange(bytes, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn shrinks_to_a_quarter_of_what_got_through_and_grows_back_with_time_to_spare() {
        let pace = Pace::default();
        pace.speed_up(1 << 20, Duration::ZERO, SECOND);
        assert_eq!(pace.limit(), None, "no limit until a batch is cut short");
        pace.slow_down(400_000, "test");
        assert_eq!(pace.limit(), Some(100_000));
        pace.slow_down(800_000, "test");
        assert_eq!(pace.limit(), Some(100_000), "never raised by a cut");
        pace.slow_down(1_000, "test");
        assert_eq!(pace.limit(), Some(MIN_BYTES), "never below the floor");
        pace.speed_up(MIN_BYTES, SECOND / 4, SECOND);
        assert_eq!(
            pace.limit(),
            Some(MIN_BYTES),
            "a quarter of the time is not to spare"
        );
        pace.speed_up(MIN_BYTES, SECOND / 5, SECOND);
        assert_eq!(pace.limit(), Some(MIN_BYTES + MIN_BYTES / 4));
        for _ in 0..100 {
            let full = pace.limit().unwrap_or(0);
            pace.speed_up(full, Duration::ZERO, SECOND);
        }
        assert_eq!(pace.limit(), None, "lifted once past any batch");
    }

    /// A trickle after a cut: single small messages going through with
    /// time to spare lifted the limit within about 50 batches (well under a
    /// second at the default poll), and the next burst went out at full
    /// size over the same slow link, to be cut again, its copies sent twice.
    #[test]
    fn a_trickle_of_small_batches_keeps_the_limit_a_cut_set() {
        let pace = Pace::default();
        pace.slow_down(400_000, "test");
        for _ in 0..1_000 {
            pace.speed_up(1_024, Duration::from_millis(1), Duration::from_secs(30));
        }
        assert_eq!(pace.limit(), Some(100_000));
        pace.speed_up(50_000, Duration::from_millis(1), Duration::from_secs(30));
        assert_eq!(
            pace.limit(),
            Some(125_000),
            "a batch of half the limit counts"
        );
    }

    #[test]
    fn a_batch_timed_out_whole_halves_what_was_sent_down_to_the_floor() {
        let pace = Pace::default();
        pace.timed_out_whole(400_000, "test");
        assert_eq!(pace.limit(), Some(200_000));
        pace.timed_out_whole(400_000, "test");
        assert_eq!(pace.limit(), Some(200_000), "never raised");
        pace.timed_out_whole(200_000, "test");
        assert_eq!(pace.limit(), Some(100_000));
        pace.timed_out_whole(0, "test");
        assert_eq!(pace.limit(), Some(MIN_BYTES), "never below the floor");
    }

    #[test]
    fn only_a_message_above_the_floor_is_one_pacing_cannot_help() {
        let timeout = Duration::from_secs(3);
        assert_eq!(
            alone_too_slow(MIN_BYTES, timeout),
            None,
            "pacing can get here"
        );
        let hint = alone_too_slow(MIN_BYTES + 1, timeout).expect("above the floor");
        assert!(hint.contains(&format!("{} bytes", MIN_BYTES + 1)), "{hint}");
        assert!(hint.contains("raise --confirm-timeout"), "{hint}");
    }
}
