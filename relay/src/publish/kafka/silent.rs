//! Partitions that leave records unanswered while the rest of the topic
//! answers: a partition without a leader, or whose leader is unreachable.
//!
//! librdkafka keeps such a partition's records until their message timeout.
//! A batch handed over whole waits for them, holding a pipeline slot all
//! that while, and with keys spread over the partitions nearly every batch
//! holds some: one offline partition of four took the other three down to
//! a few batches per message timeout. So once a partition has left records
//! unanswered while others of their batch were confirmed, the records the
//! relay can place on it are answered "unanswered" at once, without being
//! sent, and their rows set aside until the partition is tried again. One
//! batch per message timeout sends its records of the partition, to find
//! out whether it is back; the first record it confirms there ends the
//! silence.
//!
//! Only records whose partition the relay can tell are held: keyed records
//! under librdkafka's `murmur2_random` partitioner (the relay's default),
//! whose partition is Kafka's murmur2 of the key. Records without a key,
//! which that partitioner places at random, are placed by the relay on
//! the topic's other partitions, in turn (librdkafka's random pick passes
//! over a partition whose leader it cannot reach, but not always: 2 of 500
//! went to it in one run). Under any other partitioner nothing is held or
//! placed, and such batches wait as before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The partitioner whose placement of a keyed record the relay can tell.
pub(super) const PREDICTABLE: &str = "murmur2_random";

/// The partition Kafka's Java client (and librdkafka's `murmur2` and
/// `murmur2_random` partitioners) gives `key` among `partitions`.
pub fn murmur2_partition(key: &[u8], partitions: i32) -> i32 {
    let partitions = u32::try_from(partitions.max(1)).unwrap_or(1);
    i32::try_from((murmur2(key) & 0x7fff_ffff) % partitions).unwrap_or(0)
}

