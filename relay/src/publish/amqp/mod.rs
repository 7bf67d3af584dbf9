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
//! rejected one by one while the rest of the batch flows. An exchange deleted
//! since its check, or one the relay's user may not write to (ACCESS_REFUSED,
//! which no passive declare reveals), still closes a batch's channel: that
//! batch keeps what was confirmed, the rest goes again without an attempt
//! counted, and the exchange is checked again, or barred for a while
//! (`closed_about_an_exchange`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::future::{ready, Either};
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{Confirmation, Connection};

use super::cloudevents::CloudEvents;
use super::pace::{alone_too_slow, Pace};
use super::{Envelope, PublishError, Publisher, Rejection, Verdict};
use link::{Broker, Prepared};
use wire::{
    check_header_frame, correlate, correlate_cut, is_access_refused, is_not_found, properties,
    refused_target, size_limit_from, Answer, Barred, Returned,
};

mod link;
mod wire;
use crate::redact::redact_url;

pub use crate::envelope::DEFAULT_EXCHANGE_ALIAS;

/// Why nothing is sent on a connection the broker blocked.
const BLOCKED: &str = "rabbitmq has blocked the connection (a memory or disk alarm)";

/// How long a positive exchange check is trusted before it is made again.
const EXCHANGE_CHECK_TTL: Duration = Duration::from_secs(30);

