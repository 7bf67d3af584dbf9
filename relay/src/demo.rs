//! `outbox-relay demo`: the whole path on the local services, narrated.
//!
//! Migrates, commits sample messages in one transaction together with a domain
//! row, rolls back another transaction, runs the relay in-process, and prints
//! what an independent RabbitMQ consumer received.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use outbox_client::{Message, Outbox};
use tokio_util::sync::CancellationToken;

use crate::config::DemoArgs;
use crate::publish::amqp::{AmqpPublisher, AmqpSettings};
use crate::{Relay, Settings};

const EXCHANGE: &str = "outbox.demo";

/// Runs the demo; fails if the consumer's view differs from what was committed.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let pg = args.db.database()?;
    let schema = args.db.schema.clone();
    crate::migrate(&pg, &schema).await?;
    println!("1. migrated schema {schema}");

    let amqp_url = args.amqp.url()?;
    let amqp = Connection::connect(amqp_url.expose(), ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot connect to rabbitmq at {amqp_url}"))?;
    let ch = amqp.create_channel().await?;
    ch.exchange_declare(
        EXCHANGE.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let queue = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    ch.queue_bind(
        queue.name().clone(),
        EXCHANGE.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let mut consumer = ch
        .basic_consume(
            queue.name().clone(),
            "demo".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("2. consumer bound to exchange {EXCHANGE:?} (topic, '#')");

    let (mut client, connection) = pg.connect().await?;
    tokio::spawn(connection);
    let outbox = Outbox::with_schema(schema.clone());
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {}.demo_orders (id bigint PRIMARY KEY, state text NOT NULL)",
            schema.quoted()
        ))
        .await?;

    // Committed: N events over two orders, in the same transaction as the orders.
    let tx = client.transaction().await?;
    let mut committed = HashMap::new();
    for i in 0..args.count {
        let order = i64::from(i % 2) + 1;
        let state = ["created", "paid", "packed", "shipped"][usize::from(i / 2) % 4];
        tx.execute(
            &format!(
                "INSERT INTO {}.demo_orders VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET state = $2",
                schema.quoted()
            ),
            &[&order, &state],
        )
        .await?;
        let id = outbox
            .enqueue(
                &tx,
                &Message::builder(EXCHANGE)
                    .key(format!("order-{order}"))
                    .routing_key(format!("order.{state}"))
                    .header("source", "demo")
                    .json(&serde_json::json!({"order": order, "state": state, "n": i}))
                    .build()?,
            )
            .await?;
        committed.insert(id.to_string(), i);
    }
    tx.commit().await?;
    println!(
        "3. committed {} messages with their order rows in one transaction",
        args.count
    );

    // Rolled back: must never reach the consumer.
    let tx = client.transaction().await?;
    let ghost = outbox
        .enqueue(
            &tx,
            &Message::builder(EXCHANGE)
                .key("order-9")
                .routing_key("order.ghost")
                .json(&serde_json::json!({"order": 9, "state": "never"}))
                .build()?,
        )
        .await?;
    tx.rollback().await?;
    println!("4. rolled back a transaction that enqueued {ghost}");

    let publisher = AmqpPublisher::new(AmqpSettings {
        url: amqp_url.expose().to_owned(),
        confirm_timeout: Duration::from_secs(30),
        connect_timeout: Duration::from_secs(10),
        ca_pem: None,
    });
    let shutdown = CancellationToken::new();
    let relay = Relay::new(pg.clone(), schema.clone(), publisher, Settings::default());
    let relay_task = tokio::spawn(relay.run(shutdown.clone()));
    println!("5. relay started; consumer received:");

    // Distinct ids: a copy of one message must not stand in for another
    // that never came.
    let mut received = std::collections::HashSet::new();
    let mut copies = 0usize;
    let mut unexpected = Vec::new();
    let deadline = tokio::time::sleep(Duration::from_secs(20));
    tokio::pin!(deadline);
    // Wait for every committed message, then a little longer for strays.
    let mut linger = None;
    loop {
        let next = async {
            match linger.as_mut() {
                Some(l) => {
                    tokio::select! {
                        d = consumer.next() => d,
                        _ = l => None,
                    }
                }
                None => consumer.next().await,
            }
        };
        let delivery = tokio::select! {
            _ = &mut deadline => break,
            d = next => match d { Some(d) => d?, None => break },
        };
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        println!(
            "   message_id={id} routing_key={} payload={}",
            delivery.routing_key,
            String::from_utf8_lossy(&delivery.data)
        );
        delivery.ack(BasicAckOptions::default()).await?;
        if !committed.contains_key(&id) {
            unexpected.push(id);
        } else if !received.insert(id) {
            copies += 1;
        }
        if received.len() == committed.len() && linger.is_none() {
            linger = Some(Box::pin(tokio::time::sleep(Duration::from_millis(500))));
        }
    }
    shutdown.cancel();
    relay_task.await??;
    let _ = amqp.close(200, "demo done".into()).await;

    println!(
        "6. committed {}, received {} of them, copies {copies}, unexpected {} (the rolled-back one must not appear)",
        committed.len(),
        received.len(),
        unexpected.len()
    );
    // Nothing failed here, so at-least-once has no reason for a copy.
    if received.len() != committed.len() || copies > 0 || !unexpected.is_empty() {
        bail!("the consumer's view differs from what was committed");
    }
    println!(
        "ok: every committed message arrived once with its message id; nothing rolled back did"
    );
    Ok(())
}
