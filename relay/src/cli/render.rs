//! Text for a person at a terminal: how `status`, `dead-letters` and
//! `locate` read without `--json`.

use std::fmt::Write as _;

use crate::ops::{Blocker, DeadLetter, Located, Location, Status};

/// An age as an operator reads it: 42s, 17m, 3.5h; "-" when unknown.
pub(super) fn human_age(secs: Option<f64>) -> String {
    match secs {
        None => "-".into(),
        Some(s) if s < 120.0 => format!("{s:.0}s"),
        Some(s) if s < 7200.0 => format!("{:.0}m", s / 60.0),
        Some(s) => format!("{:.1}h", s / 3600.0),
    }
}

/// A destination as an operator reads it: AMQP's default exchange has no name.
pub(super) fn destination_name(d: &str) -> &str {
    if d.is_empty() {
        "(default exchange)"
    } else {
        d
    }
}

fn shown<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

/// `outbox-relay status`.
pub(super) fn status_text(v: &Status) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "outbox schema {}", v.schema);
    if v.backlog.is_empty() {
        let _ = writeln!(o, "backlog: empty");
    } else {
        let _ = writeln!(o, "backlog:");
        for b in &v.backlog {
            let _ = writeln!(
                o,
                "  {:<32} pending {:>8}  oldest {:>6}  retrying {}",
                b.destination,
                b.pending,
                human_age(b.oldest_age_s),
                b.retrying
            );
        }
    }
    let _ = writeln!(o, "in flight: {}", v.in_flight);
    let _ = writeln!(o, "dead letters: {}", v.dead_letters);
    let retained = &v.published_retained;
    if retained.count > 0 {
        let _ = writeln!(
            o,
            "published, kept for retention: {}{} (oldest {})",
            retained.count,
            if retained.at_least { "+" } else { "" },
            human_age(retained.oldest_age_s)
        );
    }
    for p in &v.parked_keys {
        let _ = writeln!(
            o,
            "  parked key {:?}: {} waiting behind {}",
            p.key, p.waiting, p.behind_dead_letter
        );
    }
    for p in &v.paused {
        let _ = writeln!(
            o,
            "paused destination {:?} since {} ({} ago): {} waiting{}",
            p.destination,
            p.paused_at,
            human_age(p.paused_for_s),
            p.waiting,
            p.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(
        o,
        "replicas ({} of {} partitions owned):",
        v.partitions_owned, v.partitions_total
    );
    for r in &v.replicas {
        let _ = writeln!(
            o,
            "  slot {} {}:{}  partitions {:>2} (since {})  in flight {}  published {}  heartbeat {}",
            r.slot,
            r.host.as_deref().unwrap_or("?"),
            shown(r.pid),
            r.partitions.len(),
            human_age(r.owning_since_age_s),
            shown(r.in_flight),
            shown(r.published),
            human_age(r.heartbeat_age_s),
        );
        if r.stepped_aside {
            let _ = writeln!(
                o,
                "    stepped aside: its broker is unreachable while another replica's is not; \
                 its partitions went to the others until its broker answers again"
            );
        }
    }
    if v.blockers.is_empty() {
        let _ = writeln!(o, "holding back: nothing");
    } else {
        let _ = writeln!(o, "holding back:");
        for b in &v.blockers {
            let _ = match b {
                Blocker::LongTransaction {
                    pid,
                    application,
                    state,
                    age_s,
                    why,
                } => writeln!(
                    o,
                    "  transaction open {} in pid {pid} ({}, {}): {why}",
                    human_age(*age_s),
                    application.as_deref().unwrap_or(""),
                    state.as_deref().unwrap_or(""),
                ),
                Blocker::PartitionSilent {
                    slot,
                    topic,
                    partition,
                    silent_for_s,
                    why,
                    ..
                } => writeln!(
                    o,
                    "  partition {partition} of {topic:?} silent for {} (replica {slot}): {why}",
                    human_age(*silent_for_s),
                ),
                Blocker::BrokerUnreachable {
                    slot,
                    down_for_s,
                    error,
                    ..
                } => writeln!(
                    o,
                    "  broker unreachable for {} (replica {slot}): {}",
                    human_age(Some(*down_for_s)),
                    error.as_deref().unwrap_or("")
                ),
                Blocker::CommitsWaitForStandby {
                    waiting,
                    longest_s,
                    why,
                } => writeln!(
                    o,
                    "  {waiting} commit(s) waiting up to {} for a synchronous standby: {why}",
                    human_age(*longest_s),
                ),
                Blocker::NoRelay { why } | Blocker::PartitionsUnowned { why, .. } => {
                    writeln!(o, "  {why}")
                }
            };
        }
    }
    o
}

/// `dead-letters list`, or with `detailed` `dead-letters show`.
pub(super) fn dead_letters_text(list: &[DeadLetter], detailed: bool) -> String {
    let mut o = String::new();
    if list.is_empty() {
        let _ = writeln!(o, "no dead letters match");
    }
    for d in list {
        let _ = writeln!(
            o,
            "{}  {}  key={}  attempts={}  dead {} ago  error: {}",
            d.message_id,
            destination_name(&d.destination),
            d.key.as_deref().unwrap_or("-"),
            d.attempts,
            human_age(d.dead_age_s),
            d.last_error
        );
        if detailed {
            let _ = writeln!(
                o,
                "    seq {}  routing key {:?}  content type {}  payload {} bytes  written {} ago\n    headers {}",
                d.seq,
                d.routing_key,
                d.content_type.as_deref().unwrap_or("-"),
                d.payload_bytes,
                human_age(d.created_age_s),
                d.headers
            );
            if let Some(p) = &d.payload {
                let _ = writeln!(o, "    payload ({}): {}", p.encoding, p.data);
            }
        }
    }
    o
}

/// "kafka partition 3 offset 17" or "rabbitmq confirm ack (exchange ...)".
fn receipt_text(r: &serde_json::Value) -> String {
    match r["broker"].as_str() {
        Some("kafka") => format!(
            "kafka topic {:?} partition {} offset {}",
            r["topic"].as_str().unwrap_or(""),
            r["partition"],
            r["offset"]
        ),
        Some("rabbitmq") => format!(
            "rabbitmq confirm {} (exchange {:?}, routing key {:?})",
            r["confirm"].as_str().unwrap_or(""),
            r["exchange"].as_str().unwrap_or(""),
            r["routing_key"].as_str().unwrap_or("")
        ),
        _ => r.to_string(),
    }
}

/// `outbox-relay locate`.
pub(super) fn locate_text(v: &Located) -> String {
    let id = v.message_id;
    match &v.location {
        Location::Pending(w)
        | Location::Retrying(w)
        | Location::Held(w)
        | Location::Parked(w)
        | Location::Paused(w) => {
            let state = match &v.location {
                Location::Pending(_) => "pending",
                Location::Retrying(_) => "retrying",
                Location::Held(_) => "held",
                Location::Parked(_) => "parked",
                _ => "paused",
            };
            format!(
                "{id}: {state} to {:?} (key {}), {} failed attempts{}; written {} ago{}\n",
                w.destination,
                w.key.as_deref().unwrap_or("-"),
                w.attempts,
                w.last_error
                    .as_deref()
                    .map(|e| format!(", last error: {e}"))
                    .unwrap_or_default(),
                human_age(w.age_s),
                w.why
                    .as_deref()
                    .map(|w| format!("; {w}"))
                    .unwrap_or_default(),
            )
        }
        Location::InFlight { why } => format!("{id}: in flight: {why}\n"),
        Location::DeadLettered {
            attempts,
            last_error,
            dead_age_s,
            ..
        } => format!(
            "{id}: dead-lettered {} ago after {attempts} attempts: {last_error}\n",
            human_age(*dead_age_s),
        ),
        Location::Published {
            destination,
            key,
            published_at,
            published_age_s,
            receipt,
            ..
        } => format!(
            "{id}: published to {destination:?} (key {}) at {published_at} ({} ago), receipt {}\n",
            key.as_deref().unwrap_or("-"),
            human_age(*published_age_s),
            receipt_text(receipt),
        ),
        Location::Unknown { why } => format!("{id}: unknown: {why}\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_exchange_is_named_and_ages_read_as_units() {
        assert_eq!(destination_name(""), "(default exchange)");
        assert_eq!(destination_name("orders"), "orders");
        assert_eq!(human_age(Some(42.0)), "42s");
        assert_eq!(human_age(Some(600.0)), "10m");
        assert_eq!(human_age(Some(9000.0)), "2.5h");
        assert_eq!(human_age(None), "-");
    }

    #[test]
    fn a_silent_partition_is_named_under_holding_back() {
        let v = Status {
            schema: "outbox".into(),
            at: "2026-12-05T00:00:00Z".into(),
            backlog: Vec::new(),
            in_flight: 0,
            dead_letters: 0,
            published_retained: crate::ops::status::Retained {
                count: 0,
                at_least: false,
                oldest_at: None,
                oldest_age_s: None,
            },
            parked_keys: Vec::new(),
            paused: Vec::new(),
            replicas: Vec::new(),
            partitions_owned: 64,
            partitions_total: 64,
            backlog_per_partition: Vec::new(),
            blockers: vec![Blocker::PartitionSilent {
                slot: 7,
                topic: "orders".into(),
                partition: 3,
                since: "2026-12-04T23:58:00Z".into(),
                silent_for_s: Some(120.0),
                why: "why",
            }],
        };
        let text = status_text(&v);
        assert!(
            text.contains("partition 3 of \"orders\" silent for 2m (replica 7): why"),
            "{text}"
        );
        let json = serde_json::to_value(&v).expect("json");
        assert_eq!(json["blockers"][0]["kind"], "partition_silent");
        assert_eq!(json["blockers"][0]["partition"], 3);
    }
}
