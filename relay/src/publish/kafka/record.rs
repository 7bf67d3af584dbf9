//! A record's headers, and what a refused or failed record means.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};

use crate::publish::cloudevents::CloudEvents;
use crate::publish::{Envelope, Rejection};

/// Errors a retry can never fix.
fn is_permanent(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
    )
}

/// A broker's refusal of a record batch for its size: `max.message.bytes`
/// (MessageSizeTooLarge) or the segment size (MessageBatchTooLarge).
pub(super) fn is_size_refusal(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge
    )
}

/// A broker's refusal of a whole record batch on account of one record in
/// it, or of their sum: for size (above), or InvalidRecord (a record
/// without a key on a compacted topic, a timestamp further off than the
/// topic allows). It covers every record of the batch, so it names none
/// of them (see `super::alone`).
pub(super) fn is_batch_refusal(code: RDKafkaErrorCode) -> bool {
    is_size_refusal(code) || code == RDKafkaErrorCode::InvalidRecord
}

/// Errors about one topic that an operator can fix (create the topic, grant
/// access): the message waits and retries, while other topics keep flowing.
fn is_topic_problem(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::TopicAuthorizationFailed
    )
}

/// Why Kafka would not have a topic of this name, if it would not: a name
/// is 1 to 249 bytes of ASCII letters, digits, `.`, `_` and `-`, and not
/// `.` or `..` (Apache Kafka's `Topic.validate`, which Kafka-protocol
/// brokers follow). A record for such a topic can never be delivered, and
/// asking for it would not even be answered as "does not exist": librdkafka
/// refuses a name over 512 bytes before it asks the broker.
pub(super) fn illegal_topic(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name == "." || name == ".." {
        Some("may not be \".\" or \"..\"")
    } else if name.len() > 249 {
        Some("is longer than the 249 bytes Kafka allows")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some(
            "holds a character Kafka does not allow (only ASCII letters, digits, '.', '_' and '-')",
        )
    } else {
        None
    }
}

/// A topic name for an error message: quoted, and cut short past 64
/// characters with its length.
pub(super) fn shown(name: &str) -> String {
    match name.char_indices().nth(64) {
        None => format!("{name:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &name[..cut], name.len()),
    }
}

/// The outcome for a record librdkafka refused or failed, or None when the
/// failure is not the record's own and the batch must be retried.
pub(super) fn rejection(e: &KafkaError) -> Option<Rejection> {
    match e {
        KafkaError::MessageProduction(code) if is_permanent(*code) => {
            Some(Rejection::permanent(format!("kafka: {code}")))
        }
        KafkaError::MessageProduction(code) if is_topic_problem(*code) => {
            Some(Rejection::retryable(format!("kafka: {code}")))
        }
        _ => None,
    }
}

pub(super) fn headers(env: &Envelope, cloudevents: Option<&CloudEvents>) -> OwnedHeaders {
    let id = env.message_id.to_string();
    let mut h = OwnedHeaders::new_with_capacity(env.headers.len() + 7).insert(Header {
        key: "message-id",
        value: Some(id.as_str()),
    });
    if let Some(ct) = &env.content_type {
        h = h.insert(Header {
            key: "content-type",
            value: Some(ct.as_str()),
        });
    }
    let attributes: Vec<(String, String)> = cloudevents
        .map(|ce| ce.attributes(env))
        .into_iter()
        .flatten()
        .map(|(name, value)| (format!("ce_{name}"), value))
        .collect();
    // Kafka headers may repeat a name; a row header that spells one of the
    // event's attributes is left out rather than sent beside it.
    for (k, v) in &env.headers {
        let shadowed = cloudevents.is_some()
            && crate::publish::cloudevents::ATTRIBUTES.iter().any(|a| {
                k.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce_"))
                    && k.get(3..).is_some_and(|n| n.eq_ignore_ascii_case(a))
            });
        // The relay's own headers, which a plain INSERT can also spell:
        // a consumer reading the last `message-id` would take the row's
        // for the message's id, and drop other messages as copies.
        let reserved = outbox_client::RESERVED_HEADERS
            .iter()
            .any(|r| r.eq_ignore_ascii_case(k));
        if shadowed || reserved {
            continue;
        }
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    for (k, v) in &attributes {
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_are_judged_by_kafkas_rules() {
        for fine in ["orders", "orders.created", "a-b_c.9", "Z", &"x".repeat(249)] {
            assert_eq!(illegal_topic(fine), None, "{fine:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            "orders:created",
            "orders created",
            "orders/created",
            "commandes-créées",
            &"x".repeat(250),
            &"x".repeat(600),
        ] {
            assert!(illegal_topic(bad).is_some(), "{bad:?}");
        }
        // Dots alone are fine beyond the two names Kafka keeps.
        assert_eq!(illegal_topic("..."), None);
    }

    /// A row written by plain SQL may carry headers named like the
    /// relay's own (the client and `enqueue()` refuse them): each of the
    /// relay's goes once, with its value, and the row's are left out.
    #[test]
    fn row_headers_spelling_the_relays_own_are_left_out() {
        use rdkafka::message::Headers;
        let id = uuid::Uuid::new_v4();
        let env = Envelope {
            seq: 1,
            message_id: id,
            destination: "t".into(),
            ordering_key: None,
            routing_key: String::new(),
            headers: vec![
                ("message-id".into(), "forged".into()),
                ("Content-Type".into(), "text/forged".into()),
                ("tenant".into(), "a".into()),
            ],
            payload: Vec::new(),
            content_type: Some("application/json".into()),
            event_type: None,
            created_at: std::time::SystemTime::UNIX_EPOCH,
            attempts: 0,
        };
        let h = headers(&env, None);
        let all: Vec<(String, String)> = (0..h.count())
            .map(|i| {
                let header = h.get(i);
                (
                    header.key.to_owned(),
                    String::from_utf8_lossy(header.value.unwrap_or_default()).into_owned(),
                )
            })
            .collect();
        assert_eq!(
            all,
            vec![
                ("message-id".to_owned(), id.to_string()),
                ("content-type".to_owned(), "application/json".to_owned()),
                ("tenant".to_owned(), "a".to_owned()),
            ]
        );
    }

    #[test]
    fn a_long_topic_name_is_shown_cut_short() {
        assert_eq!(shown("orders"), "\"orders\"");
        // Cut at a character, not a byte: "é" is two bytes.
        let long = "é".repeat(100);
        assert_eq!(
            shown(&long),
            format!("\"{}\"... (200 bytes)", "é".repeat(64))
        );
    }
}
