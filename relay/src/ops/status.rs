//! `outbox-relay status`: the backlog, dead letters, parked keys, pauses,
//! replicas and what holds the relay back.

use std::time::SystemTime;

use outbox_client::SchemaName;
use serde::Serialize;
use tokio_postgres::Client;

use super::{age_secs, at, rfc3339, OpsError};
use crate::source::inspect;
use crate::source::ownership::{LockKeys, ADVISORY_HELD_HERE, PARTITIONS};

/// Retained published rows counted exactly up to this many.
const RETAINED_CAP: i64 = 100_000;

/// Parked keys listed at most.
const PARKED_SHOWN: i64 = 50;

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// The outbox schema.
    pub schema: String,
    /// When the report was made (RFC 3339).
    pub at: String,
    /// Waiting rows per destination, largest first.
    pub backlog: Vec<DestinationBacklog>,
    /// Rows the replicas have claimed and not settled.
    pub in_flight: i64,
    /// Messages in the dead letters.
    pub dead_letters: i64,
    /// Published rows kept for `--retention`.
    pub published_retained: Retained,
    /// Keys waiting behind a dead letter.
    pub parked_keys: Vec<ParkedKey>,
    /// Paused destinations.
    pub paused: Vec<PausedDestination>,
    /// Running replicas.
    pub replicas: Vec<Replica>,
    /// Partitions some replica owns.
    pub partitions_owned: usize,
    /// All partitions.
    pub partitions_total: i16,
    /// Waiting rows per partition.
    pub backlog_per_partition: Vec<PartitionBacklog>,
    /// What holds the relay back.
    pub blockers: Vec<Blocker>,
}

/// Waiting rows of one destination.
#[derive(Debug, Clone, Serialize)]
pub struct DestinationBacklog {
    /// The destination.
    pub destination: String,
    /// Rows waiting.
    pub pending: i64,
    /// When the oldest was written.
    pub oldest_at: Option<String>,
    /// Its age in seconds.
    pub oldest_age_s: Option<f64>,
    /// Rows with a failed attempt.
    pub retrying: i64,
}

/// Published rows kept for retention.
#[derive(Debug, Clone, Serialize)]
pub struct Retained {
    /// How many (exact up to a cap).
    pub count: i64,
    /// True when there are more than `count`.
    pub at_least: bool,
    /// When the oldest was published.
    pub oldest_at: Option<String>,
    /// Its age in seconds.
    pub oldest_age_s: Option<f64>,
}

/// A key parked behind a dead letter.
#[derive(Debug, Clone, Serialize)]
pub struct ParkedKey {
    /// The ordering key.
    pub key: String,
    /// The dead letter it waits behind.
    pub behind_dead_letter: String,
    /// Its messages waiting.
    pub waiting: i64,
}

/// A paused destination.
#[derive(Debug, Clone, Serialize)]
pub struct PausedDestination {
    /// The destination.
    pub destination: String,
    /// Since when (RFC 3339, seconds).
    pub paused_at: String,
    /// For how long, in seconds.
    pub paused_for_s: Option<f64>,
    /// Why, as given to `pause`.
    pub reason: Option<String>,
    /// Its messages waiting.
    pub waiting: i64,
}

/// A running replica, from its presence lock and heartbeat.
#[derive(Debug, Clone, Serialize)]
pub struct Replica {
    /// Its presence slot.
    pub slot: i32,
    /// Host name it reported.
    pub host: Option<String>,
    /// Process id it reported.
    pub pid: Option<i32>,
    /// When it started.
    pub started_at: Option<String>,
    /// Seconds since it started.
    pub started_age_s: Option<f64>,
    /// Its last heartbeat.
    pub heartbeat_at: Option<String>,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_s: Option<f64>,
    /// Rows it has claimed and not settled.
    pub in_flight: Option<i32>,
    /// Messages it has published since it started.
    pub published: Option<i64>,
    /// Since when it cannot reach the broker.
    pub broker_down_since: Option<String>,
    /// For how long, in seconds.
    pub broker_down_for_s: Option<f64>,
    /// The broker error it last saw.
    pub broker_error: Option<String>,
    /// Broker partitions that leave its records unanswered while the rest
    /// answers.
    pub silent_partitions: Vec<SilentPartition>,
    /// It stepped aside: its broker unreachable while another replica's
    /// is not, it owns no partitions and counts for no share until its
    /// broker answers again.
    pub stepped_aside: bool,
    /// The partitions it owns.
    pub partitions: Vec<i32>,
    /// Since when it owns them.
    pub owning_since: Option<String>,
    /// For how long, in seconds.
    pub owning_since_age_s: Option<f64>,
}

