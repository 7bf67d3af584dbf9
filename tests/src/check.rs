//! The delivery checker: loss, strays, duplicates, id stability and per-key order.

use std::collections::{HashMap, HashSet};
use std::fmt;

use uuid::Uuid;

use crate::workload::{Tag, Written};

/// One delivery as any consumer saw it: the message id it carried and its payload.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The broker-level message id (AMQP property or Kafka header).
    pub message_id: String,
    /// The payload.
    pub payload: Vec<u8>,
}

/// What the checker found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Messages committed.
    pub committed: usize,
    /// Deliveries received (with duplicates).
    pub deliveries: usize,
    /// Committed messages never delivered.
    pub lost: Vec<Uuid>,
    /// Deliveries that match nothing committed or indeterminate (rolled back,
    /// foreign, or without a parseable id).
    pub unexpected: Vec<String>,
    /// Deliveries beyond the first of each message.
    pub duplicates: usize,
    /// Deliveries whose payload does not match what was committed under their id
    /// (an id reused for another message, or a payload altered in flight).
    pub id_mismatches: usize,
    /// First deliveries that arrived after a later message of the same key.
    pub inversions: usize,
}

impl Report {
    /// True when nothing was lost, nothing unexpected arrived, ids were stable
    /// and per-key order held; duplicates are judged separately against a bound.
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty()
            && self.unexpected.is_empty()
            && self.id_mismatches == 0
            && self.inversions == 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "committed={} deliveries={} lost={} unexpected={} duplicates={} id_mismatches={} inversions={}",
            self.committed,
            self.deliveries,
            self.lost.len(),
            self.unexpected.len(),
            self.duplicates,
            self.id_mismatches,
            self.inversions
        )
    }
}

/// Compares what was delivered with what was written.
pub fn check(written: &Written, seen: &[Seen]) -> Report {
    let mut report = Report {
        committed: written.committed.len(),
        deliveries: seen.len(),
        ..Report::default()
    };
    let mut first_seen: HashSet<Uuid> = HashSet::new();
    // Highest seq delivered (first time) per key so far.
    let mut high: HashMap<&str, u64> = HashMap::new();
    for s in seen {
        let Ok(id) = Uuid::parse_str(&s.message_id) else {
            report.unexpected.push(s.message_id.clone());
            continue;
        };
        let expected: Option<&Tag> = written
            .committed
            .get(&id)
            .or_else(|| written.indeterminate.get(&id));
        let Some(expected) = expected else {
            report.unexpected.push(s.message_id.clone());
            continue;
        };
        match serde_json::from_slice::<Tag>(&s.payload) {
            Ok(tag) if &tag == expected => {}
            _ => report.id_mismatches += 1,
        }
        if !first_seen.insert(id) {
            report.duplicates += 1;
            continue;
        }
        let h = high.entry(expected.key.as_str()).or_insert(0);
        if expected.seq < *h {
            report.inversions += 1;
        } else {
            *h = expected.seq;
        }
    }
    report.lost = written
        .committed
        .keys()
        .filter(|id| !first_seen.contains(id))
        .copied()
        .collect();
    report
}

/// True once every message `written` committed is among `seen`. Waiting for
/// a count would not do: duplicates make the count reach the number
/// committed while a first delivery is still on its way.
pub fn all_seen(written: &Written, seen: &[Seen]) -> bool {
    check(written, seen).lost.is_empty()
}

/// Appends one row of the summary table for `scenario` under `dir` (the suites
/// pass `env!("CARGO_TARGET_TMPDIR")`); `tests/run.sh` prints the table at the
/// end of the run. Also prints the row to the test's own output.
pub fn record(
    dir: &str,
    scenario: &str,
    report: &Report,
    duration: std::time::Duration,
    duplicate_bound: Option<usize>,
) {
    let row = format!(
        "{:<44} {:>9} {:>10} {:>5} {:>10} {:>10} {:>10} {:>8.1}s",
        scenario,
        report.committed,
        report.deliveries,
        report.lost.len(),
        report.unexpected.len(),
        match duplicate_bound {
            Some(b) => format!("{}/{}", report.duplicates, b),
            None => report.duplicates.to_string(),
        },
        report.inversions,
        duration.as_secs_f64()
    );
    println!("{row}");
    let dir = std::path::Path::new(dir).join("correctness");
    let _ = std::fs::create_dir_all(&dir);
    let file: String = scenario
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let _ = std::fs::write(dir.join(format!("{file}.row")), format!("{row}\n"));
}

/// Records `report` as `scenario`'s row under `dir` (see [`record`]), then
/// fails the test unless nothing was lost or unexpected and, with a `bound`,
/// there were no more duplicates than it.
pub fn judge(
    dir: &str,
    scenario: &str,
    report: &Report,
    started: std::time::Instant,
    bound: Option<usize>,
) {
    record(dir, scenario, report, started.elapsed(), bound);
    assert!(report.is_clean(), "{scenario}: {report}");
    if let Some(bound) = bound {
        assert!(
            report.duplicates <= bound,
            "{scenario}: {} duplicates, more than the bound of {bound}: {report}",
            report.duplicates
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(n: u64) -> (Written, Vec<Uuid>) {
        let mut w = Written::default();
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
        for (i, id) in ids.iter().enumerate() {
            w.committed.insert(
                *id,
                Tag {
                    key: "k".into(),
                    seq: i as u64,
                },
            );
        }
        (w, ids)
    }

    fn seen(w: &Written, id: Uuid) -> Seen {
        Seen {
            message_id: id.to_string(),
            payload: serde_json::to_vec(&w.committed[&id]).expect("json"),
        }
    }

    #[test]
    fn clean_run_is_clean() {
        let (w, ids) = written(3);
        let r = check(&w, &ids.iter().map(|id| seen(&w, *id)).collect::<Vec<_>>());
        assert!(r.is_clean(), "{r}");
        assert_eq!(r.duplicates, 0);
    }

    #[test]
    fn finds_loss_strays_duplicates_and_inversions() {
        let (mut w, ids) = written(4);
        let ghost = Uuid::new_v4();
        w.rolled_back.push(ghost);
        let mut s: Vec<Seen> = vec![seen(&w, ids[0]), seen(&w, ids[2]), seen(&w, ids[1])];
        s.push(seen(&w, ids[0]));
        s.push(Seen {
            message_id: ghost.to_string(),
            payload: vec![],
        });
        let r = check(&w, &s);
        assert_eq!(r.lost, vec![ids[3]]);
        assert_eq!(r.unexpected, vec![ghost.to_string()]);
        assert_eq!(r.duplicates, 1);
        assert_eq!(r.inversions, 1);
        assert!(!r.is_clean());
    }

    #[test]
    fn a_reused_id_is_a_mismatch() {
        let (w, ids) = written(2);
        let mut s = seen(&w, ids[0]);
        s.payload = serde_json::to_vec(&w.committed[&ids[1]]).expect("json");
        let r = check(&w, &[s, seen(&w, ids[1])]);
        assert_eq!(r.id_mismatches, 1);
    }
}
