//! Durable before published: the relay publishes a row only once the
//! transaction that wrote it is as durable as a default commit on the
//! server: flushed to the WAL on disk, and on every synchronous standby the
//! server names.
//!
//! Why it is needed: a commit becomes visible before it is durable when
//! its writer asks for less. With `synchronous_commit = off` it is visible
//! before its WAL is flushed, and with `local` before a synchronous standby
//! has it. A claim sees such a row at once. Publishing it then would let a
//! crash of the server, or a failover to the standby, take back the change
//! while consumers act on its event: the event would exist without the
//! change. (A default commit, `on`, is visible only once it is both, so
//! for its rows the wait below finds nothing to wait for but its own
//! round trip.)
//!
//! How: after a claim, a separate session commits a transaction that
//! writes WAL (a logical-decoding message) with `synchronous_commit` at
//! least `on`. Its commit record comes after the commit of every row the
//! claim could see, and Postgres flushes, and replicates, the WAL in order:
//! once that commit returns, every such row's commit is durable too. One
//! such commit covers every claim that ended before it was sent, so the
//! workers share them, as Postgres shares a flush between the commits that
//! arrive together.
//!
//! A claim that shows by itself that the WAL was flushed past every
//! commit it saw, on a server that names no synchronous standby, needs no
//! barrier (`claim::Claimed::flushed`): under writers that commit with the
//! default, the flush is there, a round trip after the claim, for most
//! claims.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::supervise::supervise_until_cancelled;

/// The barrier the workers share: which claims wait for one, and which
/// claims are covered.
#[derive(Debug)]
pub struct Durable {
    /// Off: every claim counts as covered at once (the loop's tests over
    /// memory, where nothing is ever less than durable).
    on: bool,
    /// The latest claim waiting to be covered: when its statement returned.
    wanted: watch::Sender<Option<Instant>>,
    /// What the barrier session has covered so far.
    coverage: watch::Sender<Coverage>,
}

/// The claims a barrier session covers: those that returned while it was
/// connected, before its latest barrier was sent. A barrier proves nothing
/// about a claim made before its session connected: the claim may have
/// read a server that crashed or failed over since, and a barrier
/// committed on its successor says nothing about what the old one lost.
/// A session connected before the claim would have died with that server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Coverage {
    /// When the barrier session was connected; `None` before the first.
    since: Option<Instant>,
    /// When its latest committed barrier was sent; `None` before one.
    through: Option<Instant>,
}

impl Coverage {
    fn covers(&self, claimed: Instant) -> bool {
        self.since.is_some_and(|s| s <= claimed) && self.through.is_some_and(|t| t >= claimed)
    }

    /// The session connected after the claim: no barrier on it can cover it.
    fn too_late_for(&self, claimed: Instant) -> bool {
        self.since.is_some_and(|s| s > claimed)
    }
}

impl Durable {
    /// A barrier that [`run`] serves.
    pub fn new() -> Self {
        Durable {
            on: true,
            wanted: watch::Sender::new(None),
            coverage: watch::Sender::new(Coverage::default()),
        }
    }

    /// A barrier that never waits.
    #[cfg(test)]
    pub(crate) fn off() -> Self {
        Durable {
            on: false,
            ..Self::new()
        }
    }

    /// Asks for a barrier covering a claim whose statement returned at
    /// `claimed`. Cheap and idempotent; [`Durable::wait`] asks too, and
    /// asking early lets the barrier run while the batch gets ready.
    pub fn ask(&self, claimed: Instant) {
        if self.on {
            self.wanted.send_if_modified(|wanted| {
                let later = wanted.is_none_or(|w| w < claimed);
                if later {
                    *wanted = Some(claimed);
                }
                later
            });
        }
    }

    /// Waits until every transaction whose commit a claim that returned at
    /// `claimed` could see is durable (true), or until that can no longer
    /// be shown because the barrier session reconnected after the claim
    /// (false: the claim's rows must be claimed again). Without a barrier
    /// session, and while a synchronous standby is missing, it waits on:
    /// the caller bounds the wait.
    pub async fn wait(&self, claimed: Instant) -> bool {
        if !self.on {
            return true;
        }
        let mut coverage = self.coverage.subscribe();
        self.ask(claimed);
        // The sender lives as long as `self`.
        coverage
            .wait_for(|c| c.covers(claimed) || c.too_late_for(claimed))
            .await
            .is_ok_and(|c| c.covers(claimed))
    }
}

impl Default for Durable {
    fn default() -> Self {
        Self::new()
    }
}

