//! Loss and stalls under conditions the happy path never shows: returns that
//! arrive out of step with confirms, a hot key whose head is blocked while
//! thousands of its messages wait, several outboxes on one cluster,
//! messages refused before or while sending, failovers to a standby, and a
//! server that ends idle sessions.
//!
//! Every case here failed against the relay before its fix; see the comment on
//! each test for what it caught. Two are coverage only, and say so: the
//! failover while writers commit passed before the fix it sits beside, and
//! the server ending idle sessions passed when it was written.

use std::time::Duration;

mod blocked_head;
mod failover;
mod floor;
mod idle;
mod outboxes;
mod plans;
mod reaped;
mod refused;
mod returns;

const PATIENCE: Duration = Duration::from_secs(120);
