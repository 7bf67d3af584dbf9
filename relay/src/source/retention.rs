//! Retention mode: published rows are kept with their receipts for a while,
//! then deleted here.
//!
//! Each pass deletes in statements of at most `batch` rows, each its own short
//! transaction, oldest first, skipping rows another replica's cleanup holds. A
//! large backlog of expired rows therefore never holds many locks or one long
//! transaction, and the relay's claims and settles are never queued behind it.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::claim::Queries;
use crate::supervise::{sleep_or_cancel, supervise_until_cancelled};

/// How often expired rows are looked for: a tenth of the retention, between
/// one second and one minute.
pub fn interval(retention: Duration) -> Duration {
    (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Deletes published rows past `retention` until `shutdown`.
pub async fn run(
    pg: super::Database,
    queries: Queries,
    retention: Duration,
    batch: i64,
    reconnect_max: Duration,
    shutdown: CancellationToken,
) {
    // A session: connect, then purge every interval until an error or
    // shutdown. Cannot-connect is quiet (the workers report Postgres); a
    // failed purge is worth a line.
    let session = || async {
        let client = super::connect(&pg, Duration::from_secs(60))
            .await
            .map_err(|e| (false, e))?;
        loop {
            // A purge's commit may wait for a missing synchronous standby
            // for as long as it stays away; shutdown does not wait with it.
            let purged = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                purged = purge_expired(&client, &queries, retention, batch, &shutdown) => purged,
            };
            match purged {
                Ok(0) => {}
                Ok(n) => tracing::debug!(deleted = n, "published rows past retention deleted"),
                Err(e) => return Err((true, e)),
            }
            if sleep_or_cancel(interval(retention), &shutdown).await {
                return Ok(());
            }
        }
    };
    supervise_until_cancelled(
        Duration::from_millis(200),
        reconnect_max,
        &shutdown,
        session,
        |(connected, e): &(bool, super::PgFault)| {
            if *connected {
                tracing::warn!(error = %e, "retention cleanup failed; reconnecting");
            } else {
                tracing::debug!(error = %e, "retention cleanup cannot reach postgres");
            }
        },
    )
    .await;
}

/// One pass: batches until fewer than `batch` rows were due.
async fn purge_expired(
    client: &super::Session,
    queries: &Queries,
    retention: Duration,
    batch: i64,
    shutdown: &CancellationToken,
) -> Result<u64, super::PgFault> {
    let mut total = 0;
    loop {
        // The session's statement_timeout is 30 s: past a minute, nothing
        // is answering (see `super::answered`).
        let n = client
            .answered(
                Duration::from_secs(60),
                queries.purge_published(client, retention, batch),
            )
            .await?;
        total += n;
        metrics::counter!(crate::metrics::RETENTION_DELETED).increment(n);
        if n < u64::try_from(batch).unwrap_or(u64::MAX) || shutdown.is_cancelled() {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cleanup_interval_follows_retention_within_bounds() {
        assert_eq!(interval(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(interval(Duration::from_secs(100)), Duration::from_secs(10));
        assert_eq!(
            interval(Duration::from_secs(86_400)),
            Duration::from_secs(60)
        );
    }
}
