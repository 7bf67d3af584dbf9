//! Which virtual partitions this replica works on.
//!
//! Every row belongs to one of [`PARTITIONS`] partitions (a hash of its ordering
//! key). A replica owns a partition while its ownership session holds the
//! session-level advisory lock `(partition key, partition)`; it is present while
//! that session holds `(presence key, slot)`. Both vanish the moment the session
//! ends: at once when the process dies (its socket closes), and after `lease`
//! when it stops answering (Postgres' `idle_session_timeout` ends a session that
//! misses its heartbeats, e.g. a SIGSTOPped process).
//!
//! Each tick a replica lists the replicas present, takes free partitions up to
//! its share (64 / replicas, the lowest slots taking the remainder), and
//! releases any beyond it, so ownership converges as replicas join and leave.
//!
//! A replica whose broker has failed every batch and probe for twice the
//! lease (at least [`ASIDE_AT_LEAST`]), while another present replica has
//! reached its own for as long, steps aside: it releases its
//! partitions and its presence, so that every replica (one a version behind
//! too) counts it out and the rest take its share. It keeps its heartbeat
//! and its readiness, and comes back once its broker answers again, or once
//! no present replica reaches a broker either (an outage for everyone, where
//! stepping aside would only stop the replica that recovers first).
//!
//! Ownership only spreads the work. Correctness does not depend on it: row locks
//! keep two replicas from publishing one row at the same time, and the claim's
//! head-of-key rule keeps per-key order, even while ownership changes hands.

use std::sync::Arc;
use std::time::Duration;

use outbox_client::SchemaName;
use rand::seq::SliceRandom;
use tokio::sync::watch;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use super::{answered, Database, PgFault};

/// The least time a step of the ownership session may go unanswered.
const MIN_BOUND: Duration = Duration::from_secs(5);

/// The least time a replica's broker fails it, while another's answers,
/// before it steps aside. Longer than two rounds of the broker probe (every
/// 2 s): when an outage for all ends and another replica's batch goes
/// through first, this replica has asked its own broker again before it
/// could step aside.
const ASIDE_AT_LEAST: Duration = Duration::from_secs(5);
use tokio_util::sync::CancellationToken;

use crate::supervise::supervise;

/// Number of virtual partitions; fixed by the schema (migration V2).
pub const PARTITIONS: i16 = 64;

/// The condition on `pg_locks` that selects granted two-key advisory locks of
/// *this* database. Advisory locks are per database, but `pg_locks` lists the
/// whole cluster's: without the database filter, relays of two databases
/// that use the same schema name would count each other as peers. Every read
/// of `pg_locks` (ownership, `status`, metrics) goes through it.
pub const ADVISORY_HELD_HERE: &str = "locktype = 'advisory' AND objsubid = 2 AND granted \
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// The outbox schemas of this database (`oid`, name `s`, and `since`, the
/// oid of its `replicas` table, which orders them by when they were
/// migrated): those with the relay's tables. A CTE, for the lock-key
/// statements.
const OUTBOX_SCHEMAS: &str = "outboxes AS ( \
     SELECT n.oid, n.nspname::text AS s, r.oid AS since FROM pg_catalog.pg_namespace n \
     JOIN pg_catalog.pg_class r ON r.relnamespace = n.oid AND r.relname = 'replicas' \
     WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_class c \
                   WHERE c.relnamespace = n.oid AND c.relname = 'messages'))";

/// Advisory-lock namespaces of one schema, as `(key1)` of the two-key form.
#[derive(Debug, Clone, Copy)]
pub struct LockKeys {
    /// Key for partition locks: `(partitions, partition)`.
    pub partitions: i32,
    /// Key for presence locks: `(presence, slot)`.
    pub presence: i32,
    /// Key held by a replica that stepped aside: `(aside, slot)`, in place
    /// of its presence, so that `status` can list it.
    pub aside: i32,
    /// Whether the schema's usual keys collide with another outbox's of
    /// this database, so that these are keys of its own.
    pub apart: bool,
}

