//! The relay's claim as Postgres runs it, for tests and benchmarks that
//! look at its cost, and the claim floor as the relay would compute it.

use std::time::Duration;

use outbox_client::SchemaName;
use outbox_relay::source::claim::{ClaimLimits, Heads, Prepared, Queries};
use outbox_relay::source::floor::{FloorAt, Tracker};
use tokio_postgres::Client;

/// What one claim cost.
#[derive(Debug, Clone, Copy)]
pub struct ClaimCost {
    /// Execution time, ms.
    pub ms: f64,
    /// Shared buffers touched (hit + read), the claim's subplans included.
    pub buffers: u64,
    /// Temporary file blocks written (a sort or hash that spilled to disk).
    pub temp_written: u64,
    /// Milliseconds Postgres spent compiling the claim with JIT, if it did.
    pub jit_ms: Option<f64>,
}

/// Every partition: the claims here take the whole outbox.
pub fn all_partitions() -> Vec<i16> {
    (0..outbox_relay::source::ownership::PARTITIONS).collect()
}

/// All 64 partitions, as a `smallint[]` literal.
fn partitions() -> String {
    let partitions: Vec<String> = all_partitions().iter().map(|p| p.to_string()).collect();
    format!("'{{{}}}'::smallint[]", partitions.join(","))
}

/// The claim's limits: 500 rows, 8 MiB, 60 s park recheck.
fn limits() -> ClaimLimits {
    ClaimLimits {
        rows: 500,
        bytes: 8 << 20,
        park_recheck: Duration::from_secs(60),
        due_recheck: std::time::Duration::from_millis(10),
        max_payload: i64::MAX,
        max_headers: i64::MAX,
    }
}

/// The claim's first statement, which locks the rows, with the same
/// arguments (no other batch holding rows).
fn lock_args(floor: i64) -> String {
    format!("lock(500, {}, {floor}, '{{}}'::bigint[])", partitions())
}

/// `items` as an SQL array literal of type `ty`.
fn array<T: ToString>(items: &[T], ty: &str) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|i| {
            format!(
                "\"{}\"",
                i.to_string().replace('\\', "\\\\").replace('"', "\\\"")
            )
        })
        .collect();
    format!("'{{{}}}'::{ty}", quoted.join(",").replace('\'', "''"))
}

/// A session of the relay's own, connected and set up as a worker's is,
/// with the relay's claim prepared on it: what it runs uses the plans the
/// relay's would, cached from their first execution as the relay's are.
pub struct ClaimSession {
    client: outbox_relay::source::Session,
    queries: Queries,
    prepared: Prepared,
}

impl ClaimSession {
    /// Opens the session and prepares the claim for `schema`.
    pub async fn open(
        config: &tokio_postgres::Config,
        schema: &SchemaName,
    ) -> anyhow::Result<Self> {
        Self::open_with(config, schema, "").await
    }

    /// [`ClaimSession::open`], then `settings` (SQL) run on the session
    /// before the claim is prepared: a session set up otherwise than the
    /// relay's, for a baseline.
    pub async fn open_with(
        config: &tokio_postgres::Config,
        schema: &SchemaName,
        settings: &str,
    ) -> anyhow::Result<Self> {
        let queries = Queries::new(schema, true, false);
        let client =
            outbox_relay::source::connect(&config.clone().into(), Duration::from_secs(60)).await?;
        client.batch_execute(settings).await?;
        let prepared = queries.prepare(&client).await?;
        client
            .batch_execute(&format!(
                "PREPARE lock(bigint, smallint[], bigint, bigint[]) AS {}; \
                 PREPARE probe(text[], bigint[], bigint[], bigint, bigint, bigint[]) AS {}; \
                 PREPARE bodies(bigint[]) AS {}",
                queries.lock_sql(),
                queries.probe_sql(),
                queries.bodies_sql()
            ))
            .await?;
        Ok(ClaimSession {
            client,
            queries,
            prepared,
        })
    }

