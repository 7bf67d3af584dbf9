//! Trace context: a message enqueued inside a span carries its traceparent to
//! RabbitMQ and Kafka consumers.

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::eventually;

use super::PATIENCE;

/// Trace context round trip: a message enqueued inside a traced span carries
/// that span's W3C traceparent to RabbitMQ and Kafka consumers, who continue
/// the same trace.
#[tokio::test]
async fn enqueue_inside_a_span_and_consumers_see_the_same_trace() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests")));
    // This test's thread only (a current-thread runtime runs everything here).
    let _trace = tracing::subscriber::set_default(subscriber);

    // One outbox per broker, both written inside the same span.
    let db = TestDb::new().await;
    let kafka_db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let brokers = outbox_tests::kafka_brokers();
    let topic = outbox_tests::kafka::Fixture::new(&brokers, 1).await;

    let span = tracing::info_span!("checkout");
    let span_context = span.context().span().span_context().clone();
    assert!(
        span_context.is_valid(),
        "the test's tracer must make real spans"
    );
    let (trace_id, span_id) = (span_context.trace_id(), span_context.span_id());
    let paid = |destination: &str| {
        Message::builder(destination)
            .key("order-1")
            .json(&"paid")
            .build()
            .expect("valid")
    };
    async {
        db.outbox()
            .enqueue(&db.client, &paid(&rabbit.exchange))
            .await
            .expect("enqueue");
        kafka_db
            .outbox()
            .enqueue(&kafka_db.client, &paid(&topic.topic))
            .await
            .expect("enqueue");
    }
    .instrument(span)
    .await;
    // Outside any span nothing is added.
    db.outbox()
        .enqueue(
            &db.client,
            &Message::builder(rabbit.exchange.as_str())
                .json(&"untraced")
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");

    let amqp_relay = outbox_tests::InProcessRelay::amqp(&db, outbox_tests::fast_settings());
    let kafka_relay = outbox_tests::InProcessRelay::kafka(
        &kafka_db,
        &brokers,
        &[],
        outbox_tests::fast_settings(),
    );
    assert!(eventually(PATIENCE, || async { rabbit.count() >= 2 }).await);
    assert!(eventually(PATIENCE, || async { topic.count() >= 1 }).await);
    amqp_relay.stop().await;
    kafka_relay.stop().await;

    let expected = format!("00-{trace_id}-{span_id}-01");
    let deliveries = rabbit.deliveries();
    let traced = deliveries
        .iter()
        .find(|d| d.payload == br#""paid""#)
        .expect("traced amqp message");
    assert_eq!(traced.headers.get("traceparent"), Some(&expected));
    let untraced = deliveries
        .iter()
        .find(|d| d.payload == br#""untraced""#)
        .expect("untraced amqp message");
    assert_eq!(untraced.headers.get("traceparent"), None);
    let record = topic.records().into_iter().next().expect("kafka record");
    assert_eq!(record.headers.get("traceparent"), Some(&expected));
    // A consumer parses it back into the same trace id.
    let parsed = expected.split('-').nth(1).expect("trace id field");
    assert_eq!(parsed, trace_id.to_string());

    topic.stop().await;
    rabbit.cleanup().await;
    kafka_db.cleanup().await;
    db.cleanup().await;
}
