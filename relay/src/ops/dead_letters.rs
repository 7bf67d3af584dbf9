//! `dead-letters list|show|retry|discard`, and `pause`/`resume` of a
//! destination.

use std::time::SystemTime;

use outbox_client::SchemaName;
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{age_secs, rfc3339, OpsError};

/// Which dead letters a command acts on (the CLI's `--id`, `--key`,
/// `--destination`, `--since`, `--all`).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this message id.
    pub id: Option<Uuid>,
    /// Only this ordering key.
    pub key: Option<String>,
    /// Only this destination.
    pub destination: Option<String>,
    /// Only those dead-lettered at or after this time.
    pub since: Option<SystemTime>,
    /// Every dead letter (required by retry/discard when no other filter is given).
    pub all: bool,
}

impl Filter {
    /// True when no criterion is set (`all` aside).
    pub fn is_empty(&self) -> bool {
        self.id.is_none()
            && self.key.is_none()
            && self.destination.is_none()
            && self.since.is_none()
    }

    fn sql(&self) -> (String, Vec<Box<dyn ToSql + Sync + Send>>) {
        let mut clauses = vec!["true".to_owned()];
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
        if let Some(id) = self.id {
            params.push(Box::new(id));
            clauses.push(format!("message_id = ${}", params.len()));
        }
        if let Some(k) = &self.key {
            params.push(Box::new(k.clone()));
            clauses.push(format!("ordering_key = ${}", params.len()));
        }
        if let Some(d) = &self.destination {
            params.push(Box::new(d.clone()));
            clauses.push(format!("destination = ${}", params.len()));
        }
        if let Some(t) = self.since {
            params.push(Box::new(t));
            clauses.push(format!("dead_at >= ${}", params.len()));
        }
        (clauses.join(" AND "), params)
    }
}

/// One dead letter, as `dead-letters list|show` report it.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// Its message id.
    pub message_id: Uuid,
    /// Its place in the outbox's order.
    pub seq: i64,
    /// Its destination.
    pub destination: String,
    /// Its ordering key.
    pub key: Option<String>,
    /// Its AMQP routing key.
    pub routing_key: String,
    /// Failed attempts.
    pub attempts: i32,
    /// The broker's last refusal.
    pub last_error: String,
    /// When it was written (RFC 3339).
    pub created_at: String,
    /// Seconds since.
    pub created_age_s: Option<f64>,
    /// When it was dead-lettered (RFC 3339).
    pub dead_at: String,
    /// Seconds since.
    pub dead_age_s: Option<f64>,
    /// Payload size.
    pub payload_bytes: usize,
    /// MIME content type.
    pub content_type: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Its headers, as a JSON object; as their JSON text, in a string, when
    /// the relay cannot read them (a number no f64 holds, nesting past the
    /// parser's depth: why such a row is a dead letter).
    pub headers: serde_json::Value,
    /// The payload, only when asked for (`dead-letters show --payload`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Payload>,
}

/// A payload as text when it is UTF-8, else as hex.
#[derive(Debug, Clone, Serialize)]
pub struct Payload {
    /// `utf-8` or `hex`.
    pub encoding: &'static str,
    /// The payload in that encoding.
    pub data: String,
}

impl Payload {
    /// The payload `bytes`, as text when they are UTF-8.
    pub fn of(bytes: &[u8]) -> Payload {
        match std::str::from_utf8(bytes) {
            Ok(text) => Payload {
                encoding: "utf-8",
                data: text.to_owned(),
            },
            Err(_) => Payload {
                encoding: "hex",
                data: bytes.iter().map(|b| format!("{b:02x}")).collect(),
            },
        }
    }
}

