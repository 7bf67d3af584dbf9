//! An independent RabbitMQ consumer that records every delivery.
//!
//! The exchange and queue are durable so they survive a broker restart; the
//! consumer reconnects on its own, like a real service would, and acks only
//! after recording (so a redelivery shows up as a duplicate, never as a loss).
//!
//! Also small helpers for a test that drives lapin itself: a plain queue on
//! the default exchange, publishing to it with confirms, consuming from it,
//! its depth.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio_util::sync::CancellationToken;

/// One message as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// AMQP `message_id` property ("" when absent).
    pub message_id: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Headers table, values as text.
    pub headers: BTreeMap<String, String>,
    /// Content type property.
    pub content_type: Option<String>,
    /// Delivery mode property (2 = persistent).
    pub delivery_mode: Option<u8>,
    /// Timestamp property (seconds).
    pub timestamp: Option<u64>,
    /// Body.
    pub payload: Vec<u8>,
    /// When the consumer received it.
    pub received: std::time::Instant,
}

/// A topic exchange, a queue bound to it with `#`, and a consumer on the queue.
pub struct Fixture {
    /// Exchange name (use it as the outbox destination).
    pub exchange: String,
    queue: String,
    deliveries: Arc<Mutex<Vec<Delivery>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

async fn connect() -> lapin::Result<Connection> {
    Connection::connect(&crate::amqp_url(), ConnectionProperties::default()).await
}

/// A connection to the test broker, for a test that drives lapin itself;
/// panics when RabbitMQ does not accept it.
pub async fn connection() -> Connection {
    connect().await.expect("connect to rabbitmq")
}

/// Declares a non-durable queue `name` (reachable through the default
/// exchange by its name) with `args`, on `ch`.
pub async fn declare_queue(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare queue");
}

/// Ready messages in queue `name` (unacked ones excluded), by a passive declare.
pub async fn queue_depth(name: &str) -> u32 {
    let conn = connection().await;
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = conn.close(200, "ok".into()).await;
    q.message_count()
}

/// Deletes queue `name`; panics only when RabbitMQ cannot be reached.
pub async fn delete_queue(name: &str) {
    let conn = connection().await;
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "ok".into()).await;
}

/// Publishes `copies` identical messages (same body, same message id when
/// given) to queue `queue` through the default exchange, and waits for the
/// broker to confirm each.
pub async fn publish(queue: &str, body: &str, message_id: Option<&str>, copies: usize) {
    let conn = connection().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    for _ in 0..copies {
        let mut props = BasicProperties::default();
        if let Some(id) = message_id {
            props = props.with_message_id(id.into());
        }
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .expect("publish");
        assert!(confirm.await.expect("confirm").is_ack(), "publish nacked");
    }
    let _ = conn.close(200, "ok".into()).await;
}

