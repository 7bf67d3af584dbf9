//! `outbox-relay locate <id>`: where one message is.

use std::time::SystemTime;

use outbox_client::SchemaName;
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, GenericClient};
use uuid::Uuid;

use super::{age_secs, at, rfc3339, OpsError};

/// A message and where it is.
#[derive(Debug, Clone, Serialize)]
pub struct Located {
    /// The message id asked about.
    pub message_id: Uuid,
    /// Where it is, as `state` plus its details.
    #[serde(flatten)]
    pub location: Location,
}

/// Where a message is.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Location {
    /// In the outbox, due.
    Pending(Waiting),
    /// In the outbox, waiting out a retry delay after a failed attempt.
    Retrying(Waiting),
    /// In the outbox, set aside behind an older message of its key.
    Held(Waiting),
    /// In the outbox, behind a dead letter of its key.
    Parked(Waiting),
    /// In the outbox, its destination paused.
    Paused(Waiting),
    /// Claimed by a relay that is publishing it.
    InFlight {
        /// Why that means in flight.
        why: &'static str,
    },
    /// In the dead letters.
    DeadLettered {
        /// Its destination.
        destination: String,
        /// Its ordering key.
        key: Option<String>,
        /// Failed attempts.
        attempts: i32,
        /// The broker's last refusal.
        last_error: String,
        /// When it was dead-lettered.
        dead_at: Option<String>,
        /// Seconds since.
        dead_age_s: Option<f64>,
    },
    /// Published and kept for `--retention`.
    Published {
        /// Its destination.
        destination: String,
        /// Its ordering key.
        key: Option<String>,
        /// Failed attempts before it went.
        attempts: i32,
        /// When the broker confirmed it.
        published_at: String,
        /// Seconds since.
        published_age_s: Option<f64>,
        /// The broker's receipt (Kafka partition and offset, or the AMQP confirm).
        receipt: serde_json::Value,
    },
    /// Nowhere the relay keeps messages.
    Unknown {
        /// What that can mean.
        why: &'static str,
    },
}

/// A message still in the outbox.
#[derive(Debug, Clone, Serialize)]
pub struct Waiting {
    /// Its place in the outbox's order.
    pub seq: i64,
    /// Its destination.
    pub destination: String,
    /// Its ordering key.
    pub key: Option<String>,
    /// Failed attempts.
    pub attempts: i32,
    /// The broker's last refusal.
    pub last_error: Option<String>,
    /// When it was written.
    pub created_at: Option<String>,
    /// Seconds since.
    pub age_s: Option<f64>,
    /// Its last attempt.
    pub last_attempt_at: Option<String>,
    /// Seconds since.
    pub last_attempt_age_s: Option<f64>,
    /// When it is next due.
    pub next_attempt_at: String,
    /// Seconds until then, if in the future.
    pub next_attempt_in_s: Option<f64>,
    /// Its partition.
    pub partition: i16,
    /// The dead letter of its key it waits behind (parked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind_dead_letter: Option<String>,
    /// What holds it back, with the command that releases it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

impl Location {
    /// True for [`Location::Unknown`].
    pub fn is_unknown(&self) -> bool {
        matches!(self, Location::Unknown { .. })
    }
}

/// Where message `id` is: waiting (and what holds it back), in flight,
/// dead-lettered (why), published (with `--retention`), or not known (rows
/// are deleted on confirm). With `park` (the relay's `--dead-letter-order
/// park`), a message behind its key's dead letter is parked.
pub async fn locate(
    client: &mut Client,
    schema: &SchemaName,
    id: Uuid,
    park: bool,
) -> Result<Located, OpsError> {
    let located = |location| Located {
        message_id: id,
        location,
    };
    let s = schema.quoted();
    let columns = "seq, destination, ordering_key, attempts, last_error, created_at, \
                   last_attempt_at, next_attempt_at, partition";
    let tx = client.transaction().await?;
    // Probe the row lock without waiting: a relay holding it is publishing
    // it, or its claim is setting it aside again for a moment.
    let probe = tx
        .query_opt(
            &format!("SELECT {columns} FROM {s}.messages WHERE message_id = $1 FOR UPDATE NOWAIT"),
            &[&id],
        )
        .await;
    match probe {
        Ok(Some(r)) => return Ok(located(waiting(&tx, &s, &r, park).await?)),
        Ok(None) => drop(tx),
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            drop(tx);
            // A row behind its key's dead letter, or of a paused
            // destination, is never published: each claim that reaches
            // it (every recheck, while that lasts) locks it only to set
            // it aside again. Read unlocked, it says why it waits.
            let row = client
                .query_opt(
                    &format!("SELECT {columns} FROM {s}.messages WHERE message_id = $1"),
                    &[&id],
                )
                .await?;
            if let Some(r) = row {
                let location = waiting(&*client, &s, &r, park).await?;
                if matches!(location, Location::Parked(_) | Location::Paused(_)) {
                    return Ok(located(location));
                }
                return Ok(located(Location::InFlight {
                    why: "a relay holds it while the broker confirms it",
                }));
            }
            // Published and deleted since the probe: looked up below.
        }
        Err(e) => return Err(e.into()),
    }
    // An id may have left the outbox more than once: an app may enqueue it
    // again once its first message has gone, and either may have been
    // dead-lettered (V20 lets the dead letters share an id). The newest
    // departure answers.
    let dead = client
        .query_opt(
            &format!(
                "SELECT destination, ordering_key, attempts, last_error, dead_at FROM {s}.dead_letters \
                 WHERE message_id = $1 ORDER BY dead_at DESC, id DESC LIMIT 1"
            ),
            &[&id],
        )
        .await?;
    // Retention mode keeps published rows; the newest wins if an id was reused.
    let published = client
        .query_opt(
            &format!(
                "SELECT destination, ordering_key, attempts, published_at, receipt FROM {s}.published \
                 WHERE message_id = $1 ORDER BY published_at DESC LIMIT 1"
            ),
            &[&id],
        )
        .await?;
    let dead_at = |r: &tokio_postgres::Row| r.get::<_, Option<SystemTime>>(4);
    let published_at = |r: &tokio_postgres::Row| r.get::<_, SystemTime>(3);
    let dead = match (dead, &published) {
        (Some(d), Some(p)) if dead_at(&d).is_some_and(|at| at < published_at(p)) => None,
        (dead, _) => dead,
    };
    if let Some(r) = dead {
        return Ok(located(Location::DeadLettered {
            destination: r.get(0),
            key: r.get(1),
            attempts: r.get(2),
            last_error: r.get(3),
            dead_at: at(r.get(4)),
            dead_age_s: age_secs(r.get(4)),
        }));
    }
    if let Some(r) = published {
        let published_at = published_at(&r);
        return Ok(located(Location::Published {
            destination: r.get(0),
            key: r.get(1),
            attempts: r.get(2),
            published_at: humantime::format_rfc3339_millis(published_at).to_string(),
            published_age_s: age_secs(Some(published_at)),
            receipt: r.get(4),
        }));
    }
    Ok(located(Location::Unknown {
        why: "not in the outbox, the dead letters or the retained published rows: published and deleted (without --retention, rows go once the broker confirms), or never committed",
    }))
}