    /// Runs the claim at `floor` in a transaction rolled back afterwards:
    /// what its statements (the lock, the probes, the bodies) cost together
    /// under EXPLAIN ANALYZE, and the seqs it takes.
    pub async fn run(&self, floor: impl Into<FloorAt>) -> anyhow::Result<(ClaimCost, Vec<i64>)> {
        let floor = floor.into();
        let client = &self.client;
        client.batch_execute("BEGIN").await?;
        let mut cost = ClaimCost {
            ms: 0.0,
            buffers: 0,
            temp_written: 0,
            jit_ms: None,
        };
        self.explain(&lock_args(floor.scan), &mut cost).await?;
        // Once more for its rows: they are this transaction's own, so the
        // lock takes the same ones again.
        let rows = client
            .query(&format!("EXECUTE {}", lock_args(floor.scan)), &[])
            .await?;
        let heads = Heads::from_rows(&rows, &limits())?;
        let (keys, tops, kept) = heads.probe_args();
        if !keys.is_empty() {
            let probe = format!(
                "probe({}, {}, {}, {}, {}, {})",
                array(&keys, "text[]"),
                array(&tops, "bigint[]"),
                array(&kept, "bigint[]"),
                floor.probe,
                floor.scan,
                array(floor.open_writers(), "bigint[]")
            );
            self.explain(&probe, &mut cost).await?;
        }
        if !kept.is_empty() {
            self.explain(&format!("bodies({})", array(&kept, "bigint[]")), &mut cost)
                .await?;
        }
        client.batch_execute("ROLLBACK").await?;
        let seqs = self
            .verdicts(floor)
            .await?
            .into_iter()
            .map(|v| v.0)
            .collect();
        Ok((cost, seqs))
    }

    /// Adds what EXECUTE `statement` costs under EXPLAIN ANALYZE to `cost`.
    async fn explain(&self, statement: &str, cost: &mut ClaimCost) -> anyhow::Result<()> {
        let plan: serde_json::Value = self
            .client
            .query_one(
                &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {statement}"),
                &[],
            )
            .await?
            .get(0);
        let top = &plan[0]["Plan"];
        let blocks = |k: &str| {
            top[k]
                .as_u64()
                .ok_or_else(|| anyhow::anyhow!("no {k} in the plan of {statement}"))
        };
        cost.ms += plan[0]["Execution Time"].as_f64().unwrap_or(f64::NAN);
        cost.buffers += blocks("Shared Hit Blocks")? + blocks("Shared Read Blocks")?;
        cost.temp_written += blocks("Temp Written Blocks")?;
        if let Some(jit) = plan[0]["JIT"]["Timing"]["Total"].as_f64() {
            cost.jit_ms = Some(cost.jit_ms.unwrap_or(0.0) + jit);
        }
        Ok(())
    }

    /// The relay's look at `partitions` from `floor`, beside batches that
    /// hold `mine`, outside any transaction: whether its claim would find
    /// anything.
    pub async fn ready(
        &self,
        partitions: &[i16],
        floor: i64,
        mine: &[i64],
    ) -> Result<bool, tokio_postgres::Error> {
        self.queries
            .ready(&self.client, &self.prepared, partitions, floor, mine)
            .await
    }

    /// Runs `settings` (SQL) on the session.
    pub async fn set(&self, settings: &str) -> anyhow::Result<()> {
        Ok(self.client.batch_execute(settings).await?)
    }

    /// The session's connection.
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }

    /// Runs the relay's claim at `floor` in a transaction rolled back
    /// afterwards: each row it keeps as (seq, blocked), oldest first,
    /// blocked rows being those held back behind an older row of their key
    /// (or a paused destination).
    pub async fn verdicts(&self, floor: impl Into<FloorAt>) -> anyhow::Result<Vec<(i64, bool)>> {
        let client = &self.client;
        client
            .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        let claimed = self
            .queries
            .claim(
                client,
                &self.prepared,
                &limits(),
                &all_partitions(),
                floor,
                || {},
            )
            .await;
        client.batch_execute("ROLLBACK").await?;
        let claimed = claimed?;
        let mut verdicts: Vec<(i64, bool)> = claimed
            .batch
            .iter()
            .map(|e| (e.seq, false))
            .chain(claimed.blocked.iter().map(|&seq| (seq, true)))
            .collect();
        verdicts.sort_unstable();
        Ok(verdicts)
    }
}

/// [`ClaimSession::run`] on a session of its own.
pub async fn run_claim(
    config: &tokio_postgres::Config,
    schema: &SchemaName,
    floor: impl Into<FloorAt>,
) -> anyhow::Result<(ClaimCost, Vec<i64>)> {
    ClaimSession::open(config, schema).await?.run(floor).await
}

/// The claim floor for `schema`, computed by a tracker of the caller's on
/// `client` (a fresh computation, from seq 0).
pub async fn floor(client: &Client, schema: &SchemaName) -> anyhow::Result<i64> {
    let mut tracker = Tracker::new(schema, Duration::from_secs(3600));
    tracker.prepare(client).await?;
    for _ in 0..100 {
        if let Some(floor) = tracker.step(client, 0).await? {
            return Ok(floor);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the floor did not move in 100 steps")
}
