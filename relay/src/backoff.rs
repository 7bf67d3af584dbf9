//! Capped exponential backoff with jitter, for reconnects and retries.

use std::time::Duration;

use rand::Rng;

/// Doubles from `base` up to `max`; each delay is drawn from [d/2, d] ("equal
/// jitter") so a fleet of relays does not retry in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting at `base`, never above `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max: max.max(base),
            attempt: 0,
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let d = delay_for(self.base, self.max, self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        d
    }

    /// Back to `base` after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// The jittered delay after `attempt` failures (0-based).
pub fn delay_for(base: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 2u32.saturating_pow(attempt.min(30));
    let capped = base.saturating_mul(factor).min(max);
    let half = capped / 2;
    half + rand::rng().random_range(Duration::ZERO..=capped - half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_then_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(50) && delays[0] <= Duration::from_millis(100));
        assert!(delays[3] >= Duration::from_millis(400) && delays[3] <= Duration::from_millis(800));
        for d in &delays[4..] {
            assert!(
                *d >= Duration::from_millis(500) && *d <= Duration::from_secs(1),
                "{d:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
