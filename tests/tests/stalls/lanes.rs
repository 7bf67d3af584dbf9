//! A key whose messages change lanes (routing keys taking turns) on a broker
//! slow to confirm: each lane change is a wave of its own, one confirm
//! round trip each.

use std::time::Duration;

use outbox_client::Message;
use outbox_relay::publish::amqp::{AmqpPublisher, AmqpSettings};
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::proxy::Proxy;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

use super::PATIENCE;

/// Twenty messages of one key whose routing keys take turns
/// (`order.created`, `order.paid`, ...), beside 200 of other keys, with
/// every answer from RabbitMQ 400 ms late (confirms after a slow disk's
/// fsync). The batch's waves outlast its time: the wave cut at the
/// deadline failed the whole batch, the waves confirmed before it were
/// sent again at every claim, and the key never drained. Each batch now
/// keeps what its waves had confirmed, and the next takes up the rest.
#[tokio::test]
async fn a_key_changing_lanes_drains_on_a_broker_slow_to_confirm() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    proxy.delay_answers(Duration::from_millis(400));
    let publisher = AmqpPublisher::new(AmqpSettings {
        url: format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
        confirm_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(20),
        ca_pem: None,
    });
    let settings = outbox_relay::Settings {
        batch_size: 250,
        hold_limit: Duration::from_secs(8),
        ..fast_settings()
    };
    let mut messages: Vec<Message> = (0..20)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key("order-1")
                .routing_key(if i % 2 == 0 {
                    "order.created"
                } else {
                    "order.paid"
                })
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    messages.extend(outbox_tests::workload::json_over_keys(
        &rabbit.exchange,
        200,
        10,
    ));
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let relay = InProcessRelay::with(&db, publisher, settings);
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let pending = db.pending().await;
    relay.stop().await;
    assert!(drained, "{pending} rows never went");
    assert!(
        eventually(Duration::from_secs(30), || async { rabbit.count() >= 220 }).await,
        "{} of 220 delivered",
        rabbit.count()
    );
    // The key's first deliveries in order.
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<i64> = rabbit
        .deliveries()
        .into_iter()
        .filter(|d| d.routing_key.starts_with("order."))
        .filter(|d| seen.insert(d.message_id.clone()))
        .map(|d| serde_json::from_slice(&d.payload).expect("the key's json"))
        .collect();
    assert_eq!(
        firsts,
        (0..20).collect::<Vec<i64>>(),
        "the key's first deliveries out of order"
    );
    // The confirmed waves of a batch are not sent again: at most a wave's
    // worth (its time ran out) per batch, not the batch's 220.
    let copies = rabbit.count() - 220;
    println!("{copies} copies");
    assert!(
        copies <= 20,
        "{copies} copies: confirmed waves were sent again"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}
