//! outbox-client against a real Postgres: transactions, batching, bad input.

use outbox_client::{Error, Message, MessageId, Outbox};
use outbox_tests::db::{TestDb, NEVER_EQUAL_TEXT};
use outbox_tests::random_hex;
use tokio_postgres::error::SqlState;

fn msg(dest: &str) -> Message {
    Message::builder(dest)
        .key("k")
        .payload("p")
        .build()
        .expect("valid")
}

#[tokio::test]
async fn rollback_writes_nothing_and_commit_writes_one_row() {
    let mut db = TestDb::new().await;
    let outbox = db.outbox();

    let tx = db.client.transaction().await.expect("begin");
    outbox.enqueue(&tx, &msg("d")).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(db.pending().await, 0);

    let tx = db.client.transaction().await.expect("begin");
    let id = outbox.enqueue(&tx, &msg("d")).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let rows = db
        .client
        .query(
            &format!(
                "SELECT message_id, destination, ordering_key, payload, content_type FROM {}",
                db.table()
            ),
            &[],
        )
        .await
        .expect("select");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, uuid::Uuid>(0), id.0);
    assert_eq!(rows[0].get::<_, &str>(1), "d");
    assert_eq!(rows[0].get::<_, Option<&str>>(2), Some("k"));
    assert_eq!(rows[0].get::<_, &[u8]>(3), b"p");
    assert_eq!(
        rows[0].get::<_, Option<&str>>(4),
        Some("application/octet-stream")
    );
    assert_eq!(id.0.get_version_num(), 7, "default ids are UUIDv7");
    db.cleanup().await;
}

