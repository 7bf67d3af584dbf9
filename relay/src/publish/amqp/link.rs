//! The one connection and its pool of confirm-mode channels: connecting
//! (TLS, timeouts), taking and giving back channels, dropping a dead link,
//! learning the broker's size limit, and checking exchanges exist.
//!
//! Connecting, checking exchanges and opening channels are round trips to
//! the broker, a few seconds of them when it answers slowly. They run in a
//! task of their own, each bounded by its own timeout, not by the batch
//! that asked for them: a batch that runs out of time while they are under
//! way has sent nothing, and leaves what they set up to the batches after
//! it instead of starting over.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::{oneshot, Mutex};

use super::wire::is_not_found;
use super::{AmqpSettings, BLOCKED, EXCHANGE_CHECK_TTL};
use crate::envelope::Envelope;
use crate::publish::PublishError;
use crate::redact::redact_url;

struct Link {
    connection: Arc<Connection>,
    /// Idle confirm-mode channels. A batch takes one for itself and gives it
    /// back only after every confirm of the batch has arrived, so no two
    /// batches ever share a channel's confirms or returns.
    idle: Vec<Channel>,
}

/// The connection to the broker and what the publisher knows of it, shared
/// with the tasks that set the link up.
pub(super) struct Broker {
    pub(super) settings: AmqpSettings,
    link: Mutex<Option<Link>>,
    exchanges_seen: Mutex<HashMap<String, Instant>>,
    /// When the latest connection attempt failed, and why.
    failed: std::sync::Mutex<Option<(Instant, String)>>,
}

/// What a batch needs before it sends: the connection, the exchanges of its
/// messages that do not exist, and a confirm-mode channel of its own.
pub(super) struct Prepared {
    pub(super) connection: Arc<Connection>,
    pub(super) missing: HashSet<String>,
    pub(super) channel: Channel,
}

impl Broker {
    pub(super) fn new(settings: AmqpSettings) -> Self {
        Broker {
            settings,
            link: Mutex::new(None),
            exchanges_seen: Mutex::new(HashMap::new()),
            failed: std::sync::Mutex::new(None),
        }
    }

    /// The connection, an idle channel and the exchange checks `batch`
    /// needs. When any of them takes a round trip, that work runs in a task
    /// of its own, and a channel it opens for a batch that stopped waiting
    /// goes to the pool for the next.
    pub(super) async fn prepare(
        self: &Arc<Self>,
        batch: &[Envelope],
    ) -> Result<Prepared, PublishError> {
        let to_check = self.exchanges_to_check(batch).await;
        if to_check.is_empty() {
            let mut link = self.link.lock().await;
            if let Some(l) = link.as_mut() {
                if l.connection.status().connected() {
                    if l.connection.status().blocked() {
                        // Anything sent now would sit in the socket until
                        // the alarm clears; the rows wait in the outbox
                        // instead.
                        return Err(PublishError::msg(BLOCKED));
                    }
                    if let Some(channel) = take_idle(&mut l.idle) {
                        return Ok(Prepared {
                            connection: l.connection.clone(),
                            missing: HashSet::new(),
                            channel,
                        });
                    }
                }
            }
        }
        let (tx, rx) = oneshot::channel();
        let broker = self.clone();
        tokio::spawn(async move {
            let prepared = broker.set_up(to_check).await;
            if let Err(Ok(unwanted)) = tx.send(prepared) {
                broker
                    .give_back(&unwanted.connection, unwanted.channel)
                    .await;
            }
        });
        rx.await
            .unwrap_or_else(|_| Err(PublishError::msg("the link's set-up task ended early")))
    }

    async fn set_up(&self, to_check: Vec<String>) -> Result<Prepared, PublishError> {
        let connection = self.connection().await?;
        if connection.status().blocked() {
            return Err(PublishError::msg(BLOCKED));
        }
        let (missing, channel) = tokio::try_join!(
            self.missing_exchanges(&connection, to_check),
            self.take_channel(&connection)
        )?;
        Ok(Prepared {
            connection,
            missing,
            channel,
        })
    }

    /// Runs `f` in a task of its own and waits for it: if the caller stops
    /// waiting, the task still ends, and what it set up stays for later.
    pub(super) async fn detached<T, F>(
        self: &Arc<Self>,
        f: impl FnOnce(Arc<Broker>) -> F,
    ) -> Result<T, PublishError>
    where
        F: Future<Output = Result<T, PublishError>> + Send + 'static,
        T: Send + 'static,
    {
        tokio::spawn(f(self.clone()))
            .await
            .unwrap_or_else(|e| Err(PublishError::new("the link's set-up task failed", e)))
    }