impl LockKeys {
    /// Asks Postgres for the schema's keys (non-negative, so they compare
    /// directly with `pg_locks.classid`).
    ///
    /// The usual keys are 31-bit hashes of the schema's name, and with
    /// thousands of schemas in one database two outboxes' keys collide:
    /// one's partition locks then read as the other's replicas, or both
    /// share one set of partitions, and an outbox stalls. A schema whose
    /// usual keys meet those of an outbox migrated before it (or each
    /// other) takes keys hashed with its oid as well; the earlier one
    /// keeps its own, so that relays already running never change keys
    /// when a schema is added. Every release that knows this computes the
    /// same; a relay older than it, on such a schema, counts a newer one as
    /// a stranger, which costs only the spread of the work.
    pub async fn fetch(
        client: &Client,
        schema: &SchemaName,
    ) -> Result<Self, tokio_postgres::Error> {
        let row = client
            .query_one(
                &format!(
                    "WITH {OUTBOX_SCHEMAS}, \
                     usual AS ( \
                         SELECT o.s, o.since, k.kind, k.v FROM outboxes o CROSS JOIN LATERAL (VALUES \
                             (1, hashtext('outbox-partitions:' || o.s) & 2147483647), \
                             (2, hashtext('outbox-replicas:' || o.s) & 2147483647), \
                             (3, hashtext('outbox-aside:' || o.s) & 2147483647)) AS k(kind, v)), \
                     salt AS ( \
                         SELECT CASE WHEN EXISTS ( \
                                    SELECT 1 FROM usual a JOIN usual b \
                                      ON a.v = b.v \
                                     AND (b.since < a.since OR (a.s = b.s AND a.kind <> b.kind)) \
                                    WHERE a.s = $1) \
                                THEN ':' || (SELECT oid FROM pg_catalog.pg_namespace \
                                             WHERE nspname = $1)::text \
                                ELSE '' END AS x) \
                     SELECT hashtext('outbox-partitions:' || $1 || x) & 2147483647, \
                            hashtext('outbox-replicas:' || $1 || x) & 2147483647, \
                            hashtext('outbox-aside:' || $1 || x) & 2147483647, \
                            x <> '' \
                     FROM salt"
                ),
                &[&schema.as_str()],
            )
            .await?;
        Ok(LockKeys {
            partitions: row.get(0),
            presence: row.get(1),
            aside: row.get(2),
            apart: row.get(3),
        })
    }
}

/// The key of the lock whose holder exports the database-wide gauges
/// (`endpoints::collect`): a 32-bit hash of the schema's name, as in every
/// release, unless it meets that of an outbox migrated before it, as
/// [`LockKeys::fetch`] decides for its keys; one of the two would never
/// export its gauges.
pub async fn exporter_key(
    client: &Client,
    schema: &SchemaName,
) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_one(
            &format!(
                "WITH {OUTBOX_SCHEMAS}, mine AS (SELECT since FROM outboxes WHERE s = $1) \
                 SELECT CASE WHEN EXISTS ( \
                            SELECT 1 FROM outboxes o, mine \
                            WHERE o.since < mine.since \
                              AND hashtext('outbox-metrics:' || o.s) = hashtext('outbox-metrics:' || $1)) \
                        THEN hashtextextended('outbox-metrics:' || $1 || ':' || \
                                 (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = $1)::text, 0) \
                        ELSE hashtext('outbox-metrics:' || $1)::int8 END"
            ),
            &[&schema.as_str()],
        )
        .await?
        .get(0))
}

/// The set of partitions this replica may claim from, as the workers see it.
pub type Owned = watch::Receiver<Arc<Vec<i16>>>;

/// Ownership settings.
#[derive(Debug, Clone)]
pub struct OwnershipSettings {
    /// How long a silent replica keeps its partitions; also the failover bound
    /// for a replica that stops answering.
    pub lease: Duration,
}

/// What this replica says about itself in its heartbeat (the `replicas`
/// table, which `status` reads).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    /// Rows claimed and not yet settled.
    pub in_flight: i64,
    /// Messages published since start.
    pub published: u64,
    /// Since when the broker has been unreachable, and why.
    pub broker_down: Option<(std::time::SystemTime, String)>,
    /// For how long every batch and broker probe has failed, if the latest
    /// did.
    pub broker_unanswering_for: Option<Duration>,
    /// The broker's partitions that leave records unanswered while the rest
    /// answers: topic, partition, and since when.
    pub silent_partitions: Vec<(String, i32, std::time::SystemTime)>,
}

