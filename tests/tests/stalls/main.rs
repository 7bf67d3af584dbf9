//! Loss and stalls under conditions the happy path never shows: returns that
//! arrive out of step with confirms, a hot key whose head is blocked while
//! thousands of its messages wait, several outboxes on one cluster,
//! messages refused before or while sending, failovers to a standby, a
//! server that ends idle sessions, and sessions that a load balancer in front
//! of Postgres leaves open and silent.
//!
//! Every case here failed against the relay before its fix; see the comment on
//! each test for what it caught. Two are coverage only, and say so: the
//! failover while writers commit passed before the fix it sits beside, and
//! the server ending idle sessions passed when it was written. One guards a
//! fix against its own failure mode: a missing synchronous standby must make
//! the relay give up no session, which a first version of the bound on
//! stranded sessions did.

use std::time::Duration;

mod blocked_head;
mod failover;
mod floor;
mod idle;
mod lanes;
mod outboxes;
mod plans;
mod reaped;
mod refused;
mod returns;
mod stranded;

const PATIENCE: Duration = Duration::from_secs(120);