/// Where a message still in the outbox waits, from its row (`columns` of
/// [`locate`]): behind a paused destination or its key's dead letter, out
/// a retry delay, set aside, or due.
async fn waiting(
    client: &impl GenericClient,
    s: &str,
    r: &tokio_postgres::Row,
    park: bool,
) -> Result<Location, OpsError> {
    let next: SystemTime = r.get(7);
    let mut w = Waiting {
        seq: r.get(0),
        destination: r.get(1),
        key: r.get(2),
        attempts: r.get(3),
        last_error: r.get(4),
        created_at: at(r.get(5)),
        age_s: age_secs(r.get(5)),
        last_attempt_at: at(r.get(6)),
        last_attempt_age_s: age_secs(r.get(6)),
        next_attempt_at: rfc3339(next),
        next_attempt_in_s: next
            .duration_since(SystemTime::now())
            .ok()
            .map(|d| d.as_secs_f64()),
        partition: r.get(8),
        behind_dead_letter: None,
        why: None,
    };
    // What holds a waiting message back, when something does: its
    // destination is paused, or an older message of its key is a dead
    // letter (the key is parked until that one is retried or discarded).
    let paused = client
        .query_opt(
            &format!("SELECT reason FROM {s}.paused_destinations WHERE destination = $1"),
            &[&w.destination],
        )
        .await?;
    let blocker = match &w.key {
        Some(k) if park => client
            .query_opt(
                &format!(
                    "SELECT message_id::text FROM {s}.dead_letters \
                     WHERE ordering_key = $1 AND seq < $2 ORDER BY seq LIMIT 1"
                ),
                &[k, &w.seq],
            )
            .await?
            .map(|r| r.get::<_, String>(0)),
        _ => None,
    };
    Ok(if let Some(p) = paused {
        w.why = Some(format!(
            "its destination is paused{} (outbox-relay resume {:?})",
            p.get::<_, Option<String>>(0)
                .map(|r| format!(": {r}"))
                .unwrap_or_default(),
            w.destination
        ));
        Location::Paused(w)
    } else if let Some(dead) = blocker {
        w.why = Some(format!(
            "parked behind dead letter {dead} of its key (outbox-relay dead-letters retry|discard --id {dead})"
        ));
        w.behind_dead_letter = Some(dead);
        Location::Parked(w)
    } else if w.attempts > 0 {
        Location::Retrying(w)
    } else if next > SystemTime::now() {
        Location::Held(w)
    } else {
        Location::Pending(w)
    })
}
