//! A fresh, migrated outbox schema per test.

use std::str::FromStr;

use outbox_client::{Outbox, SchemaName};
use tokio_postgres::{Client, Config, NoTls};

/// A migrated schema with a random name, dropped by [`TestDb::cleanup`].
pub struct TestDb {
    /// Connection settings.
    pub config: Config,
    /// The schema.
    pub schema: SchemaName,
    /// A connection for the test's own queries.
    pub client: Client,
}

/// A database of its own on the test cluster, made through `admin`, for
/// what several outboxes on one cluster share: its name and connection
/// settings. [`drop_database`] removes it.
pub async fn create_database(admin: &TestDb, prefix: &str) -> (String, Config) {
    let name = crate::unique(prefix);
    admin
        .client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    let config = format!("postgres://postgres@127.0.0.1:5432/{name}")
        .parse()
        .expect("url");
    (name, config)
}

/// Drops a database [`create_database`] made, with whatever still uses it.
pub async fn drop_database(admin: &TestDb, name: &str) {
    let _ = admin
        .client
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await;
}

/// Connects and drives the connection in the background.
pub async fn connect(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect to postgres");
    tokio::spawn(connection);
    client
}

/// Opens a REPEATABLE READ transaction and takes its snapshot: run on a
/// connection of its own and left open, it pins the xmin horizon as a long
/// report or `pg_dump` does, so rows deleted meanwhile cannot be marked
/// dead. `ROLLBACK` ends it.
pub const PIN_SNAPSHOT: &str =
    "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class";

/// A connection of its own holding [`PIN_SNAPSHOT`] open.
pub async fn pinned_snapshot(config: &Config) -> Client {
    let pin = connect(config).await;
    pin.batch_execute(PIN_SNAPSHOT)
        .await
        .expect("pin a snapshot");
    pin
}

/// Runs deploy/roles.sql, as an operator would with `psql`, against the
/// server at `url` for the outbox in `schema`: it creates (or updates) the
/// roles `outbox_app` and `outbox_relay` and their grants.
pub async fn apply_roles_sql(url: &str, schema: &SchemaName) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/roles.sql");
    let status = tokio::process::Command::new("psql")
        .args(["-q", "-X", url, "-v"])
        .arg(format!("schema={schema}"))
        .args(["-f", script])
        .status()
        .await
        .expect("psql");
    assert!(status.success(), "roles.sql failed");
}

/// The last seq the sequence of `table` (quoted, as [`TestDb::table`]
/// gives it) has given, asked on `client`: what a test means by "the seqs
/// written so far" even once the rows are drained.
pub async fn last_seq(client: &Client, table: &str) -> i64 {
    let table = table.replace('\'', "''");
    client
        .query_one(
            &format!("SELECT pg_sequence_last_value(pg_get_serial_sequence('{table}', 'seq'))"),
            &[],
        )
        .await
        .expect("the sequence's last value")
        .get(0)
}

/// DDL for [`TestDb::create_decoy`]: an `=` for text in the decoy schema
/// that never finds two values equal, for a caller's path to find before
/// pg_catalog's.
pub const NEVER_EQUAL_TEXT: &str = "CREATE FUNCTION {decoy}.never_equal(text, text) \
     RETURNS boolean LANGUAGE sql AS $$ SELECT false $$; \
     CREATE OPERATOR {decoy}.= (LEFTARG = text, RIGHTARG = text, \
     FUNCTION = {decoy}.never_equal)";

impl TestDb {
    /// The server's `host:port`, for a proxy to forward to.
    pub fn address(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        format!("{host}:{port}")
    }

    /// Creates and migrates a new schema.
    pub async fn new() -> TestDb {
        Self::new_at(Config::from_str(&crate::pg_url()).expect("valid OUTBOX_TEST_DATABASE_URL"))
            .await
    }

    /// Creates and migrates a new schema on the server `config` names.
    pub async fn new_at(config: Config) -> TestDb {
        let schema = SchemaName::new(&crate::unique("t")).expect("valid schema name");
        let mut client = connect(&config).await;
        outbox_client::migrate(&mut client, schema.as_str())
            .await
            .expect("migrate");
        TestDb {
            config,
            schema,
            client,
        }
    }

    /// A writer for this schema.
    pub fn outbox(&self) -> Outbox {
        Outbox::with_schema(self.schema.clone())
    }

    /// Enqueues `rows` on the test's own connection, 1,000 per statement.
    pub async fn enqueue_all(&self, rows: &[outbox_client::Message]) {
        let outbox = self.outbox();
        for chunk in rows.chunks(1000) {
            outbox
                .enqueue_batch(&self.client, chunk)
                .await
                .expect("enqueue");
        }
    }

    /// `schema.messages`, quoted.
    pub fn table(&self) -> String {
        format!("{}.messages", self.schema.quoted())
    }

    /// Rows still in the outbox.
    pub async fn pending(&self) -> i64 {
        self.client
            .query_one(&format!("SELECT count(*) FROM {}", self.table()), &[])
            .await
            .expect("count")
            .get(0)
    }

    /// The first column of every row `sql` returns.
    pub async fn column<T>(&self, sql: &str) -> Vec<T>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        self.client
            .query(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Rows in `table` of this schema (`dead_letters`, `published`, ...).
    pub async fn count(&self, table: &str) -> i64 {
        self.client
            .query_one(
                &format!("SELECT count(*) FROM {}.{table}", self.schema.quoted()),
                &[],
            )
            .await
            .expect("count")
            .get(0)
    }

    /// A new schema of look-alike objects, for a caller's `search_path` to
    /// find before the outbox's own: `ddl` runs with `{decoy}` replaced by
    /// the schema's quoted name, which is returned.
    pub async fn create_decoy(&self, ddl: &str) -> String {
        let decoy = format!("\"{}\"", crate::unique("decoy"));
        self.client
            .batch_execute(&format!(
                "CREATE SCHEMA {decoy}; {}",
                ddl.replace("{decoy}", &decoy)
            ))
            .await
            .expect("decoy schema");
        decoy
    }

    /// Sets this connection's `search_path` to `path`.
    pub async fn set_path(&self, path: &str) {
        self.client
            .batch_execute(&format!("SET search_path = {path}"))
            .await
            .unwrap_or_else(|e| panic!("set search_path = {path}: {e}"));
    }

    /// Puts this connection's `search_path` back to the server's default.
    pub async fn reset_path(&self) {
        self.client
            .batch_execute("RESET search_path")
            .await
            .expect("reset search_path");
    }

    /// Asserts that nothing was written into `table` of the `decoy` schema,
    /// then drops that schema.
    pub async fn drop_empty_decoy(&self, decoy: &str, table: &str) {
        let rows: i64 = self
            .client
            .query_one(&format!("SELECT count(*) FROM {decoy}.{table}"), &[])
            .await
            .expect("decoy count")
            .get(0);
        assert_eq!(
            rows, 0,
            "{rows} rows went into the caller's look-alike {table}"
        );
        self.client
            .batch_execute(&format!("DROP SCHEMA {decoy} CASCADE"))
            .await
            .expect("drop decoy");
    }

    /// The database URL for a relay process.
    pub fn url(&self) -> String {
        crate::pg_url()
    }

    /// Drops the schema.
    pub async fn cleanup(self) {
        let _ = self
            .client
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema.quoted()))
            .await;
    }
}
