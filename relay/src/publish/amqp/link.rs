//! The one connection and its pool of confirm-mode channels: connecting
//! (TLS, timeouts), taking and giving back channels, dropping a dead link,
//! learning the broker's size limit, and checking exchanges exist.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use super::wire::{is_not_found, size_limit_from};
use super::{AmqpPublisher, Link, EXCHANGE_CHECK_TTL};
use crate::envelope::Envelope;
use crate::publish::PublishError;
use crate::redact::redact_url;

impl AmqpPublisher {
    pub(super) async fn connect(&self) -> Result<Link, PublishError> {
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
    pub(super) async fn connection(&self) -> Result<Arc<Connection>, PublishError> {
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
    pub(super) async fn take_channel(
        &self,
        connection: &Connection,
    ) -> Result<Channel, PublishError> {
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
    pub(super) async fn give_back(&self, connection: &Arc<Connection>, channel: Channel) {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_mut() {
            if Arc::ptr_eq(&l.connection, connection) && channel.status().connected() {
                l.idle.push(channel);
            }
        }
    }

    /// Forgets the link so the next batch reconnects (used after a confirm timeout,
    /// when the socket may be black-holed rather than closed).
    pub(super) async fn drop_link(&self) {
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
    pub(super) fn learn_size_limit(&self, error: &lapin::Error) {
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
    pub(super) async fn missing_exchanges(
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
