//! W3C trace context, captured when a message is enqueued.
//!
//! With the `opentelemetry` feature, [`Outbox::enqueue`](crate::Outbox::enqueue)
//! and [`Outbox::enqueue_batch`](crate::Outbox::enqueue_batch) look at the span
//! they run in: the current `tracing` span through `tracing-opentelemetry`, or
//! else the current OpenTelemetry context. When it carries a valid span
//! context, each message gets `traceparent` (and `tracestate`, when not empty)
//! headers in the W3C Trace Context format, unless the message already sets
//! `traceparent` itself. The relay forwards row headers as AMQP and Kafka
//! headers, so a consumer continues the trace from them.
//!
//! Without the feature, or outside a sampled or unsampled span with a valid
//! context, nothing is added.

/// The header carrying the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";
/// The header carrying vendor trace state.
pub const TRACESTATE: &str = "tracestate";

/// The trace headers of the current span, if there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<trace id>-<span id>-<flags>`.
    pub traceparent: String,
    /// Vendor state, if any.
    pub tracestate: Option<String>,
}

/// The trace context of the code calling it, or `None` when it runs outside
/// a span with a valid context (or the `opentelemetry` feature is off).
pub fn current() -> Option<TraceContext> {
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        let from_span = tracing::Span::current().context();
        let cx = if from_span.span().span_context().is_valid() {
            from_span
        } else {
            opentelemetry::Context::current()
        };
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        let state = sc.trace_state().header();
        Some(TraceContext {
            traceparent: format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ),
            tracestate: (!state.is_empty()).then_some(state),
        })
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        None
    }
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use super::*;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };

    #[test]
    fn outside_any_span_there_is_no_context() {
        assert_eq!(current(), None);
    }

    #[test]
    fn an_active_opentelemetry_context_is_formatted_per_w3c() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("trace id"),
            SpanId::from_hex("00f067aa0ba902b7").expect("span id"),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_key_value([("vendor", "v1")]).expect("state"),
        );
        let _guard = opentelemetry::Context::current()
            .with_remote_span_context(sc)
            .attach();
        assert_eq!(
            current(),
            Some(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("vendor=v1".into()),
            })
        );
    }
}
