#[cfg(feature = "migrate")]
use refinery::{Migration, Runner};
use tokio_postgres::Client;

use crate::{Error, SchemaName};

#[cfg(feature = "migrate")]
/// The schema's migrations, in order. The files in `migrations/` are the one
/// source of the schema; they are embedded here so an app can migrate at start-up.
const MIGRATIONS: &[(&str, &str)] = &[
    (
        "V1__create_outbox",
        include_str!("../../migrations/V1__create_outbox.sql"),
    ),
    (
        "V2__partitions_replicas_dead_letters",
        include_str!("../../migrations/V2__partitions_replicas_dead_letters.sql"),
    ),
    (
        "V3__consumer_defenses",
        include_str!("../../migrations/V3__consumer_defenses.sql"),
    ),
    (
        "V4__idempotency",
        include_str!("../../migrations/V4__idempotency.sql"),
    ),
    (
        "V5__retention",
        include_str!("../../migrations/V5__retention.sql"),
    ),
    (
        "V6__claim_paths",
        include_str!("../../migrations/V6__claim_paths.sql"),
    ),
    (
        "V7__sql_enqueue_and_pause",
        include_str!("../../migrations/V7__sql_enqueue_and_pause.sql"),
    ),
    (
        "V8__event_type",
        include_str!("../../migrations/V8__event_type.sql"),
    ),
    (
        "V9__notify_off_by_default",
        include_str!("../../migrations/V9__notify_off_by_default.sql"),
    ),
    (
        "V10__claim_floor",
        include_str!("../../migrations/V10__claim_floor.sql"),
    ),
    (
        "V11__waiting_by_key",
        include_str!("../../migrations/V11__waiting_by_key.sql"),
    ),
    (
        "V12__enqueue_without_search_path",
        include_str!("../../migrations/V12__enqueue_without_search_path.sql"),
    ),
    (
        "V13__inbox_check_in_plpgsql",
        include_str!("../../migrations/V13__inbox_check_in_plpgsql.sql"),
    ),
    (
        "V14__enqueue_names_pg_catalog",
        include_str!("../../migrations/V14__enqueue_names_pg_catalog.sql"),
    ),
    (
        "V15__uuid_v7_names_pg_catalog",
        include_str!("../../migrations/V15__uuid_v7_names_pg_catalog.sql"),
    ),
    (
        "V16__triggers_name_pg_catalog",
        include_str!("../../migrations/V16__triggers_name_pg_catalog.sql"),
    ),
    (
        "V17__replica_silent_partitions",
        include_str!("../../migrations/V17__replica_silent_partitions.sql"),
    ),
    (
        "V18__ordering_key_limit",
        include_str!("../../migrations/V18__ordering_key_limit.sql"),
    ),
    (
        "V19__inbox_key_limit",
        include_str!("../../migrations/V19__inbox_key_limit.sql"),
    ),
    (
        "V20__dead_letters_share_message_ids",
        include_str!("../../migrations/V20__dead_letters_share_message_ids.sql"),
    ),
    (
        "V21__dead_letters_keyed_apart_from_seq",
        include_str!("../../migrations/V21__dead_letters_keyed_apart_from_seq.sql"),
    ),
    (
        "V22__enqueue_null_limit_is_the_default",
        include_str!("../../migrations/V22__enqueue_null_limit_is_the_default.sql"),
    ),
    (
        "V23__enqueue_refuses_an_empty_key",
        include_str!("../../migrations/V23__enqueue_refuses_an_empty_key.sql"),
    ),
];

