//! A batch of messages as the column arrays of one `INSERT ... SELECT unnest`,
//! shared by every driver the client writes through, so that each writes the
//! same rows after the same checks.

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::{trace, Error, Message, MessageId, MessageIdOrBatch, SchemaName};

/// The insert for `schema`, with the `event_type` column (migration V8) or
/// without it. A batch that sets no event type uses the plain one, so a
/// client of this version still writes to a schema one migration behind.
/// With `chosen` (some message's id is the caller's), a row whose id is
/// already in the outbox is skipped rather than failing the statement:
/// a failed statement aborts the caller's transaction, and an app that took
/// the duplicate for "already enqueued" and committed lost its own writes
/// to the rollback Postgres answers such a COMMIT with. Fresh UUIDv7 ids
/// cannot meet, and their insert skips the check's cost.
pub(crate) fn insert_sql(schema: &SchemaName, typed: bool, chosen: bool) -> String {
    // One statement for one message or ten thousand: unnest keeps the array
    // order, so seq follows the order of the slice.
    let (column, array) = if typed {
        (", event_type", ", $8::text[]")
    } else {
        ("", "")
    };
    format!(
        "INSERT INTO {}.messages \
           (message_id, destination, ordering_key, routing_key, headers, payload, content_type{column}) \
         SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], \
                              $6::bytea[], $7::text[]{array}){conflict}",
        schema.quoted(),
        conflict = if chosen {
            " ON CONFLICT (message_id) DO NOTHING"
        } else {
            ""
        }
    )
}

/// The statements of [`insert_sql`], by (typed, chosen).
#[derive(Debug, Clone)]
pub(crate) struct Inserts([String; 4]);

impl Inserts {
    pub(crate) fn new(schema: &SchemaName) -> Self {
        Inserts([
            insert_sql(schema, false, false),
            insert_sql(schema, true, false),
            insert_sql(schema, false, true),
            insert_sql(schema, true, true),
        ])
    }

    /// The statement for `rows`.
    pub(crate) fn of(&self, rows: &Rows<'_>) -> &str {
        let i = usize::from(rows.event_types.is_some()) + 2 * usize::from(rows.chosen);
        &self.0[i]
    }
}

/// Why a statement wrote fewer rows than it was given: the others' ids were
/// already in the outbox.
#[derive(Debug)]
pub(crate) struct AlreadyInOutbox {
    pub(crate) skipped: u64,
}

impl std::fmt::Display for AlreadyInOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} message(s) skipped, their ids already in the outbox; the transaction goes on",
            self.skipped
        )
    }
}

impl std::error::Error for AlreadyInOutbox {}

/// An error when the insert wrote `written` of `rows.ids`.
pub(crate) fn check_written(rows: &Rows<'_>, written: u64) -> Result<(), Error> {
    let given = rows.ids.len() as u64;
    if written >= given {
        return Ok(());
    }
    Err(Error::DuplicateMessageId {
        message_id: MessageIdOrBatch::Batch,
        source: Box::new(AlreadyInOutbox {
            skipped: given - written,
        }),
    })
}

/// The id each message is written with: its own, or a fresh UUIDv7.
pub(crate) fn ids(messages: &[Message]) -> Vec<MessageId> {
    messages
        .iter()
        .map(|m| m.message_id.unwrap_or_else(MessageId::new_v7))
        .collect()
}

/// A single enqueue knows which id collided; a batch does not.
pub(crate) fn name_duplicate(e: Error, id: MessageId) -> Error {
    match e {
        Error::DuplicateMessageId { source, .. } => Error::DuplicateMessageId {
            message_id: MessageIdOrBatch::Message(id),
            source,
        },
        other => other,
    }
}

/// The columns of a validated batch, in the order of `insert_sql`'s arrays.
pub(crate) struct Rows<'a> {
    pub ids: Vec<Uuid>,
    pub destinations: Vec<&'a str>,
    pub keys: Vec<Option<&'a str>>,
    pub routing_keys: Vec<&'a str>,
    pub headers: Vec<Value>,
    pub payloads: Vec<&'a [u8]>,
    pub content_types: Vec<Option<&'a str>>,
    /// None when no message of the batch has an event type.
    pub event_types: Option<Vec<Option<&'a str>>>,
    /// Whether some message's id is the caller's (see [`insert_sql`]).
    pub chosen: bool,
}

/// The most one batch's statement may carry. Postgres refuses a protocol
/// message over 1 GiB by closing the connection; the margin covers the
/// statement's own framing.
pub(crate) const MAX_STATEMENT_BYTES: usize = (1 << 30) - (1 << 20);

impl<'a> Rows<'a> {
    /// Checks every message against `max_payload_bytes` before anything is
    /// written, and adds the enqueueing span's trace headers.
    pub(crate) fn new(
        messages: &'a [Message],
        ids: &[MessageId],
        max_payload_bytes: usize,
    ) -> Result<Self, Error> {
        for m in messages {
            if m.payload.len() > max_payload_bytes {
                return Err(Error::PayloadTooLarge {
                    size: m.payload.len(),
                    limit: max_payload_bytes,
                });
            }
        }
        let bytes: usize = messages.iter().map(Message::wire_bytes).sum();
        if bytes > MAX_STATEMENT_BYTES {
            return Err(Error::BatchTooLarge {
                bytes,
                limit: MAX_STATEMENT_BYTES,
            });
        }
        // Only caller-chosen ids can repeat; the insert would fail on the
        // unique key, aborting the caller's transaction, as if one were
        // already in the outbox.
        if messages
            .iter()
            .filter(|m| m.message_id.is_some())
            .nth(1)
            .is_some()
        {
            let mut given = std::collections::HashSet::with_capacity(messages.len());
            for m in messages {
                if let Some(id) = m.message_id {
                    if !given.insert(id) {
                        return Err(Error::DuplicateInBatch { message_id: id });
                    }
                }
            }
        }
        let trace = trace::current();
        let headers = messages
            .iter()
            .map(|m| {
                let mut map: Map<String, Value> = m
                    .headers
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect();
                // The message's own trace headers, if it set any, win.
                if let Some(t) = trace
                    .as_ref()
                    .filter(|_| !map.contains_key(trace::TRACEPARENT))
                {
                    map.insert(trace::TRACEPARENT.into(), t.traceparent.clone().into());
                    if let Some(state) = &t.tracestate {
                        map.insert(trace::TRACESTATE.into(), state.clone().into());
                    }
                }
                Value::Object(map)
            })
            .collect();
        let event_types = messages
            .iter()
            .any(|m| m.event_type.is_some())
            .then(|| messages.iter().map(|m| m.event_type.as_deref()).collect());
        Ok(Rows {
            ids: ids.iter().map(|id| id.0).collect(),
            destinations: messages.iter().map(|m| m.destination.as_str()).collect(),
            keys: messages.iter().map(|m| m.key.as_deref()).collect(),
            routing_keys: messages.iter().map(|m| m.routing_key.as_str()).collect(),
            headers,
            payloads: messages.iter().map(|m| m.payload.as_slice()).collect(),
            content_types: messages.iter().map(|m| m.content_type.as_deref()).collect(),
            event_types,
            chosen: messages.iter().any(|m| m.message_id.is_some()),
        })
    }
}
