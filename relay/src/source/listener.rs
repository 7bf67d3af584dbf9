//! LISTEN for the insert trigger's NOTIFY and turn it into wake-ups.
//!
//! The trigger is off unless an operator turns it on (`outbox-relay notify
//! on`): at commit, Postgres serializes every transaction that sent a
//! notification, so it costs the writers. Notifications only shorten the
//! wait: polling still finds every row, so a notification lost while this
//! connection was down costs at most one poll interval. After every
//! (re)connect a wake-up is sent anyway, as a catch-up poll. A wake-up
//! rouses one worker, whichever is waiting, not all of them.

use std::future::poll_fn;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;

use super::Database;
use tokio_util::sync::CancellationToken;

use crate::supervise::supervise;

/// Keeps a LISTEN connection open until `shutdown`, reconnecting with capped
/// backoff. Each notification wakes one waiting worker; if none waits, the
/// next one to wait finds the wake-up (however many arrived, one is kept).
pub async fn run(
    config: Database,
    channel: String,
    wake: Arc<Notify>,
    reconnect_max: Duration,
    shutdown: CancellationToken,
) {
    supervise(
        Duration::from_millis(100),
        reconnect_max,
        &shutdown,
        // Connecting and LISTEN may wait out ANSWER on a stranded
        // connection; shutdown does not wait with them.
        || async {
            tokio::select! {
                _ = shutdown.cancelled() => Ok(()),
                listened = listen_once(&config, &channel, &wake, &shutdown) => listened,
            }
        },
        |e| tracing::warn!(error = %e, "listen connection lost; polling continues meanwhile"),
    )
    .await;
}

async fn listen_once(
    config: &Database,
    channel: &str,
    wake: &Arc<Notify>,
    shutdown: &CancellationToken,
) -> Result<(), ListenError> {
    let (client, mut connection) = super::answered(ANSWER, config.connect()).await?;
    // The Connection future must be polled through poll_message: awaiting it as a
    // whole (the usual spawn) would drop every notification on the floor.
    // Aborted with the handle, on every way out.
    let notifier = Arc::clone(wake);
    let mut driver = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        loop {
            match poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(_))) => notifier.notify_one(),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    }));
    let setup = format!("SET application_name = 'outbox-relay-listen'; LISTEN \"{channel}\"");
    super::answered(ANSWER, client.batch_execute(&setup)).await?;
    tracing::debug!(channel, "listening");
    // Catch up on whatever was committed while we were not listening: every
    // waiting worker, since notifications for any partition may have been
    // missed (and one permit for a worker not waiting yet).
    wake.notify_waiters();
    wake.notify_one();

    // A quiet connection can die without an error (server restarted, NAT dropped
    // it); a cheap query now and then surfaces that.
    let mut probe = tokio::time::interval(Duration::from_secs(10));
    probe.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            ended = &mut driver => {
                return Err(match ended {
                    Ok(Err(e)) => ListenError::Postgres(e.into()),
                    Ok(Ok(())) => ListenError::Closed,
                    Err(_) => ListenError::Closed,
                });
            }
            _ = probe.tick() => {
                // A probe on a stranded connection waits out ANSWER;
                // shutdown does not wait with it.
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    answer = super::answered(ANSWER, client.simple_query("SELECT 1")) => {
                        answer?;
                    }
                }
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ListenError {
    #[error("{0}")]
    Postgres(#[from] super::PgFault),
    #[error("connection closed by the server")]
    Closed,
}

/// How long connecting, LISTEN, and each probe may go unanswered; a quiet
/// listener is probed every 10 s (see `super::answered`).
const ANSWER: Duration = Duration::from_secs(30);