/// Creates `schema` if needed and applies every pending migration to it
/// (feature `migrate`, on by default).
///
/// Everything runs in one transaction, so it works through a transaction
/// pooler (PgBouncer, Supavisor, RDS Proxy) as well as on a session of its
/// own, and applies all pending migrations or none. Safe to call from
/// several processes at once: a transaction-level advisory lock keyed on
/// the schema name serializes them (the same key as the session lock of
/// earlier versions, so those wait too), and the later callers find nothing
/// left to apply. The transaction's `search_path` is the schema (the
/// migrations create unqualified objects) and ends with it. Versions
/// applied by a newer release are passed over: an instance a release
/// behind still starts during a rolling deploy or after a rollback.
///
/// A pending migration that needs a table's lock while other transactions
/// hold the table (the relay's batches in flight, a long report) waits for
/// it at most a second, then gives way and tries again after a pause, for
/// up to two minutes ([`Error::MigrationLockBusy`] after that): the
/// application's inserts, which queue behind a waiting lock request, go
/// through in between instead of stalling for as long as the longest
/// transaction runs.
///
/// With nothing pending it creates and changes nothing, so a role that may
/// only read refinery's history (deploy/roles.sql's app role) can call it
/// at start-up as well.
#[cfg(feature = "migrate")]
pub async fn migrate(client: &mut Client, schema: &str) -> Result<(), Error> {
    let schema = SchemaName::new(schema)?;
    let migrations = MIGRATIONS
        .iter()
        .map(|(name, sql)| Migration::unapplied(name, sql))
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::Migration)?;
    let started = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(100);
    loop {
        match migrate_once(client, &schema, &migrations).await {
            Err(Once::LockBusy(source)) => {
                let waited = started.elapsed();
                if waited >= LOCK_PATIENCE {
                    return Err(Error::MigrationLockBusy {
                        schema: schema.to_string(),
                        waited,
                        source,
                    });
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            Err(Once::Failed(e)) => return Err(e),
            Ok(()) => return Ok(()),
        }
    }
}

/// How long one migration statement waits for a table lock before the
/// attempt gives way. A statement waiting for a lock makes every later
/// request for that table wait behind it: the application's inserts too,
/// for as long as the transactions ahead of it (the relay's batches in
/// flight, a report) stay open. Giving way after this long bounds that.
#[cfg(feature = "migrate")]
const LOCK_TIMEOUT: &str = "1s";

/// How long [`migrate`] keeps trying, with pauses between the attempts
/// that let the waiting inserts through.
#[cfg(feature = "migrate")]
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// How one attempt of [`migrate`] ended, if not applied.
#[cfg(feature = "migrate")]
enum Once {
    /// A migration's statement gave way to a table lock held elsewhere;
    /// nothing was applied.
    LockBusy(tokio_postgres::Error),
    Failed(Error),
}

#[cfg(feature = "migrate")]
impl From<tokio_postgres::Error> for Once {
    fn from(e: tokio_postgres::Error) -> Self {
        Once::Failed(e.into())
    }
}

/// One transaction: every pending migration, or none.
#[cfg(feature = "migrate")]
async fn migrate_once(
    client: &mut Client,
    schema: &SchemaName,
    migrations: &[Migration],
) -> Result<(), Once> {
    // READ COMMITTED whatever the server's default: a caller that waited
    // for the lock must see what the holder committed.
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
        .start()
        .await?;
    let lock_key = format!("outbox-migrate:{schema}");
    tx.query_typed(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        &[(&lock_key, tokio_postgres::types::Type::TEXT)],
    )
    .await?;
    if all_applied(&tx, schema).await? {
        // Nothing to create or change: a role without the right to create
        // objects (roles.sql's app role) may call this at start-up too.
        tx.commit().await?;
        return Ok(());
    }
    // After the advisory lock, whose wait for another migrator is not
    // bounded: only the tables' locks give way.
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {q}; SET LOCAL search_path TO {q}; \
         SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'",
        q = schema.quoted()
    ))
    .await?;
    // A version applied that this release does not know is a newer
    // release's (a rolling deploy, a rollback): the migrations are
    // additive, so this one runs on that schema and goes on, where
    // refinery's default would refuse to start.
    let mut runner = InOne {
        tx: &tx,
        lock_busy: None,
    };
    let ran = Runner::new(migrations)
        .set_abort_missing(false)
        .run_async(&mut runner)
        .await;
    let lock_busy = runner.lock_busy.take();
    match (ran, lock_busy) {
        (Ok(_), _) => {
            tx.commit().await?;
            Ok(())
        }
        (Err(_), Some(busy)) => {
            tx.rollback().await?;
            Err(Once::LockBusy(busy))
        }
        (Err(e), None) => Err(Once::Failed(Error::Migration(e))),
    }
}

/// Whether refinery's history in `schema` lists every migration of this
/// release, as far as this role may read it (a history it cannot read, or
/// none, says no).
#[cfg(feature = "migrate")]
async fn all_applied(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &SchemaName,
) -> Result<bool, tokio_postgres::Error> {
    let history = format!("{}.refinery_schema_history", schema.quoted());
    let readable = tx
        .query_typed(
            "SELECT coalesce(has_table_privilege(to_regclass($1), 'SELECT'), false)",
            &[(&history, tokio_postgres::types::Type::TEXT)],
        )
        .await?;
    if !readable.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(false);
    }
    let applied: std::collections::HashSet<i64> = tx
        .query_typed(&format!("SELECT version::int8 FROM {history}"), &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(MIGRATIONS
        .iter()
        .all(|(name, _)| version_of(name).is_some_and(|v| applied.contains(&v))))
}

