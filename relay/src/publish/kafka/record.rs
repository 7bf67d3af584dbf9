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
        if attributes.iter().any(|(a, _)| a.eq_ignore_ascii_case(k)) {
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
