//! Kafka fixtures: a fresh topic and an independent consumer that records every
//! record with its key, headers, partition and offset.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

/// One record as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Record {
    /// Record key as text.
    pub key: Option<String>,
    /// Headers as text.
    pub headers: BTreeMap<String, String>,
    /// Value.
    pub payload: Vec<u8>,
    /// Partition it was read from.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
}

/// Creates `topic` with `partitions` partitions on `brokers`.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    create_topic_with(brokers, &[], topic, partitions).await;
}

fn client_config(brokers: &str, properties: &[(&str, &str)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in properties {
        config.set(*k, *v);
    }
    config
}

/// [`create_topic`] with extra client properties (e.g. TLS).
pub async fn create_topic_with(
    brokers: &str,
    properties: &[(&str, &str)],
    topic: &str,
    partitions: i32,
) {
    let admin: AdminClient<DefaultClientContext> = client_config(brokers, properties)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic request");
    for r in results {
        r.expect("topic created");
    }
}

/// A topic and a consumer reading every partition from the beginning.
pub struct Fixture {
    /// Topic name (use it as the outbox destination).
    pub topic: String,
    records: Arc<Mutex<Vec<Record>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Fixture {
    /// Creates a fresh topic with `partitions` partitions and starts consuming.
    pub async fn new(brokers: &str, partitions: i32) -> Fixture {
        let topic = crate::unique("t");
        create_topic(brokers, &topic, partitions).await;
        Fixture::consume(brokers, &topic, partitions)
    }

    /// Starts consuming an existing topic's `partitions` from the beginning.
    pub fn consume(brokers: &str, topic: &str, partitions: i32) -> Fixture {
        Fixture::consume_with(brokers, &[], topic, partitions)
    }

    /// [`Fixture::new`] with extra client properties (e.g. TLS).
    pub async fn new_with(brokers: &str, properties: &[(&str, &str)], partitions: i32) -> Fixture {
        let topic = crate::unique("t");
        create_topic_with(brokers, properties, &topic, partitions).await;
        Fixture::consume_with(brokers, properties, &topic, partitions)
    }

    /// [`Fixture::consume`] with extra client properties (e.g. TLS).
    pub fn consume_with(
        brokers: &str,
        properties: &[(&str, &str)],
        topic: &str,
        partitions: i32,
    ) -> Fixture {
        let topic = topic.to_owned();
        let consumer: StreamConsumer = client_config(brokers, properties)
            .set("group.id", crate::unique("g"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(&topic, p, Offset::Beginning)
                .expect("partition");
        }
        consumer.assign(&tpl).expect("assign");
        let records = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let sink = Arc::clone(&records);
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut stream = consumer.stream();
            loop {
                let next = tokio::select! {
                    _ = token.cancelled() => return,
                    n = stream.next() => n,
                };
                let Some(Ok(m)) = next else {
                    // Transient consumer errors (broker restarting) are retried
                    // by librdkafka itself.
                    continue;
                };
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    String::from_utf8_lossy(h.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(Record {
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    headers,
                    payload: m.payload().unwrap_or_default().to_vec(),
                    partition: m.partition(),
                    offset: m.offset(),
                });
            }
        });
        Fixture {
            topic,
            records,
            stop,
            task,
        }
    }

    /// Everything received so far.
    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many records so far.
    pub fn count(&self) -> usize {
        self.records.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Stops consuming.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