/// Kafka's murmur2 (MurmurHash2, seed `0x9747b28c`).
fn murmur2(key: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ key.len() as u32;
    let mut chunks = key.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, b) in tail.iter().enumerate() {
            h ^= u32::from(*b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The silent partitions of every topic.
pub(super) struct Silent {
    partitions: Mutex<HashMap<(String, i32), Quiet>>,
    /// How many there are: read without the lock on every batch.
    count: AtomicUsize,
    /// How often a silent partition is tried again.
    retry_every: Duration,
}

struct Quiet {
    since: Instant,
    /// When a batch may next send it records.
    retry_at: Instant,
}

/// What one batch does with a topic's silent partitions.
pub(super) struct Held {
    /// Partitions whose records the batch holds back, with how long until
    /// they are tried again and since when they have been silent.
    held: Vec<(i32, Duration, Instant)>,
    /// The topic's partitions that are not silent, for records without a
    /// key: even a batch that tries a silent partition sends it only the
    /// records whose key places them there.
    open: Vec<i32>,
}

impl Held {
    /// Whether a record with `key` is held, and if so for how long and since
    /// when its partition has been silent.
    pub(super) fn holds(&self, key: &[u8], partitions: i32) -> Option<(i32, Duration, Instant)> {
        let p = murmur2_partition(key, partitions);
        self.held.iter().find(|h| h.0 == p).copied()
    }

    /// A partition for the `n`th record without a key: one that is not
    /// silent, if any is.
    pub(super) fn open_partition(&self, n: usize) -> Option<i32> {
        (!self.open.is_empty()).then(|| self.open[n % self.open.len()])
    }
}

impl Silent {
    pub(super) fn new(retry_every: Duration) -> Silent {
        Silent {
            partitions: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            retry_every,
        }
    }

    /// Whether any partition is silent.
    pub(super) fn any(&self) -> bool {
        self.count.load(Ordering::Relaxed) > 0
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i32), Quiet>> {
        self.partitions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What a batch about to send records of `topic` (of `partitions`
    /// partitions) holds back: `None` when none of them is silent. A silent
    /// partition due to be tried again is tried by this batch if it has
    /// records for it (`wanted`), and then by no other until `retry_every`
    /// has passed; a batch without any leaves it due for the next.
    pub(super) fn hold(&self, topic: &str, partitions: i32, wanted: &[i32]) -> Option<Held> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let now = Instant::now();
        let mut map = self.map();
        let (mut held, mut silent) = (Vec::new(), Vec::new());
        for ((t, p), quiet) in map.iter_mut() {
            if t != topic || *p >= partitions {
                continue;
            }
            silent.push(*p);
            if quiet.retry_at <= now {
                if wanted.contains(p) {
                    quiet.retry_at = now + self.retry_every;
                }
            } else {
                held.push((*p, quiet.retry_at - now, quiet.since));
            }
        }
        if silent.is_empty() {
            return None;
        }
        let open = (0..partitions).filter(|p| !silent.contains(p)).collect();
        Some(Held { held, open })
    }

    /// `partition` of `topic` left a record unanswered while others of its
    /// batch were confirmed.
    pub(super) fn unanswered(&self, topic: &str, partition: i32) {
        let now = Instant::now();
        let mut map = self.map();
        let quiet = map.entry((topic.to_owned(), partition)).or_insert_with(|| {
            tracing::warn!(
                topic,
                partition,
                "kafka partition left records unanswered while others answered; \
                 its records are held back and it is tried again every {:?}",
                self.retry_every
            );
            Quiet {
                since: now,
                retry_at: now,
            }
        });
        quiet.retry_at = now + self.retry_every;
        self.counted(map.len());
    }

    /// Keeps the count, and its gauge, at `n`.
    fn counted(&self, n: usize) {
        if self.count.swap(n, Ordering::Relaxed) != n {
            metrics::gauge!(crate::metrics::KAFKA_SILENT_PARTITIONS).set(n as f64);
        }
    }

    /// The silent partitions, oldest first.
    pub(super) fn list(&self) -> Vec<crate::publish::SilentPartition> {
        if !self.any() {
            return Vec::new();
        }
        let now = std::time::SystemTime::now();
        let mut list: Vec<_> = self
            .map()
            .iter()
            .map(
                |((topic, partition), quiet)| crate::publish::SilentPartition {
                    topic: topic.clone(),
                    partition: *partition,
                    since: now - quiet.since.elapsed(),
                },
            )
            .collect();
        list.sort_by(|a, b| {
            (a.since, &a.topic, a.partition).cmp(&(b.since, &b.topic, b.partition))
        });
        list
    }

    /// `partition` of `topic` confirmed a record.
    pub(super) fn answered(&self, topic: &str, partition: i32) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut map = self.map();
        if let Some(quiet) = map.remove(&(topic.to_owned(), partition)) {
            tracing::info!(
                topic,
                partition,
                silent = ?quiet.since.elapsed(),
                "kafka partition answers again"
            );
        }
        self.counted(map.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_is_kafkas() {
        // The Java client's own test vectors (UtilsTest.testMurmur2), as
        // signed 32-bit results.
        for (key, hash) in [
            (&b"21"[..], -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ] {
            assert_eq!(
                murmur2(key) as i32,
                hash,
                "{}",
                String::from_utf8_lossy(key)
            );
        }
        // toPositive, then modulo.
        assert_eq!(
            murmur2_partition(b"21", 7),
            ((-973_932_308i32 & 0x7fff_ffff) % 7)
        );
        assert_eq!(murmur2_partition(b"anything", 1), 0);
    }

    #[tokio::test]
    async fn the_silent_partitions_are_listed_until_they_answer() {
        let silent = Silent::new(Duration::from_secs(30));
        assert!(silent.list().is_empty());
        let before = std::time::SystemTime::now();
        silent.unanswered("t", 2);
        tokio::time::sleep(Duration::from_millis(5)).await;
        silent.unanswered("u", 0);
        silent.unanswered("t", 2);
        let listed: Vec<(String, i32)> = silent
            .list()
            .into_iter()
            .map(|p| {
                // Within the clocks' drift of when it was marked.
                let slack = Duration::from_millis(50);
                assert!(
                    p.since + slack >= before && p.since <= std::time::SystemTime::now() + slack,
                    "silent since {:?}, marked after {before:?}",
                    p.since
                );
                (p.topic, p.partition)
            })
            .collect();
        assert_eq!(
            listed,
            [("t".to_owned(), 2), ("u".to_owned(), 0)],
            "oldest first, each once"
        );
        silent.answered("t", 2);
        assert_eq!(silent.list().len(), 1);
        silent.answered("u", 0);
        assert!(silent.list().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_partition_is_held_and_tried_again_by_one_batch_at_a_time() {
        let silent = Silent::new(Duration::from_secs(30));
        let all = [0, 1, 2, 3];
        assert!(silent.hold("t", 4, &all).is_none());
        silent.unanswered("t", 2);
        let of = |partition: i32| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| (murmur2_partition(k.as_bytes(), 4) == 2) == (partition == 2))
                .expect("a key")
        };
        let (key, other) = (of(2), of(0));
        let held = silent.hold("t", 4, &all).expect("partition 2 held");
        let (p, wait, _) = held.holds(key.as_bytes(), 4).expect("held");
        assert_eq!((p, wait), (2, Duration::from_secs(30)));
        assert!(held.holds(other.as_bytes(), 4).is_none());
        assert_eq!(held.open, vec![0, 1, 3]);
        assert_eq!(held.open_partition(0), Some(0));
        assert_eq!(held.open_partition(4), Some(1));
        // Other topics are not affected.
        assert!(silent.hold("u", 4, &all).is_none());
        // After the wait, one batch tries it; the next ones hold it again.
        // A batch with no record of it leaves the try to the next.
        tokio::time::advance(Duration::from_secs(30)).await;
        let elsewhere = silent.hold("t", 4, &[0, 1]).expect("still silent");
        assert!(elsewhere.holds(key.as_bytes(), 4).is_none());
        let trying = silent.hold("t", 4, &[2]).expect("still silent");
        assert!(
            trying.holds(key.as_bytes(), 4).is_none(),
            "this batch tries it"
        );
        assert_eq!(trying.open, vec![0, 1, 3], "with its keys' records only");
        let next = silent.hold("t", 4, &all).expect("still silent");
        assert!(next.holds(key.as_bytes(), 4).is_some(), "the next holds it");
        // A record it confirms ends the silence.
        silent.answered("t", 2);
        assert!(silent.hold("t", 4, &all).is_none());
        assert_eq!(silent.count.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_gauge_counts_the_silent_partitions() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let gauge = |handle: &metrics_exporter_prometheus::PrometheusHandle| {
            handle
                .render()
                .lines()
                .find_map(|l| l.strip_prefix("outbox_kafka_silent_partitions "))
                .map(str::to_owned)
        };
        metrics::with_local_recorder(&recorder, || {
            let silent = Silent::new(Duration::from_secs(30));
            silent.unanswered("t", 2);
            silent.unanswered("t", 2);
            silent.unanswered("u", 0);
            assert_eq!(gauge(&handle).as_deref(), Some("2"));
            silent.answered("t", 2);
            assert_eq!(gauge(&handle).as_deref(), Some("1"));
            silent.answered("u", 0);
            assert_eq!(gauge(&handle).as_deref(), Some("0"));
        });
    }
}