#[tokio::test]
async fn enqueue_batch_of_1000_is_one_statement_in_order() {
    let db = TestDb::new().await;
    // Count INSERT statements on the outbox with a statement-level trigger of the
    // test's own: one firing per statement, however many rows it inserts.
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.stmt_count (n int NOT NULL); INSERT INTO {s}.stmt_count VALUES (0);
             CREATE FUNCTION {s}.bump() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN UPDATE {s}.stmt_count SET n = n + 1; RETURN NULL; END $$;
             CREATE TRIGGER count_statements AFTER INSERT ON {t}
               FOR EACH STATEMENT EXECUTE FUNCTION {s}.bump();",
            s = db.schema.quoted(),
            t = db.table()
        ))
        .await
        .expect("install counter");
    let messages: Vec<Message> = (0..1000)
        .map(|i| {
            Message::builder("d")
                .key(format!("k{}", i % 7))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("batch");
    assert_eq!(ids.len(), 1000);
    let n: i32 = db
        .client
        .query_one(
            &format!("SELECT n FROM {}.stmt_count", db.schema.quoted()),
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(n, 1, "enqueue_batch must be a single INSERT statement");
    // seq follows slice order.
    let stored: Vec<uuid::Uuid> = db
        .column(&format!(
            "SELECT message_id FROM {} ORDER BY seq",
            db.table()
        ))
        .await;
    assert_eq!(stored, ids.iter().map(|i| i.0).collect::<Vec<_>>());
    db.cleanup().await;
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_the_transaction_survives() {
    let mut db = TestDb::new().await;
    let outbox = db.outbox().max_payload_bytes(16);
    let tx = db.client.transaction().await.expect("begin");

    let big = Message::builder("d")
        .payload(vec![0u8; 17])
        .build()
        .expect("valid shape");
    match outbox.enqueue(&tx, &big).await {
        Err(Error::PayloadTooLarge {
            size: 17,
            limit: 16,
        }) => {}
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    // One bad message in a batch: nothing of the batch is written.
    let batch = vec![msg("d"), big.clone()];
    assert!(matches!(
        outbox.enqueue_batch(&tx, &batch).await,
        Err(Error::PayloadTooLarge { .. })
    ));
    assert!(matches!(
        Message::builder("").build(),
        Err(Error::EmptyDestination)
    ));
    match Message::builder("d").header("bad name", "v").build() {
        Err(e @ Error::InvalidHeaderName { .. }) => {
            assert!(e.to_string().contains("\"bad name\""), "{e}");
            assert!(e.is_invalid_input());
        }
        other => panic!("expected InvalidHeaderName, got {other:?}"),
    }
    assert!(matches!(
        Outbox::new("no-dashes"),
        Err(Error::InvalidSchemaName { .. })
    ));

    // Validation sent no SQL, so the transaction is still usable.
    outbox
        .enqueue(&tx, &msg("d"))
        .await
        .expect("valid enqueue after errors");
    tx.commit().await.expect("commit");
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}

/// A row's ordering key is indexed with its seq, and a Postgres btree entry
/// holds at most 2,704 bytes of a value that does not compress. A random key
/// of 2,700 bytes came back as a bare "database error" that aborted the
/// caller's transaction. The outbox takes keys of up to 2,048 bytes: a longer
/// one is refused before any SQL is sent, naming its size, and one of 2,048
/// bytes that does not compress is stored.
#[tokio::test]
async fn an_ordering_key_over_the_limit_is_refused_by_name_and_one_at_it_is_stored() {
    let mut db = TestDb::new().await;
    let outbox = db.outbox();
    let tx = db.client.transaction().await.expect("begin");
    for size in [2_049, 2_700, 100_000] {
        let err = match Message::builder("d")
            .key(random_hex(size))
            .payload("p")
            .build()
        {
            Ok(m) => outbox
                .enqueue(&tx, &m)
                .await
                .expect_err(&format!("a key of {size} bytes is refused")),
            Err(e) => e,
        };
        assert!(err.is_invalid_input(), "{size}: {err:?}");
        assert_eq!(
            err.to_string(),
            format!("ordering key of {size} bytes exceeds the limit of 2048 bytes")
        );
    }
    let at = random_hex(2_048);
    let m = Message::builder("d").key(at.clone()).payload("p").build();
    outbox
        .enqueue(&tx, &m.expect("a key at the limit is valid"))
        .await
        .expect("a key at the limit is stored, after the refusals");
    tx.commit().await.expect("commit");
    let stored: Vec<String> = db
        .column(&format!("SELECT ordering_key FROM {}", db.table()))
        .await;
    assert_eq!(stored, [at]);
    db.cleanup().await;
}

/// Writers in other languages are held to the same limit. `enqueue()`
/// refuses a longer key as it refuses its other bad input (SQLSTATE 22023,
/// "outbox: ..."), and a plain INSERT is refused by the table's check
/// constraint, which names it; neither writes anything.
#[tokio::test]
async fn sql_writers_are_held_to_the_ordering_key_limit_by_name() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let enqueue = format!("SELECT {s}.enqueue('d', 'p'::bytea, key => $1)");
    let insert = format!(
        "INSERT INTO {s}.messages (destination, ordering_key, payload) VALUES ('d', $1, 'p')"
    );
    let over = random_hex(2_049);

    let refused = db
        .client
        .query_one(&enqueue, &[&over])
        .await
        .expect_err("enqueue() refuses a key over the limit");
    let refused = refused.as_db_error().expect("a database error");
    assert_eq!(refused.code(), &SqlState::INVALID_PARAMETER_VALUE);
    assert_eq!(
        refused.message(),
        "outbox: ordering key of 2049 bytes exceeds the limit of 2048 bytes"
    );
    let refused = db
        .client
        .execute(&insert, &[&over])
        .await
        .expect_err("the table refuses a key over the limit");
    let refused = refused.as_db_error().expect("a database error");
    assert_eq!(refused.code(), &SqlState::CHECK_VIOLATION);
    assert_eq!(refused.constraint(), Some("messages_ordering_key_length"));
    assert_eq!(db.pending().await, 0);

    let at = random_hex(2_048);
    db.client
        .query_one(&enqueue, &[&at])
        .await
        .expect("enqueue at the limit");
    db.client
        .execute(&insert, &[&at])
        .await
        .expect("insert at the limit");
    assert_eq!(db.pending().await, 2);
    db.cleanup().await;
}

/// Postgres text cannot hold a NUL character, and jsonb refuses `\u0000`.
/// A Rust string can hold one, and a NUL in any of a message's text fields
/// came back as a bare "database error" that aborted the caller's
/// transaction. Each is now refused before any SQL is sent, naming the
/// field, and the transaction goes on to commit a valid message.
#[tokio::test]
async fn a_nul_character_in_any_text_field_is_refused_by_name_before_any_sql() {
    let mut db = TestDb::new().await;
    let outbox = db.outbox();
    let tx = db.client.transaction().await.expect("begin");
    let with_nul = [
        ("destination", Message::builder("d\0")),
        ("ordering key", Message::builder("d").key("k\0")),
        ("routing key", Message::builder("d").routing_key("r\0")),
        ("header value", Message::builder("d").header("h", "v\0")),
        (
            "content type",
            Message::builder("d").content_type("text/plain\0"),
        ),
        ("event type", Message::builder("d").event_type("e\0")),
    ];
    for (field, builder) in with_nul {
        let err = match builder.payload("p").build() {
            Ok(m) => outbox
                .enqueue(&tx, &m)
                .await
                .expect_err(&format!("a NUL in the {field} is refused")),
            Err(e) => e,
        };
        assert!(err.is_invalid_input(), "{field}: {err:?}");
        assert_eq!(err.to_string(), format!("{field} contains a NUL character"));
    }
    outbox
        .enqueue(&tx, &msg("d"))
        .await
        .expect("a valid enqueue after the refusals");
    tx.commit().await.expect("commit");
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn missing_schema_is_named() {
    let db = TestDb::new().await;
    let outbox = Outbox::new("never_migrated_schema").expect("valid name");
    match outbox.enqueue(&db.client, &msg("d")).await {
        Err(e @ Error::SchemaMissing { .. }) => {
            assert!(e.to_string().contains("never_migrated_schema"), "{e}")
        }
        other => panic!("expected SchemaMissing, got {other:?}"),
    }
    db.cleanup().await;
}

#[tokio::test]
async fn caller_chosen_ids_are_kept_and_duplicates_rejected() {
    let db = TestDb::new().await;
    let id = MessageId::from(uuid::Uuid::new_v4());
    let m = Message::builder("d")
        .message_id(id)
        .payload("x")
        .build()
        .expect("valid");
    assert_eq!(
        db.outbox().enqueue(&db.client, &m).await.expect("first"),
        id
    );
    match db.outbox().enqueue(&db.client, &m).await {
        Err(Error::DuplicateMessageId { message_id, .. }) => {
            assert_eq!(message_id.to_string(), id.to_string())
        }
        other => panic!("expected DuplicateMessageId, got {other:?}"),
    }
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}

/// A caller-chosen id makes the enqueue idempotent, and an app that takes
/// `DuplicateMessageId` as "already enqueued" commits its transaction. The
/// insert failed on the unique key, which aborted the transaction, and
/// Postgres answered that COMMIT with a rollback and no error: the app's own
/// writes were gone. A duplicate now skips the row, the transaction goes on,
/// and in a batch the other messages are written.
#[tokio::test]
async fn a_duplicate_id_leaves_the_callers_transaction_usable() {
    let db = TestDb::new().await;
    let table = outbox_tests::unique("orders");
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {}.{table} (id int PRIMARY KEY, state text); \
             INSERT INTO {}.{table} VALUES (42, 'new')",
            db.schema.quoted(),
            db.schema.quoted()
        ))
        .await
        .expect("domain table");
    let id = MessageId::from(uuid::Uuid::new_v4());
    let with_id = |i: MessageId| {
        Message::builder("d")
            .message_id(i)
            .payload("x")
            .build()
            .expect("valid")
    };
    db.outbox()
        .enqueue(&db.client, &with_id(id))
        .await
        .expect("first");
    let mut client = outbox_tests::db::connect(&db.config).await;
    let tx = client.transaction().await.expect("begin");
    tx.execute(
        &format!(
            "UPDATE {}.{table} SET state = 'paid' WHERE id = 42",
            db.schema.quoted()
        ),
        &[],
    )
    .await
    .expect("the app's own write");
    match db.outbox().enqueue(&tx, &with_id(id)).await {
        Err(Error::DuplicateMessageId { message_id, .. }) => {
            assert_eq!(message_id.to_string(), id.to_string())
        }
        other => panic!("expected DuplicateMessageId, got {other:?}"),
    }
    // A batch with the same id and a new one: the new one is written.
    let other = MessageId::from(uuid::Uuid::new_v4());
    match db
        .outbox()
        .enqueue_batch(&tx, &[with_id(id), with_id(other)])
        .await
    {
        Err(Error::DuplicateMessageId { .. }) => {}
        other => panic!("expected DuplicateMessageId for the batch, got {other:?}"),
    }
    tx.commit().await.expect("commit");
    let state: String = db
        .client
        .query_one(
            &format!(
                "SELECT state FROM {}.{table} WHERE id = 42",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("state")
        .get(0);
    assert_eq!(
        state, "paid",
        "the app's write was rolled back by the transaction the duplicate aborted"
    );
    assert_eq!(
        db.pending().await,
        2,
        "the first message and the batch's new one"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn concurrent_migrations_are_safe() {
    let schema = outbox_tests::unique("mig");
    let config: tokio_postgres::Config = outbox_tests::pg_url().parse().expect("url");
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let config = config.clone();
        let schema = schema.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = outbox_tests::db::connect(&config).await;
            outbox_client::migrate(&mut client, &schema).await
        }));
    }
    for t in tasks {
        t.await
            .expect("task")
            .expect("every concurrent migrate succeeds");
    }
    let client = outbox_tests::db::connect(&config).await;
    let row = client
        .query_one(
            &format!("SELECT count(*), count(DISTINCT version) FROM \"{schema}\".refinery_schema_history"),
            &[],
        )
        .await
        .expect("history");
    let (applied, distinct): (i64, i64) = (row.get(0), row.get(1));
    // Every file in migrations/ is embedded by migrate(); counting them keeps
    // this test right as migrations are added.
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations"))
        .expect("migrations dir")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    assert!(files >= 2, "found {files} migration files");
    assert_eq!(applied, distinct, "a migration was applied twice");
    assert_eq!(
        applied,
        i64::try_from(files).expect("count"),
        "each migration applied exactly once"
    );
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .expect("drop");
}

/// The server's message for a database error, or the error itself.
fn db_message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_else(|| e.to_string())
}

/// The message ids in the outbox of schema `s` (quoted), oldest first.
async fn outbox_ids(db: &TestDb, s: &str) -> Vec<uuid::Uuid> {
    db.client
        .query(
            &format!("SELECT message_id FROM {s}.messages ORDER BY seq"),
            &[],
        )
        .await
        .expect("outbox rows")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// `enqueue()` carries no `SET search_path` (it costs writers CPU on every
/// call); its body names the outbox's own objects with their schema. A caller
/// whose path holds a look-alike `messages` table first, or nothing at all,
/// still writes into the outbox, with a defaulted UUIDv7 id, and the checks
/// still run.
#[tokio::test]
async fn the_sql_enqueue_writes_into_its_own_schema_whatever_the_callers_path() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let decoy = db
        .create_decoy(&format!(
            "CREATE TABLE {{decoy}}.messages (LIKE {s}.messages INCLUDING DEFAULTS); \
             CREATE FUNCTION {{decoy}}.uuid_v7() RETURNS uuid LANGUAGE sql AS \
               $$ SELECT '00000000-0000-0000-0000-000000000000'::uuid $$"
        ))
        .await;
    let mut ids = Vec::new();
    for path in [decoy.clone(), "''".to_owned()] {
        db.set_path(&path).await;
        let id: uuid::Uuid = db
            .client
            .query_one(
                &format!("SELECT {s}.enqueue('d', 'p'::bytea, key => 'k')"),
                &[],
            )
            .await
            .unwrap_or_else(|e| panic!("enqueue with search_path {path}: {e}"))
            .get(0);
        assert_eq!(id.get_version_num(), 7, "search_path {path}: {id}");
        ids.push(id);
        let refused = db
            .client
            .query_one(&format!("SELECT {s}.enqueue('', 'p'::bytea)"), &[])
            .await
            .expect_err("an empty destination is refused");
        assert!(
            db_message(&refused).contains("destination is empty"),
            "search_path {path}: {refused}"
        );
    }
    db.reset_path().await;
    assert_eq!(
        outbox_ids(&db, &s).await,
        ids,
        "both calls wrote into the outbox"
    );
    db.drop_empty_decoy(&decoy, "messages").await;
    db.cleanup().await;
}

/// A caller may put pg_catalog after a schema of its own on purpose, so that
/// its functions and operators override the built-ins (Postgres documents
/// this; Oracle-compatibility setups use it). `enqueue()` still checks with
/// the built-ins: each of these calls must be refused as without the
/// look-alikes, and only the valid one written.
#[tokio::test]
async fn the_sql_enqueue_checks_with_the_builtins_when_the_callers_path_overrides_them() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let decoy = db
        .create_decoy(&format!(
            "CREATE TABLE {{decoy}}.messages (LIKE {s}.messages INCLUDING DEFAULTS); \
             CREATE FUNCTION {{decoy}}.octet_length(bytea) RETURNS integer \
               LANGUAGE sql AS $$ SELECT 0 $$; \
             CREATE FUNCTION {{decoy}}.lower(text) RETURNS text \
               LANGUAGE sql AS $$ SELECT 'x'::pg_catalog.text $$; \
             CREATE FUNCTION {{decoy}}.jsonb_typeof(jsonb) RETURNS text \
               LANGUAGE sql AS $$ SELECT 'object'::pg_catalog.text $$; \
             {NEVER_EQUAL_TEXT}"
        ))
        .await;
    db.set_path(&format!("{decoy}, pg_catalog")).await;
    let refusals = [
        (
            "'d', '\\x0102030405'::bytea, max_payload_bytes => 4",
            "exceeds the limit",
        ),
        ("'', 'p'::bytea", "destination is empty"),
        ("'d', 'p'::bytea, event_type => ''", "event type is empty"),
        (
            "'d', 'p'::bytea, headers => '[]'::jsonb",
            "headers must be a JSON object",
        ),
        (
            "'d', 'p'::bytea, headers => '{\"Message-Id\": \"x\"}'::jsonb",
            "reserved",
        ),
    ];
    for (args, expected) in refusals {
        let refused = db
            .client
            .query_one(&format!("SELECT {s}.enqueue({args})"), &[])
            .await
            .expect_err(&format!("enqueue({args}) is refused"));
        let message = db_message(&refused);
        assert!(
            message.contains(expected),
            "enqueue({args}): expected '{expected}', got: {message}"
        );
    }
    let id: uuid::Uuid = db
        .client
        .query_one(
            &format!("SELECT {s}.enqueue('d', 'p'::bytea, headers => '{{\"h\": \"v\"}}'::jsonb)"),
            &[],
        )
        .await
        .expect("a valid call is taken")
        .get(0);
    db.reset_path().await;
    assert_eq!(
        outbox_ids(&db, &s).await,
        vec![id],
        "only the valid call wrote a row"
    );
    db.drop_empty_decoy(&decoy, "messages").await;
    db.cleanup().await;
}

