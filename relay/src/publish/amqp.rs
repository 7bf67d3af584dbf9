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

use super::{Envelope, Outcome, PublishError, Publisher, Receipt, Rejection};
use crate::redact::redact_url;

/// Name accepted as an alias of the default exchange (`""`), which an outbox
/// client refuses as an empty destination.
pub const DEFAULT_EXCHANGE_ALIAS: &str = "amq.default";

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
    channel: Channel,
}

/// Publishes to RabbitMQ; reconnects lazily on the next batch after a failure.
pub struct AmqpPublisher {
    settings: AmqpSettings,
    link: Mutex<Option<Link>>,
    exchanges_seen: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

pub(crate) fn exchange_name(destination: &str) -> &str {
    if destination == DEFAULT_EXCHANGE_ALIAS {
        ""
    } else {
        destination
    }
}

impl AmqpPublisher {
    /// A publisher that connects on first use.
    pub fn new(settings: AmqpSettings) -> Self {
        AmqpPublisher {
            settings,
            link: Mutex::new(None),
            exchanges_seen: Mutex::new(HashMap::new()),
        }
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
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Link {
                connection: Arc::new(connection),
                channel,
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

    /// The confirm-mode channel and its connection, (re)connecting if either is gone.
    async fn channel(&self) -> Result<(Arc<Connection>, Channel), PublishError> {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref() {
            if l.channel.status().connected() {
                return Ok((l.connection.clone(), l.channel.clone()));
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
        let out = (fresh.connection.clone(), fresh.channel.clone());
        *link = Some(fresh);
        Ok(out)
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
                .map(|e| exchange_name(&e.destination))
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

fn properties(env: &Envelope) -> Result<BasicProperties, Rejection> {
    let mut headers = FieldTable::default();
    for (name, value) in &env.headers {
        let name = ShortString::try_new(name.as_str())
            .map_err(|_| Rejection::permanent(format!("header name {name:?} exceeds 255 bytes")))?;
        headers.insert(
            name,
            AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
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

impl Publisher for AmqpPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Outcome>, PublishError> {
        let (connection, channel) = self.channel().await?;
        let missing = self.missing_exchanges(&connection, batch).await?;

        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut pending = Vec::with_capacity(batch.len());
        for (i, env) in batch.iter().enumerate() {
            let exchange = exchange_name(&env.destination);
            if missing.contains(exchange) {
                outcomes[i] = Some(Err(Rejection::retryable(format!(
                    "exchange {exchange:?} does not exist"
                ))));
                continue;
            }
            let (Ok(exchange), Ok(routing_key)) = (
                ShortString::try_new(exchange),
                ShortString::try_new(env.routing_key.as_str()),
            ) else {
                outcomes[i] = Some(Err(Rejection::permanent(
                    "exchange or routing key exceeds 255 bytes",
                )));
                continue;
            };
            let props = match properties(env) {
                Ok(p) => p,
                Err(r) => {
                    outcomes[i] = Some(Err(r));
                    continue;
                }
            };
            // Awaiting basic_publish only hands the frames to the connection; the
            // broker's answer is the returned confirm future, awaited below for the
            // whole batch at once.
            let confirm = channel
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
                .map_err(|e| PublishError::new("publish failed", e))?;
            pending.push(async move { (i, confirm.await) });
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
        for (i, answer) in answers {
            outcomes[i] = Some(match answer {
                Ok(Confirmation::Ack(None)) => Ok(Receipt::Amqp),
                Ok(Confirmation::Ack(Some(returned))) => Err(Rejection::retryable(format!(
                    "unroutable: returned by rabbitmq ({} {})",
                    returned.reply_code, returned.reply_text
                ))),
                Ok(Confirmation::Nack(_)) => Err(Rejection::retryable("nacked by rabbitmq")),
                Ok(Confirmation::NotRequested) => {
                    return Err(PublishError::msg("channel is not in confirm mode"))
                }
                Err(e) => return Err(PublishError::new("connection lost before confirm", e)),
            });
        }
        // Every slot was filled above: either rejected before sending or answered.
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::retryable("no answer"))))
            .collect())
    }

    async fn ready(&self) -> Result<(), PublishError> {
        self.channel().await.map(|_| ())
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