/// The version in a migration's name, `V<version>__<name>`.
#[cfg(feature = "migrate")]
fn version_of(name: &str) -> Option<i64> {
    name.strip_prefix('V')?.split_once("__")?.0.parse().ok()
}

/// refinery's runner inside one open transaction: its statements go out as
/// simple queries (no prepared statement a pooler could lose between
/// server connections), and a failed migration fails the whole transaction.
#[cfg(feature = "migrate")]
struct InOne<'t, 'c> {
    tx: &'t tokio_postgres::Transaction<'c>,
    /// The lock timeout a statement met, if one did.
    lock_busy: Option<tokio_postgres::Error>,
}

/// Why [`InOne`] could not run a statement or read refinery's history.
#[cfg(feature = "migrate")]
#[derive(Debug, thiserror::Error)]
enum InOneError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("refinery_schema_history has a row that does not parse: {0}")]
    History(String),
    #[error("a table lock was held elsewhere past the lock timeout")]
    LockBusy,
}

#[cfg(feature = "migrate")]
impl refinery_core::traits::r#async::AsyncTransaction for InOne<'_, '_> {
    type Error = InOneError;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &mut self,
        queries: T,
    ) -> Result<usize, Self::Error> {
        let mut count = 0;
        for query in queries {
            if let Err(e) = self.tx.batch_execute(query).await {
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
                    self.lock_busy = Some(e);
                    return Err(InOneError::LockBusy);
                }
                return Err(e.into());
            }
            count += 1;
        }
        Ok(count)
    }
}

#[cfg(feature = "migrate")]
impl refinery_core::traits::r#async::AsyncQuery<Vec<Migration>> for InOne<'_, '_> {
    async fn query(&mut self, query: &str) -> Result<Vec<Migration>, Self::Error> {
        let mut applied = Vec::new();
        for message in self.tx.simple_query(query).await? {
            let tokio_postgres::SimpleQueryMessage::Row(row) = message else {
                continue;
            };
            // refinery's own table: version, name, applied_on (RFC 3339),
            // checksum.
            let text = |i: usize| row.get(i).unwrap_or_default().to_owned();
            let bad = |what: &str| InOneError::History(format!("{what} {:?}", text(0)));
            let applied_on = time::OffsetDateTime::parse(
                &text(2),
                &time::format_description::well_known::Rfc3339,
            )
            .map_err(|_| bad("applied_on of version"))?;
            applied.push(Migration::applied(
                text(0).parse().map_err(|_| bad("version"))?,
                text(1),
                applied_on,
                text(3).parse().map_err(|_| bad("checksum of version"))?,
            ));
        }
        Ok(applied)
    }
}

#[cfg(feature = "migrate")]
impl refinery::AsyncMigrate for InOne<'_, '_> {}

/// Switches the statement-level NOTIFY trigger on or off.
///
/// With it off the relay still finds every row by polling, at most one poll
/// interval later; inserting transactions then skip NOTIFY's commit-time lock.
pub async fn set_notify(client: &Client, schema: &str, enabled: bool) -> Result<(), Error> {
    let schema = SchemaName::new(schema)?;
    let len = schema.notify_channel().len();
    if enabled && len > 63 {
        return Err(Error::NotifyChannelTooLong {
            schema: schema.as_str().to_owned(),
            len,
        });
    }
    let verb = if enabled { "ENABLE" } else { "DISABLE" };
    client
        .batch_execute(&format!(
            "ALTER TABLE {}.messages {verb} TRIGGER messages_notify",
            schema.quoted()
        ))
        .await
        .map_err(|e| Error::from_db(&schema, e))
}

#[cfg(all(test, feature = "migrate"))]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_migration_has_a_version() {
        let versions: Vec<i64> = MIGRATIONS
            .iter()
            .map(|(name, _)| version_of(name).unwrap_or_else(|| panic!("{name}")))
            .collect();
        assert_eq!(
            versions,
            (1..=i64::try_from(MIGRATIONS.len()).expect("few")).collect::<Vec<_>>()
        );
    }
}