/// The replica's side of ownership: what goes into each heartbeat, and
/// where ownership says whether its session is up. Implemented by the
/// relay's health state; ownership knows nothing else of the relay.
pub trait ReplicaReport: Send + Sync + 'static {
    /// This replica's figures for the next heartbeat.
    fn heartbeat(&self) -> Heartbeat;
    /// The ownership session came up (true) or went down (false).
    fn set_owner_up(&self, up: bool);
}

/// Keeps this replica's share of partitions until `shutdown`, publishing the
/// owned set through `owned`. While the ownership session is down, the set is
/// empty and the replica claims nothing.
pub async fn run(
    pg: Database,
    schema: SchemaName,
    settings: OwnershipSettings,
    owned: watch::Sender<Arc<Vec<i16>>>,
    report: Arc<impl ReplicaReport>,
    reconnect_max: Duration,
    shutdown: CancellationToken,
) {
    let session = || async {
        let result = own(&pg, &schema, &settings, &owned, report.as_ref(), &shutdown).await;
        // Whatever ended the session, this replica owns nothing now.
        owned.send_replace(Arc::new(Vec::new()));
        report.set_owner_up(false);
        metrics::gauge!(crate::metrics::PARTITIONS_OWNED).set(0.0);
        result
    };
    supervise(
        Duration::from_millis(100),
        reconnect_max,
        &shutdown,
        session,
        |e| tracing::warn!(error = %e, "ownership session lost; claiming nothing until it is back"),
    )
    .await;
}

async fn own(
    pg: &Database,
    schema: &SchemaName,
    settings: &OwnershipSettings,
    owned: &watch::Sender<Arc<Vec<i16>>>,
    report: &impl ReplicaReport,
    shutdown: &CancellationToken,
) -> Result<(), PgFault> {
    // Connecting must be done within the lease, and each step answered
    // within it unless the server is working on it (see
    // `Session::answered`): by then the server has ended a session that
    // missed its heartbeats. At least a few seconds, for a busy server.
    let bound = settings.lease.max(MIN_BOUND);
    let client = answered(bound, pg.connect_session()).await?;
    let (keys, slot) = client
        .answered(bound, register(&client, schema, settings))
        .await?;
    tracing::info!(slot, "replica registered");
    report.set_owner_up(true);
    let replicas = format!("{}.replicas", schema.quoted());
    let owners = format!("{}.partition_owners", schema.quoted());
    let statements = client
        .answered(bound, BeatStatements::prepare(&client, &replicas, &keys))
        .await?;

    let tick = settings.lease / 5;
    let mut standing = Standing {
        mine: Vec::new(),
        aside: false,
        aside_after: (settings.lease * 2).max(ASIDE_AT_LEAST),
        others_reach_since: None,
    };
    let mut interval = tokio::time::interval(tick.max(Duration::from_millis(20)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return leave(&client, &replicas, slot, bound).await,
            _ = interval.tick() => {}
        }
        if client.is_closed() {
            // The connection ended; this says why.
            return client
                .answered(bound, client.simple_query("SELECT 1"))
                .await
                .map(|_| ());
        }
        let beat = report.heartbeat();
        let step = heartbeat(
            &client,
            &keys,
            slot,
            &statements,
            &owners,
            beat,
            &mut standing,
        );
        // A heartbeat's commit may wait for a missing synchronous standby
        // for as long as it stays away; shutdown does not wait with it.
        let stepped = tokio::select! {
            _ = shutdown.cancelled() => None,
            stepped = client.answered(bound, step) => Some(stepped),
        };
        let Some(stepped) = stepped else {
            return leave(&client, &replicas, slot, bound).await;
        };
        if let Some(now) = stepped? {
            owned.send_replace(Arc::new(now));
        }
        #[cfg(feature = "mutants")]
        crate::mutants::ownership_beat();
    }
}

