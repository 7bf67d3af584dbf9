//! What goes on the wire and what comes back: message properties and
//! headers, and pairing confirms and returns with the messages of a batch
//! (in any order RabbitMQ may send them).

use std::collections::HashMap;
use std::time::UNIX_EPOCH;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

use crate::envelope::Envelope;
use crate::publish::cloudevents::CloudEvents;
use crate::publish::{PublishError, Receipt, Rejection, Verdict};

pub(super) fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404)
}

pub(super) fn is_access_refused(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403)
}

/// What an ACCESS_REFUSED channel close bars: an exchange, or (a topic
/// permission) one routing key on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Barred {
    pub(super) exchange: String,
    pub(super) routing_key: Option<String>,
}

impl Barred {
    /// Whether it bars a message to `exchange` with `routing_key`.
    pub(super) fn bars(&self, exchange: &str, routing_key: &str) -> bool {
        self.exchange == exchange
            && self
                .routing_key
                .as_deref()
                .is_none_or(|rk| rk == routing_key)
    }
}

/// What RabbitMQ's ACCESS_REFUSED `reason` bars among `targets` (a batch's
/// exchanges, `""` for the default, with their routing keys): "access to
/// exchange 'x' in vhost '/' refused for user 'u'" an exchange, "write
/// access to topic 'rk' in exchange 'x' in vhost ..." one routing key on
/// it. The names are read from prose, so they must be the batch's;
/// failing that, the batch's only exchange.
pub(super) fn refused_target<'x>(
    reason: &str,
    targets: impl Iterator<Item = (&'x str, &'x str)> + Clone,
) -> Option<Barred> {
    fn as_named(x: &str) -> &str {
        if x.is_empty() {
            "amq.default"
        } else {
            x
        }
    }
    if let Some((_, topic)) = reason.split_once("access to topic '") {
        // The routing key may hold "' in exchange '" itself: the last
        // such split is the exchange's.
        let (rk, rest) = topic.rsplit_once("' in exchange '")?;
        let named = rest.rsplit_once("' in vhost '")?.0;
        let (x, rk) = targets
            .into_iter()
            .find(|(x, k)| as_named(x) == named && *k == rk)?;
        return Some(Barred {
            exchange: x.to_owned(),
            routing_key: Some(rk.to_owned()),
        });
    }
    let named = reason
        .split_once("exchange '")
        .and_then(|(_, rest)| rest.rsplit_once("' in vhost '"))
        .map(|(name, _)| name);
    if let Some(name) = named {
        if let Some((x, _)) = targets.clone().find(|(x, _)| as_named(x) == name) {
            return Some(Barred {
                exchange: x.to_owned(),
                routing_key: None,
            });
        }
    }
    let mut distinct = targets.map(|(x, _)| x);
    let first = distinct.next()?;
    distinct.all(|x| x == first).then(|| Barred {
        exchange: first.to_owned(),
        routing_key: None,
    })
}

pub(super) fn properties(
    env: &Envelope,
    cloudevents: Option<&CloudEvents>,
) -> Result<BasicProperties, Rejection> {
    let attributes = cloudevents.map(|ce| ce.attributes(env));
    let mut headers = FieldTable::default();
    for (name, value) in &env.headers {
        // A row header that spells one of the event's attributes in any case
        // is left out: the event's own value is the one consumers must see.
        let shadowed = attributes.is_some()
            && crate::publish::cloudevents::ATTRIBUTES.iter().any(|a| {
                name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce-"))
                    && name.get(3..).is_some_and(|n| n.eq_ignore_ascii_case(a))
            });
        if shadowed {
            continue;
        }
        // RabbitMQ reads these two itself, as extra routing keys
        // (sender-selected distribution), and closes the channel under the
        // whole batch at one that is not an array: a row's headers travel
        // as strings.
        if name == "CC" || name == "BCC" {
            return Err(Rejection::permanent(format!(
                "header {name:?} names extra routing keys to rabbitmq (sender-selected \
                 distribution) and must be an array, but row headers are sent as strings; \
                 rename the header"
            )));
        }
        let name = ShortString::try_new(name.as_str())
            .map_err(|_| Rejection::permanent(format!("header name {name:?} exceeds 255 bytes")))?;
        headers.insert(
            name,
            AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
        );
    }
    for (name, value) in attributes.into_iter().flatten() {
        headers.insert(
            ShortString::from(format!("ce-{name}")),
            AMQPValue::LongString(LongString::from(value.into_bytes())),
        );
    }
    let timestamp = env
        .created_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut props = BasicProperties::default()
        .with_message_id(env.message_id.to_string().into())
        .with_delivery_mode(2)
        .with_timestamp(timestamp)
        .with_headers(headers);
    if let Some(ct) = &env.content_type {
        let ct = ShortString::try_new(ct.as_str())
            .map_err(|_| Rejection::permanent("content type exceeds 255 bytes"))?;
        props = props.with_content_type(ct);
    }
    Ok(props)
}

