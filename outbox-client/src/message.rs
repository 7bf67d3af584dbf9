use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use uuid::Uuid;

use crate::{Error, MAX_ORDERING_KEY_BYTES};

/// The stable id of one outbox message, stamped on every publish attempt.
///
/// Consumers record it in the same transaction as their effect to drop
/// redeliveries. Unless the caller picks one, it is a UUIDv7 made at enqueue
/// time, so ids sort roughly by creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(pub Uuid);

impl MessageId {
    /// A fresh time-ordered (v7) id.
    pub fn new_v7() -> Self {
        MessageId(Uuid::now_v7())
    }

    /// The id as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<Uuid> for MessageId {
    fn from(u: Uuid) -> Self {
        MessageId(u)
    }
}

/// Header names the relay sets itself on Kafka records; a row may not carry them.
pub const RESERVED_HEADERS: [&str; 2] = ["message-id", "content-type"];

/// One message to write to the outbox. Build it with [`Message::builder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) message_id: Option<MessageId>,
    pub(crate) destination: String,
    pub(crate) key: Option<String>,
    pub(crate) routing_key: String,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) content_type: Option<String>,
    pub(crate) event_type: Option<String>,
}

impl Message {
    /// About how many bytes the message takes in a batch's statement: its
    /// columns, each array element's 4-byte length, the headers' JSON
    /// quoting, and room for the trace headers the batch adds.
    pub(crate) fn wire_bytes(&self) -> usize {
        const PER_ROW: usize = 16 + 8 * 4 + 256;
        let headers: usize = self
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 6)
            .sum();
        PER_ROW
            + self.destination.len()
            + self.key.as_ref().map_or(0, String::len)
            + self.routing_key.len()
            + headers
            + self.payload.len()
            + self.content_type.as_ref().map_or(0, String::len)
            + self.event_type.as_ref().map_or(0, String::len)
    }

    /// Starts a message for `destination`: the AMQP exchange or the Kafka topic.
    pub fn builder(destination: impl Into<String>) -> MessageBuilder {
        MessageBuilder {
            message: Message {
                message_id: None,
                destination: destination.into(),
                key: None,
                routing_key: String::new(),
                headers: BTreeMap::new(),
                payload: Vec::new(),
                content_type: None,
                event_type: None,
            },
            error: None,
        }
    }

    /// The caller-chosen id, if any.
    pub fn message_id(&self) -> Option<MessageId> {
        self.message_id
    }

    /// The AMQP exchange or Kafka topic.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The ordering key.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The MIME content type (`application/octet-stream` unless set, or
    /// `application/json` for a [`MessageBuilder::json`] payload).
    pub fn content_type(&self) -> Option<&str> {
        self.content_type.as_deref()
    }

    /// The event type, if the message carries one.
    pub fn event_type(&self) -> Option<&str> {
        self.event_type.as_deref()
    }
}

/// Builds a [`Message`]; problems are reported once, by [`MessageBuilder::build`].
#[derive(Debug)]
#[must_use = "a builder does nothing until build() is called"]
pub struct MessageBuilder {
    message: Message,
    error: Option<Error>,
}

impl MessageBuilder {
    /// The ordering key: messages with the same key are delivered in commit order
    /// (given that the writers of one key serialize, e.g. by locking the aggregate
    /// row before enqueueing). On Kafka it is also the record key. At most
    /// [`MAX_ORDERING_KEY_BYTES`] bytes.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.message.key = Some(key.into());
        self
    }

    /// The AMQP routing key (ignored by Kafka). Defaults to empty.
    pub fn routing_key(mut self, routing_key: impl Into<String>) -> Self {
        self.message.routing_key = routing_key.into();
        self
    }

    /// Adds a header, forwarded as an AMQP header or a Kafka record header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        if self.error.is_none() {
            if let Err(reason) = check_header_name(&name) {
                self.error = Some(Error::InvalidHeaderName { name, reason });
                return self;
            }
        }
        self.message.headers.insert(name, value.into());
        self
    }

    /// Raw payload bytes; content type defaults to `application/octet-stream`.
    pub fn payload(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.message.payload = bytes.into();
        self
    }

    /// Any `Serialize` value as a JSON payload; content type defaults to
    /// `application/json`.
    pub fn json<T: Serialize + ?Sized>(mut self, value: &T) -> Self {
        match serde_json::to_vec(value) {
            Ok(bytes) => {
                self.message.payload = bytes;
                if self.message.content_type.is_none() {
                    self.message.content_type = Some("application/json".to_owned());
                }
            }
            Err(e) => {
                self.error.get_or_insert(Error::Serialize(e));
            }
        }
        self
    }

    /// The MIME content type, overriding the default.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.message.content_type = Some(content_type.into());
        self
    }

    /// What kind of event this is, e.g. `com.example.order.paid`: stored in
    /// the row's `event_type` column, and the CloudEvents `type` when the
    /// relay publishes CloudEvents (`--cloudevents`). Must not be empty.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.message.event_type = Some(event_type.into());
        self
    }

    /// Uses a caller-chosen message id instead of a fresh UUIDv7, e.g. to make the
    /// enqueue itself idempotent: an id already in the outbox is skipped and
    /// reported as [`Error::DuplicateMessageId`], and the transaction goes on.
    pub fn message_id(mut self, id: impl Into<MessageId>) -> Self {
        self.message.message_id = Some(id.into());
        self
    }

    /// Validates and returns the message.
    pub fn build(self) -> Result<Message, Error> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.message.destination.is_empty() {
            return Err(Error::EmptyDestination);
        }
        if self.message.event_type.as_deref() == Some("") {
            return Err(Error::EmptyKey { what: "event type" });
        }
        // An empty key is a key: every message written with it, for every
        // destination, would share one lane (leave the key unset for none).
        if self.message.key.as_deref() == Some("") {
            return Err(Error::EmptyKey {
                what: "ordering key",
            });
        }
        let m = &self.message;
        let text = [
            ("destination", Some(&m.destination)),
            ("ordering key", m.key.as_ref()),
            ("routing key", Some(&m.routing_key)),
            ("content type", m.content_type.as_ref()),
            ("event type", m.event_type.as_ref()),
        ];
        let values = m.headers.values().map(|v| ("header value", Some(v)));
        for (what, value) in text.into_iter().chain(values) {
            if value.is_some_and(|v| v.contains('\0')) {
                return Err(Error::ContainsNul { what });
            }
        }
        if let Some(key) = &m.key {
            if key.len() > MAX_ORDERING_KEY_BYTES {
                return Err(Error::OrderingKeyTooLong {
                    size: key.len(),
                    limit: MAX_ORDERING_KEY_BYTES,
                });
            }
        }
        let mut message = self.message;
        if message.content_type.is_none() {
            message.content_type = Some("application/octet-stream".to_owned());
        }
        Ok(message)
    }
}