/// Settings for [`AmqpPublisher`].
#[derive(Clone)]
pub struct AmqpSettings {
    /// `amqp://` or `amqps://` URI, credentials included.
    pub url: String,
    /// Longest a batch waits while nothing at all is confirmed on the
    /// connection before it is presumed dead. A direct [`Publisher::publish`]
    /// also ends there; the relay's batches end at their own deadline.
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

/// Publishes to RabbitMQ; reconnects lazily on the next batch after a failure.
pub struct AmqpPublisher {
    /// The connection, its channels and the exchanges seen.
    broker: Arc<Broker>,
    /// The largest message the broker accepts, as far as the relay knows:
    /// RabbitMQ's default until a channel closes for a larger message and the
    /// broker's error names its limit.
    max_message_size: AtomicUsize,
    /// The frame size negotiated on the latest connection, which a message's
    /// properties and headers must fit in (see `wire::check_header_frame`):
    /// RabbitMQ's default until a batch has been sent on one.
    frame_max: AtomicUsize,
    /// CloudEvents binary mode, when on: `ce-` headers on every message.
    cloudevents: Option<CloudEvents>,
    /// When the broker last confirmed anything, in milliseconds since
    /// `origin`: a batch waiting behind another's bytes on a slow link is
    /// not on a dead connection while that one is being confirmed.
    progress: AtomicU64,
    origin: Instant,
    /// The batch size a slow link can confirm in time.
    pace: Pace,
    /// Exchanges, or routing keys on them, the broker refused the relay's
    /// user access to (a channel closed with ACCESS_REFUSED): their
    /// messages go unsent until [`EXCHANGE_CHECK_TTL`] has passed, then a
    /// batch tries again.
    refused_exchanges: std::sync::Mutex<Vec<Bar>>,
}

/// One refusal in [`AmqpPublisher::refused_exchanges`].
struct Bar {
    target: Barred,
    /// When the broker refused.
    at: Instant,
    /// The reason given to its rows.
    reason: String,
    /// Whether its messages count an attempt each time they are refused:
    /// an internal exchange takes no client's publish, whatever the user
    /// may do, so the message fails on its own account and ends in the
    /// dead letters. A missing permission may be granted: its messages wait
    /// without attempts counted, like a paused destination's.
    counts: bool,
}

/// RabbitMQ's default `max_message_size` (since 3.8): 128 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 128 * 1024 * 1024;

/// RabbitMQ's default `frame_max`: 128 KiB.
const DEFAULT_FRAME_MAX: usize = 128 * 1024;

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("settings", &self.broker.settings)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// A publisher that connects on first use.
    pub fn new(settings: AmqpSettings) -> Self {
        AmqpPublisher {
            broker: Arc::new(Broker::new(settings)),
            max_message_size: AtomicUsize::new(DEFAULT_MAX_MESSAGE_SIZE),
            frame_max: AtomicUsize::new(DEFAULT_FRAME_MAX),
            cloudevents: None,
            progress: AtomicU64::new(0),
            origin: Instant::now(),
            pace: Pace::default(),
            refused_exchanges: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Publishes every message as a CloudEvent in binary content mode, with
    /// the RabbitMQ binding's `ce-` headers ([`super::cloudevents`]).
    pub fn with_cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    /// The bars in force on the relay's access to exchanges (or routing
    /// keys on them), each with what its messages are refused with: the
    /// broker refused that access less than [`EXCHANGE_CHECK_TTL`] ago.
    fn bars(&self) -> Vec<(Barred, Rejection)> {
        let mut bars = self
            .refused_exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if bars.is_empty() {
            return Vec::new();
        }
        bars.retain(|b| b.at.elapsed() < EXCHANGE_CHECK_TTL);
        bars.iter()
            .map(|b| {
                let left = EXCHANGE_CHECK_TTL.saturating_sub(b.at.elapsed());
                let rejection = match b.counts {
                    true => Rejection::retryable(b.reason.clone()),
                    // Not the message's own failure, and the broker is
                    // asked again only when the bar ends.
                    false => Rejection::unanswered(b.reason.clone()).for_at_least(left),
                };
                (b.target.clone(), rejection)
            })
            .collect()
    }

    /// Bars what an ACCESS_REFUSED channel close names in `reason`, among
    /// the exchanges and routing keys of `batch`; false when it names none
    /// of them and the batch has several exchanges.
    fn bar(&self, batch: &[Envelope], reason: &str) -> bool {
        let targets = batch
            .iter()
            .map(|env| (env.amqp_exchange(), env.routing_key.as_str()));
        let Some(bar) = refused_target(reason, targets) else {
            return false;
        };
        // RabbitMQ's words for a publish to an exchange declared internal.
        let internal = reason.contains("cannot publish to internal exchange");
        let row = if internal {
            tracing::warn!(
                exchange = bar.exchange,
                reason,
                "an exchange of the batch is internal and takes no publishes; its messages \
                 count attempts and go to the dead letters, the others go on"
            );
            format!(
                "exchange {:?} is internal: rabbitmq takes no publishes to it (declare it \
                 without `internal`, or send to an exchange bound to it): {reason}",
                bar.exchange
            )
        } else {
            tracing::warn!(
                exchange = bar.exchange,
                routing_key = bar.routing_key,
                reason,
                "rabbitmq refused the relay's user access; those messages wait, the others go on"
            );
            let what = match &bar.routing_key {
                Some(rk) => format!("routing key {rk:?} on exchange {:?}", bar.exchange),
                None => format!("exchange {:?}", bar.exchange),
            };
            format!(
                "rabbitmq refused the relay's user access to {what}; waiting, no attempts \
                 counted, until it is granted (tried again every {EXCHANGE_CHECK_TTL:?}): {reason}"
            )
        };
        let mut bars = self
            .refused_exchanges
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        bars.retain(|b| b.target != bar);
        bars.push(Bar {
            target: bar,
            at: Instant::now(),
            reason: row,
            counts: internal,
        });
        true
    }

    /// The verdicts of a batch whose channel RabbitMQ closed for an
    /// exchange of it (`closed`, the broker's reason): one that does not
    /// exist, or that the relay may not write to. What it confirmed before
    /// the close stands (the confirms that arrived by then, as for a lost
    /// connection); the rest goes again unanswered, without an attempt
    /// counted. The next batch refuses the messages of that exchange alone
    /// (checked again, or barred), and the others flow.
    async fn closed_about_an_exchange<P>(
        &self,
        closed: &str,
        mut outcomes: Vec<Option<Verdict>>,
        sent: &[(usize, String)],
        mut answers: Vec<Option<Answer>>,
        pending: P,
        channel: &lapin::Channel,
    ) -> Result<Vec<Verdict>, PublishError>
    where
        P: futures::Stream<Item = (usize, Answer)> + Unpin,
    {
        tracing::warn!(
            reason = closed,
            "rabbitmq closed the channel over an exchange of the batch; the batch's other \
             messages go again"
        );
        let trusted = harvest(channel, &mut answers, pending);
        for (i, outcome) in correlate_cut(sent, answers, &trusted)? {
            outcomes[i] = Some(outcome);
        }
        let reason = format!("rabbitmq closed the channel: {closed}");
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::unanswered(reason.clone()))))
            .collect())
    }
}

