//! Kafka (rdkafka) consumers that apply each record once.
//!
//! Run the consumer with `enable.auto.commit=false`: the offset of a record is
//! committed here, after the database commit of its effect. A crash between the
//! two re-reads the record from the last committed offset, and its
//! `message-id` header is then found in the inbox.
//!
//! ```no_run
//! # use outbox_client::consumer::Handler;
//! # struct Credit;
//! # impl<'a> Handler<rdkafka::message::BorrowedMessage<'a>> for Credit {
//! #     type Error = tokio_postgres::Error;
//! #     async fn handle(&self, tx: &tokio_postgres::Transaction<'_>, m: &rdkafka::message::BorrowedMessage<'a>) -> Result<(), Self::Error> { Ok(()) }
//! # }
//! # async fn example(db: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::consumer::kafka::KafkaInbox;
//! use outbox_client::inbox::Inbox;
//! use rdkafka::consumer::{Consumer, StreamConsumer};
//!
//! let consumer: StreamConsumer = rdkafka::ClientConfig::new()
//!     .set("bootstrap.servers", "127.0.0.1:9092")
//!     .set("group.id", "billing")
//!     .set("enable.auto.commit", "false")
//!     .create()?;
//! consumer.subscribe(&["orders"])?;
//! let inbox = KafkaInbox::new(Inbox::default(), "billing")?;
//! loop {
//!     let record = consumer.recv().await?;
//!     if let Err(e) = inbox.handle(db, &consumer, &record, &Credit).await {
//!         tracing::warn!(error = %e, "record will be read again");
//!     }
//! }
//! # }
//! ```

use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_postgres::Client;

use super::{apply_once, usable_id, ConsumeError, Handler};
use crate::inbox::{check_key, Arrival, Inbox};
use crate::Error;

/// The record header that carries the message id (set by `outbox-relay`).
pub const MESSAGE_ID_HEADER: &str = "message-id";

/// What to do with a record that has no `message-id` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingIdPolicy {
    /// Commit past it without applying it: a partition is not blocked by one
    /// foreign record. The record stays in the topic for inspection.
    #[default]
    Skip,
    /// Seek back to it: every read of the partition returns it again until an
    /// operator steps in. For topics where skipping a record is worse than
    /// stopping.
    Halt,
}

/// Applies Kafka records once per `message-id` header, for one named consumer.
#[derive(Debug, Clone)]
pub struct KafkaInbox {
    inbox: Inbox,
    consumer: String,
    missing_id: MissingIdPolicy,
    commit_mode: CommitMode,
    seek_timeout: Duration,
}

impl KafkaInbox {
    /// A consumer named `consumer`. Use one name per logical consumer, shared
    /// by all its replicas; the consumer group id is a natural choice.
    pub fn new(inbox: Inbox, consumer: impl Into<String>) -> Result<Self, Error> {
        let consumer = consumer.into();
        check_key("consumer name", &consumer)?;
        Ok(KafkaInbox {
            inbox,
            consumer,
            missing_id: MissingIdPolicy::default(),
            commit_mode: CommitMode::Sync,
            seek_timeout: Duration::from_secs(10),
        })
    }

    /// Sets the policy for records without a message id.
    pub fn missing_id(mut self, policy: MissingIdPolicy) -> Self {
        self.missing_id = policy;
        self
    }

    /// How offsets are committed. The default, [`CommitMode::Sync`], returns
    /// only once the broker has the offset. [`CommitMode::Async`] saves a round
    /// trip per record; a commit lost in a crash only causes a re-read, which the
    /// inbox recognizes.
    pub fn commit_mode(mut self, mode: CommitMode) -> Self {
        self.commit_mode = mode;
        self
    }

    /// How long a seek back to a failed record may wait for the fetcher
    /// (default 10 s). Waiting is what guarantees that records fetched after the
    /// failed one are discarded rather than handed out ahead of it.
    pub fn seek_timeout(mut self, timeout: Duration) -> Self {
        self.seek_timeout = timeout;
        self
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Processes one record: inbox check and handler in one transaction, commit,
    /// then commit the record's offset. A duplicate's offset is committed too and
    /// it returns `Ok(Arrival::Duplicate)`.
    ///
    /// On a handler or database error nothing is committed and the consumer is
    /// sought back to this record, so the next read returns it again (Kafka has
    /// no per-record nack; without the seek, committing a later record would
    /// commit past this one). Records must be handled one at a time per
    /// partition, in order.
    ///
    /// The offset commit and the seek are blocking librdkafka calls; on a
    /// multi-threaded runtime they run via `block_in_place`.
    pub async fn handle<C, X, M, H>(
        &self,
        client: &mut Client,
        consumer: &C,
        record: &M,
        handler: &H,
    ) -> Result<Arrival, ConsumeError<H::Error>>
    where
        C: Consumer<X>,
        X: ConsumerContext + 'static,
        M: Message + Sync,
        H: Handler<M>,
    {
        let message_id = record.headers().and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == MESSAGE_ID_HEADER)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .filter(|v| usable_id(v))
                .map(str::to_owned)
        });
        let Some(message_id) = message_id else {
            tracing::warn!(
                consumer = %self.consumer,
                topic = record.topic(),
                partition = record.partition(),
                offset = record.offset(),
                policy = ?self.missing_id,
                "record without a usable message id"
            );
            match self.missing_id {
                MissingIdPolicy::Skip => self.commit(consumer, record)?,
                MissingIdPolicy::Halt => self.seek_back(consumer, record)?,
            }
            return Err(ConsumeError::MissingMessageId);
        };
        match apply_once(
            client,
            &self.inbox,
            &self.consumer,
            &message_id,
            record,
            handler,
        )
        .await
        {
            Ok(outcome) => {
                self.commit(consumer, record)?;
                tracing::debug!(
                    consumer = %self.consumer,
                    message_id = %message_id,
                    ?outcome,
                    "offset committed"
                );
                Ok(outcome)
            }
            Err(e) => {
                tracing::warn!(
                    consumer = %self.consumer,
                    message_id = %message_id,
                    error = %e,
                    "record will be read again"
                );
                self.seek_back(consumer, record)?;
                Err(e)
            }
        }
    }

    fn commit<C, X, M, E>(&self, consumer: &C, record: &M) -> Result<(), ConsumeError<E>>
    where
        C: Consumer<X>,
        X: ConsumerContext + 'static,
        M: Message,
    {
        // The committed offset is the next record to read.
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(
            record.topic(),
            record.partition(),
            Offset::Offset(record.offset() + 1),
        )
        .map_err(ConsumeError::Kafka)?;
        let mode = self.commit_mode;
        blocking(|| consumer.commit(&tpl, mode)).map_err(ConsumeError::Kafka)
    }

    fn seek_back<C, X, M, E>(&self, consumer: &C, record: &M) -> Result<(), ConsumeError<E>>
    where
        C: Consumer<X>,
        X: ConsumerContext + 'static,
        M: Message,
    {
        blocking(|| {
            consumer.seek(
                record.topic(),
                record.partition(),
                Offset::Offset(record.offset()),
                self.seek_timeout,
            )
        })
        .map_err(ConsumeError::Kafka)
    }
}

/// Runs a blocking librdkafka call without stalling the other tasks of a
/// multi-threaded runtime.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}