/// A message's properties and headers travel in one content header frame,
/// which may not exceed the connection's negotiated frame size (`frame_max`,
/// 128 KiB on RabbitMQ by default); only the body is split across frames.
/// RabbitMQ closes the whole connection on a larger one (FRAME_ERROR), so a
/// message whose header frame would not fit is refused here, for good.
pub(super) fn check_header_frame(props: &BasicProperties, frame_max: u32) -> Result<(), Rejection> {
    // A frame's 8 bytes of framing, then class id, weight and body size.
    let room = (frame_max as usize).saturating_sub(8 + 12);
    // Every header `properties` sets is a long string: 1 + name, a type
    // byte, 4 + value. The other properties (flags, message id, delivery
    // mode, timestamp, content type of at most 255 bytes) take under 1 KiB.
    let bound = props.headers().as_ref().map_or(0, |h| {
        h.inner()
            .iter()
            .map(|(name, value)| match value {
                AMQPValue::LongString(v) => 6 + name.as_str().len() + v.as_bytes().len(),
                _ => usize::MAX / 2,
            })
            .fold(4, usize::saturating_add)
    });
    if bound.saturating_add(1024) <= room {
        return Ok(());
    }
    // Near or over the limit: measure with lapin's own serializer.
    let size =
        cookie_factory::gen_simple(lapin::protocol::basic::gen_properties(props), Vec::new())
            .map_or(usize::MAX, |v| v.len());
    if size <= room {
        return Ok(());
    }
    Err(Rejection::permanent(format!(
        "properties and headers of {size} bytes exceed the connection's frame size of {frame_max} bytes (rabbitmq's frame_max): only a body may span frames"
    )))
}

/// What the broker said about one published message, as lapin delivered it.
#[derive(Debug)]
pub(super) enum Answer {
    /// An ack or a nack, with whatever `basic.return` lapin attached to it.
    /// lapin attaches a pending return to whichever confirm completes next,
    /// which need not be the returned message's own.
    Confirmed {
        acked: bool,
        returned: Option<Returned>,
    },
    /// The channel or connection failed before the confirm arrived.
    Lost(lapin::Error),
}

/// A `basic.return`: the returned message's id and why.
#[derive(Debug, Clone)]
pub(super) struct Returned {
    message_id: Option<String>,
    reason: String,
}

impl Returned {
    pub(super) fn from_lapin(r: &lapin::message::BasicReturnMessage) -> Self {
        Returned {
            message_id: r
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string()),
            reason: format!(
                "unroutable: returned by rabbitmq ({} {})",
                r.reply_code, r.reply_text
            ),
        }
    }
}

/// Pairs every confirm of one batch with the returns of the batch by message
/// id. The batch had its channel to itself, and RabbitMQ sends a message's
/// return before its ack, so once every confirm has arrived, every return of
/// the batch has been attached to one of them — maybe another message's.
/// A message is published only if it was acked and no return names it.
///
/// `sent` holds (index in batch, message id) per published message, `answers`
/// the confirms in the same order. A return that names no message of the
/// batch means the pairing cannot be trusted: the whole batch is retried.
pub(super) fn correlate(
    sent: &[(usize, String)],
    answers: Vec<Answer>,
) -> Result<Vec<(usize, Verdict)>, PublishError> {
    let trusted = vec![true; answers.len()];
    correlate_cut(sent, answers.into_iter().map(Some).collect(), &trusted)
}