/// Every row that names no message id takes `uuid_v7()`'s, from a plain
/// INSERT or from `enqueue()`, and a caller's path that puts its own
/// `gen_random_uuid()` and `clock_timestamp()` ahead of pg_catalog changes
/// nothing: the ids stay distinct, version 7, and stamped with the time.
#[tokio::test]
async fn message_ids_stay_time_ordered_uuids_when_the_callers_path_overrides_builtins() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let decoy = db
        .create_decoy(&format!(
            "CREATE TABLE {{decoy}}.messages (LIKE {s}.messages INCLUDING DEFAULTS); \
             CREATE FUNCTION {{decoy}}.gen_random_uuid() RETURNS uuid LANGUAGE sql AS \
               $$ SELECT '00000000-0000-0000-0000-000000000000'::pg_catalog.uuid $$; \
             CREATE FUNCTION {{decoy}}.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS \
               $$ SELECT 'epoch'::pg_catalog.timestamptz $$"
        ))
        .await;
    let unix_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as u64
    };
    let from = unix_ms();
    db.set_path(&format!("{decoy}, pg_catalog")).await;
    let mut ids: Vec<uuid::Uuid> = Vec::new();
    for statement in [
        format!("INSERT INTO {s}.messages (destination, payload) VALUES ('d', 'p'::bytea) RETURNING message_id"),
        format!("INSERT INTO {s}.messages (destination, payload) VALUES ('d', 'p'::bytea) RETURNING message_id"),
        format!("SELECT {s}.enqueue('d', 'p'::bytea)"),
        format!("SELECT {s}.enqueue('d', 'p'::bytea)"),
    ] {
        let id = db
            .client
            .query_one(&statement, &[])
            .await
            .unwrap_or_else(|e| panic!("{statement}: {}", db_message(&e)))
            .get(0);
        ids.push(id);
    }
    db.reset_path().await;
    let to = unix_ms();
    for id in &ids {
        assert_eq!(id.get_version_num(), 7, "{id} is a UUIDv7");
        let b = id.as_bytes();
        let ms = u64::from_be_bytes([0, 0, b[0], b[1], b[2], b[3], b[4], b[5]]);
        assert!(
            (from.saturating_sub(1_000)..=to + 1_000).contains(&ms),
            "{id} carries {ms} ms, not the time of its insert ({from}..{to})"
        );
    }
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "every id differs: {ids:?}");
    db.drop_empty_decoy(&decoy, "messages").await;
    db.cleanup().await;
}