/// Dead letters matching `filter`, oldest seq first, at most `limit`; with
/// each one's payload when `payload` is set.
pub async fn dead_letters(
    client: &Client,
    schema: &SchemaName,
    filter: &Filter,
    limit: i64,
    payload: bool,
) -> Result<Vec<DeadLetter>, OpsError> {
    let (wher, params) = filter.sql();
    let mut refs = as_refs(&params);
    refs.push(&limit);
    let rows = client
        .query(
            &format!(
                "SELECT message_id, seq, destination, ordering_key, routing_key, attempts, last_error, \
                        created_at, dead_at, length(payload), content_type, headers::text, event_type, \
                        CASE WHEN {payload} THEN payload END \
                 FROM {}.dead_letters WHERE {wher} ORDER BY seq LIMIT ${}",
                schema.quoted(),
                refs.len()
            ),
            &refs,
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            message_id: r.get(0),
            seq: r.get(1),
            destination: r.get(2),
            key: r.get(3),
            routing_key: r.get(4),
            attempts: r.get(5),
            last_error: r.get(6),
            created_at: rfc3339(r.get(7)),
            created_age_s: age_secs(r.get(7)),
            dead_at: rfc3339(r.get(8)),
            dead_age_s: age_secs(r.get(8)),
            payload_bytes: usize::try_from(r.get::<_, i32>(9)).unwrap_or(0),
            content_type: r.get(10),
            headers: headers_of(r.get(11)),
            event_type: r.get(12),
            payload: r.get::<_, Option<&[u8]>>(13).map(Payload::of),
        })
        .collect())
}

