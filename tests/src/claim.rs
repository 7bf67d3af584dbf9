//! The relay's claim as Postgres runs it, for tests and benchmarks that
//! look at its cost, and the claim floor as the relay would compute it.

use std::time::Duration;

use outbox_client::SchemaName;
use outbox_relay::source::claim::Queries;
use outbox_relay::source::floor::Tracker;
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

/// All 64 partitions, as a `smallint[]` literal.
fn partitions() -> String {
    let partitions: Vec<String> = (0..64).map(|p| p.to_string()).collect();
    format!("'{{{}}}'::smallint[]", partitions.join(","))
}

/// The claim's arguments: 500 rows, 8 MiB, 60 s park recheck, from
/// `floor`.
fn args(floor: i64) -> String {
    format!("500, 8388608, 60, {floor}")
}

/// The claim's first statement, which locks the rows, with the same
/// arguments.
fn lock_args(floor: i64) -> String {
    format!("lock(500, {}, {floor})", partitions())
}

/// A session of the relay's own, connected and set up as a worker's is,
/// with the relay's claim prepared on it: what it runs uses the plan the
/// relay's would, cached from its first execution as the relay's is.
pub struct ClaimSession {
    client: Client,
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
        queries.prepare(&client).await?;
        client
            .batch_execute(&format!(
                "PREPARE lock(bigint, smallint[], bigint) AS {}; \
                 PREPARE claim(bigint, bigint, float8, bigint) AS {}",
                queries.lock_sql(),
                queries.claim_sql()
            ))
            .await?;
        Ok(ClaimSession { client })
    }

    /// Runs the claim at `floor` in a transaction rolled back afterwards:
    /// what its two statements cost together under EXPLAIN ANALYZE, and the
    /// seqs it takes.
    pub async fn run(&self, floor: i64) -> anyhow::Result<(ClaimCost, Vec<i64>)> {
        let client = &self.client;
        client.batch_execute("BEGIN").await?;
        let mut cost = ClaimCost {
            ms: 0.0,
            buffers: 0,
            temp_written: 0,
            jit_ms: None,
        };
        for statement in [lock_args(floor), format!("claim({})", args(floor))] {
            let plan: serde_json::Value = client
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

    /// Runs the claim at `floor` in a transaction rolled back afterwards:
    /// each row it returns as (seq, blocked), blocked rows being those held
    /// back behind an older row of their key (or a paused destination).
    pub async fn verdicts(&self, floor: i64) -> anyhow::Result<Vec<(i64, bool)>> {
        let client = &self.client;
        client.batch_execute("BEGIN").await?;
        client
            .batch_execute(&format!("EXECUTE {}", lock_args(floor)))
            .await?;
        let rows = client
            .query(&format!("EXECUTE claim({})", args(floor)), &[])
            .await?
            .iter()
            .map(|r| (r.get::<_, i64>("seq"), r.get::<_, bool>("blocked")))
            .collect();
        client.batch_execute("ROLLBACK").await?;
        Ok(rows)
    }
}

/// [`ClaimSession::run`] on a session of its own.
pub async fn run_claim(
    config: &tokio_postgres::Config,
    schema: &SchemaName,
    floor: i64,
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
