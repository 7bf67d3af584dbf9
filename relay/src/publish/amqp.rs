//! RabbitMQ (AMQP 0-9-1) with publisher confirms.
//!
//! Every message is published persistent and mandatory on a confirm-mode channel.
//! A message counts as published only when its confirm is an Ack that was not
//! preceded by a `basic.return`: RabbitMQ acks unroutable mandatory messages too,
//! right after returning them, so "acked" alone is not success.
//!
//! Publishing to an exchange that does not exist is a channel error in AMQP: it
//! would close the channel under every other message in flight. Destinations are
//! therefore checked with a passive declare on a throwaway channel before first
//! use (and again after a while), and messages for a missing exchange are
//! rejected one by one while the rest of the batch flows.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::Mutex;

use super::cloudevents::CloudEvents;
use super::{Envelope, Outcome, PublishError, Publisher, Receipt, Rejection};
use crate::redact::redact_url;

pub use crate::envelope::DEFAULT_EXCHANGE_ALIAS;

/// How long a positive exchange check is trusted before it is made again.
const EXCHANGE_CHECK_TTL: Duration = Duration::from_secs(30);

/// Settings for [`AmqpPublisher`].
#[derive(Clone)]
pub struct AmqpSettings {
    /// `amqp://` or `amqps://` URI, credentials included.
    pub url: String,
    /// Longest wait for a batch's confirms before the connection is presumed dead.
    pub confirm_timeout: Duration,
    /// Longest wait for a TCP + AMQP handshake.
    pub connect_timeout: Duration,
    /// Extra trusted CA certificates (PEM) for `amqps://`, besides the
    /// system's. The server's certificate and host name are always verified.
    pub ca_pem: Option<String>,
}

impl std::fmt::Debug for AmqpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSettings")
            .field("url", &redact_url(&self.url))
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .finish()
    }
}

struct Link {
    connection: Arc<Connection>,
    /// Idle confirm-mode channels. A batch takes one for itself and gives it
    /// back only after every confirm of the batch has arrived, so no two
    /// batches ever share a channel's confirms or returns.
    idle: Vec<Channel>,
}

/// Publishes to RabbitMQ; reconnects lazily on the next batch after a failure.
pub struct AmqpPublisher {
    settings: AmqpSettings,
    link: Mutex<Option<Link>>,
    exchanges_seen: Mutex<HashMap<String, Instant>>,
    /// The largest message the broker accepts, as far as the relay knows:
    /// RabbitMQ's default until a channel closes for a larger message and the
    /// broker's error names its limit.
    max_message_size: AtomicUsize,
    /// CloudEvents binary mode, when on: `ce-` headers on every message.
    cloudevents: Option<CloudEvents>,
}

