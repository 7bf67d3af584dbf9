//! What a settled batch leaves in the metrics.

use std::collections::HashMap;

use super::plan::SettlePlan;
use crate::envelope::Envelope;

/// Counts each settled message under its destination and result, and
/// records, for the published ones, the latency from the row's
/// `created_at` to `answered`, when the broker's answers came: one pass
/// over the batch, one label lookup per destination.
pub(super) fn record_settled(
    batch: &[Envelope],
    plan: &SettlePlan,
    answered: std::time::SystemTime,
) {
    const PUBLISHED: &str = "published";
    let mut result_of: HashMap<i64, &'static str> = HashMap::new();
    result_of.extend(plan.published.iter().map(|p| (p.0.seq, PUBLISHED)));
    result_of.extend(plan.failed.iter().map(|f| (f.0, "rejected")));
    result_of.extend(plan.dead.iter().map(|d| (d.0, "dead_lettered")));
    let latency = metrics::histogram!(crate::metrics::COMMIT_TO_CONFIRM);
    let mut counts: HashMap<(&str, &'static str), u64> = HashMap::new();
    for env in batch {
        let Some(&result) = result_of.get(&env.seq) else {
            continue; // held back: published again later, counted then
        };
        *counts
            .entry((env.destination.as_str(), result))
            .or_default() += 1;
        if result == PUBLISHED {
            if let Ok(d) = answered.duration_since(env.created_at) {
                latency.record(d.as_secs_f64());
            }
        }
    }
    let mut labels: HashMap<&str, String> = HashMap::new();
    for ((destination, result), n) in counts {
        let label = labels
            .entry(destination)
            .or_insert_with(|| crate::metrics::destination_label(destination))
            .clone();
        metrics::counter!(crate::metrics::MESSAGES, "destination" => label, "result" => result)
            .increment(n);
    }
    metrics::counter!(crate::metrics::RETRIES).increment(plan.failed.len() as u64);
}

/// Counts messages dead-lettered without being published (too large to
/// send, unreadable), under their destinations.
pub(super) fn record_dead_lettered<'d>(destinations: impl Iterator<Item = &'d str>) {
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for destination in destinations {
        *counts.entry(destination).or_default() += 1;
    }
    for (destination, n) in counts {
        let label = crate::metrics::destination_label(destination);
        metrics::counter!(crate::metrics::MESSAGES, "destination" => label, "result" => "dead_lettered")
            .increment(n);
    }
}
