//! A `basic.return` matched to its message by id, never by arrival order: an
//! unroutable message is dead-lettered, never settled as published.

use std::collections::HashSet;
use std::time::Duration;

use outbox_client::{Message, MessageId};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use rand::{Rng, SeedableRng};

use super::PATIENCE;

async fn ids_in(db: &TestDb, table: &str) -> HashSet<String> {
    db.client
        .query(
            &format!(
                "SELECT message_id::text FROM {}.{table}",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Unroutable and routable messages mixed in pipelined batches on one
/// channel. RabbitMQ sends each `basic.return` before its message's ack, but
/// a later ack (often a `multiple` one) may complete first, so a return must
/// be matched to its message by id, never by arrival order. Before the fix,
/// about one unroutable message in a few thousand was deleted as published.
#[tokio::test]
async fn a_returned_message_is_never_settled_as_published() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    // The fixture's topic exchange routes "#" to its queue; a direct exchange
    // bound with one routing key makes every other key unroutable.
    let direct = outbox_tests::unique("direct");
    amqp::declare_direct_exchange_bound(&rabbit, &direct, "ok").await;

    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            batch_size: 250,
            max_attempts: 1,
            park_on_dead_letter: false,
            ..fast_settings()
        },
    );
    let outbox = db.outbox();
    let mut routable = HashSet::new();
    let mut unroutable = HashSet::new();
    let total = 12_000;
    let mut written = 0;
    while written < total {
        let n = rng.random_range(50..400).min(total - written);
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            let bad = rng.random_bool(0.3);
            let id = MessageId::new_v7();
            let m = Message::builder(direct.as_str())
                .message_id(id)
                .routing_key(if bad { "nowhere" } else { "ok" })
                .key(format!("k{}", rng.random_range(0..500)))
                .payload(vec![b'x'; 64])
                .build()
                .expect("valid");
            if bad {
                unroutable.insert(id.to_string());
            } else {
                routable.insert(id.to_string());
            }
            batch.push(m);
        }
        outbox
            .enqueue_batch(&db.client, &batch)
            .await
            .expect("enqueue");
        written += n;
    }
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "seed {seed}: the outbox did not drain"
    );
    relay.stop().await;
    let delivered = || -> HashSet<String> { rabbit.message_ids().into_iter().collect() };
    eventually(Duration::from_secs(30), || async {
        routable.is_subset(&delivered())
    })
    .await;
    let delivered = delivered();
    let missing: Vec<&String> = routable.difference(&delivered).collect();
    assert!(
        missing.is_empty(),
        "seed {seed}: {} routable messages never arrived",
        missing.len()
    );
    let dead = ids_in(&db, "dead_letters").await;
    let lost: Vec<&String> = unroutable.difference(&dead).collect();
    assert!(
        lost.is_empty(),
        "seed {seed}: {} unroutable messages were deleted as published, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    let wrongly_dead: Vec<&String> = routable.intersection(&dead).collect();
    assert!(
        wrongly_dead.is_empty(),
        "seed {seed}: {} routable messages were dead-lettered",
        wrongly_dead.len()
    );
    amqp::delete_exchange(&direct).await;
    rabbit.cleanup().await;
    db.cleanup().await;
}
