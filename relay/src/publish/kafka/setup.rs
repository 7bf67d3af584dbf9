//! Whether a producer is set up to send a topic's records at once.
//!
//! librdkafka counts a record's `message.timeout.ms` from the moment the
//! record is handed to it. Before the first record can go out, the producer
//! needs a connection, a producer id (idempotence) and the partitions of
//! the record's topic: several round trips. On a link whose round trip is
//! half the message timeout, records handed over at once time out in the
//! queue, or are sent too late and time out in flight. One that times out
//! in flight makes librdkafka bump its epoch, which starts the wait over.
//! A broker that then fences the producer makes the relay build a new one,
//! which starts from nothing.
//!
//! So a batch's records are handed over only once the producer has its id
//! and knows their topics. Getting them goes on apart from any batch: a
//! batch that cannot wait longer gives its rows back unsent, and the next
//! batch finds the set-up further along.
//!
//! The id shows only in librdkafka's statistics, the first of which comes
//! a whole interval after the producer is created, however soon the id
//! came. On a link that answers at once that wait was most of a new
//! relay's start: its first Kafka batch settled about 500 ms after start,
//! against about 50 ms to a broker answering at once. librdkafka asks for
//! the id as soon as it has a connection to a broker, which an answer
//! about the topics' partitions shows it has. So while a new producer has
//! not yet reported any statistics, a set-up that got its topics'
//! partitions within [`SetUp::quick`] of the producer's creation is taken
//! as a link fast enough for the id to follow within a round trip: the
//! records wait for it in librdkafka's queue, a small part of their
//! message timeout. Any later wait for an id (a slower set-up, an epoch
//! bump) is waited out as the statistics show it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::types::RDKafkaRespErr;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::producer::Deliveries;

/// How often librdkafka reports its statistics, which carry its
/// idempotence state: how late a producer's new id is noticed.
pub(super) const STATISTICS_INTERVAL: Duration = Duration::from_millis(500);

/// What a producer still lacks, and since when.
#[derive(Debug)]
pub(super) struct Missing {
    pub(super) what: String,
    pub(super) since: Instant,
}

/// A producer's set-up, as far as the relay can tell.
pub(super) struct SetUp {
    state: Mutex<State>,
    changed: Notify,
    /// When the producer was created.
    created: Instant,
    /// How soon after the producer's creation its topics must be known for
    /// its id not to be waited for before its first statistics (see the
    /// module's documentation): the smaller of the statistics interval and
    /// a tenth of the message timeout.
    quick: Duration,
}

struct State {
    /// Since when the producer has been without a producer id: since it
    /// was created, or since librdkafka's statistics last showed it
    /// drained for a new epoch. `None` while it has one.
    without_id_since: Option<Instant>,
    /// Whether librdkafka has reported the idempotence state yet.
    reported: bool,
    /// Whether its statistics ever showed it with a producer id.
    had_id: bool,
    /// Topics whose metadata the broker has answered for, with their
    /// partition counts.
    known: HashMap<String, i32>,
    /// Topics the broker last said do not exist. Asked again with every
    /// batch that holds one, so a topic created since is found.
    absent: HashSet<String>,
    /// Topics whose metadata is being asked for, and since when.
    asking: Vec<(String, Instant)>,
}