/// Starts consuming `queue` on `ch` with at most `prefetch` unacked
/// deliveries, under a fresh consumer tag. The deliveries are not acked for
/// the caller.
pub async fn consume(ch: &Channel, queue: &str, prefetch: u16) -> lapin::Consumer {
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .expect("qos");
    ch.basic_consume(
        queue.into(),
        crate::unique("c").as_str().into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("consume")
}

/// Declares an exchange with no queue bound to it, so every publish is unroutable.
pub async fn declare_unbound_exchange(name: &str) {
    declare_topic_exchange(name, false).await;
}

/// Declares `name` as an internal topic exchange: RabbitMQ routes to it
/// from other exchanges only, and refuses a client's publish to it.
pub async fn declare_internal_exchange(name: &str) {
    declare_topic_exchange(name, true).await;
}

async fn declare_topic_exchange(name: &str, internal: bool) {
    let conn = connect().await.expect("connect to rabbitmq");
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            auto_delete: false,
            internal,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare exchange");
    let _ = conn.close(200, "ok".into()).await;
}

/// Deletes an exchange (best effort).
pub async fn delete_exchange(name: &str) {
    if let Ok(conn) = connect().await {
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .exchange_delete(name.into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "ok".into()).await;
    }
}

/// Binds `fixture`'s queue to another exchange as well (e.g. after "fixing" a
/// binding).
pub async fn bind_fixture_queue(fixture: &Fixture, exchange: &str) {
    let conn = connect().await.expect("connect to rabbitmq");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_bind(
        fixture.queue.as_str().into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    let _ = conn.close(200, "ok".into()).await;
}

impl Fixture {
    /// Declares fresh names and starts consuming.
    pub async fn new() -> Fixture {
        let exchange = crate::unique("x");
        let queue = crate::unique("q");
        // Declare once up front so the relay finds the exchange from the start.
        declare(&exchange, &queue).await.expect("declare topology");
        let deliveries = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(consume_forever(
            exchange.clone(),
            queue.clone(),
            Arc::clone(&deliveries),
            stop.clone(),
        ));
        Fixture {
            exchange,
            queue,
            deliveries,
            stop,
            task,
        }
    }

    /// Everything received so far, in arrival order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.deliveries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The message ids received so far, in arrival order, repeats included.
    pub fn message_ids(&self) -> Vec<String> {
        self.deliveries()
            .into_iter()
            .map(|d| d.message_id)
            .collect()
    }

    /// How many deliveries so far.
    pub fn count(&self) -> usize {
        self.deliveries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Waits up to `within` for at least `n` deliveries; panics naming how
    /// many came.
    pub async fn expect_at_least(&self, n: usize, within: std::time::Duration) {
        assert!(
            crate::eventually(within, || async { self.count() >= n }).await,
            "only {} of {n} delivered within {within:?}",
            self.count()
        );
    }

    /// Stops consuming and deletes the queue and exchange.
    pub async fn cleanup(self) {
        self.stop.cancel();
        let _ = self.task.await;
        if let Ok(conn) = connect().await {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch
                    .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = ch
                    .exchange_delete(
                        self.exchange.as_str().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
            }
            let _ = conn.close(200, "ok".into()).await;
        }
    }
}

async fn declare(exchange: &str, queue: &str) -> lapin::Result<Connection> {
    let conn = connect().await?;
    declare_topology(&conn.create_channel().await?, exchange, queue).await?;
    Ok(conn)
}

/// Declares a durable topic `exchange` and a durable `queue` bound to all of
/// it ("#").
pub async fn declare_topology(ch: &Channel, exchange: &str, queue: &str) -> lapin::Result<()> {
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}

async fn consume_forever(
    exchange: String,
    queue: String,
    sink: Arc<Mutex<Vec<Delivery>>>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Err(e) = consume_once(&exchange, &queue, &sink, &stop).await {
            tracing::debug!(error = %e, "test consumer reconnecting");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
}

/// Whether `queue` still counts a consumer, asked on `ch` within 5 s: the
/// test consumer's own, the only one a fixture's queue has.
async fn registered(conn: &Connection, ch: &Channel, queue: &str) -> bool {
    if !conn.status().connected() {
        return false;
    }
    let asked = ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    );
    matches!(
        tokio::time::timeout(Duration::from_secs(5), asked).await,
        Ok(Ok(q)) if q.consumer_count() > 0
    )
}

async fn consume_once(
    exchange: &str,
    queue: &str,
    sink: &Arc<Mutex<Vec<Delivery>>>,
    stop: &CancellationToken,
) -> lapin::Result<()> {
    // A broker still starting up can accept the TCP connection and then not
    // answer the handshake; without a bound the consumer would wait there
    // forever and every later delivery would look lost.
    let setup = async {
        let conn = declare(exchange, queue).await?;
        let ch = conn.create_channel().await?;
        ch.basic_qos(500, BasicQosOptions::default()).await?;
        let consumer = ch
            .basic_consume(
                queue.into(),
                crate::unique("c").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok::<_, lapin::Error>((conn, ch, consumer))
    };
    let (conn, ch, mut consumer) = match tokio::time::timeout(Duration::from_secs(10), setup).await
    {
        Ok(r) => r?,
        Err(_) => {
            tracing::debug!("test consumer: no answer from rabbitmq within 10s; reconnecting");
            return Ok(());
        }
    };
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => {
                let _ = conn.close(200, "done".into()).await;
                return Ok(());
            }
            n = tokio::time::timeout(Duration::from_secs(5), consumer.next()) => match n {
                Ok(n) => n,
                // Quiet for a while: fine for a consumer the queue still
                // has, a reason to reconnect otherwise. The connection's own
                // status is not enough: after a broker restart one consumer
                // stayed "connected" for two minutes while its queue filled
                // with no consumer, and every message looked lost.
                Err(_) if registered(&conn, &ch, queue).await => continue,
                Err(_) => return Ok(()),
            },
        };
        let Some(d) = next else { return Ok(()) };
        let d = d?;
        let p = &d.properties;
        let headers = p
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .map(|(k, v)| (k.to_string(), value_text(v)))
                    .collect()
            })
            .unwrap_or_default();
        sink.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Delivery {
                message_id: p
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
                routing_key: d.routing_key.to_string(),
                headers,
                content_type: p.content_type().as_ref().map(|s| s.to_string()),
                delivery_mode: *p.delivery_mode(),
                timestamp: *p.timestamp(),
                payload: d.data.clone(),
                received: std::time::Instant::now(),
            });
        // An ack written as the broker goes away can wait forever on the
        // dead connection, and the loop above with it: after a broker
        // restart the queue held 5,348 messages and no consumer. Bounded,
        // the consumer reconnects instead, and the broker delivers again
        // what it had not seen acked.
        match tokio::time::timeout(Duration::from_secs(5), d.ack(BasicAckOptions::default())).await
        {
            Ok(acked) => {
                acked?;
            }
            Err(_) => return Ok(()),
        }
    }
}

