//! Pausing one destination: its messages wait in the outbox on every
//! replica, across restarts, counting no attempts, while other destinations
//! flow; a key with a message for it waits there too; resume lets all of it
//! out in key order.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use rand::{Rng, SeedableRng};

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");

async fn cli(db: &TestDb, args: &[&str]) -> (Option<i32>, String, String) {
    outbox_tests::process::cli(RELAY_BIN, db.schema.as_str(), args).await
}

/// `key/n` payloads, n counting up per key in commit order.
fn tag(key: &str, n: usize) -> Vec<u8> {
    format!("{key}/{n}").into_bytes()
}

fn untag(payload: &[u8]) -> (String, usize) {
    let s = String::from_utf8_lossy(payload);
    let (k, n) = s.rsplit_once('/').expect("tagged payload");
    (k.to_owned(), n.parse().expect("number"))
}

#[tokio::test]
async fn a_paused_destination_waits_on_every_replica_and_resumes_in_key_order() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let a = Fixture::new().await; // the destination to pause
    let b = Fixture::new().await;
    let settings = outbox_relay::Settings {
        batch_size: 50,
        ..fast_settings()
    };
    let relays = vec![
        InProcessRelay::amqp(&db, settings.clone()),
        InProcessRelay::amqp(&db, settings.clone()),
    ];
    let outbox = db.outbox();
    // Keys "a*" write only to A, "b*" only to B, "m*" to both.
    let mut next: BTreeMap<String, usize> = BTreeMap::new();
    // Which messages went to A, by (key, n).
    let mut to_a: HashSet<(String, usize)> = HashSet::new();
    let mut write = |rng: &mut rand::rngs::StdRng| {
        let mut msgs = Vec::new();
        for _ in 0..rng.random_range(5..30) {
            let (key, dest) = match rng.random_range(0..3) {
                0 => (format!("a{}", rng.random_range(0..5)), a.exchange.clone()),
                1 => (format!("b{}", rng.random_range(0..5)), b.exchange.clone()),
                _ => {
                    let d = if rng.random_bool(0.5) { &a } else { &b };
                    (format!("m{}", rng.random_range(0..5)), d.exchange.clone())
                }
            };
            let n = next.entry(key.clone()).or_default();
            if dest == a.exchange {
                to_a.insert((key.clone(), *n));
            }
            msgs.push(
                Message::builder(dest)
                    .key(key.as_str())
                    .payload(tag(&key, *n))
                    .build()
                    .expect("valid"),
            );
            *n += 1;
        }
        msgs
    };
    for _ in 0..10 {
        let msgs = write(&mut rng);
        outbox
            .enqueue_batch(&db.client, &msgs)
            .await
            .expect("enqueue");
    }
    assert!(eventually(Duration::from_secs(30), || async { a.count() > 0 }).await);

    let (code, out, err) = cli(
        &db,
        &["pause", a.exchange.as_str(), "--reason", "consumer fix"],
    )
    .await;
    assert_eq!(code, Some(0), "pause: {out}{err}");
    // Batches claimed before the pause finish; then A goes quiet.
    assert!(
        eventually(Duration::from_secs(30), || async {
            let before = a.count();
            tokio::time::sleep(Duration::from_millis(500)).await;
            a.count() == before
        })
        .await,
        "A kept receiving after the pause"
    );
    let frozen = a.count();
    let b_before = b.count();
    for _ in 0..20 {
        let msgs = write(&mut rng);
        outbox
            .enqueue_batch(&db.client, &msgs)
            .await
            .expect("enqueue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // B-only keys keep flowing on both replicas while A waits.
    assert!(
        eventually(Duration::from_secs(30), || async { b.count() > b_before }).await,
        "seed {seed}: B stopped while A was paused"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        a.count(),
        frozen,
        "seed {seed}: A received messages while paused"
    );
    let attempts: i64 = db
        .client
        .query_one(
            &format!(
                "SELECT coalesce(sum(attempts), 0)::int8 FROM {} WHERE destination = $1",
                db.table()
            ),
            &[&a.exchange],
        )
        .await
        .expect("attempts")
        .get(0);
    assert_eq!(attempts, 0, "a paused destination's rows count no attempts");
    let (code, out, _) = cli(&db, &["status", "--json"]).await;
    assert_eq!(code, Some(0));
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    let paused = &status["paused"][0];
    assert_eq!(paused["destination"], a.exchange.as_str(), "{status}");
    assert_eq!(paused["reason"], "consumer fix");
    assert!(paused["waiting"].as_i64().unwrap_or(0) > 0, "{status}");
    assert!(paused["paused_at"].as_str().is_some(), "{status}");
    // `locate` says why one of them waits.
    let waiting: uuid::Uuid = db
        .client
        .query_one(
            &format!(
                "SELECT message_id FROM {} WHERE destination = $1 ORDER BY seq LIMIT 1",
                db.table()
            ),
            &[&a.exchange],
        )
        .await
        .expect("a waiting message")
        .get(0);
    // Each replica locks the paused rows for a moment every recheck
    // (`retry_max`, 1 s here) to set them aside again; `locate` in that
    // moment still says the destination is paused.
    let (code, out, _) = cli(&db, &["locate", &waiting.to_string(), "--json"]).await;
    assert_eq!(code, Some(0));
    let located: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(located["state"], "paused", "{located}");
    assert!(
        located["why"]
            .as_str()
            .unwrap_or("")
            .contains("consumer fix"),
        "{located}"
    );

    // A relay restarted while paused still honours it.
    for relay in relays {
        relay.stop().await;
    }
    let relay = InProcessRelay::amqp(&db, settings.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        a.count(),
        frozen,
        "seed {seed}: a restarted relay ignored the pause"
    );

    let (a_at_resume, b_at_resume) = (a.count(), b.count());
    let (code, out, err) = cli(&db, &["resume", a.exchange.as_str()]).await;
    assert_eq!(code, Some(0), "resume: {out}{err}");
    let (code, _, err) = cli(&db, &["resume", a.exchange.as_str()]).await;
    assert_ne!(code, Some(0), "resuming twice is refused");
    assert!(err.contains("is not paused"), "{err}");
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.pending().await == 0
        })
        .await,
        "seed {seed}: the outbox did not drain after resume"
    );
    relay.stop().await;

    // Every key's first deliveries, per destination, in commit order; and no
    // message of a key was delivered while an older one waited behind the
    // pause: by key, what arrived before resume is a prefix.
    // Every message written, each at least once, at its destination: by
    // distinct (key, n), so a copy cannot stand in for a lost one.
    let written: HashSet<(String, usize)> = next
        .iter()
        .flat_map(|(key, n)| (0..*n).map(move |i| (key.clone(), i)))
        .collect();
    let delivered = |fixture: &Fixture| -> HashSet<(String, usize)> {
        fixture
            .deliveries()
            .iter()
            .map(|d| untag(&d.payload))
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            delivered(&a).len() + delivered(&b).len() >= written.len()
        })
        .await,
        "seed {seed}: {} of {} delivered",
        delivered(&a).len() + delivered(&b).len(),
        written.len()
    );
    let (got_a, got_b) = (delivered(&a), delivered(&b));
    let to_b: HashSet<(String, usize)> = written.difference(&to_a).cloned().collect();
    assert_eq!(
        got_a, to_a,
        "seed {seed}: A's deliveries differ from what was written to A"
    );
    assert_eq!(
        got_b, to_b,
        "seed {seed}: B's deliveries differ from what was written to B"
    );
    for fixture in [&a, &b] {
        let mut last: BTreeMap<String, usize> = BTreeMap::new();
        let mut seen = HashSet::new();
        for d in fixture.deliveries() {
            let (key, n) = untag(&d.payload);
            if !seen.insert((key.clone(), n)) {
                continue; // a duplicate
            }
            if let Some(prev) = last.insert(key.clone(), n) {
                assert!(
                    prev < n,
                    "seed {seed}: key {key} out of order: {prev} then {n}"
                );
            }
        }
    }
    // Across destinations: no B message of a key arrived, before resume,
    // while an older message of the key for A was waiting behind the pause.
    let a_before: HashSet<(String, usize)> = a.deliveries()[..a_at_resume]
        .iter()
        .map(|d| untag(&d.payload))
        .collect();
    let mut oldest_waiting: BTreeMap<String, usize> = BTreeMap::new();
    for (key, n) in to_a.iter().filter(|m| !a_before.contains(*m)) {
        let e = oldest_waiting.entry(key.clone()).or_insert(*n);
        *e = (*e).min(*n);
    }
    assert!(
        oldest_waiting.keys().any(|k| k.starts_with('m')),
        "seed {seed}: no mixed key had a message waiting for A; the check below would be empty"
    );
    for d in &b.deliveries()[..b_at_resume] {
        let (key, n) = untag(&d.payload);
        if let Some(&w) = oldest_waiting.get(&key) {
            assert!(
                n < w,
                "seed {seed}: {key}/{n} went to B while {key}/{w} waited for the paused A"
            );
        }
    }
    a.cleanup().await;
    b.cleanup().await;
    db.cleanup().await;
}
