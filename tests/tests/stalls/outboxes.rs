//! Several outboxes on one cluster (other databases, other schemas): each
//! relay sees only its own replicas and owns all of its partitions.

use std::collections::HashSet;
use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

/// The replica count and partitions a relay reports through `status --json`.
async fn status(url: &str, schema: &str) -> serde_json::Value {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay-under-test"))
        .args(["status", "--json"])
        .env("OUTBOX_DATABASE_URL", url)
        .env("OUTBOX_SCHEMA", schema)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run status");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "status is not json ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// One cluster, two databases with the default-named schema each, and a
/// second schema in one of them; one relay per outbox. Advisory locks are per
/// database, but `pg_locks` lists every database's: before the fix each relay
/// counted the other database's relay as a peer, took half the partitions,
/// and half of each outbox's keys never went out.
#[tokio::test]
async fn outboxes_in_other_databases_and_schemas_never_see_each_other() {
    outbox_tests::init_logging();
    let admin = TestDb::new().await;
    let schema = outbox_tests::unique("shared");
    let mut outboxes = Vec::new();
    for db_name in [outbox_tests::unique("db_a"), outbox_tests::unique("db_b")] {
        admin
            .client
            .batch_execute(&format!("CREATE DATABASE {db_name}"))
            .await
            .expect("create database");
        outboxes.push((db_name.clone(), schema.clone()));
    }
    // A second schema beside the first in database A.
    outboxes.push((outboxes[0].0.clone(), outbox_tests::unique("second")));

    let rabbit = Fixture::new().await;
    let mut relays = Vec::new();
    let mut expected = Vec::new();
    for (db_name, schema) in &outboxes {
        let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
        let config: tokio_postgres::Config = url.parse().expect("url");
        let mut client = outbox_tests::db::connect(&config).await;
        outbox_client::migrate(&mut client, schema)
            .await
            .expect("migrate");
        let outbox = outbox_client::Outbox::new(schema).expect("schema");
        let msgs: Vec<Message> = (0..640)
            .map(|i| {
                Message::builder(rabbit.exchange.as_str())
                    .key(format!("{db_name}-{schema}-{i}"))
                    .payload(b"x".to_vec())
                    .build()
                    .expect("valid")
            })
            .collect();
        let ids = outbox.enqueue_batch(&client, &msgs).await.expect("enqueue");
        expected.extend(ids.iter().map(|i| i.to_string()));
        let db = TestDb {
            config,
            schema: outbox_client::SchemaName::new(schema).expect("schema"),
            client,
        };
        relays.push(InProcessRelay::amqp(&db, fast_settings()));
        std::mem::forget(db); // dropped with its database below
    }
    let delivered = || {
        let seen: HashSet<String> = rabbit.message_ids().into_iter().collect();
        expected.iter().filter(|id| seen.contains(*id)).count()
    };
    assert!(
        eventually(Duration::from_secs(60), || async {
            delivered() == expected.len()
        })
        .await,
        "{} of {} messages delivered",
        delivered(),
        expected.len()
    );
    for (db_name, schema) in &outboxes {
        let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
        let s = status(&url, schema).await;
        let replicas = s["replicas"].as_array().expect("replicas");
        assert_eq!(
            replicas.len(),
            1,
            "{db_name}/{schema} sees replicas of other outboxes: {s}"
        );
        assert_eq!(
            replicas[0]["partitions"].as_array().map(Vec::len),
            Some(64),
            "{db_name}/{schema}: {s}"
        );
    }
    for relay in relays {
        relay.stop().await;
    }
    rabbit.cleanup().await;
    for (db_name, _) in outboxes.iter().take(2) {
        let _ = admin
            .client
            .batch_execute(&format!("DROP DATABASE {db_name} WITH (FORCE)"))
            .await;
    }
    admin.cleanup().await;
}

/// Two outbox schemas of one database whose advisory-lock keys, 31-bit
/// hashes of their names, collide: `tenant_82575`'s partition key is
/// `tenant_143164`'s presence key. With tens of thousands of tenant schemas
/// such pairs are likely. The relay of `tenant_143164` counted the other's
/// 64 partition locks as 64 replicas, took a share of none, and published
/// nothing. A schema whose keys collide with another outbox's in its
/// database now uses keys of its own.
#[tokio::test]
async fn outboxes_whose_lock_keys_collide_each_own_their_partitions() {
    outbox_tests::init_logging();
    let admin = TestDb::new().await;
    let (db_name, config) = outbox_tests::db::create_database(&admin, "collide").await;
    let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
    let rabbit = Fixture::new().await;
    let mut relays = Vec::new();
    let mut expected = Vec::new();
    for schema in ["tenant_82575", "tenant_143164"] {
        let mut client = outbox_tests::db::connect(&config).await;
        outbox_client::migrate(&mut client, schema)
            .await
            .expect("migrate");
        let outbox = outbox_client::Outbox::new(schema).expect("schema");
        let msgs: Vec<Message> = (0..640)
            .map(|i| {
                Message::builder(rabbit.exchange.as_str())
                    .key(format!("{schema}-{i}"))
                    .payload(b"x".to_vec())
                    .build()
                    .expect("valid")
            })
            .collect();
        let ids = outbox.enqueue_batch(&client, &msgs).await.expect("enqueue");
        expected.push((
            schema,
            ids.iter().map(|i| i.to_string()).collect::<Vec<_>>(),
        ));
        let db = TestDb {
            config: config.clone(),
            schema: outbox_client::SchemaName::new(schema).expect("schema"),
            client,
        };
        relays.push(InProcessRelay::amqp(&db, fast_settings()));
        std::mem::forget(db); // dropped with its database below
    }
    let delivered = |ids: &[String]| {
        let seen: HashSet<String> = rabbit.message_ids().into_iter().collect();
        ids.iter().filter(|id| seen.contains(*id)).count()
    };
    assert!(
        eventually(Duration::from_secs(60), || async {
            expected.iter().all(|(_, ids)| delivered(ids) == ids.len())
        })
        .await,
        "delivered: {:?}",
        expected
            .iter()
            .map(|(s, ids)| format!("{s} {} of {}", delivered(ids), ids.len()))
            .collect::<Vec<_>>()
    );
    for (schema, _) in &expected {
        let s = status(&url, schema).await;
        let replicas = s["replicas"].as_array().expect("replicas");
        assert_eq!(replicas.len(), 1, "{schema} sees other replicas: {s}");
        assert_eq!(
            replicas[0]["partitions"].as_array().map(Vec::len),
            Some(64),
            "{schema}: {s}"
        );
    }
    for relay in relays {
        relay.stop().await;
    }
    rabbit.cleanup().await;
    outbox_tests::db::drop_database(&admin, &db_name).await;
    admin.cleanup().await;
}