/// [`correlate`] for a batch cut short: `answers[j]` is the confirm of
/// `sent[j]` if it arrived, and only those with `trusted[j]` may count as
/// published. The caller trusts the confirms that had arrived before every
/// confirm frame then being handled was done, and passes every confirm that
/// arrived by then, so that a return carried by another message's confirm
/// of the same frame is seen. Messages without an outcome here went
/// unanswered. A return that names a message whose confirm did not arrive
/// refuses it all the same.
pub(super) fn correlate_cut(
    sent: &[(usize, String)],
    answers: Vec<Option<Answer>>,
    trusted: &[bool],
) -> Result<Vec<(usize, Verdict)>, PublishError> {
    let mut returns: HashMap<String, String> = HashMap::new();
    let mut acked = Vec::with_capacity(answers.len());
    for answer in answers {
        match answer {
            Some(Answer::Confirmed { acked: a, returned }) => {
                if let Some(r) = returned {
                    let Some(id) = r.message_id else {
                        return Err(PublishError::msg(
                            "rabbitmq returned a message without a message id",
                        ));
                    };
                    returns.insert(id, r.reason);
                }
                acked.push(Some(a));
            }
            Some(Answer::Lost(e)) => {
                return Err(PublishError::new("connection lost before confirm", e))
            }
            None => acked.push(None),
        }
    }
    let mut outcomes = Vec::with_capacity(sent.len());
    for (j, (i, id)) in sent.iter().enumerate() {
        let outcome = match (returns.remove(id), acked.get(j).copied().flatten()) {
            (Some(reason), _) => Err(Rejection::retryable(reason)),
            (None, Some(_)) if !trusted.get(j).copied().unwrap_or(false) => continue,
            (None, Some(true)) => Ok(Receipt::Amqp),
            (None, Some(false)) => Err(Rejection::retryable("nacked by rabbitmq")),
            (None, None) => continue,
        };
        outcomes.push((*i, outcome));
    }
    if let Some(stray) = returns.keys().next() {
        return Err(PublishError::msg(format!(
            "rabbitmq returned message {stray}, which this batch did not send; retrying the batch"
        )));
    }
    Ok(outcomes)
}