/// With `notify on`, the insert trigger signals the outbox's channel however
/// the inserting caller's path is set: look-alike `pg_notify` and `||` ahead
/// of pg_catalog must not swallow or redirect the wake-up. A sentinel sent
/// after the insert commits marks where the trigger's notification must
/// already be, since listeners get notifications in commit order.
#[tokio::test]
async fn the_notify_trigger_signals_its_channel_when_the_callers_path_overrides_builtins() {
    use futures::StreamExt;

    let db = TestDb::new().await;
    let s = db.schema.quoted();
    outbox_client::set_notify(&db.client, db.schema.as_str(), true)
        .await
        .expect("notify on");
    let decoy = db
        .create_decoy(&format!(
            "CREATE TABLE {{decoy}}.messages (LIKE {s}.messages INCLUDING DEFAULTS); \
             CREATE FUNCTION {{decoy}}.pg_notify(text, text) RETURNS void \
               LANGUAGE sql AS $$ SELECT $$; \
             CREATE FUNCTION {{decoy}}.concat_elsewhere(text, text) RETURNS text \
               LANGUAGE sql AS $$ SELECT 'elsewhere'::pg_catalog.text $$; \
             CREATE OPERATOR {{decoy}}.|| (LEFTARG = text, RIGHTARG = text, \
               FUNCTION = {{decoy}}.concat_elsewhere)"
        ))
        .await;

    let channel = db.schema.notify_channel();
    let (listener, mut connection) = db
        .config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("listener connects");
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    let (notifications, mut received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = notifications.send((n.channel().to_owned(), n.payload().to_owned()));
            }
        }
    });
    listener
        .batch_execute(&format!("LISTEN \"{channel}\"; LISTEN elsewhere"))
        .await
        .expect("listen");

    db.client
        .batch_execute(&format!(
            "SET search_path = {decoy}, pg_catalog; \
             INSERT INTO {s}.messages (destination, payload) VALUES ('d', 'p'::bytea); \
             RESET search_path; \
             NOTIFY \"{channel}\", 'sentinel'"
        ))
        .await
        .expect("insert under the look-alike path, then the sentinel");

    let mut before_sentinel = Vec::new();
    loop {
        let (channel, payload) = received.recv().await.expect("listener is open");
        if payload == "sentinel" {
            break;
        }
        before_sentinel.push((channel, payload));
    }
    assert_eq!(
        before_sentinel,
        vec![(channel, String::new())],
        "the insert's commit signals the outbox's channel, and only it"
    );
    assert_eq!(
        outbox_ids(&db, &s).await.len(),
        1,
        "the row is in the outbox"
    );
    db.drop_empty_decoy(&decoy, "messages").await;
    db.cleanup().await;
}