/// Hands this replica's partitions over at once rather than after the
/// lease, and removes its row. Within `bound`, whatever the server is
/// doing: the DELETE's commit may wait for a missing synchronous standby,
/// and shutdown must not.
async fn leave(client: &Client, replicas: &str, slot: i32, bound: Duration) -> Result<(), PgFault> {
    let release = async {
        client
            .execute("SELECT pg_advisory_unlock_all()", &[])
            .await?;
        client
            .execute(&format!("DELETE FROM {replicas} WHERE slot = $1"), &[&slot])
            .await
    };
    let _ = answered(bound, release).await;
    Ok(())
}

/// Sets the session up and registers this replica under a random free
/// presence slot.
async fn register(
    client: &Client,
    schema: &SchemaName,
    settings: &OwnershipSettings,
) -> Result<(LockKeys, i32), tokio_postgres::Error> {
    let keys = LockKeys::fetch(client, schema).await?;
    if keys.apart {
        tracing::warn!(
            schema = %schema,
            "this schema's usual advisory-lock keys collide with another outbox's in this database; \
             using keys of its own (relays older than this release on this schema would not see this one)"
        );
    }
    let lease_ms = settings.lease.as_millis().max(100);
    client
        .batch_execute(&format!(
            "SET application_name = 'outbox-relay-owner'; SET idle_session_timeout = {lease_ms}"
        ))
        .await?;

    // Presence: a random slot nobody else holds.
    let slot = loop {
        let candidate: i32 = rand::random::<i32>() & 0x7fff_ffff;
        let got: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, $2)",
                &[&keys.presence, &candidate],
            )
            .await?
            .get(0);
        if got {
            break candidate;
        }
    };
    let replicas = format!("{}.replicas", schema.quoted());
    client
        .execute(
            &format!(
                "INSERT INTO {replicas} (slot, host, pid) VALUES ($1, $2, $3) \
                 ON CONFLICT (slot) DO UPDATE SET host = EXCLUDED.host, pid = EXCLUDED.pid, \
                   started_at = now(), seen_at = now()"
            ),
            &[&slot, &hostname(), &(std::process::id() as i32)],
        )
        .await?;
    Ok((keys, slot))
}

/// This replica's place in the replica set, kept from one heartbeat to the
/// next.
struct Standing {
    /// The partitions it holds.
    mine: Vec<i16>,
    /// It stepped aside: it holds neither partitions nor its presence.
    aside: bool,
    /// How long its broker fails it, while another replica's answers,
    /// before it steps aside.
    aside_after: Duration,
    /// Since when another present replica has reported its broker
    /// reachable, heartbeat after heartbeat.
    others_reach_since: Option<std::time::Instant>,
}

/// What every heartbeat runs, prepared once per session: each heartbeat
/// sends the three together, in one round trip.
struct BeatStatements {
    /// Records the heartbeat's figures (see [`beat_statement`]).
    update: Statement,
    /// Every replica present, by slot, and those of them whose latest
    /// heartbeat reported their broker reachable.
    present: Statement,
    /// How many partitions any replica owns.
    owned: Statement,
}

impl BeatStatements {
    async fn prepare(
        client: &Client,
        replicas: &str,
        keys: &LockKeys,
    ) -> Result<Self, tokio_postgres::Error> {
        let update = client
            .prepare(&beat_statement(client, replicas).await?)
            .await?;
        // The lock keys are the schema's, fixed for the session: written
        // into the text, they leave no parameter to type.
        // A replica registering has no row yet: it counts as reaching its
        // broker until its first heartbeat says otherwise.
        let present = client
            .prepare(&format!(
                "WITH present AS ( \
                   SELECT objid::int AS slot FROM pg_locks \
                   WHERE {ADVISORY_HELD_HERE} AND classid::int8 = {}) \
                 SELECT coalesce(array_agg(p.slot ORDER BY p.slot), '{{}}'), \
                        coalesce(array_agg(p.slot ORDER BY p.slot) \
                                 FILTER (WHERE r.broker_down_since IS NULL), '{{}}') \
                 FROM present p LEFT JOIN {replicas} r ON r.slot = p.slot",
                i64::from(keys.presence)
            ))
            .await?;
        let owned = client
            .prepare(&format!(
                "SELECT count(*) FROM pg_locks WHERE {ADVISORY_HELD_HERE} AND classid::int8 = {}",
                i64::from(keys.partitions)
            ))
            .await?;
        Ok(BeatStatements {
            update,
            present,
            owned,
        })
    }
}