/// The limit named by RabbitMQ's "message size N is larger than configured
/// max size M" channel error.
pub(super) fn size_limit_from(error: &lapin::Error) -> Option<usize> {
    let text = error.to_string();
    let (_, tail) = text.split_once("larger than configured max size")?;
    tail.trim()
        .trim_matches(|c: char| !c.is_ascii_digit())
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_access_refused_bars_is_read_from_the_reason_and_must_be_the_batchs() {
        let exchange = |x: &str| {
            format!(
                "protocol error: AMQP soft error: ACCESS-REFUSED: ACCESS_REFUSED - access to \
                 exchange '{x}' in vhost '/' refused for user 'relay'"
            )
        };
        let topic = |rk: &str, x: &str| {
            format!(
                "ACCESS_REFUSED - write access to topic '{rk}' in exchange '{x}' in vhost '/' \
                 refused for user 'relay'"
            )
        };
        let batch = [
            ("orders", "a.b"),
            ("it's in vhost 'x", ""),
            ("", "q"),
            ("orders", "c' in exchange 'd"),
        ];
        let of = |r: &str| refused_target(r, batch.iter().copied());
        let whole = |x: &str| {
            Some(Barred {
                exchange: x.to_owned(),
                routing_key: None,
            })
        };
        let key = |x: &str, rk: &str| {
            Some(Barred {
                exchange: x.to_owned(),
                routing_key: Some(rk.to_owned()),
            })
        };
        assert_eq!(of(&exchange("orders")), whole("orders"));
        assert_eq!(of(&exchange("it's in vhost 'x")), whole("it's in vhost 'x"));
        assert_eq!(of(&exchange("amq.default")), whole(""));
        assert_eq!(of(&topic("a.b", "orders")), key("orders", "a.b"));
        assert_eq!(
            of(&topic("c' in exchange 'd", "orders")),
            key("orders", "c' in exchange 'd")
        );
        assert_eq!(of(&topic("q", "amq.default")), key("", "q"));
        // Named, but not in the batch; or not named, several exchanges.
        assert_eq!(of(&exchange("elsewhere")), None);
        assert_eq!(of(&topic("z", "orders")), None);
        assert_eq!(of("ACCESS_REFUSED"), None);
        // One exchange in the batch: that one, whatever the prose says.
        let one = [("orders", "a"), ("orders", "b")];
        assert_eq!(
            refused_target("ACCESS_REFUSED", one.iter().copied()),
            whole("orders")
        );
        assert_eq!(refused_target("", std::iter::empty()), None);
        // A bar on one routing key leaves the exchange's others alone.
        let bar = key("orders", "a.b").expect("a bar");
        assert!(bar.bars("orders", "a.b"));
        assert!(!bar.bars("orders", "a.c"));
        assert!(whole("orders").expect("a bar").bars("orders", "a.c"));
    }

    #[test]
    fn headers_rabbitmq_reads_as_routing_keys_are_refused_by_name() {
        let mut env = Envelope {
            seq: 1,
            message_id: uuid::Uuid::nil(),
            destination: "orders".into(),
            ordering_key: None,
            routing_key: String::new(),
            headers: Vec::new(),
            payload: Vec::new(),
            content_type: None,
            event_type: None,
            created_at: UNIX_EPOCH,
            attempts: 0,
        };
        for name in ["CC", "BCC"] {
            env.headers = vec![(name.to_owned(), "billing".to_owned())];
            let refused = properties(&env, None).expect_err(name);
            assert!(
                refused.permanent && refused.reason.contains(name),
                "{refused:?}"
            );
        }
        // Names are case-sensitive to RabbitMQ: these are plain headers.
        env.headers = vec![
            ("cc".to_owned(), "a".to_owned()),
            ("Bcc".to_owned(), "b".to_owned()),
        ];
        assert!(properties(&env, None).is_ok());
    }

    fn with_header(len: usize) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("h"),
            AMQPValue::LongString(LongString::from(vec![b'x'; len])),
        );
        BasicProperties::default()
            .with_message_id(uuid::Uuid::nil().to_string().into())
            .with_delivery_mode(2)
            .with_timestamp(1)
            .with_headers(headers)
    }

    #[test]
    fn a_header_frame_fits_up_to_the_frame_size_and_not_a_byte_more() {
        let frame_max = 4096;
        let size = |p: &BasicProperties| {
            cookie_factory::gen_simple(lapin::protocol::basic::gen_properties(p), Vec::new())
                .expect("serializes")
                .len()
        };
        // Grow the header until its frame is exactly full.
        let base = size(&with_header(0));
        let fill = frame_max as usize - 8 - 12 - base;
        assert_eq!(size(&with_header(fill)), frame_max as usize - 20);
        assert!(check_header_frame(&with_header(fill), frame_max).is_ok());
        let over =
            check_header_frame(&with_header(fill + 1), frame_max).expect_err("one byte over");
        assert!(over.permanent, "{over:?}");
        assert!(over.reason.contains("frame size of 4096 bytes"), "{over:?}");
        // Far below the limit the bound alone decides; far above, too.
        assert!(check_header_frame(&with_header(10), 131_072).is_ok());
        assert!(check_header_frame(&with_header(300 * 1024), 131_072).is_err());
    }
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    fn returned(id: &str) -> Option<Returned> {
        Some(Returned {
            message_id: Some(id.to_owned()),
            reason: "unroutable".into(),
        })
    }

    /// Every order RabbitMQ may produce: a return travels before its own
    /// ack, but lapin hands it to whichever confirm completes next (several
    /// at once for a `multiple` ack, in no particular order). Whatever the
    /// pairing, exactly the returned messages are refused.
    #[test]
    fn returns_are_matched_by_message_id_whatever_confirm_carries_them() {
        for seed in 0..500u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let n = rng.random_range(1..60);
            let sent: Vec<(usize, String)> = (0..n).map(|i| (i, format!("m{i}"))).collect();
            let bad: Vec<bool> = (0..n).map(|_| rng.random_bool(0.3)).collect();
            // Hand each return to a confirm at or after its own message's,
            // the way a FIFO of pending returns drains into later confirms.
            let mut carriers: Vec<Option<Returned>> = (0..n).map(|_| None).collect();
            let mut waiting: Vec<String> = Vec::new();
            let mut order: Vec<usize> = (0..n).collect();
            order.shuffle(&mut rng);
            for &i in &order {
                if bad[i] {
                    waiting.push(format!("m{i}"));
                }
                if !waiting.is_empty() {
                    let pick = rng.random_range(0..waiting.len());
                    carriers[i] = returned(&waiting.remove(pick));
                }
            }
            // Returns still waiting drain into confirms that carry none.
            for slot in carriers.iter_mut().filter(|c| c.is_none()) {
                if let Some(id) = waiting.pop() {
                    *slot = returned(&id);
                }
            }
            assert!(waiting.is_empty());
            let answers = carriers
                .into_iter()
                .map(|returned| Answer::Confirmed {
                    acked: true,
                    returned,
                })
                .collect();
            let outcomes = correlate(&sent, answers).expect("consistent");
            for (i, outcome) in outcomes {
                assert_eq!(outcome.is_err(), bad[i], "seed {seed}, message {i}");
            }
        }
    }

    fn acked(returned: Option<Returned>) -> Option<Answer> {
        Some(Answer::Confirmed {
            acked: true,
            returned,
        })
    }

    /// A batch cut short: `a`'s ack came before the cut, and the return
    /// naming it rode on `b`'s ack of the same frame, which came after.
    /// `a` is refused, `b` (not trusted) gets no outcome, `c` (no confirm)
    /// none either, and `d`, whose confirm never came but whose return
    /// did, is refused.
    #[test]
    fn a_cut_batch_counts_a_confirm_only_with_every_return_it_could_carry() {
        let sent: Vec<(usize, String)> = ["a", "b", "c", "d", "e"]
            .iter()
            .enumerate()
            .map(|(i, id)| (i, (*id).to_owned()))
            .collect();
        let answers = vec![
            acked(None),
            acked(returned("a")),
            None,
            None,
            acked(returned("d")),
        ];
        let trusted = [true, false, false, false, true];
        let outcomes = correlate_cut(&sent, answers, &trusted).expect("consistent");
        let by_index: HashMap<usize, Verdict> = outcomes.into_iter().collect();
        assert!(
            matches!(&by_index[&0], Err(r) if !r.unanswered),
            "{by_index:?}"
        );
        assert!(
            matches!(&by_index[&3], Err(r) if !r.unanswered),
            "{by_index:?}"
        );
        assert_eq!(by_index[&4], Ok(Receipt::Amqp), "{by_index:?}");
        assert!(!by_index.contains_key(&1), "untrusted: {by_index:?}");
        assert!(!by_index.contains_key(&2), "unanswered: {by_index:?}");
    }

    #[test]
    fn a_return_for_a_message_the_batch_did_not_send_fails_the_batch() {
        let sent = vec![(0, "a".to_owned())];
        let answers = vec![Answer::Confirmed {
            acked: true,
            returned: returned("zzz"),
        }];
        assert!(correlate(&sent, answers).is_err());
    }

    #[test]
    fn a_nack_is_a_refusal() {
        let sent = vec![(0, "a".to_owned()), (1, "b".to_owned())];
        let answers = vec![
            Answer::Confirmed {
                acked: false,
                returned: None,
            },
            Answer::Confirmed {
                acked: true,
                returned: None,
            },
        ];
        let outcomes = correlate(&sent, answers).expect("consistent");
        assert!(outcomes[0].1.is_err());
        assert_eq!(outcomes[1].1, Ok(Receipt::Amqp));
    }

    #[test]
    fn the_size_limit_is_read_from_rabbitmqs_error() {
        let e = lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "PRECONDITION_FAILED - message size 2097152 is larger than configured max size 1048576",
        ));
        // The text above stands in for the broker's channel.close reason.
        assert_eq!(size_limit_from(&e), Some(1_048_576));
    }

    #[test]
    fn cloudevents_headers_replace_row_headers_that_spell_them() {
        let env = Envelope {
            seq: 1,
            message_id: uuid::Uuid::nil(),
            destination: "orders".into(),
            ordering_key: None,
            routing_key: String::new(),
            headers: vec![
                ("CE-Type".into(), "spoofed".into()),
                ("ce-subject".into(), "kept".into()),
                ("x-other".into(), "kept".into()),
            ],
            payload: Vec::new(),
            content_type: Some("application/json".into()),
            event_type: Some("order.paid".into()),
            created_at: UNIX_EPOCH,
            attempts: 0,
        };
        let ce = CloudEvents::new("/orders").expect("valid source");
        let props = properties(&env, Some(&ce)).expect("properties");
        let headers = props.headers().as_ref().expect("headers");
        let names: Vec<&str> = headers.inner().keys().map(|k| k.as_str()).collect();
        assert!(!names.contains(&"CE-Type"), "{names:?}");
        assert!(names.contains(&"ce-subject") && names.contains(&"x-other"));
        assert_eq!(
            headers.inner().get("ce-type"),
            Some(&AMQPValue::LongString(LongString::from("order.paid")))
        );
        for attribute in ["ce-id", "ce-source", "ce-specversion", "ce-time"] {
            assert!(names.contains(&attribute), "{attribute} missing: {names:?}");
        }
        // Without the mode, nothing is added.
        let plain = properties(&env, None).expect("properties");
        let names: Vec<String> = plain
            .headers()
            .as_ref()
            .expect("headers")
            .inner()
            .keys()
            .map(|k| k.to_string())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
    }
}