/// Borrows boxed parameters in the form `execute` takes.
fn as_refs(params: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    params
        .iter()
        .map(|p| p.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

/// Refuses retry/discard without an explicit selection.
pub fn require_selection(filter: &Filter) -> Result<(), OpsError> {
    if filter.is_empty() && !filter.all {
        return Err(OpsError::Selection(
            "select dead letters with --id, --key, --destination or --since, or pass --all".into(),
        ));
    }
    Ok(())
}

/// A dead letter's headers from their JSON text (see [`DeadLetter::headers`]).
fn headers_of(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
}

/// Returns matching dead letters to the outbox with their original seq (so they
/// keep their place in their key's order) and a fresh attempt count. Their keys
/// unpark as the dead letters leave. Returns how many moved.
///
/// Rows that come back below the claim floor (see [`crate::source::floor`])
/// come back due now rather than fresh: the claim's scan of fresh rows
/// starts at the floor, its scan of due rows does not. The same holds for
/// [`resume`] and the rows set aside behind a dead letter.
pub async fn retry(client: &Client, schema: &SchemaName, filter: &Filter) -> Result<u64, OpsError> {
    require_selection(filter)?;
    let (wher, params) = filter.sql();
    let refs = as_refs(&params);
    let s = schema.quoted();
    // One statement: the move is atomic without an explicit transaction.
    let moved = client
        .execute(
            &format!(
                "WITH moved AS (DELETE FROM {s}.dead_letters WHERE {wher} RETURNING *), \
                 {unhold} \
                 INSERT INTO {s}.messages (seq, message_id, destination, ordering_key, routing_key, \
                                           headers, payload, content_type, event_type, created_at, last_error, \
                                           next_attempt_at) \
                 OVERRIDING SYSTEM VALUE \
                 SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                        content_type, event_type, created_at, 'retried from dead letters: ' || last_error, now() \
                 FROM moved ORDER BY seq",
                unhold = unhold_keys_of(&s, "moved"),
            ),
            &refs,
        )
        .await
        .map_err(|e| {
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
                OpsError::Selection(
                    "a selected message is already back in the outbox, or another with its \
                     message id or seq is there (dead letters of an id enqueued twice, or \
                     from before the sequence was set back): retry them one at a time"
                        .into(),
                )
            } else {
                OpsError::Postgres(e)
            }
        })?;
    Ok(moved)
}

/// Pauses `destination` for every replica: its rows wait in the outbox, not
/// claimed and not counted as attempts, until [`resume`]; a key with a
/// message for it waits there too, so order per key holds. Batches already
/// claimed finish; each replica's next claim honours the pause. Returns false
/// when it was already paused (its reason is updated when one is given).
pub async fn pause(
    client: &Client,
    schema: &SchemaName,
    destination: &str,
    reason: Option<&str>,
) -> Result<bool, OpsError> {
    let row = client
        .query_one(
            &format!(
                "INSERT INTO {s}.paused_destinations AS p (destination, reason) VALUES ($1, $2) \
                 ON CONFLICT (destination) DO UPDATE SET reason = coalesce(EXCLUDED.reason, p.reason) \
                 RETURNING (xmax = 0)",
                s = schema.quoted()
            ),
            &[&destination, &reason],
        )
        .await?;
    Ok(row.get(0))
}

/// Resumes a paused destination: its rows, and the rows of keys set aside
/// behind them, are ready at once. Returns how many rows were brought back.
///
/// The rows are locked before they are brought back, waiting for a batch
/// that holds them: a claim that found the destination still paused sets
/// them aside until the next recheck (as behind a dead letter, see
/// `discard`), and a batch claimed before the pause finishes publishing.
/// Fresh rows are locked too: a claim may be setting them aside now.
pub async fn resume(
    client: &Client,
    schema: &SchemaName,
    destination: &str,
) -> Result<u64, OpsError> {
    let s = schema.quoted();
    let row = client
        .query_one(
            &format!(
                "WITH gone AS (DELETE FROM {s}.paused_destinations WHERE destination = $1 RETURNING 1), \
                 held AS ( \
                    SELECT seq, next_attempt_at FROM {s}.messages \
                    WHERE EXISTS (SELECT 1 FROM gone) \
                      AND (destination = $1 OR (attempts = 0 AND ordering_key IN ( \
                            SELECT ordering_key FROM {s}.messages \
                            WHERE destination = $1 AND ordering_key IS NOT NULL))) \
                    FOR UPDATE), \
                 back AS ( \
                    UPDATE {s}.messages AS m SET next_attempt_at = now() FROM held \
                    WHERE m.seq = held.seq AND held.next_attempt_at > now() \
                    RETURNING 1) \
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM back)"
            ),
            &[&destination],
        )
        .await?;
    if row.get::<_, i64>(0) == 0 {
        return Err(OpsError::Selection(format!(
            "destination {destination:?} is not paused"
        )));
    }
    Ok(u64::try_from(row.get::<_, i64>(1)).unwrap_or(0))
}

/// Deletes matching dead letters for good. Returns how many.
pub async fn discard(
    client: &Client,
    schema: &SchemaName,
    filter: &Filter,
) -> Result<u64, OpsError> {
    require_selection(filter)?;
    let (wher, params) = filter.sql();
    let refs = as_refs(&params);
    let s = schema.quoted();
    let row = client
        .query_one(
            &format!(
                "WITH gone AS (DELETE FROM {s}.dead_letters WHERE {wher} RETURNING ordering_key), \
                 {unhold} \
                 SELECT count(*) FROM gone",
                unhold = unhold_keys_of(&s, "gone"),
            ),
            &refs,
        )
        .await?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// CTEs (`behind`, then `unheld`) that bring back the rows a claim set
/// aside behind the dead letters in CTE `source`, so the key flows again at
/// once rather than at the next recheck. That includes rows that had failed
/// themselves before the key was parked: a claim sets them aside a recheck
/// later too, and one still waiting out its own retry delay is only tried
/// a little early. Safe however it races: the claim's head-of-key rule
/// still holds back any row whose older rows remain.
///
/// The rows are locked first, waiting for a claim that holds them: every
/// recheck, a claim locks a parked key's rows that came due, finds the dead
/// letter (its snapshot is older than this statement's commit) and sets
/// them aside again until the next recheck. Judged by this statement's
/// snapshot, such a row is due, not set aside, and was left as it was; the
/// claim then committed its recheck a `--retry-max` away. A lock taken
/// after the wait reads the row as that claim left it. So every row of the
/// keys is locked, fresh ones too: a claim may be setting fresh rows aside
/// at this moment, and a row chosen by this statement's snapshot (where it
/// is fresh) would be neither locked nor waited for.
fn unhold_keys_of(schema: &str, source: &str) -> String {
    format!(
        "behind AS (SELECT seq, next_attempt_at FROM {schema}.messages \
           WHERE ordering_key IN (SELECT ordering_key FROM {source} WHERE ordering_key IS NOT NULL) \
           FOR UPDATE), \
         unheld AS (UPDATE {schema}.messages AS m SET next_attempt_at = now() FROM behind \
           WHERE m.seq = behind.seq AND behind.next_attempt_at > now() RETURNING 1)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_show_as_text_when_utf8_else_as_hex() {
        let p = Payload::of("é {}".as_bytes());
        assert_eq!((p.encoding, p.data.as_str()), ("utf-8", "é {}"));
        let p = Payload::of(&[0xff, 0x00, 0x10]);
        assert_eq!((p.encoding, p.data.as_str()), ("hex", "ff0010"));
    }
}
