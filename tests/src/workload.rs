//! Concurrent writers that enqueue through `outbox-client` and remember what
//! they committed, what they rolled back and what is indeterminate.
//!
//! Each key belongs to one writer, so its commit order is defined; payloads
//! carry `(key, seq)` so the checker needs nothing but the deliveries.

use std::collections::HashMap;
use std::time::Duration;

use outbox_client::{Message, Outbox};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio_postgres::Config;
use uuid::Uuid;

/// What a writer puts in each payload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    /// Ordering key.
    pub key: String,
    /// Position in the key's commit order (0-based).
    pub seq: u64,
}

/// What the writers did.
#[derive(Debug, Default, Clone)]
pub struct Written {
    /// Committed messages, with their tag.
    pub committed: HashMap<Uuid, Tag>,
    /// Ids enqueued in transactions that rolled back.
    pub rolled_back: Vec<Uuid>,
    /// Ids whose COMMIT failed with a lost connection: they may or may not exist.
    pub indeterminate: HashMap<Uuid, Tag>,
}

/// Shape of a workload.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Concurrent writers.
    pub writers: usize,
    /// Distinct keys (each owned by one writer).
    pub keys: usize,
    /// Committed messages in total (approximately, rounded per writer).
    pub messages: usize,
    /// Percent of transactions rolled back.
    pub rollback_percent: u32,
    /// Most messages per transaction.
    pub max_per_tx: usize,
    /// Longest random pause before COMMIT.
    pub max_commit_delay: Duration,
    /// Percent of transactions held open for `hold` before committing, so rows
    /// with lower seqs commit after higher ones were published.
    pub hold_percent: u32,
    /// How long held transactions stay open.
    pub hold: Duration,
    /// Outbox destination.
    pub destination: String,
    /// Bytes of padding added to each payload (0: none), for workloads
    /// where what is in flight must weigh something.
    pub pad: usize,
}

impl Spec {
    /// The workload of the RabbitMQ end-to-end test.
    pub fn new(destination: &str, writers: usize, keys: usize, messages: usize) -> Spec {
        Spec {
            writers,
            keys,
            messages,
            rollback_percent: 10,
            max_per_tx: 5,
            max_commit_delay: Duration::from_millis(3),
            hold_percent: 0,
            hold: Duration::from_secs(2),
            destination: destination.to_owned(),
            pad: 0,
        }
    }
}

/// Runs `spec` on a task of its own against `db`'s outbox; the task returns
/// what was written.
pub fn spawn(db: &crate::db::TestDb, spec: Spec) -> tokio::task::JoinHandle<Written> {
    let config = db.config.clone();
    let outbox = db.outbox();
    tokio::spawn(async move { run(&config, &outbox, &spec).await })
}

/// Runs `spec` against `outbox` and returns what was written.
pub async fn run(config: &Config, outbox: &Outbox, spec: &Spec) -> Written {
    // Each writer draws its keys, sizes, rollbacks and pauses from the
    // run's seed, printed here so that a failure can be replayed.
    let seed = crate::seed();
    let mut tasks = Vec::new();
    for w in 0..spec.writers {
        let config = config.clone();
        let outbox = outbox.clone();
        let spec = spec.clone();
        tasks.push(tokio::spawn(async move {
            writer(w, seed, &config, &outbox, &spec).await
        }));
    }
    let mut all = Written::default();
    for t in tasks {
        let w = t.await.expect("writer panicked");
        all.committed.extend(w.committed);
        all.rolled_back.extend(w.rolled_back);
        all.indeterminate.extend(w.indeterminate);
    }
    all
}