fn value_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        other => format!("{other:?}"),
    }
}

/// Declares a direct exchange bound to `fixture`'s queue with `routing_key`
/// only, so a message with any other routing key is unroutable.
pub async fn declare_direct_exchange_bound(fixture: &Fixture, name: &str, routing_key: &str) {
    let conn = connect().await.expect("connect to rabbitmq");
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        name.into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("declare exchange");
    ch.queue_bind(
        fixture.queue.as_str().into(),
        name.into(),
        routing_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    let _ = conn.close(200, "ok".into()).await;
}

/// Sets the broker's `max_message_size` (bytes) for channels opened from now
/// on, through `rabbitmqctl eval`.
pub async fn set_max_message_size(bytes: usize) {
    rabbitmqctl(&[
        "eval",
        &format!("application:set_env(rabbit, max_message_size, {bytes})."),
    ])
    .await;
}

/// Runs `rabbitmqctl` with `args`, panicking with its output when it fails.
pub async fn rabbitmqctl(args: &[&str]) {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .await
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How many of the broker's connections from `ports` (this process's own,
/// see [`crate::process::own_tcp_ports`]) it has blocked: connections that
/// published during a resource alarm.
pub async fn blocked_connections_from(ports: &[i32]) -> usize {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "peer_port",
            "state",
        ])
        .output()
        .await
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.parse::<i32>().ok()?, f.next()?.to_owned()))
        })
        .filter(|(port, state)| state == "blocked" && ports.contains(port))
        .count()
}

/// A memory alarm on the broker (`vm_memory_high_watermark` 0), cleared by
/// [`MemoryAlarm::clear`], or on drop if a failed assertion got there first,
/// so that one failing test does not leave every later one blocked.
pub struct MemoryAlarm {
    cleared: bool,
}

/// The watermark RabbitMQ ships with.
const DEFAULT_WATERMARK: &str = "0.4";

impl MemoryAlarm {
    /// Raises the alarm: the broker blocks every publishing connection.
    pub async fn raise() -> MemoryAlarm {
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]).await;
        MemoryAlarm { cleared: false }
    }

    /// Clears it.
    pub async fn clear(mut self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", DEFAULT_WATERMARK]).await;
        self.cleared = true;
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        if !self.cleared {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["set_vm_memory_high_watermark", DEFAULT_WATERMARK])
                .output();
        }
    }
}

/// The broker's application stopped (`rabbitmqctl stop_app`): connections
/// refused, the node up. Started again by [`BrokerStopped::start`], or on
/// drop if a failed assertion got there first, so that one failing test
/// does not leave every later one without a broker.
pub struct BrokerStopped {
    started: bool,
}

impl BrokerStopped {
    /// Stops the broker's application.
    pub async fn stop() -> BrokerStopped {
        rabbitmqctl(&["stop_app"]).await;
        BrokerStopped { started: false }
    }

    /// Starts it again and waits until it takes connections.
    pub async fn start(mut self) {
        rabbitmqctl(&["start_app"]).await;
        rabbitmqctl(&["await_startup"]).await;
        self.started = true;
    }
}

impl Drop for BrokerStopped {
    fn drop(&mut self) {
        if !self.started {
            for args in [["start_app"], ["await_startup"]] {
                let _ = std::process::Command::new("rabbitmqctl")
                    .args(args)
                    .output();
            }
        }
    }
}