/// During a rolling deploy, or after a rollback, an instance of the
/// release before restarts on a schema the new release has migrated:
/// its `migrate()` finds a version it does not know applied, and (the
/// migrations being additive) goes on. refinery's default refused it
/// ("missing version"), so the older instance could not start.
#[tokio::test]
async fn migrate_goes_on_where_a_newer_release_has_migrated_further() {
    let db = TestDb::new().await;
    let history = format!("{}.refinery_schema_history", db.schema.quoted());
    db.client
        .execute(
            format!(
                "INSERT INTO {history} (version, name, applied_on, checksum) \
                 VALUES (100000, 'from_a_newer_release', $1, '1')"
            )
            .as_str(),
            &[&"2026-12-07T00:00:00Z"],
        )
        .await
        .expect("a newer release's history row");
    let mut client = outbox_tests::db::connect(&db.config).await;
    outbox_client::migrate(&mut client, db.schema.as_str())
        .await
        .expect("an older release migrates on a newer schema");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay-under-test"))
        .args(["migrate"])
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("outbox-relay migrate");
    assert!(
        out.status.success(),
        "outbox-relay migrate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = Message::builder("d").payload("x").build().expect("valid");
    db.outbox().enqueue(&db.client, &m).await.expect("enqueue");
    db.cleanup().await;
}

/// An app's start-up `migrate()` while another transaction holds the
/// outbox table (a relay's batch in flight to a slow broker, a report):
/// a pending migration that needs the table's lock gives way and tries
/// again, so the app's inserts, which queue behind its lock request, go
/// through meanwhile, and it applies once the table is free. Before, its
/// request waited for as long as the holder ran, and every insert with it.
#[tokio::test]
async fn a_pending_migration_behind_a_long_transaction_lets_the_writers_through() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    // V18 pending again: it adds a constraint to messages, under an
    // ACCESS EXCLUSIVE lock.
    db.client
        .batch_execute(&format!(
            "DELETE FROM {s}.refinery_schema_history WHERE version >= 18; \
             ALTER TABLE {s}.messages DROP CONSTRAINT messages_ordering_key_length"
        ))
        .await
        .expect("V18 pending");
    let holder = outbox_tests::db::connect(&db.config).await;
    holder
        .batch_execute(&format!("BEGIN; SELECT seq FROM {} FOR UPDATE", db.table()))
        .await
        .expect("a transaction holding the table");
    let mut migrating = outbox_tests::db::connect(&db.config).await;
    let schema = db.schema.to_string();
    let migration =
        tokio::spawn(async move { outbox_client::migrate(&mut migrating, &schema).await });
    let waiting = format!(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND mode = 'AccessExclusiveLock' \
         AND relation = '{}'::regclass",
        db.table()
    );
    assert!(
        outbox_tests::eventually(std::time::Duration::from_secs(30), || async {
            let n: i64 = db
                .client
                .query_one(waiting.as_str(), &[])
                .await
                .expect("pg_locks")
                .get(0);
            n > 0
        })
        .await,
        "the migration never asked for the table's lock"
    );
    let writer = outbox_tests::db::connect(&db.config).await;
    let m = Message::builder("d").payload("x").build().expect("valid");
    let inserted = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        db.outbox().enqueue(&writer, &m),
    )
    .await;
    assert!(
        inserted.is_ok(),
        "the insert waited 60 s behind the migration's lock request"
    );
    inserted.expect("in time").expect("enqueue");
    holder.batch_execute("COMMIT").await.expect("commit");
    migration
        .await
        .expect("task")
        .expect("migrated once the table was free");
    let constraint: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_constraint WHERE conname = 'messages_ordering_key_length' \
             AND conrelid = $1::text::regclass",
            &[&db.table()],
        )
        .await
        .expect("constraint")
        .get(0);
    assert_eq!(constraint, 1, "V18 applied");
    db.cleanup().await;
}

