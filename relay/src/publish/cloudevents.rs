//! CloudEvents 1.0 in binary content mode (`--cloudevents`).
//!
//! The payload stays the message body, untouched; the event's attributes
//! travel beside it as headers, as the protocol bindings say:
//!
//! | attribute | from | Kafka header | RabbitMQ header |
//! |---|---|---|---|
//! | `id` | the message id | `ce_id` | `ce-id` |
//! | `source` | `--cloudevents-source` | `ce_source` | `ce-source` |
//! | `specversion` | `1.0` | `ce_specversion` | `ce-specversion` |
//! | `type` | the row's `event_type`, else its destination | `ce_type` | `ce-type` |
//! | `time` | the row's `created_at`, RFC 3339 in UTC | `ce_time` | `ce-time` |
//! | `datacontenttype` | the row's content type | `content-type` | the `content_type` property |
//!
//! Kafka follows the CloudEvents Kafka protocol binding; RabbitMQ, which
//! speaks AMQP 0-9-1 rather than the AMQP 1.0 of the CloudEvents AMQP binding,
//! follows the RabbitMQ binding (Knative eventing-rabbitmq), which the
//! CloudEvents SDKs read. The relay's own `message-id` header and property
//! stay as they are, so consumers that use them need no change.

#[cfg(test)]
use std::time::SystemTime;

use super::Envelope;

/// The `type` of a message that has no event type and goes to AMQP's default
/// exchange (whose name is empty, and `type` must not be).
const FALLBACK_TYPE: &str = "outbox.message";

/// Binary-mode CloudEvents attributes for every message published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
}

impl CloudEvents {
    /// CloudEvents with `source` as every event's `source`: a URI reference
    /// naming the producing context, e.g. `/orders-service` or
    /// `urn:example:orders`. It must be non-empty and contain no whitespace.
    pub fn new(source: impl Into<String>) -> Result<Self, String> {
        let source = source.into();
        if source.is_empty() {
            return Err("the CloudEvents source is empty".into());
        }
        if source.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "the CloudEvents source {source:?} is not a URI reference: it contains whitespace"
            ));
        }
        Ok(CloudEvents { source })
    }

    /// The event's attributes other than `datacontenttype`, unprefixed, in the
    /// order the spec lists them. `time` is left out (it is optional) when
    /// the row's `created_at` lies outside RFC 3339's years 0000 to 9999,
    /// as Postgres allows (`'infinity'` included).
    pub fn attributes(&self, env: &Envelope) -> Vec<(&'static str, String)> {
        let kind = match (&env.event_type, env.destination.as_str()) {
            (Some(t), _) => t.clone(),
            (None, "") => FALLBACK_TYPE.to_owned(),
            (None, destination) => destination.to_owned(),
        };
        let mut a = vec![
            ("id", env.message_id.to_string()),
            ("source", self.source.clone()),
            ("specversion", "1.0".to_owned()),
            ("type", kind),
        ];
        if let Some(time) = crate::timefmt::rfc3339(env.created_at) {
            a.push(("time", time));
        }
        a
    }
}

/// The attributes [`CloudEvents::attributes`] may set: a row header that
/// spells one of them is left out, whether or not the event has it.
pub const ATTRIBUTES: [&str; 5] = ["id", "source", "specversion", "type", "time"];

#[cfg(test)]
mod tests {
    use super::*;

    fn env(event_type: Option<&str>, destination: &str) -> Envelope {
        Envelope {
            seq: 1,
            message_id: uuid::Uuid::nil(),
            destination: destination.into(),
            ordering_key: None,
            routing_key: String::new(),
            headers: Vec::new(),
            payload: Vec::new(),
            content_type: None,
            event_type: event_type.map(Into::into),
            created_at: SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(1_500_000),
            attempts: 0,
        }
    }

    #[test]
    fn attributes_map_the_row() {
        let ce = CloudEvents::new("/orders").expect("valid source");
        let a = ce.attributes(&env(Some("order.paid"), "orders"));
        assert_eq!(
            a.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>(),
            [
                "id=00000000-0000-0000-0000-000000000000",
                "source=/orders",
                "specversion=1.0",
                "type=order.paid",
                "time=1970-01-01T00:00:01.500000Z",
            ]
        );
    }

    #[test]
    fn a_message_without_event_type_is_typed_by_its_destination() {
        let ce = CloudEvents::new("/orders").expect("valid source");
        assert_eq!(ce.attributes(&env(None, "orders"))[3].1, "orders");
        assert_eq!(ce.attributes(&env(None, ""))[3].1, FALLBACK_TYPE);
    }

    /// A plain-SQL writer can set any `created_at` Postgres takes: a
    /// backfill keeps its events' own times, from before 1970 too. Before,
    /// formatting one panicked, which stopped the relay, and every relay
    /// that claimed the row after it.
    #[test]
    fn any_created_at_postgres_takes_is_a_time_or_no_time_never_a_panic() {
        let ce = CloudEvents::new("/orders").expect("valid source");
        let at = |t: SystemTime| {
            let e = Envelope {
                created_at: t,
                ..env(None, "orders")
            };
            let a = ce.attributes(&e);
            a.iter().find(|(k, _)| *k == "time").map(|(_, v)| v.clone())
        };
        let epoch = SystemTime::UNIX_EPOCH;
        let us = std::time::Duration::from_micros;
        assert_eq!(
            at(epoch - us(14_182_939_500_000)).as_deref(),
            Some("1969-07-20T20:17:40.500000Z")
        );
        // 'infinity': past what RFC 3339 writes, so no `time` at all.
        let pg_2000 = epoch + std::time::Duration::from_secs(946_684_800);
        assert_eq!(at(pg_2000 + us(i64::MAX as u64)), None);
        assert_eq!(at(pg_2000 - us(i64::MAX as u64)), None);
    }

    #[test]
    fn sources_must_be_uri_references() {
        assert!(CloudEvents::new("").is_err());
        assert!(CloudEvents::new("has space").is_err());
        assert!(CloudEvents::new("urn:example:orders").is_ok());
    }
}
