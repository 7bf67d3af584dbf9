//! Operating the relay: metrics move while messages flow, readiness follows the
//! broker, and logs never carry passwords or payloads.

use std::time::Duration;

mod logs;
mod metrics;
mod trace_context;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(120);
