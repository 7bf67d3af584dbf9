//! Brokers, behind one boundary.
//!
//! A [`Publisher`] takes a batch of claimed rows and resolves only when the broker
//! has answered for every one of them. A message counts as published only on the
//! broker's own "yes": an AMQP publisher-confirm Ack that was not preceded by a
//! return, or a Kafka delivery report without error. Anything else is a
//! [`Rejection`] for that message, or a [`PublishError`] for the whole batch.

use std::future::Future;

pub use crate::envelope::{Envelope, Receipt};

pub mod amqp;
pub mod cloudevents;
pub mod kafka;
pub mod memory;
pub mod pace;

/// Part of the broker that leaves the relay's messages unanswered while the
/// rest answers: a Kafka partition without a reachable leader. The relay
/// holds its records back (see `kafka::silent`), and reports it in the
/// replica's heartbeat, so `status` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SilentPartition {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// Since when it has been silent.
    pub since: std::time::SystemTime,
}

/// Why the broker did not accept one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Human-readable reason, recorded in the row's `last_error`.
    pub reason: String,
    /// True when retrying the same message can never succeed (e.g. too large).
    pub permanent: bool,
    /// True when the broker said nothing about the message itself: it went
    /// unanswered (a partition without a leader, a request that timed out)
    /// while others of its batch were confirmed. Like a batch lost to an
    /// outage, it is sent again without counting an attempt.
    pub unanswered: bool,
    /// For an unanswered message, how long at least its row is set aside
    /// before it is claimed again (the publisher knows it will hold it back
    /// until then).
    pub wait: Option<std::time::Duration>,
}

impl Rejection {
    /// A rejection that may succeed later (unroutable until a binding exists, nack).
    pub fn retryable(reason: impl Into<String>) -> Self {
        Rejection {
            reason: reason.into(),
            permanent: false,
            unanswered: false,
            wait: None,
        }
    }

    /// A rejection that can never succeed for this message.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Rejection {
            reason: reason.into(),
            permanent: true,
            unanswered: false,
            wait: None,
        }
    }

    /// A message the broker left unanswered while it answered others of
    /// the batch: sent again shortly, no attempt counted.
    pub fn unanswered(reason: impl Into<String>) -> Self {
        Rejection {
            reason: reason.into(),
            permanent: false,
            unanswered: true,
            wait: None,
        }
    }

    /// This rejection, its row set aside for `wait` at least.
    pub fn for_at_least(mut self, wait: std::time::Duration) -> Self {
        self.wait = Some(wait);
        self
    }
}

/// The broker's answer for one message of a batch, in batch order.
pub type Verdict = Result<Receipt, Rejection>;

/// The whole batch could not be published: the broker is unreachable, the
/// connection dropped, or confirms did not arrive in time. Every message of the
/// batch is to be retried; none counts toward poisoning.
#[derive(Debug, thiserror::Error)]
#[error("{context}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
pub struct PublishError {
    context: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    unsent: bool,
}

impl PublishError {
    /// A batch failure with a reason and its cause.
    pub fn new(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        PublishError {
            context: context.into(),
            source: Some(source.into()),
            unsent: false,
        }
    }

    /// A batch failure with only a reason.
    pub fn msg(context: impl Into<String>) -> Self {
        PublishError {
            context: context.into(),
            source: None,
            unsent: false,
        }
    }

    /// Nothing of the batch was sent: the publisher gave it back because
    /// setting up the link (connecting, opening a channel) took half its
    /// time, and the set-up goes on for the batches after it. Not a broker
    /// failure: the relay claims the rows again at once, with a full budget.
    pub fn unsent(context: impl Into<String>) -> Self {
        PublishError {
            context: context.into(),
            source: None,
            unsent: true,
        }
    }

    /// Whether this is [`PublishError::unsent`].
    pub fn is_unsent(&self) -> bool {
        self.unsent
    }
}

/// A broker the relay can publish to.
///
/// Implementations must keep the order of the batch on the wire for messages that
/// share an ordering key, and must pipeline: send the whole batch, then await the
/// answers, never one message at a time.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `batch` and returns one outcome per envelope, in order.
    fn publish<'a>(
        &'a self,
        batch: &'a [Envelope],
    ) -> impl Future<Output = Result<Vec<Verdict>, PublishError>> + Send + 'a;

    /// [`Publisher::publish`], answering by `deadline` at the latest: a
    /// broker still confirming at the deadline is not waited for, and the
    /// messages it confirmed by then are reported as published, the rest as
    /// unanswered. The default ignores the deadline.
    fn publish_until<'a>(
        &'a self,
        batch: &'a [Envelope],
        deadline: tokio::time::Instant,
    ) -> impl Future<Output = Result<Vec<Verdict>, PublishError>> + Send + 'a {
        let _ = deadline;
        self.publish(batch)
    }

    /// The most payload bytes a batch should carry now, if fewer than the
    /// relay's limit: a broker that takes bytes slower than the batches in
    /// flight can cross before their deadline learns a smaller size here.
    /// The default never asks for less.
    fn batch_bytes(&self) -> Option<usize> {
        None
    }

    /// The largest payload the broker can take, if known, with the name of
    /// the limit: a row larger is dead-lettered without being read (its
    /// size is known first), since reading it could take more memory than
    /// the relay has. The default knows none.
    fn max_payload_bytes(&self) -> Option<(usize, &'static str)> {
        None
    }

    /// The most header bytes a message can carry, if known, with the name
    /// of the limit; by default the same as [`Publisher::max_payload_bytes`]
    /// (Kafka's limit is the whole record's). A row whose headers are well
    /// over it is dead-lettered without being read.
    fn max_header_bytes(&self) -> Option<(usize, &'static str)> {
        self.max_payload_bytes()
    }

    /// Whether two messages of one key share their fate at the broker: if the
    /// first is refused, so is the second. The relay sends a key's messages in
    /// one go only while they share a lane; at a lane change it waits for the
    /// earlier messages' answers first, so a refused message is never overtaken.
    ///
    /// The default (same exchange and routing key) fits AMQP, where routing
    /// decides returns.
    fn same_lane(&self, a: &Envelope, b: &Envelope) -> bool {
        a.destination == b.destination && a.routing_key == b.routing_key
    }

    /// Checks that the broker can be reached and would take messages now,
    /// connecting if needed. The relay's probe calls it every few seconds;
    /// an error keeps the broker reported down (logs, `status`) between
    /// batches.
    fn ready(&self) -> impl Future<Output = Result<(), PublishError>> + Send + '_;

    /// The parts of the broker that are silent now. The probe reads it with
    /// each check. The default has none.
    fn silent_partitions(&self) -> Vec<SilentPartition> {
        Vec::new()
    }

    /// Called when a batch was given up mid-publish (it ran past its
    /// deadline): drop whatever could still send its messages later, so the
    /// copies an abandoned batch can leave behind stay bounded. The default
    /// does nothing.
    fn abandon(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::ready(())
    }

    /// Waits for everything handed to the broker to be answered, then disconnects.
    fn close(&self) -> impl Future<Output = ()> + Send + '_;
}