/// The UPDATE that records a heartbeat's figures in `replicas`: with the
/// silent partitions where the table has their column (V17), without on a
/// schema a migration behind, as during a rolling deploy that has not
/// migrated yet.
async fn beat_statement(client: &Client, replicas: &str) -> Result<String, tokio_postgres::Error> {
    let silent: bool = client
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute \
             WHERE attrelid = $1::text::regclass AND attname = 'silent_partitions' \
               AND NOT attisdropped)",
            &[&replicas],
        )
        .await?
        .get(0);
    let set = format!(
        "UPDATE {replicas} SET seen_at = now(), in_flight = $2, published = $3, \
         broker_down_since = $4, broker_error = $5"
    );
    Ok(if silent {
        format!("{set}, silent_partitions = $6 WHERE slot = $1")
    } else {
        // No column for $6 (the silent partitions, never NULL): naming it
        // keeps one parameter list for both statements.
        format!("{set} WHERE slot = $1 AND $6::jsonb IS NOT NULL")
    })
}

/// One heartbeat: records this replica's figures (by `update`, from
/// [`beat_statement`]), steps aside or back (see the module's notes), then
/// takes or releases partitions toward its share. The partitions it owns,
/// if they changed.
async fn heartbeat(
    client: &Client,
    keys: &LockKeys,
    slot: i32,
    statements: &BeatStatements,
    owners: &str,
    beat: Heartbeat,
    standing: &mut Standing,
) -> Result<Option<Vec<i16>>, tokio_postgres::Error> {
    let unanswering = beat.broker_unanswering_for;
    let (down_since, down_error) = match beat.broker_down {
        Some((since, e)) => (Some(since), Some(e)),
        None => (None, None),
    };
    let in_flight = i32::try_from(beat.in_flight).unwrap_or(i32::MAX);
    let published = i64::try_from(beat.published).unwrap_or(i64::MAX);
    let silent = serde_json::Value::Array(
        beat.silent_partitions
            .iter()
            .map(|(topic, partition, since)| {
                serde_json::json!({
                    "topic": topic,
                    "partition": partition,
                    "since": humantime::format_rfc3339_micros(*since).to_string(),
                })
            })
            .collect(),
    );
    // The figures, everyone present (by slot; targets sum to exactly
    // PARTITIONS, the lowest slots taking the remainder, so every replica
    // agrees on them) and the partitions owned, in one round trip: a
    // heartbeat a second is most of what an idle relay sends.
    let params: [&(dyn ToSql + Sync); 6] = [
        &slot,
        &in_flight,
        &published,
        &down_since,
        &down_error,
        &silent,
    ];
    let (_, present, owned) = futures::try_join!(
        client.execute(&statements.update, &params),
        client.query_one(&statements.present, &[]),
        client.query_one(&statements.owned, &[]),
    )?;
    let mut slots: Vec<i32> = present.try_get(0)?;
    let reaching: Vec<i32> = present.try_get(1)?;
    let mut owned_by_anyone: i64 = owned.try_get(0)?;
    // Another present replica reaches its broker (one stepped aside is not
    // present).
    let others_reach = reaching.iter().any(|s| *s != slot);
    standing.others_reach_since = match others_reach {
        true => standing
            .others_reach_since
            .or_else(|| Some(std::time::Instant::now())),
        false => None,
    };
    let others_reached_long = standing
        .others_reach_since
        .is_some_and(|since| since.elapsed() >= standing.aside_after);
    let mine = &mut standing.mine;
    if standing.aside {
        if unanswering.is_some() && others_reach {
            return Ok(None);
        }
        let back: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, $2)",
                &[&keys.presence, &slot],
            )
            .await?
            .get(0);
        if back {
            client
                .execute("SELECT pg_advisory_unlock($1, $2)", &[&keys.aside, &slot])
                .await?;
        } else {
            // Its slot was taken while it stood aside (a new replica drew
            // the same number out of 2^31): the others keep its share.
            tracing::warn!(slot, "cannot take this replica's slot back; staying aside");
            return Ok(None);
        }
        standing.aside = false;
        slots.push(slot);
        slots.sort_unstable();
        tracing::info!(
            slot,
            "back in the replica set: {}",
            if unanswering.is_none() {
                "the broker answers again"
            } else {
                "no other replica reaches a broker either"
            }
        );
    } else if unanswering.is_some_and(|d| d >= standing.aside_after) && others_reached_long {
        let partitions: Vec<i32> = mine.drain(..).map(i32::from).collect();
        release(client, keys, &partitions).await?;
        client
            .execute(
                "SELECT pg_try_advisory_lock($2, $3), pg_advisory_unlock($1, $3)",
                &[&keys.presence, &keys.aside, &slot],
            )
            .await?;
        standing.aside = true;
        metrics::gauge!(crate::metrics::PARTITIONS_OWNED).set(0.0);
        tracing::warn!(
            slot,
            released = partitions.len(),
            unanswering_for = ?unanswering.unwrap_or_default(),
            "broker unreachable while another replica reaches it; stepping aside, its partitions go to the others"
        );
        return Ok(Some(Vec::new()));
    }
    let present = slots.len().max(1);
    let rank = slots.iter().position(|s| *s == slot).unwrap_or(0);
    let share = PARTITIONS as usize / present + usize::from(rank < PARTITIONS as usize % present);
    let before = mine.clone();

    // Each a single round trip, whatever the number of partitions: on a
    // link with a long round trip, one per partition (64 at a lone
    // replica's start) outlasted the session's bound, and the replica never
    // finished registering.
    if mine.len() > share {
        let surplus: Vec<i32> = mine.drain(share..).map(i32::from).collect();
        release(client, keys, &surplus).await?;
    }
    if mine.len() < share {
        let mut free: Vec<i32> = (0..PARTITIONS)
            .filter(|p| !mine.contains(p))
            .map(i32::from)
            .collect();
        free.shuffle(&mut rand::rng());
        let wanted = i64::try_from(share - mine.len()).unwrap_or(i64::MAX);
        // The scan of the candidates hands them up one at a time, and the
        // limit stops it once enough were locked: no partition past those
        // is tried, so none is locked and left unrecorded.
        let taken = client
            .query(
                &format!(
                    "WITH taken AS ( \
                       SELECT p::int2 AS partition FROM unnest($2::int4[]) AS p \
                       WHERE pg_try_advisory_lock($1, p) LIMIT $4 \
                     ) \
                     INSERT INTO {owners} (partition, slot) SELECT partition, $3 FROM taken \
                     ON CONFLICT (partition) DO UPDATE SET slot = $3, since = now() \
                     RETURNING partition"
                ),
                &[&keys.partitions, &free, &slot, &wanted],
            )
            .await?;
        mine.extend(taken.iter().map(|row| row.get::<_, i16>(0)));
    }
    if *mine != before {
        // Counted before this heartbeat took or released any.
        owned_by_anyone = client.query_one(&statements.owned, &[]).await?.try_get(0)?;
    }
    metrics::gauge!(crate::metrics::PARTITIONS_UNOWNED)
        .set((i64::from(PARTITIONS) - owned_by_anyone) as f64);
    metrics::gauge!(crate::metrics::PARTITIONS_OWNED).set(mine.len() as f64);
    if *mine == before {
        return Ok(None);
    }
    mine.sort_unstable();
    tracing::info!(
        slot,
        replicas = present,
        owned = mine.len(),
        "partitions rebalanced"
    );
    Ok(Some(mine.clone()))
}

/// Releases `partitions`, in one round trip.
async fn release(
    client: &Client,
    keys: &LockKeys,
    partitions: &[i32],
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_advisory_unlock($1, p) FROM unnest($2::int4[]) AS p",
            &[&keys.partitions, &partitions],
        )
        .await?;
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".to_owned())
}