/// Two messages of one batch with the same caller-chosen id: a typed
/// validation error naming the id, before any SQL, so the caller's
/// transaction can still commit. The insert failed on the unique key,
/// aborting the transaction, with "already in the outbox" though neither
/// copy was.
#[tokio::test]
async fn a_batch_giving_one_id_twice_is_refused_before_any_sql() {
    let mut db = TestDb::new().await;
    let id = MessageId::from(uuid::Uuid::new_v4());
    let with_id = |payload: &str| {
        Message::builder("d")
            .message_id(id)
            .payload(payload.to_owned())
            .build()
            .expect("valid")
    };
    let other = Message::builder("d").payload("y").build().expect("valid");
    let outbox = db.outbox();
    let tx = db.client.transaction().await.expect("begin");
    match outbox
        .enqueue_batch(&tx, &[with_id("a"), other.clone(), with_id("b")])
        .await
    {
        Err(e @ Error::DuplicateInBatch { .. }) => {
            assert!(e.is_invalid_input(), "{e}");
            assert!(e.to_string().contains(&id.to_string()), "{e}");
        }
        other => panic!("expected DuplicateInBatch, got {other:?}"),
    }
    outbox
        .enqueue_batch(&tx, &[with_id("a"), other])
        .await
        .expect("the transaction is still usable");
    tx.commit().await.expect("commit");
    assert_eq!(db.pending().await, 2);
    db.cleanup().await;
}