/// A broker partition that leaves a replica's records unanswered while the
/// rest of the broker answers (a Kafka partition without a reachable
/// leader): the replica holds its records back and tries it again once per
/// message timeout.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct SilentPartition {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// Since when (RFC 3339).
    pub since: String,
}

impl SilentPartition {
    /// Seconds since it fell silent, if `since` reads as a time.
    fn silent_for_s(&self) -> Option<f64> {
        humantime::parse_rfc3339_weak(&self.since)
            .ok()
            .and_then(|t| age_secs(Some(t)))
    }
}

/// Waiting rows of one partition.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionBacklog {
    /// The partition.
    pub partition: i16,
    /// Rows waiting.
    pub pending: i64,
}

/// Something that holds the relay back, as `kind` plus its details.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Blocker {
    /// A transaction open for over 10 seconds.
    LongTransaction {
        /// Its backend pid.
        pid: i32,
        /// Its application_name.
        application: Option<String>,
        /// Its state (active, idle in transaction, ...).
        state: Option<String>,
        /// How long it has been open, in seconds.
        age_s: Option<f64>,
        /// Why it matters.
        why: &'static str,
    },
    /// A broker partition leaves a replica's records unanswered while the
    /// rest answers: messages whose key places them there wait.
    PartitionSilent {
        /// The replica's slot.
        slot: i32,
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// Since when (RFC 3339).
        since: String,
        /// For how long, in seconds.
        silent_for_s: Option<f64>,
        /// Why it matters.
        why: &'static str,
    },
    /// A replica cannot reach the broker.
    BrokerUnreachable {
        /// The replica's slot.
        slot: i32,
        /// Since when.
        down_since: Option<String>,
        /// For how long, in seconds.
        down_for_s: f64,
        /// The error it last saw.
        error: Option<String>,
    },
    /// Commits that have waited over a second for a synchronous standby:
    /// one that `synchronous_standby_names` requires is missing or far
    /// behind. The relay's settles and durability barrier wait too.
    CommitsWaitForStandby {
        /// Sessions whose commit waits (those the caller may see).
        waiting: i64,
        /// The longest wait so far, in seconds.
        longest_s: Option<f64>,
        /// Why it matters.
        why: &'static str,
    },
    /// Messages wait and no replica runs.
    NoRelay {
        /// Why it matters.
        why: &'static str,
    },
    /// Some partitions have no owner.
    PartitionsUnowned {
        /// How many.
        unowned: usize,
        /// Why it matters.
        why: &'static str,
    },
}