    async fn connect(&self) -> Result<Link, PublishError> {
        // lapin connects on a thread of its own, which waits for the
        // broker's first frame with no deadline: a connection accepted and
        // never answered (a black-holed link, a proxy whose backend is gone)
        // kept that thread and its socket for the process's life, one more
        // at every attempt. A copy of the socket, kept here, lets a timed-out
        // attempt shut it down, which ends the thread.
        let socket = Arc::new(std::sync::Mutex::new(None::<std::os::fd::OwnedFd>));
        let connect = async {
            let uri: lapin::uri::AMQPUri = self
                .settings
                .url
                .parse()
                .map_err(|e: String| lapin::Error::from(std::io::Error::other(e)))?;
            let tls = OwnedTLSConfig {
                identity: None,
                cert_chain: self.settings.ca_pem.clone(),
            };
            let kept = Arc::clone(&socket);
            let connection = Connection::connector(
                uri,
                lapin::runtime::default_runtime()?,
                async move |uri, runtime| {
                    use lapin::tcp::AMQPUriTcpExt;
                    let stream = uri
                        .connect_with_config_async(tls.as_ref(), &runtime)
                        .await?;
                    *kept.lock().unwrap_or_else(|p| p.into_inner()) = socket_of(&stream);
                    Ok(stream)
                },
                ConnectionProperties::default(),
            )
            .await?;
            Ok::<_, lapin::Error>(Link {
                connection: Arc::new(connection),
                idle: Vec::new(),
            })
        };
        let result = tokio::time::timeout(self.settings.connect_timeout, connect).await;
        let copy = socket.lock().unwrap_or_else(|p| p.into_inner()).take();
        match result {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(e)) => Err(PublishError::new("cannot connect to rabbitmq", e)),
            Err(_) => {
                if let Some(copy) = copy {
                    let _ = std::net::TcpStream::from(copy).shutdown(std::net::Shutdown::Both);
                }
                Err(PublishError::msg(format!(
                    "cannot connect to rabbitmq: no answer within {:?}",
                    self.settings.connect_timeout
                )))
            }
        }
    }

    /// The live connection, (re)connecting if it is gone. Callers that may
    /// stop waiting call it through [`Broker::detached`].
    pub(super) async fn connection(&self) -> Result<Arc<Connection>, PublishError> {
        let asked = Instant::now();
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref() {
            if l.connection.status().connected() {
                return Ok(l.connection.clone());
            }
        }
        // An attempt that failed after this caller asked is its answer too.
        // Each batch's set-up and each probe asks in a task of its own that
        // runs on after its caller stopped waiting: against a broker that
        // never answers, each of them made its own attempt in turn, one
        // connect timeout each, and they queued without bound (a relay
        // stopping waited minutes for them).
        if let Some((at, why)) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            if *at >= asked {
                return Err(PublishError::msg(why.clone()));
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
        let fresh = match self.connect().await {
            Ok(fresh) => fresh,
            Err(e) => {
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now(), e.to_string()));
                return Err(e);
            }
        };
        tracing::info!(url = %redact_url(&self.settings.url), "connected to rabbitmq");
        let connection = fresh.connection.clone();
        *link = Some(fresh);
        Ok(connection)
    }

    /// One round trip of the set-up, bounded like a confirm: no answer
    /// within the confirm timeout and the connection is presumed dead.
    async fn answer<T>(
        &self,
        connection: &Arc<Connection>,
        what: &str,
        step: impl Future<Output = Result<T, lapin::Error>>,
    ) -> Result<T, PublishError> {
        match tokio::time::timeout(self.settings.confirm_timeout, step).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(PublishError::new(what.to_owned(), e)),
            Err(_) => {
                self.drop_link(connection, "no answer to the set-up").await;
                Err(PublishError::msg(format!(
                    "{what}: no answer from rabbitmq within {:?}",
                    self.settings.confirm_timeout
                )))
            }
        }
    }

    /// A confirm-mode channel for one batch alone: an idle one, or a new one.
    async fn take_channel(&self, connection: &Arc<Connection>) -> Result<Channel, PublishError> {
        let idle = {
            let mut link = self.link.lock().await;
            link.as_mut()
                .filter(|l| Arc::ptr_eq(&l.connection, connection))
                .and_then(|l| take_idle(&mut l.idle))
        };
        if let Some(ch) = idle {
            return Ok(ch);
        }
        let channel = self
            .answer(
                connection,
                "cannot open a channel",
                connection.create_channel(),
            )
            .await?;
        self.answer(
            connection,
            "cannot enable publisher confirms",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
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

    /// Forgets `connection`, if it is still the link, so the next batch
    /// reconnects (used after a confirm timeout, when the socket may be
    /// black-holed rather than closed).
    pub(super) async fn drop_link(&self, connection: &Arc<Connection>, why: &'static str) {
        forget(&mut *self.link.lock().await, connection, why);
    }

    /// [`Broker::drop_link`] at once, unless the link is in use this very
    /// moment: then it is dropped as soon as it is free.
    pub(super) fn drop_link_now(self: &Arc<Self>, connection: &Arc<Connection>, why: &'static str) {
        match self.link.try_lock() {
            Ok(mut link) => forget(&mut link, connection, why),
            Err(_) => {
                let (broker, connection) = (self.clone(), connection.clone());
                tokio::spawn(async move { broker.drop_link(&connection, why).await });
            }
        }
    }

    /// Closes the link, waiting a little for the broker to agree. A
    /// connection attempt under way (it holds the link) is not waited for.
    pub(super) async fn close(&self) {
        let Ok(mut link) = tokio::time::timeout(Duration::from_secs(2), self.link.lock()).await
        else {
            return;
        };
        if let Some(link) = link.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                link.connection.close(200, "shutting down".into()),
            )
            .await;
        }
    }

    /// Forgets that the exchanges of `batch` were seen to exist: one of
    /// them was deleted since, and which one the broker's reason names only
    /// in prose. The next batch checks them again.
    pub(super) async fn forget_exchanges(&self, batch: &[Envelope]) {
        let mut seen = self.exchanges_seen.lock().await;
        for env in batch {
            seen.remove(env.amqp_exchange());
        }
    }

    /// The exchanges of `batch` not seen to exist lately.
    async fn exchanges_to_check(&self, batch: &[Envelope]) -> Vec<String> {
        let now = Instant::now();
        let seen = self.exchanges_seen.lock().await;
        let mut names: Vec<String> = Vec::new();
        for env in batch {
            let x = env.amqp_exchange();
            if x.is_empty() || names.iter().any(|n| n == x) {
                continue;
            }
            if seen
                .get(x)
                .is_none_or(|t| now.duration_since(*t) > EXCHANGE_CHECK_TTL)
            {
                names.push(x.to_owned());
            }
        }
        names
    }

    /// Which of `names` do not exist, each checked with a passive declare on
    /// a throwaway channel, all at once.
    async fn missing_exchanges(
        &self,
        connection: &Arc<Connection>,
        names: Vec<String>,
    ) -> Result<HashSet<String>, PublishError> {
        let checks = names.into_iter().map(|name| async move {
            let Ok(short) = ShortString::try_new(name.as_str()) else {
                return Ok(None); // rejected per message
            };
            let now = Instant::now();
            let probe = self
                .answer(
                    connection,
                    "cannot open a channel",
                    connection.create_channel(),
                )
                .await?;
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            let exists = self
                .answer(connection, "cannot check exchange", async {
                    match probe
                        .exchange_declare(
                            short,
                            ExchangeKind::Direct,
                            passive,
                            FieldTable::default(),
                        )
                        .await
                    {
                        Ok(()) => Ok(true),
                        Err(e) if is_not_found(&e) => Ok(false),
                        Err(e) => Err(e),
                    }
                })
                .await?;
            if !exists {
                return Ok(Some(name));
            }
            self.exchanges_seen.lock().await.insert(name, now);
            // Its answer is of no use to the batch.
            tokio::spawn(async move { probe.close(200, "ok".into()).await });
            Ok::<_, PublishError>(None)
        });
        let found = futures::future::try_join_all(checks).await?;
        Ok(found.into_iter().flatten().collect())
    }
}

/// Takes `connection` out of `link` if it is still the link there, and
/// closes it in the background.
fn forget(link: &mut Option<Link>, connection: &Arc<Connection>, why: &'static str) {
    if link
        .as_ref()
        .is_some_and(|l| Arc::ptr_eq(&l.connection, connection))
    {
        let old = link.take().expect("checked above");
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                old.connection.close(320, why.into()),
            )
            .await;
        });
    }
}

/// A copy of a connection's socket, to shut it down from outside lapin.
fn socket_of<S>(
    stream: &lapin::tcp::AsyncTcpStream<async_compat::Compat<S>>,
) -> Option<std::os::fd::OwnedFd>
where
    S: std::os::fd::AsFd,
    async_compat::Compat<S>: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
{
    let fd = match stream {
        lapin::tcp::AsyncTcpStream::Plain(s) => s.get_ref().as_fd(),
        lapin::tcp::AsyncTcpStream::Rustls(s) => s.get_ref().0.get_ref().as_fd(),
        _ => return None,
    };
    fd.try_clone_to_owned().ok()
}

fn take_idle(idle: &mut Vec<Channel>) -> Option<Channel> {
    while let Some(ch) = idle.pop() {
        if ch.status().connected() {
            return Some(ch);
        }
    }
    None
}
