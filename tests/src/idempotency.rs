//! What the idempotency suites share.

/// The scope their keys are stored under: one tenant's `POST /effects`. The
/// HTTP service and the core-API tests both use it.
pub const SCOPE: &str = "tenant:t1 POST /effects";