/// What a barrier commits. Postgres lets a transaction that wrote no WAL
/// before its commit record commit without waiting for the flush or the
/// standbys, even with a transaction id; a transactional logical-decoding
/// message is a WAL record that needs no table and no privilege beyond the
/// default. Logical decoding shows it only to a plugin that asks for
/// messages, under this prefix.
const BARRIER: &str = "SELECT pg_logical_emit_message(true, 'outbox-relay.barrier', '')";

/// Serves `durable`'s barriers on a session of its own until `shutdown`,
/// reconnecting with backoff up to `reconnect_max`. Claims wait meanwhile.
pub async fn run(
    pg: super::Database,
    durable: Arc<Durable>,
    hold_limit: Duration,
    reconnect_max: Duration,
    shutdown: CancellationToken,
) {
    let session = || async {
        let client = super::connect(&pg, hold_limit).await?;
        let setup = async {
            // Named apart from the workers' sessions, so that operators can
            // tell it in pg_stat_activity (waiting in `SyncRep` when a
            // synchronous standby is missing).
            client
                .batch_execute("SET application_name = 'outbox-relay-durable'")
                .await?;
            // The role or server may commit with less than `on`; the
            // barrier must not, or it would return before what it covers is
            // durable.
            let level: String = client
                .query_one("SHOW synchronous_commit", &[])
                .await?
                .get(0);
            if level == "off" || level == "local" {
                client.batch_execute("SET synchronous_commit = on").await?;
            }
            Ok(())
        };
        client.answered(hold_limit / 2, setup).await?;
        durable.coverage.send_replace(Coverage {
            since: Some(Instant::now()),
            through: None,
        });
        let mut wanted = durable.wanted.subscribe();
        loop {
            let need = *wanted.borrow_and_update();
            let through = durable.coverage.borrow().through;
            if need.is_some() && need > through {
                let sent = Instant::now();
                // Waits for as long as the server works on it: a missing
                // synchronous standby holds it on a live server, and the
                // batches waiting for it go back at half the hold limit.
                let barrier = client.answered(hold_limit, client.batch_execute(BARRIER));
                let done = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    done = barrier => done,
                };
                done?;
                durable.coverage.send_modify(|c| c.through = Some(sent));
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                changed = wanted.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                }
            }
        }
    };
    supervise_until_cancelled(
        Duration::from_millis(100),
        reconnect_max,
        &shutdown,
        session,
        // Quiet on errors: the workers report Postgres, and say when a batch
        // waited too long for its rows to become durable.
        |e: &super::PgFault| match e {
            super::PgFault::Postgres(_) => {
                tracing::debug!(error = %e, "durability barrier session ended; reconnecting")
            }
            _ => tracing::warn!(error = %e, "durability barrier session given up; reconnecting"),
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_barrier_covers_only_claims_between_its_connect_and_its_send() {
        let durable = Durable::new();
        let connected = Instant::now();
        durable.coverage.send_replace(Coverage {
            since: Some(connected),
            through: Some(connected),
        });
        assert!(
            durable.wait(connected).await,
            "a claim at the barrier's send"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        let later = Instant::now();
        let waiting = durable.wait(later);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(10), &mut waiting)
                .await
                .is_err(),
            "a claim after the last barrier counted as covered"
        );
        assert_eq!(
            *durable.wanted.borrow(),
            Some(later),
            "the claim asked for a barrier"
        );
        durable.coverage.send_modify(|c| c.through = Some(later));
        assert!(waiting.await, "the next barrier covers it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_made_before_the_barrier_session_reconnected_is_never_covered() {
        let durable = Durable::new();
        let claimed = Instant::now();
        tokio::time::advance(Duration::from_millis(1)).await;
        let waiting = durable.wait(claimed);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(10), &mut waiting)
                .await
                .is_err(),
            "covered without a barrier session"
        );
        // A session that connects after the claim, and its barriers.
        let connected = Instant::now();
        durable.coverage.send_replace(Coverage {
            since: Some(connected),
            through: Some(connected),
        });
        assert!(
            !waiting.await,
            "a barrier on a later session covered an earlier claim"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn asking_keeps_the_latest_claim() {
        let durable = Durable::new();
        let early = Instant::now();
        tokio::time::advance(Duration::from_millis(5)).await;
        let late = Instant::now();
        durable.ask(late);
        durable.ask(early);
        assert_eq!(*durable.wanted.borrow(), Some(late));
        let off = Durable::off();
        off.ask(late);
        assert_eq!(
            *off.wanted.borrow(),
            None,
            "an off barrier asks for nothing"
        );
        assert!(off.wait(late).await);
    }
}