/// A header name must survive as an AMQP short string and a Kafka header key, and
/// must not shadow the headers the relay sets itself.
fn check_header_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > 255 {
        return Err("longer than 255 bytes");
    }
    if !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("only visible ASCII characters are allowed, no spaces");
    }
    if RESERVED_HEADERS
        .iter()
        .any(|r| r.eq_ignore_ascii_case(name))
    {
        return Err("reserved: the relay sets it from the message itself");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_destination_is_rejected() {
        assert!(matches!(
            Message::builder("").payload("x").build(),
            Err(Error::EmptyDestination)
        ));
    }

    #[test]
    fn bad_header_names_are_named() {
        for bad in [
            "",
            "has space",
            "tab\t",
            "message-id",
            "Content-Type",
            &"h".repeat(256),
        ] {
            match Message::builder("d").header(bad, "v").build() {
                Err(Error::InvalidHeaderName { name, .. }) => assert_eq!(name, bad),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn a_nul_character_is_named_by_its_field() {
        let cases = [
            ("destination", Message::builder("\0")),
            ("ordering key", Message::builder("d").key("\0")),
            ("routing key", Message::builder("d").routing_key("a\0")),
            ("header value", Message::builder("d").header("h", "\0v")),
            ("content type", Message::builder("d").content_type("\0")),
            ("event type", Message::builder("d").event_type("e\0")),
        ];
        for (field, builder) in cases {
            match builder.build() {
                Err(Error::ContainsNul { what }) => assert_eq!(what, field),
                other => panic!("{field}: expected ContainsNul, got {other:?}"),
            }
        }
        // Anywhere else a NUL is plain data.
        let m = Message::builder("d").payload("\0").build().expect("valid");
        assert_eq!(m.payload(), b"\0");
    }

    #[test]
    fn a_key_over_the_limit_is_rejected_and_one_at_it_kept() {
        let at = "k".repeat(MAX_ORDERING_KEY_BYTES);
        let m = Message::builder("d")
            .key(at.as_str())
            .build()
            .expect("valid");
        assert_eq!(m.key(), Some(at.as_str()));
        // The limit counts bytes: 1,025 two-byte characters are 2,050 bytes.
        match Message::builder("d").key("é".repeat(1_025)).build() {
            Err(Error::OrderingKeyTooLong { size: 2_050, limit }) => {
                assert_eq!(limit, MAX_ORDERING_KEY_BYTES)
            }
            other => panic!("expected OrderingKeyTooLong, got {other:?}"),
        }
    }

    #[test]
    fn an_empty_event_type_is_rejected_and_a_set_one_kept() {
        assert!(matches!(
            Message::builder("d").event_type("").build(),
            Err(Error::EmptyKey { what: "event type" })
        ));
        let m = Message::builder("d")
            .event_type("order.paid")
            .build()
            .expect("valid");
        assert_eq!(m.event_type(), Some("order.paid"));
    }

    #[test]
    fn json_sets_content_type_and_bytes() {
        let m = Message::builder("d")
            .json(&serde_json::json!({"a": 1}))
            .build()
            .expect("valid");
        assert_eq!(m.payload(), br#"{"a":1}"#);
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
    }

    #[test]
    fn explicit_content_type_wins_over_json_default() {
        let m = Message::builder("d")
            .content_type("application/vnd.x+json")
            .json(&1)
            .build()
            .expect("valid");
        assert_eq!(m.content_type.as_deref(), Some("application/vnd.x+json"));
    }

    #[test]
    fn unserializable_json_is_a_typed_error() {
        use std::collections::HashMap;
        // Map keys must be strings in JSON.
        let mut bad = HashMap::new();
        bad.insert(vec![1u8], 1);
        assert!(matches!(
            Message::builder("d").json(&bad).build(),
            Err(Error::Serialize(_))
        ));
    }
}
