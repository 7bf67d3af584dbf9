//! What crosses the wall between finding rows and publishing them: the
//! claimed row ([`Envelope`]) and the broker's word that it took it
//! ([`Receipt`]). The row-finding side (`source`) and the broker side
//! (`publish`) both use these; neither imports the other.

use std::time::SystemTime;

use uuid::Uuid;

/// Name accepted as an alias of AMQP's default exchange (`""`), which an
/// outbox client refuses as an empty destination.
pub const DEFAULT_EXCHANGE_ALIAS: &str = "amq.default";

/// One claimed outbox row, as handed to a publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The row's insertion order in the outbox.
    pub seq: i64,
    /// The stable message id stamped on every attempt.
    pub message_id: Uuid,
    /// AMQP exchange or Kafka topic; `""` is AMQP's default exchange.
    pub destination: String,
    /// Per-key ordering; the Kafka record key.
    pub ordering_key: Option<String>,
    /// AMQP routing key.
    pub routing_key: String,
    /// The row's own headers, in name order.
    pub headers: Vec<(String, String)>,
    /// The payload bytes, passed through untouched.
    pub payload: Vec<u8>,
    /// MIME content type, if the row has one.
    pub content_type: Option<String>,
    /// The event type, if the row has one: the CloudEvents `type`.
    pub event_type: Option<String>,
    /// When the row was written.
    pub created_at: SystemTime,
    /// Failed attempts so far.
    pub attempts: i32,
}

impl Envelope {
    /// The bytes this row holds in memory that grow with what its writer
    /// wrote: its payload and its headers' names and values. What budgets
    /// and batch limits count.
    pub fn bytes(&self) -> usize {
        self.headers
            .iter()
            .fold(self.payload.len(), |n, (k, v)| n + k.len() + v.len())
    }

    /// The AMQP exchange this row goes to: its destination, with
    /// [`DEFAULT_EXCHANGE_ALIAS`] meaning the default exchange (`""`).
    pub fn amqp_exchange(&self) -> &str {
        if self.destination == DEFAULT_EXCHANGE_ALIAS {
            ""
        } else {
            &self.destination
        }
    }
}

/// What the broker said when it took a message: kept with the row in
/// retention mode (`--retention`) and shown by `outbox-relay locate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// A RabbitMQ publisher confirm: an Ack with no `basic.return` before it.
    Amqp,
    /// A Kafka delivery report without error.
    Kafka {
        /// The partition the record was written to.
        partition: i32,
        /// Its offset in that partition.
        offset: i64,
    },
    /// The in-memory publisher's acceptance (tests and embedders).
    Memory,
}

impl Receipt {
    /// The receipt of `env` as stored in the `published.receipt` column. Where
    /// the message went comes from the envelope, so a receipt costs no
    /// allocation unless retention asks for it.
    pub fn to_json(&self, env: &Envelope) -> serde_json::Value {
        match self {
            Receipt::Amqp => serde_json::json!({
                "broker": "rabbitmq",
                "confirm": "ack",
                "exchange": env.amqp_exchange(),
                "routing_key": env.routing_key,
            }),
            Receipt::Kafka { partition, offset } => serde_json::json!({
                "broker": "kafka",
                "topic": env.destination,
                "partition": partition,
                "offset": offset,
            }),
            Receipt::Memory => serde_json::json!({ "broker": "memory" }),
        }
    }
}