/// RabbitMQ's default `max_message_size` (since 3.8): 128 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 128 * 1024 * 1024;

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// A publisher that connects on first use.
    pub fn new(settings: AmqpSettings) -> Self {
        AmqpPublisher {
            settings,
            link: Mutex::new(None),
            exchanges_seen: Mutex::new(HashMap::new()),
            max_message_size: AtomicUsize::new(DEFAULT_MAX_MESSAGE_SIZE),
            cloudevents: None,
        }
    }

    /// Publishes every message as a CloudEvent in binary content mode, with
    /// the RabbitMQ binding's `ce-` headers ([`super::cloudevents`]).
    pub fn with_cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    async fn connect(&self) -> Result<Link, PublishError> {
        let connect = async {
            let tls = OwnedTLSConfig {
                identity: None,
                cert_chain: self.settings.ca_pem.clone(),
            };
            let connection = Connection::connect_with_config(
                &self.settings.url,
                ConnectionProperties::default(),
                tls,
                lapin::runtime::default_runtime()?,
            )
            .await?;
            Ok::<_, lapin::Error>(Link {
                connection: Arc::new(connection),
                idle: Vec::new(),
            })
        };
        match tokio::time::timeout(self.settings.connect_timeout, connect).await {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(e)) => Err(PublishError::new("cannot connect to rabbitmq", e)),
            Err(_) => Err(PublishError::msg(format!(
                "cannot connect to rabbitmq: no answer within {:?}",
                self.settings.connect_timeout
            ))),
        }
    }

    /// The live connection, (re)connecting if it is gone.
    async fn connection(&self) -> Result<Arc<Connection>, PublishError> {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref() {
            if l.connection.status().connected() {
                return Ok(l.connection.clone());
            }
        }
        if let Some(old) = link.take() {
            // Best effort; a dead socket fails fast.
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                old.connection.close(200, "reconnecting".into()),
            )
            .await;
        }
        let fresh = self.connect().await?;
        tracing::info!(url = %redact_url(&self.settings.url), "connected to rabbitmq");
        let connection = fresh.connection.clone();
        *link = Some(fresh);
        Ok(connection)
    }

    /// A confirm-mode channel for one batch alone: an idle one, or a new one.
    async fn take_channel(&self, connection: &Connection) -> Result<Channel, PublishError> {
        let idle = {
            let mut link = self.link.lock().await;
            let mut found = None;
            if let Some(l) = link.as_mut() {
                while let Some(ch) = l.idle.pop() {
                    if ch.status().connected() {
                        found = Some(ch);
                        break;
                    }
                }
            }
            found
        };
        if let Some(ch) = idle {
            return Ok(ch);
        }
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| PublishError::new("cannot open a channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| PublishError::new("cannot enable publisher confirms", e))?;
        Ok(channel)
    }

    /// Gives a channel whose confirms have all arrived back for later batches.
    async fn give_back(&self, connection: &Arc<Connection>, channel: Channel) {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_mut() {
            if Arc::ptr_eq(&l.connection, connection) && channel.status().connected() {
                l.idle.push(channel);
            }
        }
    }

    /// Forgets the link so the next batch reconnects (used after a confirm timeout,
    /// when the socket may be black-holed rather than closed).
    async fn drop_link(&self) {
        if let Some(old) = self.link.lock().await.take() {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    old.connection.close(320, "confirm timeout".into()),
                )
                .await;
            });
        }
    }

    /// Learns the broker's size limit from a channel it closed for a message
    /// over it, so the next attempt refuses that message before sending it.
    fn learn_size_limit(&self, error: &lapin::Error) {
        if let Some(limit) = size_limit_from(error) {
            let before = self.max_message_size.swap(limit, Ordering::Relaxed);
            if before != limit {
                tracing::warn!(
                    limit,
                    "rabbitmq refused a message over its max_message_size; larger messages now go to the dead letters"
                );
            }
        }
    }

    /// Destinations of `batch` whose exchange does not exist.
    async fn missing_exchanges(
        &self,
        connection: &Connection,
        batch: &[Envelope],
    ) -> Result<HashSet<String>, PublishError> {
        let now = Instant::now();
        let to_check: HashSet<&str> = {
            let seen = self.exchanges_seen.lock().await;
            batch
                .iter()
                .map(|e| e.amqp_exchange())
                .filter(|x| !x.is_empty())
                .filter(|x| {
                    seen.get(*x)
                        .is_none_or(|t| now.duration_since(*t) > EXCHANGE_CHECK_TTL)
                })
                .collect()
        };
        let mut missing = HashSet::new();
        for name in to_check {
            let Ok(short) = ShortString::try_new(name) else {
                continue; // rejected per message below
            };
            let probe = connection
                .create_channel()
                .await
                .map_err(|e| PublishError::new("cannot open a channel", e))?;
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            match probe
                .exchange_declare(short, ExchangeKind::Direct, passive, FieldTable::default())
                .await
            {
                Ok(()) => {
                    self.exchanges_seen
                        .lock()
                        .await
                        .insert(name.to_owned(), now);
                    let _ = probe.close(200, "ok".into()).await;
                }
                Err(e) if is_not_found(&e) => {
                    missing.insert(name.to_owned());
                }
                Err(e) => return Err(PublishError::new("cannot check exchange", e)),
            }
        }
        Ok(missing)
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404)
}

