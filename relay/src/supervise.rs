//! "Retry with backoff until cancelled", written once for the relay's
//! long-lived sessions (the LISTEN connection, the ownership session, the
//! retention cleanup).

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;

/// Sleeps for `d`; true when `shutdown` came first.
pub async fn sleep_or_cancel(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// Runs `session` until it returns `Ok` (it saw `shutdown` and finished) or
/// `shutdown` is cancelled. After each `Err`, `on_failure` runs (to log and
/// clean up) and the next try waits a capped, jittered backoff from `first`
/// up to `max`. A session that ran longer than `max` before failing starts
/// the backoff over, so a failure after hours of health is retried at once
/// rather than after the cap.
pub async fn supervise<E, S, Fut>(
    first: Duration,
    max: Duration,
    shutdown: &CancellationToken,
    mut session: S,
    mut on_failure: impl FnMut(&E),
) where
    S: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let mut backoff = Backoff::new(first, max);
    while !shutdown.is_cancelled() {
        let started = tokio::time::Instant::now();
        match session().await {
            Ok(()) => return,
            Err(e) => on_failure(&e),
        }
        if started.elapsed() > max {
            backoff.reset();
        }
        if sleep_or_cancel(backoff.next_delay(), shutdown).await {
            return;
        }
    }
}

/// [`supervise`] for a task that holds nothing a shutdown must finish: a
/// session still waiting on a server that accepts connections and answers
/// nothing is dropped at `shutdown`, rather than waited out to its bound.
pub async fn supervise_until_cancelled<E, S, Fut>(
    first: Duration,
    max: Duration,
    shutdown: &CancellationToken,
    mut session: S,
    on_failure: impl FnMut(&E),
) where
    S: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    supervise(
        first,
        max,
        shutdown,
        || {
            let run = session();
            async move { shutdown.run_until_cancelled(run).await.unwrap_or(Ok(())) }
        },
        on_failure,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn failures_are_retried_until_the_session_finishes() {
        let shutdown = CancellationToken::new();
        let tries = AtomicU32::new(0);
        let mut failures = Vec::new();
        supervise(
            Duration::from_millis(1),
            Duration::from_millis(5),
            &shutdown,
            || async {
                match tries.fetch_add(1, Ordering::Relaxed) {
                    0 | 1 => Err("down"),
                    _ => Ok(()),
                }
            },
            |e| failures.push(*e),
        )
        .await;
        assert_eq!(tries.load(Ordering::Relaxed), 3);
        assert_eq!(failures, ["down", "down"]);
    }

    #[tokio::test]
    async fn cancellation_ends_the_retries() {
        let shutdown = CancellationToken::new();
        let tries = AtomicU32::new(0);
        let stop = shutdown.clone();
        supervise(
            Duration::from_millis(1),
            Duration::from_millis(5),
            &shutdown,
            || {
                if tries.fetch_add(1, Ordering::Relaxed) == 3 {
                    stop.cancel();
                }
                async { Err::<(), _>("down") }
            },
            |_| {},
        )
        .await;
        assert_eq!(tries.load(Ordering::Relaxed), 4, "no try after the cancel");
    }
}
