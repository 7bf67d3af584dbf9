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
    brokers: String,
    properties: Vec<(String, String)>,
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
        let consumer = assigned(
            brokers,
            properties,
            &topic,
            (0..partitions).map(|p| (p, Offset::Beginning)),
        );
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
                sink.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(record(&m));
            }
        });
        Fixture {
            topic,
            brokers: brokers.to_owned(),
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
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

    /// Reads again, with a fresh consumer, every offset range the live
    /// consumer skipped between two offsets it read, and adds what it finds.
    /// Returns how many records were added.
    ///
    /// A Kafka broker makes offsets visible in order, so a live consumer never
    /// skips one. tansu does not always: it hands out a produce request's
    /// offsets before it stores the records, so a later request can become
    /// readable first, and a consumer reading at the tail then moves past the
    /// earlier one. The records are there when read again. Without this the
    /// suites would blame the relay for a record the broker confirmed and
    /// holds at the offset it gave.
    pub async fn read_skipped(&self) -> usize {
        let mut found = 0;
        for (partition, from, until) in gaps(&self.records()) {
            let again = read_range(
                &self.brokers,
                &self.properties,
                &self.topic,
                partition,
                from,
                until,
            )
            .await;
            let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
            let have: std::collections::HashSet<(i32, i64)> =
                records.iter().map(|r| (r.partition, r.offset)).collect();
            for r in again {
                if !have.contains(&(r.partition, r.offset)) {
                    records.push(r);
                    found += 1;
                }
            }
        }
        found
    }

    /// Stops consuming.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// A consumer assigned to `topic`'s `partitions`, each from its offset.
fn assigned(
    brokers: &str,
    properties: &[(&str, &str)],
    topic: &str,
    partitions: impl Iterator<Item = (i32, Offset)>,
) -> StreamConsumer {
    let consumer: StreamConsumer = client_config(brokers, properties)
        .set("group.id", crate::unique("g"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for (p, offset) in partitions {
        tpl.add_partition_offset(topic, p, offset)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    consumer
}

fn record(m: &rdkafka::message::BorrowedMessage<'_>) -> Record {
    let headers = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Record {
        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        headers,
        payload: m.payload().unwrap_or_default().to_vec(),
        partition: m.partition(),
        offset: m.offset(),
    }
}

/// Offset ranges `[from, until)` missing between two offsets read, per
/// partition.
pub fn gaps(records: &[Record]) -> Vec<(i32, i64, i64)> {
    let mut offsets: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for r in records {
        offsets.entry(r.partition).or_default().push(r.offset);
    }
    let mut out = Vec::new();
    for (partition, mut o) in offsets {
        o.sort_unstable();
        o.dedup();
        out.extend(
            o.windows(2)
                .filter(|w| w[1] != w[0] + 1)
                .map(|w| (partition, w[0] + 1, w[1])),
        );
    }
    out
}

/// Reads `partition` of `topic` from `from` until an offset at or past
/// `until`, giving up after ten seconds without a record.
async fn read_range(
    brokers: &str,
    properties: &[(String, String)],
    topic: &str,
    partition: i32,
    from: i64,
    until: i64,
) -> Vec<Record> {
    let properties: Vec<(&str, &str)> = properties
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let consumer = assigned(
        brokers,
        &properties,
        topic,
        std::iter::once((partition, Offset::Offset(from))),
    );
    let mut stream = consumer.stream();
    let mut out = Vec::new();
    while let Ok(Some(next)) = tokio::time::timeout(Duration::from_secs(10), stream.next()).await {
        let Ok(m) = next else { continue };
        if m.offset() >= until {
            break;
        }
        out.push(record(&m));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    fn at(partition: i32, offset: i64) -> Record {
        Record {
            key: None,
            headers: BTreeMap::new(),
            payload: Vec::new(),
            partition,
            offset,
        }
    }

    #[test]
    fn gaps_are_the_ranges_between_offsets_read() {
        let records: Vec<Record> = [
            (0, 0),
            (0, 1),
            (0, 5),
            (1, 3),
            (0, 2),
            (1, 4),
            (0, 9),
            (0, 9),
        ]
        .into_iter()
        .map(|(p, o)| at(p, o))
        .collect();
        assert_eq!(gaps(&records), vec![(0, 3, 5), (0, 6, 9)]);
        assert!(gaps(&[]).is_empty());
    }

    /// The live consumer's record list loses a range, as when tansu made a
    /// later offset readable first; reading again finds exactly that range,
    /// and a second pass finds nothing more.
    #[tokio::test]
    async fn a_skipped_range_is_read_again() {
        let brokers = crate::kafka_brokers();
        let kafka = Fixture::new(&brokers, 1).await;
        let producer: FutureProducer = client_config(&brokers, &[]).create().expect("producer");
        for i in 0..20 {
            let payload = i.to_string();
            producer
                .send(
                    FutureRecord::<(), _>::to(&kafka.topic).payload(&payload),
                    Duration::from_secs(10),
                )
                .await
                .expect("delivered");
        }
        assert!(
            crate::eventually(Duration::from_secs(60), || async { kafka.count() == 20 }).await,
            "the consumer read {} of 20",
            kafka.count()
        );
        kafka
            .records
            .lock()
            .expect("records")
            .retain(|r| !(5..12).contains(&r.offset));
        assert_eq!(gaps(&kafka.records()), vec![(0, 5, 12)]);
        assert_eq!(kafka.read_skipped().await, 7);
        let mut offsets: Vec<i64> = kafka.records().iter().map(|r| r.offset).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, (0..20).collect::<Vec<_>>());
        // One producer sending in turn: record i sits at offset i.
        for r in kafka.records() {
            assert_eq!(String::from_utf8_lossy(&r.payload), r.offset.to_string());
        }
        assert_eq!(kafka.read_skipped().await, 0);
        kafka.stop().await;
    }
}