fn properties(
    env: &Envelope,
    cloudevents: Option<&CloudEvents>,
) -> Result<BasicProperties, Rejection> {
    let attributes = cloudevents.map(|ce| ce.attributes(env));
    let mut headers = FieldTable::default();
    for (name, value) in &env.headers {
        // A row header that spells one of the event's attributes in any case
        // is left out: the event's own value is the one consumers must see.
        let shadowed = attributes.iter().flatten().any(|(a, _)| {
            name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce-"))
                && name.get(3..).is_some_and(|n| n.eq_ignore_ascii_case(a))
        });
        if shadowed {
            continue;
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

/// What the broker said about one published message, as lapin delivered it.
#[derive(Debug)]
enum Answer {
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
struct Returned {
    message_id: Option<String>,
    reason: String,
}

impl Returned {
    fn from_lapin(r: &lapin::message::BasicReturnMessage) -> Self {
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
fn correlate(
    sent: &[(usize, String)],
    answers: Vec<Answer>,
) -> Result<Vec<(usize, Outcome)>, PublishError> {
    let mut returns: HashMap<String, String> = HashMap::new();
    let mut confirmed = Vec::with_capacity(answers.len());
    for answer in answers {
        match answer {
            Answer::Confirmed { acked, returned } => {
                if let Some(r) = returned {
                    let Some(id) = r.message_id else {
                        return Err(PublishError::msg(
                            "rabbitmq returned a message without a message id",
                        ));
                    };
                    returns.insert(id, r.reason);
                }
                confirmed.push(acked);
            }
            Answer::Lost(e) => return Err(PublishError::new("connection lost before confirm", e)),
        }
    }
    let mut outcomes = Vec::with_capacity(sent.len());
    for ((i, id), acked) in sent.iter().zip(confirmed) {
        let outcome = match returns.remove(id) {
            Some(reason) => Err(Rejection::retryable(reason)),
            None if acked => Ok(Receipt::Amqp),
            None => Err(Rejection::retryable("nacked by rabbitmq")),
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
fn size_limit_from(error: &lapin::Error) -> Option<usize> {
    let text = error.to_string();
    let (_, tail) = text.split_once("larger than configured max size")?;
    tail.trim()
        .trim_matches(|c: char| !c.is_ascii_digit())
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

impl AmqpPublisher {
    /// Why `env` can never be published, checked before anything is sent.
    fn refuse_locally(&self, env: &Envelope) -> Option<Rejection> {
        let limit = self.max_message_size.load(Ordering::Relaxed);
        if env.payload.len() > limit {
            return Some(Rejection::permanent(format!(
                "message of {} bytes exceeds rabbitmq's max_message_size of {limit} bytes",
                env.payload.len()
            )));
        }
        None
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Outcome>, PublishError> {
        let connection = self.connection().await?;
        if connection.status().blocked() {
            // Anything sent now would sit in the socket until the alarm
            // clears; the rows wait in the outbox instead.
            return Err(PublishError::msg(
                "rabbitmq has blocked the connection (a memory or disk alarm)",
            ));
        }
        let missing = self.missing_exchanges(&connection, batch).await?;
        let channel = self.take_channel(&connection).await?;

        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        // Keys with a message refused here: their later messages are not sent
        // (they wait for the refused one, like after a broker refusal).
        let mut refused: HashSet<&str> = HashSet::new();
        let mut sent = Vec::with_capacity(batch.len());
        let mut pending = Vec::with_capacity(batch.len());
        for (i, env) in batch.iter().enumerate() {
            let key = env.ordering_key.as_deref();
            if key.is_some_and(|k| refused.contains(k)) {
                outcomes[i] = Some(Err(Rejection::retryable(
                    "held back behind an earlier refused message of its key",
                )));
                continue;
            }
            let exchange = env.amqp_exchange();
            let checked = if missing.contains(exchange) {
                Err(Rejection::retryable(format!(
                    "exchange {exchange:?} does not exist"
                )))
            } else if let Some(r) = self.refuse_locally(env) {
                Err(r)
            } else {
                match (
                    ShortString::try_new(exchange),
                    ShortString::try_new(env.routing_key.as_str()),
                ) {
                    (Ok(x), Ok(rk)) => {
                        properties(env, self.cloudevents.as_ref()).map(|p| (x, rk, p))
                    }
                    _ => Err(Rejection::permanent(
                        "exchange or routing key exceeds 255 bytes",
                    )),
                }
            };
            let (exchange, routing_key, props) = match checked {
                Ok(parts) => parts,
                Err(r) => {
                    if let Some(k) = key {
                        refused.insert(k);
                    }
                    outcomes[i] = Some(Err(r));
                    continue;
                }
            };
            // Awaiting basic_publish only hands the frames to the connection; the
            // broker's answer is the returned confirm future, awaited below for the
            // whole batch at once.
            let confirm = match channel
                .basic_publish(
                    exchange,
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &env.payload,
                    props,
                )
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    self.learn_size_limit(&e);
                    return Err(PublishError::new("publish failed", e));
                }
            };
            sent.push((i, env.message_id.to_string()));
            pending.push(async move {
                match confirm.await {
                    Ok(Confirmation::Ack(r)) => Answer::Confirmed {
                        acked: true,
                        returned: r.as_ref().map(Returned::from_lapin),
                    },
                    Ok(Confirmation::Nack(r)) => Answer::Confirmed {
                        acked: false,
                        returned: r.as_ref().map(Returned::from_lapin),
                    },
                    Ok(Confirmation::NotRequested) => {
                        Answer::Lost(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                            lapin::ChannelState::Initial,
                            "channel is not in confirm mode",
                        )))
                    }
                    Err(e) => Answer::Lost(e),
                }
            });
        }

        let answers =
            match tokio::time::timeout(self.settings.confirm_timeout, join_all(pending)).await {
                Ok(answers) => answers,
                Err(_) => {
                    self.drop_link().await;
                    return Err(PublishError::msg(format!(
                        "no confirms from rabbitmq within {:?}",
                        self.settings.confirm_timeout
                    )));
                }
            };
        for answer in &answers {
            if let Answer::Lost(e) = answer {
                self.learn_size_limit(e);
            }
        }
        for (i, outcome) in correlate(&sent, answers)? {
            outcomes[i] = Some(outcome);
        }
        self.give_back(&connection, channel).await;
        // Every slot was filled above: either refused before sending or answered.
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::retryable("no answer"))))
            .collect())
    }

    async fn ready(&self) -> Result<(), PublishError> {
        self.connection().await.map(|_| ())
    }

    /// A batch ran out of time. On a connection the broker blocked (resource
    /// alarm), lapin writes nothing until the alarm clears, and every later
    /// batch is refused before sending, so keeping the connection bounds the
    /// copies to the batches already handed over. Any other stall (a
    /// black-holed socket, a broker that stopped answering) drops the
    /// connection: the next batch starts on a fresh one.
    async fn abandon(&self) {
        let blocked = self
            .link
            .lock()
            .await
            .as_ref()
            .is_some_and(|l| l.connection.status().blocked());
        if !blocked {
            self.drop_link().await;
        }
    }

    async fn close(&self) {
        if let Some(link) = self.link.lock().await.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                link.connection.close(200, "shutting down".into()),
            )
            .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
