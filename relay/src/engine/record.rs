//! What a settled batch leaves in the metrics.

use std::collections::HashSet;

use super::plan::SettlePlan;
use crate::envelope::Envelope;

pub(super) fn count_by_destination(
    batch: &[Envelope],
    pick: impl Fn(&Envelope) -> bool,
    result: &'static str,
) {
    let mut counts: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for env in batch.iter().filter(|e| pick(e)) {
        *counts.entry(env.destination.as_str()).or_default() += 1;
    }
    for (destination, n) in counts {
        metrics::counter!(crate::metrics::MESSAGES, "destination" => crate::metrics::destination_label(destination), "result" => result)
            .increment(n);
    }
}

pub(super) fn record_settled(batch: &[Envelope], plan: &SettlePlan) {
    let deleted: HashSet<i64> = plan.published.iter().map(|p| p.0.seq).collect();
    let failed: HashSet<i64> = plan.failed.iter().map(|f| f.0).collect();
    let dead: HashSet<i64> = plan.dead.iter().map(|d| d.0).collect();
    count_by_destination(batch, |e| deleted.contains(&e.seq), "published");
    count_by_destination(batch, |e| failed.contains(&e.seq), "rejected");
    count_by_destination(batch, |e| dead.contains(&e.seq), "dead_lettered");
    metrics::counter!(crate::metrics::RETRIES).increment(plan.failed.len() as u64);
    let now = std::time::SystemTime::now();
    let latency = metrics::histogram!(crate::metrics::COMMIT_TO_CONFIRM);
    for env in batch.iter().filter(|e| deleted.contains(&e.seq)) {
        if let Ok(d) = now.duration_since(env.created_at) {
            latency.record(d.as_secs_f64());
        }
    }
}