impl AmqpPublisher {
    /// When anything was last confirmed on any batch (or the publisher was
    /// made).
    fn last_progress(&self) -> tokio::time::Instant {
        let ms = self.progress.load(Ordering::Relaxed);
        tokio::time::Instant::from_std(self.origin) + Duration::from_millis(ms)
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

    fn note_progress(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.progress.fetch_max(ms, Ordering::Relaxed);
    }

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

/// Which confirms of a batch cut short may count (`true` at their index):
/// those that had arrived before any confirm frame then being handled was
/// done, since lapin hands a return to whichever confirm of that frame it
/// completes next. lapin completes each frame's confirms under the
/// channel's lock, so taking that lock once ends the frame in progress;
/// the confirms that arrived by then, added to `answers`, carry every
/// return of the counted ones.
fn harvest<P>(channel: &lapin::Channel, answers: &mut [Option<Answer>], mut pending: P) -> Vec<bool>
where
    P: futures::Stream<Item = (usize, Answer)> + Unpin,
{
    let trusted: Vec<bool> = answers.iter().map(Option::is_some).collect();
    let _ = channel.wait_for_confirms().now_or_never();
    while let Some(Some((j, answer))) = pending.next().now_or_never() {
        if matches!(answer, Answer::Confirmed { .. }) {
            answers[j] = Some(answer);
        }
    }
    trusted
}

impl Publisher for AmqpPublisher {
    /// RabbitMQ's default until the broker says less (see
    /// `max_message_size`).
    fn max_payload_bytes(&self) -> Option<(usize, &'static str)> {
        Some((
            self.max_message_size.load(Ordering::Relaxed),
            "rabbitmq's max_message_size",
        ))
    }

    /// Headers travel in one frame, whatever the message's size.
    fn max_header_bytes(&self) -> Option<(usize, &'static str)> {
        Some((
            self.frame_max.load(Ordering::Relaxed),
            "the connection's frame size (rabbitmq's frame_max)",
        ))
    }

    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Verdict>, PublishError> {
        let deadline = tokio::time::Instant::now() + self.broker.settings.confirm_timeout;
        self.publish_until(batch, deadline).await
    }

    fn batch_bytes(&self) -> Option<usize> {
        self.pace.limit()
    }

    async fn publish_until(
        &self,
        batch: &[Envelope],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Verdict>, PublishError> {
        let started = tokio::time::Instant::now();
        // The link's set-up runs on in its own task if it outlasts half the
        // batch's time: a batch sent later than that would likely be cut
        // short at its deadline, sent again, and take the link with it.
        // Given back unsent, its rows are claimed again with a full budget
        // and find the set-up done.
        let halfway = started + (deadline.saturating_duration_since(started)) / 2;
        let Prepared {
            connection,
            missing,
            channel,
        } = match tokio::time::timeout_at(halfway, self.broker.prepare(batch)).await {
            Ok(prepared) => prepared?,
            Err(_) => {
                return Err(PublishError::unsent(format!(
                    "setting up the link to rabbitmq took over half the batch's time ({:?}); given back unsent",
                    halfway - started
                )))
            }
        };
        // From here frames of the batch may be queued on the connection.
        let mut handed = Handed {
            broker: self.broker.clone(),
            connection: connection.clone(),
            done: false,
        };

        let bars = self.bars();
        let mut outcomes: Vec<Option<Verdict>> = vec![None; batch.len()];
        // Keys with a message refused here: their later messages are not sent
        // (they wait for the refused one, like after a broker refusal).
        let mut refused: HashSet<&str> = HashSet::new();
        let mut sent = Vec::with_capacity(batch.len());
        let mut pending = FuturesUnordered::new();
        // Why a publish failed, which ends the sending: the rest of the batch
        // waits in the outbox for the next attempt.
        let mut failed = None;
        // Negotiated once per connection; read once per batch, not per message.
        let frame_max = connection.configuration().frame_max();
        if frame_max > 0 {
            // 0 would say no limit, which RabbitMQ never negotiates.
            self.frame_max.store(frame_max as usize, Ordering::Relaxed);
        }
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
            } else if let Some((_, rejection)) = bars
                .iter()
                .find(|(bar, _)| bar.bars(exchange, &env.routing_key))
            {
                Err(rejection.clone())
            } else if let Some(r) = self.refuse_locally(env) {
                Err(r)
            } else {
                match (
                    ShortString::try_new(exchange),
                    ShortString::try_new(env.routing_key.as_str()),
                ) {
                    (Ok(x), Ok(rk)) => properties(env, self.cloudevents.as_ref()).and_then(|p| {
                        check_header_frame(&p, frame_max)?;
                        Ok((x, rk, p))
                    }),
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
            // basic_publish registers the confirm and queues the frames when
            // first polled, then waits for the connection's I/O thread to
            // write them. Polling each once here, in batch order, keeps the
            // broker's order and lets the whole batch go out in a few writes;
            // awaiting each in turn cost a hand-off to that thread and back
            // per message. The broker's answer is the confirm, awaited below
            // for the whole batch at once.
            let mut handed = Box::pin(channel.basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &env.payload,
                props,
            ));
            let handed = match futures::poll!(handed.as_mut()) {
                Poll::Ready(Err(e)) => {
                    failed = Some(e);
                    break;
                }
                Poll::Ready(Ok(confirm)) => Either::Left(ready(Ok(confirm))),
                Poll::Pending => Either::Right(handed),
            };
            let j = sent.len();
            sent.push((i, env.message_id.to_string()));
            pending.push(async move {
                let answer = async {
                    let confirm = match handed.await {
                        Ok(confirm) => confirm,
                        Err(e) => return Answer::Lost(e),
                    };
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
                };
                (j, answer.await)
            });
        }

        // The confirms, as they come, until the last, the deadline, a lost
        // connection, or confirm_timeout without any confirm on the
        // connection.
        let mut answers: Vec<Option<Answer>> = Vec::new();
        answers.resize_with(sent.len(), || None);
        let mut answered = 0usize;
        let mut lost = None;
        // One timer for the batch, moved on only when it fires: the
        // confirms arrive with no timer work each. It starts once the batch
        // is handed over: connecting and opening a channel, a round trip
        // each to a broker that answers slowly, are not a wait for
        // confirms (half the batch's time bounds them, above).
        let mut since = tokio::time::Instant::now();
        let quiet =
            tokio::time::sleep_until((since + self.broker.settings.confirm_timeout).min(deadline));
        tokio::pin!(quiet);
        let cut = loop {
            tokio::select! {
                biased;
                next = pending.next() => match next {
                    None => break None,
                    Some((_, Answer::Lost(e))) => {
                        lost = Some(e);
                        break None;
                    }
                    Some((j, answer)) => {
                        self.note_progress();
                        answers[j] = Some(answer);
                        answered += 1;
                    }
                },
                () = &mut quiet => {
                    if tokio::time::Instant::now() >= deadline {
                        break Some(format!(
                            "rabbitmq had confirmed {answered} of {} messages when the batch's time ran out ({:?})",
                            sent.len(),
                            deadline - started
                        ));
                    }
                    // Confirmed anything meanwhile, this batch or another:
                    // the link is alive.
                    let last = self.last_progress();
                    if last <= since {
                        let timeout = self.broker.settings.confirm_timeout;
                        let alone = match sent.as_slice() {
                            [(i, _)] => alone_too_slow(batch[*i].payload.len(), timeout),
                            _ => None,
                        };
                        break Some(match alone {
                            Some(hint) => format!("no confirms from rabbitmq: {hint}"),
                            None => format!("no confirms from rabbitmq within {timeout:?}"),
                        });
                    }
                    since = last;
                    quiet.as_mut().reset((since + self.broker.settings.confirm_timeout).min(deadline));
                }
            }
        };
        // Whatever the broker answers from here is not read: the cut below
        // drops the connection itself where frames may still be queued.
        handed.done = true;
        if let Some(e) = &lost {
            self.learn_size_limit(e);
        }
        // RabbitMQ closes the channel at a publish to an exchange that does
        // not exist (one of the batch's was deleted since it was last
        // checked: an auto-delete exchange whose last binding went, a
        // topology torn down), or that the relay's user may not write to
        // (a new destination whose permission was forgotten). Either is an
        // answer about one exchange, not an outage, and must not hold up
        // the batch's other exchanges.
        let closed = [lost.as_ref(), failed.as_ref()]
            .into_iter()
            .flatten()
            .find(|e| is_not_found(e) || is_access_refused(e));
        if let Some(e) = closed {
            let reason = e.to_string();
            let understood = if is_not_found(e) {
                self.broker.forget_exchanges(batch).await;
                true
            } else {
                self.bar(batch, &reason)
            };
            if understood {
                return self
                    .closed_about_an_exchange(&reason, outcomes, &sent, answers, pending, &channel)
                    .await;
            }
        }
        if let Some(e) = failed {
            // A channel the broker closed mid-batch fails the publishes after
            // the close with a bare "channel closed"; its reason (a size limit,
            // say) reached only the confirms already handed over, read above.
            self.learn_size_limit(&e);
            if cut.is_some() && !connection.status().blocked() {
                self.broker.drop_link(&connection, "confirm timeout").await;
            }
            return Err(PublishError::new("publish failed", e));
        }
        if cut.is_none() && lost.is_none() {
            let all = answers
                .into_iter()
                .map(|a| a.expect("every confirm arrived"))
                .collect();
            for (i, outcome) in correlate(&sent, all)? {
                outcomes[i] = Some(outcome);
            }
            drop(pending);
            let carried = sent.iter().map(|(i, _)| batch[*i].payload.len()).sum();
            self.pace
                .speed_up(carried, started.elapsed(), deadline - started);
            self.broker.give_back(&connection, channel).await;
        } else {
            // Cut short, or the connection lost: what the broker confirmed
            // stands, the rest goes again later, its keys behind it (see
            // `harvest` for which confirms count).
            let trusted = harvest(&channel, &mut answers, pending);
            let confirmed = trusted.iter().filter(|t| **t).count();
            let reason = match (&cut, &lost) {
                (Some(reason), _) => reason.clone(),
                (None, Some(e)) => format!("connection lost before confirm: {e}"),
                (None, None) => unreachable!("checked above"),
            };
            if cut.is_some() {
                // Frames of this batch may still be queued on the
                // connection: dropping it bounds the copies to what already
                // left. On a connection the broker blocked (a resource
                // alarm) the batch fails whole, as in any outage: the
                // broker is down, not slow. That connection is kept: lapin
                // writes nothing on it, not even a close, so a dropped one
                // stayed open with its frames queued, and a new one took
                // the next batches until it too was blocked; when the alarm
                // cleared, each delivered its batches. Kept, it refuses
                // every later batch before sending (see `Handed`), and only
                // its own frames go once the alarm clears.
                let blocked = connection.status().blocked();
                if blocked {
                    // Its close goes behind its publishes, once the alarm
                    // clears: the kept connection must not gather channels.
                    let channel = channel.clone();
                    tokio::spawn(async move {
                        let _ = channel.close(200, "batch cut".into()).await;
                    });
                } else {
                    self.broker.drop_link(&connection, "confirm timeout").await;
                }
                if confirmed == 0 || blocked {
                    return Err(PublishError::msg(reason));
                }
                let delivered = sent
                    .iter()
                    .zip(&trusted)
                    .filter(|(_, t)| **t)
                    .map(|((i, _), _)| batch[*i].payload.len())
                    .sum();
                self.pace.slow_down(delivered, "rabbitmq");
            } else if confirmed == 0 {
                return Err(PublishError::new(
                    "connection lost before confirm",
                    lost.expect("a lost connection, cut is none"),
                ));
            }
            for (i, outcome) in correlate_cut(&sent, answers, &trusted)? {
                outcomes[i] = Some(outcome);
            }
            for (i, _) in &sent {
                outcomes[*i].get_or_insert_with(|| Err(Rejection::unanswered(reason.clone())));
            }
        }
        // Every slot was filled above: either refused before sending or answered.
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::retryable("no answer"))))
            .collect())
    }

    /// A connection the broker blocked (a memory or disk alarm) is up but
    /// takes nothing: that is not ready, or the probe would report the
    /// broker back between every two batches the alarm refuses.
    async fn ready(&self) -> Result<(), PublishError> {
        // The probe stops waiting after a while; a connection under way
        // then ends all the same, for the next batch.
        let connection = self
            .broker
            .detached(|broker| async move { broker.connection().await })
            .await?;
        if connection.status().blocked() {
            return Err(PublishError::msg(BLOCKED));
        }
        Ok(())
    }

    async fn close(&self) {
        self.broker.close().await;
    }
}

/// A batch's frames handed to the connection, until its confirms have been
/// read. A batch dropped in between (the relay gave it up at its deadline)
/// takes the connection with it, unless the broker blocked it: what is
/// still queued on it could reach the broker after the rows went back to
/// the outbox, and copies stay bounded to what already left. On a
/// connection the broker blocked (a resource alarm), lapin writes nothing
/// until the alarm clears, and every later batch is refused before
/// sending, so keeping it bounds the copies as well.
///
/// A batch given up before this point had sent nothing: the link and
/// whatever its set-up had opened stay for the next batch.
struct Handed {
    broker: Arc<Broker>,
    connection: Arc<Connection>,
    done: bool,
}

impl Drop for Handed {
    fn drop(&mut self) {
        if self.done || self.connection.status().blocked() {
            return;
        }
        // Outside a runtime (one shutting down) the connection goes with it.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.broker
                .drop_link_now(&self.connection, "batch abandoned");
        }
    }
}