impl SetUp {
    /// A new producer's set-up, given its `statistics.interval.ms` and
    /// `message.timeout.ms`. Without statistics (an interval of 0) its
    /// idempotence state cannot be seen and is not waited for.
    pub(super) fn new(statistics: Duration, message_timeout: Duration) -> Arc<SetUp> {
        let now = Instant::now();
        Arc::new(SetUp {
            state: Mutex::new(State {
                without_id_since: (!statistics.is_zero()).then_some(now),
                reported: false,
                had_id: false,
                known: HashMap::new(),
                absent: HashSet::new(),
                asking: Vec::new(),
            }),
            changed: Notify::new(),
            created: now,
            quick: statistics.min(message_timeout / 10),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the idempotence state from one of librdkafka's statistics.
    pub(super) fn statistics(&self, json: &[u8]) {
        let Some(state) = idempotence_state(json) else {
            return;
        };
        let assigned = state == "Assigned";
        let mut s = self.state();
        s.reported = true;
        s.had_id |= assigned;
        let changed = match (&s.without_id_since, assigned) {
            (Some(_), true) => {
                s.without_id_since = None;
                true
            }
            (None, false) => {
                tracing::debug!(state, "kafka producer waits for a producer id");
                s.without_id_since = Some(Instant::now());
                true
            }
            _ => false,
        };
        drop(s);
        if changed {
            self.changed.notify_waiters();
        }
    }

    /// Waits until the producer has its id and knows every topic of
    /// `topics`, or until `until`. Asks the broker for the metadata of a
    /// topic not yet known; that goes on after the wait ends.
    pub(super) async fn wait<'t>(
        self: &Arc<Self>,
        producer: &Arc<BaseProducer<Deliveries>>,
        topics: impl Iterator<Item = &'t str> + Clone,
        ask_for: Duration,
        until: Instant,
    ) -> Result<(), Missing> {
        // A topic the broker said does not exist is asked for again once
        // per batch, not at every change while the batch waits.
        let mut ask_absent = true;
        loop {
            // Registered before the state is read, so a change in between
            // is not missed.
            let changed = self.changed.notified();
            match self.missing(producer, topics.clone(), ask_for, ask_absent) {
                None => return Ok(()),
                Some(missing) => {
                    if tokio::time::timeout_at(until, changed).await.is_err() {
                        return Err(missing);
                    }
                }
            }
            ask_absent = false;
        }
    }

    /// What is missing now, asking for the topics not yet asked for.
    fn missing<'t>(
        self: &Arc<Self>,
        producer: &Arc<BaseProducer<Deliveries>>,
        topics: impl Iterator<Item = &'t str>,
        ask_for: Duration,
        ask_absent: bool,
    ) -> Option<Missing> {
        let mut s = self.state();
        let mut missing: Option<Missing> = None;
        for topic in topics {
            if s.known.contains_key(topic) {
                continue;
            }
            if s.absent.contains(topic) {
                // Answered already: its records are refused at once (see
                // `SetUp::absent`). Asked again for the batches after.
                if ask_absent && !s.asking.iter().any(|(t, _)| t == topic) {
                    s.asking.push((topic.to_owned(), Instant::now()));
                    self.ask(producer, topic, ask_for);
                }
                continue;
            }
            let since = match s.asking.iter().find(|(t, _)| t == topic) {
                Some((_, since)) => *since,
                None => {
                    let now = Instant::now();
                    s.asking.push((topic.to_owned(), now));
                    self.ask(producer, topic, ask_for);
                    now
                }
            };
            match &mut missing {
                Some(m) => {
                    m.what.push_str(&format!(", the partitions of {topic:?}"));
                    m.since = m.since.min(since);
                }
                None => {
                    missing = Some(Missing {
                        what: format!("the partitions of {topic:?}"),
                        since,
                    })
                }
            }
        }
        // The id, unless the topics came quickly enough to take it as on
        // its way (see the module's documentation).
        let id_on_its_way = missing.is_none() && !s.reported && self.created.elapsed() < self.quick;
        match s.without_id_since {
            Some(since) if !id_on_its_way => Some(match missing {
                Some(m) => Missing {
                    what: format!("a producer id, {}", m.what),
                    since: since.min(m.since),
                },
                None => Missing {
                    what: "a producer id".into(),
                    since,
                },
            }),
            _ => missing,
        }
    }

    /// Whether the producer has a producer id, as far as its statistics
    /// tell (always, with statistics off).
    pub(super) fn has_id(&self) -> bool {
        self.state().without_id_since.is_none()
    }

    /// Whether its statistics ever showed it with a producer id (never,
    /// with statistics off).
    pub(super) fn had_id(&self) -> bool {
        self.state().had_id
    }

    /// Those of `topics` that the broker said do not exist when last asked.
    /// Their records are then not handed to librdkafka: it would hold them
    /// until their message timeout (or `topic.metadata.propagation.max.ms`,
    /// 30 s) and report them timed out, which says nothing of the topic.
    pub(super) fn absent<'t>(&self, topics: &[&'t str]) -> Vec<&'t str> {
        let s = self.state();
        topics
            .iter()
            .copied()
            .filter(|t| s.absent.contains(*t))
            .collect()
    }

    /// How many partitions the broker said `topic` has, if it has answered
    /// (0 when its answer listed none).
    pub(super) fn partitions(&self, topic: &str) -> Option<i32> {
        self.state().known.get(topic).copied()
    }

    /// Asks the broker for `topic`'s metadata, which librdkafka keeps for
    /// the records that follow. Any answer will do, one for a topic that
    /// does not exist too (see [`SetUp::absent`]).
    fn ask(
        self: &Arc<Self>,
        producer: &Arc<BaseProducer<Deliveries>>,
        topic: &str,
        timeout: Duration,
    ) {
        let (setup, producer, topic) = (Arc::clone(self), Arc::clone(producer), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let answered = producer.client().fetch_metadata(Some(&topic), timeout);
            let mut s = setup.state();
            s.asking.retain(|(t, _)| *t != topic);
            match answered {
                Ok(metadata) => {
                    let answer = metadata.topics().iter().find(|t| t.name() == topic);
                    let unknown = answer.is_some_and(|t| {
                        t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
                    });
                    if unknown {
                        s.absent.insert(topic);
                    } else {
                        let partitions = answer.map_or(0, |t| t.partitions().len());
                        s.absent.remove(&topic);
                        s.known
                            .insert(topic, i32::try_from(partitions).unwrap_or(i32::MAX));
                    }
                }
                Err(e) => {
                    tracing::debug!(topic, error = %e, "no metadata for the topic yet");
                }
            }
            drop(s);
            setup.changed.notify_waiters();
        });
    }
}

