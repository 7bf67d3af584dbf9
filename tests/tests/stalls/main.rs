//! Loss and stalls under conditions the happy path never shows: returns that
//! arrive out of step with confirms, a hot key whose head is blocked while
//! thousands of its messages wait, several outboxes on one cluster,
//! messages refused before or while sending, and a failover to a standby
//! right after a drain.
//!
//! Every case here failed against the relay before its fix; see the comment on
//! each test for what it caught.

use std::time::Duration;

mod blocked_head;
mod failover;
mod floor;
mod idle;
mod outboxes;
mod plans;
mod refused;
mod returns;

const PATIENCE: Duration = Duration::from_secs(120);