async fn writer(w: usize, seed: u64, config: &Config, outbox: &Outbox, spec: &Spec) -> Written {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(w as u64));
    let mut client = crate::db::connect(config).await;
    let keys: Vec<String> = (0..spec.keys)
        .filter(|k| k % spec.writers == w)
        .map(|k| format!("key-{k}"))
        .collect();
    let quota = spec.messages / spec.writers;
    let mut next_seq: HashMap<String, u64> = keys.iter().map(|k| (k.clone(), 0)).collect();
    let mut out = Written::default();
    let mut done = 0usize;
    while done < quota && !keys.is_empty() {
        let (key, n, rollback, delay) = {
            let key = keys[rng.random_range(0..keys.len())].clone();
            let n = rng.random_range(1..=spec.max_per_tx).min(quota - done);
            let rollback = rng.random_range(0..100) < spec.rollback_percent;
            let delay = if rng.random_range(0..100) < spec.hold_percent {
                spec.hold
            } else {
                rng.random_range(Duration::ZERO..=spec.max_commit_delay)
            };
            (key, n, rollback, delay)
        };
        let first = next_seq[&key];
        let tags: Vec<Tag> = (0..n as u64)
            .map(|i| Tag {
                key: key.clone(),
                seq: first + i,
            })
            .collect();
        let messages: Vec<Message> = tags
            .iter()
            .map(|t| message(&spec.destination, t, spec.pad))
            .collect();
        match one_tx(&mut client, outbox, &messages, delay, rollback).await {
            TxResult::Committed(ids) => {
                for (id, tag) in ids.iter().zip(tags) {
                    out.committed.insert(id.0, tag);
                }
                next_seq.insert(key, first + n as u64);
                done += n;
            }
            TxResult::RolledBack(ids) => out.rolled_back.extend(ids.iter().map(|id| id.0)),
            // Nothing was written (the database restarting, say): try again on a
            // fresh connection.
            TxResult::FailedBeforeCommit => client = reconnect(config).await,
            TxResult::CommitFailed(ids) => {
                // The connection died during COMMIT: the rows may exist. Later
                // messages of this key must not reuse these seqs.
                for (id, tag) in ids.iter().zip(tags) {
                    out.indeterminate.insert(id.0, tag);
                }
                next_seq.insert(key, first + n as u64);
                client = reconnect(config).await;
            }
        }
    }
    out
}

/// The message a writer enqueues for `tag`, its payload padded with `pad`
/// bytes.
fn message(destination: &str, tag: &Tag, pad: usize) -> Message {
    let mut payload = serde_json::json!({
        "key": tag.key,
        "seq": tag.seq,
        "note": crate::PAYLOAD_SENTINEL,
    });
    if pad > 0 {
        payload["pad"] = serde_json::Value::String("p".repeat(pad));
    }
    Message::builder(destination)
        .key(tag.key.as_str())
        .routing_key(format!("wl.{}", tag.key))
        // The tag plus a sentinel RelayProcess watches its logs for.
        .json(&payload)
        .build()
        .expect("valid message")
}

/// Commits `messages` messages of the one key `key` to `db`'s outbox, `per_tx`
/// to a transaction, starting at seq `first`: a hot key with a backlog of its
/// own beside whatever the writers of a [`Spec`] do. Their keys are
/// `key-N`; give this one another name.
pub async fn hot_key(
    db: &crate::db::TestDb,
    destination: &str,
    key: &str,
    first: u64,
    messages: usize,
    per_tx: usize,
) -> Written {
    let mut client = crate::db::connect(&db.config).await;
    let outbox = db.outbox();
    let mut out = Written::default();
    let mut seq = first;
    while seq < first + messages as u64 {
        let n = per_tx.min((first + messages as u64 - seq) as usize);
        let tags: Vec<Tag> = (seq..seq + n as u64)
            .map(|seq| Tag {
                key: key.to_owned(),
                seq,
            })
            .collect();
        let batch: Vec<Message> = tags.iter().map(|t| message(destination, t, 0)).collect();
        let tx = client.transaction().await.expect("begin");
        let ids = outbox.enqueue_batch(&tx, &batch).await.expect("enqueue");
        tx.commit().await.expect("commit");
        for (id, tag) in ids.iter().zip(tags) {
            out.committed.insert(id.0, tag);
        }
        seq += n as u64;
    }
    out
}

enum TxResult {
    Committed(Vec<outbox_client::MessageId>),
    RolledBack(Vec<outbox_client::MessageId>),
    FailedBeforeCommit,
    CommitFailed(Vec<outbox_client::MessageId>),
}

async fn one_tx(
    client: &mut tokio_postgres::Client,
    outbox: &Outbox,
    messages: &[Message],
    delay: Duration,
    rollback: bool,
) -> TxResult {
    let Ok(tx) = client.transaction().await else {
        return TxResult::FailedBeforeCommit;
    };
    let Ok(ids) = outbox.enqueue_batch(&tx, messages).await else {
        return TxResult::FailedBeforeCommit;
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if rollback {
        let _ = tx.rollback().await;
        return TxResult::RolledBack(ids);
    }
    match tx.commit().await {
        Ok(()) => TxResult::Committed(ids),
        Err(_) => TxResult::CommitFailed(ids),
    }
}

/// Connects, retrying while the database is unreachable (e.g. restarting).
async fn reconnect(config: &Config) -> tokio_postgres::Client {
    for _ in 0..600 {
        if let Ok((client, connection)) = config.connect(tokio_postgres::NoTls).await {
            tokio::spawn(connection);
            return client;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("postgres unreachable for a minute")
}

/// `n` messages for `destination`, each with its index as its JSON
/// payload, over the keys `k0` to `k{keys - 1}` in turn.
pub fn json_over_keys(destination: &str, n: usize, keys: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            Message::builder(destination)
                .key(format!("k{}", i % keys))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect()
}