/// A batch over what one statement can carry: 1,100 messages at the
/// default payload limit, about 1.05 GB. Postgres refuses a protocol message
/// over 1 GiB by closing the connection, so the caller's transaction and
/// connection were gone with an untyped error. It is now refused by name
/// before any SQL, and the transaction goes on.
#[tokio::test]
async fn a_batch_too_large_for_one_statement_is_refused_before_any_sql() {
    let mut db = TestDb::new().await;
    let outbox = db.outbox();
    let full = vec![b'x'; 983_040];
    let batch: Vec<Message> = (0..1_100)
        .map(|_| {
            Message::builder("d")
                .payload(full.clone())
                .build()
                .expect("valid")
        })
        .collect();
    let tx = db.client.transaction().await.expect("begin");
    match outbox.enqueue_batch(&tx, &batch).await {
        Err(e @ Error::BatchTooLarge { .. }) => {
            assert!(e.is_invalid_input(), "{e}");
            assert!(e.to_string().contains("split it"), "{e}");
        }
        other => panic!(
            "expected BatchTooLarge, got {:?}",
            other.map(|ids| ids.len())
        ),
    }
    drop(batch);
    outbox
        .enqueue_batch(
            &tx,
            &[Message::builder("d").payload("y").build().expect("valid")],
        )
        .await
        .expect("the transaction is still usable");
    tx.commit().await.expect("commit");
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}

