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
];

/// Creates `schema` if needed and applies every pending migration to it
/// (feature `migrate`, on by default).
///
/// Safe to call from several processes at once: a session-level advisory lock
/// keyed on the schema name serializes them, and the later callers find nothing
/// left to apply. The session's `search_path` is set to the schema while the
/// migrations run (they create unqualified objects) and reset afterwards.
#[cfg(feature = "migrate")]
pub async fn migrate(client: &mut Client, schema: &str) -> Result<(), Error> {
    let schema = SchemaName::new(schema)?;
    let migrations = MIGRATIONS
        .iter()
        .map(|(name, sql)| Migration::unapplied(name, sql))
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::Migration)?;

    let lock_key = format!("outbox-migrate:{schema}");
    client
        .execute(
            "SELECT pg_advisory_lock(hashtextextended($1, 0))",
            &[&lock_key],
        )
        .await?;
    let result = async {
        client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {q}; SET search_path TO {q}",
                q = schema.quoted()
            ))
            .await?;
        Runner::new(&migrations)
            .run_async(client)
            .await
            .map_err(Error::Migration)?;
        Ok::<(), Error>(())
    }
    .await;
    // Undo the session state even when a migration failed; if the connection
    // itself is gone, the server has already dropped both.
    let reset = client.batch_execute("RESET search_path").await;
    let unlock = client
        .execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
            &[&lock_key],
        )
        .await;
    result?;
    reset?;
    unlock?;
    Ok(())
}

/// Switches the statement-level NOTIFY trigger on or off.
///
/// With it off the relay still finds every row by polling, at most one poll
/// interval later; inserting transactions then skip NOTIFY's commit-time lock.
pub async fn set_notify(client: &Client, schema: &str, enabled: bool) -> Result<(), Error> {
    let schema = SchemaName::new(schema)?;
    let verb = if enabled { "ENABLE" } else { "DISABLE" };
    client
        .batch_execute(&format!(
            "ALTER TABLE {}.messages {verb} TRIGGER messages_notify",
            schema.quoted()
        ))
        .await
        .map_err(|e| Error::from_db(&schema, e))
}
