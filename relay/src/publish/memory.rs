//! An in-memory broker, for exercising the relay's claim/publish/complete logic
//! without a network. Not a test double of RabbitMQ or Kafka: it only records
//! what it was handed and answers as scripted.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use super::{Envelope, PublishError, Publisher, Receipt, Rejection, Verdict};

#[derive(Debug, Default)]
struct State {
    published: Vec<Envelope>,
    reject: HashSet<Uuid>,
    reject_destinations: HashMap<String, Rejection>,
    down: bool,
    batches: usize,
    /// Accepted envelopes are counted, not kept (see [`MemoryPublisher::counting`]).
    discard: bool,
    accepted: usize,
}

/// Records every accepted envelope; can reject chosen ids or be "down".
/// Clones share one record and one script: one broker that several relays
/// (replicas) publish to, accepting in one order.
#[derive(Debug, Default, Clone)]
pub struct MemoryPublisher {
    state: Arc<Mutex<State>>,
}

impl MemoryPublisher {
    /// A publisher that accepts everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// A publisher that accepts everything and keeps only the count: a
    /// broker that answers at once, for measuring the relay's drain without
    /// one, its memory not growing with the messages.
    pub fn counting() -> Self {
        let publisher = Self::default();
        publisher.state().discard = true;
        publisher
    }

    /// How many envelopes were accepted.
    pub fn accepted(&self) -> usize {
        self.state().accepted
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock can only come from a test's own
        // assertion; the data is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Everything accepted so far, in publish order.
    pub fn published(&self) -> Vec<Envelope> {
        self.state().published.clone()
    }

    /// Number of batches handed over (accepted or not).
    pub fn batches(&self) -> usize {
        self.state().batches
    }

    /// Rejects (retryably) every publish of this id until [`Self::accept`].
    pub fn reject(&self, id: Uuid) {
        self.state().reject.insert(id);
    }

    /// Stops rejecting `id`.
    pub fn accept(&self, id: Uuid) {
        self.state().reject.remove(&id);
    }

    /// Rejects everything sent to `destination` with `rejection`.
    pub fn reject_destination(&self, destination: &str, rejection: Rejection) {
        self.state()
            .reject_destinations
            .insert(destination.to_owned(), rejection);
    }

    /// While down, every batch fails as a whole.
    pub fn set_down(&self, down: bool) {
        self.state().down = down;
    }
}

impl Publisher for MemoryPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Verdict>, PublishError> {
        let mut state = self.state();
        state.batches += 1;
        if state.down {
            return Err(PublishError::msg("memory broker is down"));
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for env in batch {
            if state.reject.contains(&env.message_id) {
                outcomes.push(Err(Rejection::retryable("rejected by script")));
            } else if let Some(r) = state.reject_destinations.get(&env.destination) {
                outcomes.push(Err(r.clone()));
            } else {
                state.accepted += 1;
                if !state.discard {
                    state.published.push(env.clone());
                }
                outcomes.push(Ok(Receipt::Memory));
            }
        }
        Ok(outcomes)
    }

    async fn ready(&self) -> Result<(), PublishError> {
        if self.state().down {
            Err(PublishError::msg("memory broker is down"))
        } else {
            Ok(())
        }
    }

    async fn close(&self) {}
}