/// `enqueue(max_payload_bytes => NULL)`, as a wrapper passing NULL for
/// each parameter it was not given may send: the size check compared with
/// NULL, which is never true, and let a payload of any size through, for
/// the relay to dead-letter later. NULL is the default limit now.
#[tokio::test]
async fn the_sql_enqueue_reads_a_null_limit_as_the_default() {
    let db = TestDb::new().await;
    let call = format!(
        "SELECT {}.enqueue('d', $1, max_payload_bytes => NULL)::text",
        db.schema.quoted()
    );
    let large = vec![b'x'; 983_041];
    let err = db
        .client
        .query_one(call.as_str(), &[&large])
        .await
        .expect_err("over the default limit");
    let db_err = err.as_db_error().expect("a database error");
    assert_eq!(db_err.code().code(), "22023", "{db_err}");
    assert!(
        db_err
            .message()
            .contains("983041 bytes exceeds the limit of 983040 bytes"),
        "{db_err}"
    );
    let at_limit = vec![b'x'; 983_040];
    db.client
        .query_one(call.as_str(), &[&at_limit])
        .await
        .expect("at the default limit");
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}

/// An empty ordering key is a key: every message written with `''` (a
/// wrapper passing its language's empty string for "no key"), for every
/// destination, fell into one lane, one partition and one replica, and one
/// dead letter among them parked them all. Both writers refuse it now, as
/// they refuse an empty event type ("pass NULL for none"). And the SQL
/// writer's reserved-header check lowers names in the "C" collation: in a
/// Turkish database `lower('MESSAGE-ID')` is `message-ıd`, which passed.
#[tokio::test]
async fn an_empty_ordering_key_is_refused_by_both_writers() {
    let db = TestDb::new().await;
    assert!(
        matches!(
            Message::builder("d").key("").payload("x").build(),
            Err(Error::EmptyKey {
                what: "ordering key"
            })
        ),
        "the builder took an empty ordering key"
    );
    let err = db
        .client
        .query_one(
            &format!(
                "SELECT {}.enqueue('d', 'x'::bytea, key => '')::text",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect_err("enqueue() took an empty ordering key");
    let db_err = err.as_db_error().expect("a database error");
    assert_eq!(db_err.code().code(), "22023", "{db_err}");
    assert!(
        db_err.message().contains("ordering key is empty"),
        "{db_err}"
    );
    assert_eq!(db.pending().await, 0);

    // A database whose default collation is Turkish (ICU, tr-TR).
    let name = outbox_tests::unique("turkish");
    db.client
        .batch_execute(&format!(
            "CREATE DATABASE {name} LOCALE_PROVIDER icu ICU_LOCALE 'tr-TR' \
             LOCALE 'C.UTF-8' TEMPLATE template0"
        ))
        .await
        .expect("a Turkish database");
    let mut config = db.config.clone();
    config.dbname(&name);
    let mut turkish = outbox_tests::db::connect(&config).await;
    outbox_client::migrate(&mut turkish, "outbox")
        .await
        .expect("migrate");
    let taken = turkish
        .query_one(
            "SELECT outbox.enqueue('d', 'x'::bytea, headers => '{\"MESSAGE-ID\": \"x\"}')::text",
            &[],
        )
        .await;
    drop(turkish);
    outbox_tests::db::drop_database(&db, &name).await;
    let err = taken.expect_err("a reserved header taken in a Turkish database");
    let db_err = err.as_db_error().expect("a database error");
    assert!(db_err.message().contains("reserved"), "{db_err}");
    db.cleanup().await;
}

/// A schema name of 55 to 63 characters is valid, but its NOTIFY channel,
/// `<schema>.messages`, passes Postgres' 63-byte limit: once `notify on`,
/// every insert into the outbox failed with "channel name too long", and
/// the app's transactions with it. Turning NOTIFY on is refused by name.
#[tokio::test]
async fn notify_on_for_a_schema_too_long_for_its_channel_is_refused() {
    let admin = TestDb::new().await;
    let mut name = outbox_tests::unique("long");
    name.push_str(&"x".repeat(55));
    name.truncate(55);
    let mut client = outbox_tests::db::connect(&admin.config).await;
    outbox_client::migrate(&mut client, &name)
        .await
        .expect("a 55-character schema migrates");
    let refused = outbox_client::set_notify(&client, &name, true).await;
    assert!(
        matches!(refused, Err(Error::NotifyChannelTooLong { len: 64, .. })),
        "{refused:?}"
    );
    let outbox = outbox_client::Outbox::new(&name).expect("schema");
    outbox
        .enqueue(
            &client,
            &Message::builder("d").payload("x").build().expect("valid"),
        )
        .await
        .expect("inserts still go in");
    client
        .batch_execute(&format!("DROP SCHEMA \"{name}\" CASCADE"))
        .await
        .expect("drop");
    admin.cleanup().await;
}