/// Reads the report for `schema`. With `park` (the relay's
/// `--dead-letter-order park`), a dead letter's later messages of its key are
/// listed as parked; under `skip` they go ahead, and no key is.
pub async fn status(client: &Client, schema: &SchemaName, park: bool) -> Result<Status, OpsError> {
    let s = schema.quoted();
    let backlog: Vec<DestinationBacklog> = inspect::backlog(client, schema)
        .await?
        .into_iter()
        .map(|b| DestinationBacklog {
            destination: b.destination,
            pending: b.pending,
            oldest_at: at(b.oldest),
            oldest_age_s: age_secs(b.oldest),
            retrying: b.retrying,
        })
        .collect();
    let dead_letters = inspect::dead_letter_count(client, schema).await?;
    // Retention mode only. Counting stops at RETAINED_CAP so status stays
    // quick on a week of retained rows; the oldest comes from the index.
    let r = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM (SELECT 1 FROM {s}.published LIMIT {RETAINED_CAP} + 1) c), \
                        (SELECT min(published_at) FROM {s}.published)"
            ),
            &[],
        )
        .await?;
    let retained_count: i64 = r.get(0);
    let oldest_retained: Option<SystemTime> = r.get(1);
    let published_retained = Retained {
        count: retained_count.min(RETAINED_CAP),
        at_least: retained_count > RETAINED_CAP,
        oldest_at: at(oldest_retained),
        oldest_age_s: age_secs(oldest_retained),
    };
    let parked = match park {
        true => inspect::parked_keys(client, schema, PARKED_SHOWN).await?,
        false => Vec::new(),
    };
    let parked_keys = parked
        .into_iter()
        .map(|p| ParkedKey {
            key: p.key,
            behind_dead_letter: p.behind_dead_letter,
            waiting: p.waiting,
        })
        .collect();
    let paused = client
        .query(
            &format!(
                "SELECT p.destination, p.paused_at, p.reason, \
                        (SELECT count(*) FROM {s}.messages m WHERE m.destination = p.destination) \
                 FROM {s}.paused_destinations p ORDER BY p.paused_at"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            let since: SystemTime = r.get(1);
            PausedDestination {
                destination: r.get(0),
                paused_at: humantime::format_rfc3339_seconds(since).to_string(),
                paused_for_s: age_secs(Some(since)),
                reason: r.get(2),
                waiting: r.get(3),
            }
        })
        .collect();

    let keys = LockKeys::fetch(client, schema).await?;
    let replicas: Vec<Replica> = client
        .query(
            &format!(
                "WITH present AS ( \
                    SELECT objid::int AS slot, pid, classid::int8 = $3 AS aside FROM pg_locks \
                    WHERE {ADVISORY_HELD_HERE} AND classid::int8 IN ($1, $3)), \
                 owned AS ( \
                    SELECT pid, array_agg(objid::int ORDER BY objid) AS parts FROM pg_locks \
                    WHERE {ADVISORY_HELD_HERE} AND classid::int8 = $2 \
                    GROUP BY pid) \
                 SELECT p.slot, r.host, r.pid, r.started_at, r.seen_at, r.in_flight, r.published, \
                        r.broker_down_since, r.broker_error, coalesce(o.parts, '{{}}'), \
                        (SELECT min(since) FROM {s}.partition_owners po WHERE po.slot = p.slot), \
                        to_jsonb(r) -> 'silent_partitions', p.aside \
                 FROM present p LEFT JOIN {s}.replicas r ON r.slot = p.slot \
                 LEFT JOIN owned o ON o.pid = p.pid ORDER BY r.started_at"
            ),
            &[
                &i64::from(keys.presence),
                &i64::from(keys.partitions),
                &i64::from(keys.aside),
            ],
        )
        .await?
        .iter()
        .map(|r| Replica {
            slot: r.get(0),
            host: r.get(1),
            pid: r.get(2),
            started_at: at(r.get(3)),
            started_age_s: age_secs(r.get(3)),
            heartbeat_at: at(r.get(4)),
            heartbeat_age_s: age_secs(r.get(4)),
            in_flight: r.get(5),
            published: r.get(6),
            broker_down_since: at(r.get(7)),
            broker_down_for_s: age_secs(r.get(7)),
            broker_error: r.get(8),
            // Read through to_jsonb, so that a schema a migration behind
            // (V17, during a rolling deploy) reads as none.
            silent_partitions: r
                .get::<_, Option<serde_json::Value>>(11)
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default(),
            stepped_aside: r.get(12),
            partitions: r.get(9),
            owning_since: at(r.get(10)),
            owning_since_age_s: age_secs(r.get(10)),
        })
        .collect();
    let partitions_owned: usize = replicas.iter().map(|r| r.partitions.len()).sum();
    let backlog_per_partition = client
        .query(
            &format!("SELECT partition, count(*) FROM {s}.messages GROUP BY 1 ORDER BY 1"),
            &[],
        )
        .await?
        .iter()
        .map(|r| PartitionBacklog {
            partition: r.get(0),
            pending: r.get(1),
        })
        .collect();

    let mut blockers = Vec::new();
    // A commit waits for a synchronous standby in `SyncRep` for a few
    // milliseconds at most while the standby keeps up; over a second, one
    // is missing or far behind, and every default commit waits with it.
    // This database's sessions only: another may ask more of the standby
    // (`synchronous_commit = remote_apply` for it alone) and wait where
    // this one's commits do not.
    let standby = client
        .query_one(
            "SELECT count(*), max(extract(epoch FROM now() - state_change))::float8 \
             FROM pg_stat_activity \
             WHERE wait_event = 'SyncRep' AND state_change < now() - interval '1 second' \
               AND datname = current_database()",
            &[],
        )
        .await?;
    let waiting: i64 = standby.get(0);
    if waiting > 0 {
        blockers.push(Blocker::CommitsWaitForStandby {
            waiting,
            longest_s: standby.get(1),
            why: "a synchronous standby (synchronous_standby_names) has not confirmed them: the relay's settles and durability barrier wait too, and no batch is published until the standby confirms or is no longer required; see pg_stat_replication",
        });
    }
    // Transactions stuck only in such a commit are that blocker, not this.
    // Neither is (auto)vacuum, whose horizon no one waits for (VACUUM FULL
    // is a rewrite, and does hold it), nor a relay's own session: a batch
    // open this long waits for the broker, and ending it sends the batch
    // again.
    for r in client
        .query(
            "SELECT pid, application_name, state, extract(epoch FROM now() - xact_start)::float8 \
             FROM pg_stat_activity \
             WHERE xact_start < now() - interval '10 seconds' AND pid <> pg_backend_pid() \
               AND datname = current_database() \
               AND backend_type = 'client backend' \
               AND wait_event IS DISTINCT FROM 'SyncRep' \
               AND NOT (state = 'active' AND query ~* '^\\s*vacuum\\M' AND query !~* '\\mfull\\M') \
               AND application_name NOT LIKE 'outbox-relay%' \
             ORDER BY xact_start LIMIT 5",
            &[],
        )
        .await?
    {
        blockers.push(Blocker::LongTransaction {
            pid: r.get(0),
            application: r.get(1),
            state: r.get(2),
            age_s: r.get(3),
            why: "an open transaction holds back vacuum of published rows and hides rows it has not committed yet",
        });
    }
    for r in &replicas {
        for p in &r.silent_partitions {
            blockers.push(Blocker::PartitionSilent {
                slot: r.slot,
                topic: p.topic.clone(),
                partition: p.partition,
                since: p.since.clone(),
                silent_for_s: p.silent_for_s(),
                why: "the broker leaves this partition's records unanswered (no reachable leader?) while the rest answers: messages whose key places them there wait, and are tried again once per message timeout; the others go ahead",
            });
        }
        if let Some(down_for_s) = r.broker_down_for_s {
            blockers.push(Blocker::BrokerUnreachable {
                slot: r.slot,
                down_since: r.broker_down_since.clone(),
                down_for_s,
                error: r.broker_error.clone(),
            });
        }
    }
    if replicas.is_empty() && !backlog.is_empty() {
        blockers.push(Blocker::NoRelay {
            why: "no relay replica is running",
        });
    } else if !replicas.is_empty() && partitions_owned < PARTITIONS as usize {
        blockers.push(Blocker::PartitionsUnowned {
            unowned: PARTITIONS as usize - partitions_owned,
            why: "some partitions have no owner yet (replicas starting or rebalancing)",
        });
    }
    Ok(Status {
        schema: schema.as_str().to_owned(),
        at: rfc3339(SystemTime::now()),
        backlog,
        in_flight: replicas
            .iter()
            .filter_map(|r| r.in_flight.map(i64::from))
            .sum(),
        dead_letters,
        published_retained,
        parked_keys,
        paused,
        replicas,
        partitions_owned,
        partitions_total: PARTITIONS,
        backlog_per_partition,
        blockers,
    })
}