/// librdkafka's idempotence state in one of its statistics (`Assigned`
/// once it has a producer id), if the statistics carry one.
fn idempotence_state(json: &[u8]) -> Option<&str> {
    const KEY: &str = "\"idemp_state\":";
    let json = std::str::from_utf8(json).ok()?;
    let rest = json[json.find(KEY)? + KEY.len()..].trim_start();
    let rest = rest.strip_prefix('"')?;
    Some(&rest[..rest.find('"')?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_idempotence_state_as_librdkafka_writes_it() {
        let json = br#"{"name": "p", "eos": { "idemp_state": "Assigned", "idemp_stateage": 12, "txn_state": "Init" }}"#;
        assert_eq!(idempotence_state(json), Some("Assigned"));
        let json = br#"{"eos":{"idemp_state":"WaitPID"}}"#;
        assert_eq!(idempotence_state(json), Some("WaitPID"));
        assert_eq!(idempotence_state(br#"{"name": "p"}"#), None);
        assert_eq!(idempotence_state(br#"{"eos": { "idemp_state": "#), None);
    }

    #[tokio::test]
    async fn the_statistics_tell_when_the_producer_has_its_id() {
        let setup = SetUp::new(STATISTICS_INTERVAL, Duration::from_secs(30));
        assert!(setup.state().without_id_since.is_some());
        setup.statistics(br#"{"eos": { "idemp_state": "WaitPID" }}"#);
        assert!(setup.state().without_id_since.is_some());
        setup.statistics(br#"{"eos": { "idemp_state": "Assigned" }}"#);
        assert!(setup.state().without_id_since.is_none());
        // An epoch bump drains the producer: without an id again.
        setup.statistics(br#"{"eos": { "idemp_state": "DrainBump" }}"#);
        assert!(setup.state().without_id_since.is_some());
        // Statistics without the state change nothing.
        setup.statistics(br#"{"name": "p"}"#);
        assert!(setup.state().without_id_since.is_some());
        assert!(SetUp::new(Duration::ZERO, Duration::from_secs(30))
            .state()
            .without_id_since
            .is_none());
    }

    /// A producer with no broker behind it, whose set-up is told its
    /// topics' partitions by the test, with librdkafka's statistics every
    /// `statistics` (the test gives the ones that matter itself).
    fn producer(
        statistics: Duration,
        message_timeout: Duration,
    ) -> super::super::producer::KafkaProducer {
        let config = super::super::KafkaSettings {
            brokers: "127.0.0.1:9".into(),
            properties: vec![(
                "statistics.interval.ms".into(),
                statistics.as_millis().to_string(),
            )],
            message_timeout,
            in_flight: super::super::InFlight::default(),
        }
        .client_config();
        super::super::producer::KafkaProducer::new(&config).expect("producer")
    }

    fn missing(p: &super::super::producer::KafkaProducer) -> Option<String> {
        p.setup
            .missing(&p.inner, ["t"].into_iter(), Duration::from_secs(1), true)
            .map(|m| m.what)
    }

    #[tokio::test]
    async fn topics_known_before_the_first_statistics_do_not_wait_for_them() {
        // A minute for the topics, so that a slow machine cannot make the
        // test's own set-up late.
        let p = producer(Duration::from_secs(600), Duration::from_secs(600));
        p.setup.state().known.insert("t".into(), 3);
        // Known well within a tenth of the message timeout and before any
        // statistics: the id is taken as on its way.
        assert_eq!(missing(&p), None);
        // Once the statistics have shown the producer without its id, it
        // is waited for, as after an epoch bump.
        p.setup
            .statistics(br#"{"eos": { "idemp_state": "WaitPID" }}"#);
        assert_eq!(missing(&p).as_deref(), Some("a producer id"));
        p.setup
            .statistics(br#"{"eos": { "idemp_state": "Assigned" }}"#);
        assert_eq!(missing(&p), None);
    }

    #[tokio::test]
    async fn topics_known_late_wait_for_the_id_in_the_statistics() {
        // A message timeout of 20 ms gives 2 ms for the topics: a set-up
        // that took longer is on a link too slow to hand records over
        // before the id.
        let p = producer(STATISTICS_INTERVAL, Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(10)).await;
        p.setup.state().known.insert("t".into(), 3);
        assert_eq!(missing(&p).as_deref(), Some("a producer id"));
    }
}
