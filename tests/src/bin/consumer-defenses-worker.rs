//! Jobs for the jobs suite (tests/tests/jobs.rs), run as processes the suite can start
//! side by side or SIGKILL.
//!
//! ```text
//! consumer-defenses-worker cron <schema> <job>
//!     Runs <job> under job_lock::run_exclusive. The job records a row in
//!     <schema>.cron_runs, then waits until a row appears in <schema>.cron_release.
//!     Prints "ran" (exit 0) or "busy" (exit 3).
//! consumer-defenses-worker checkpoint <schema> <job> <batch>
//!     Walks <schema>.items in id order, <batch> rows per checkpointed batch,
//!     incrementing each row's hits. Exits 0 when every row is done.
//! ```
//!
//! The database URL comes from OUTBOX_TEST_DATABASE_URL as for the suites.

use std::time::Duration;

use anyhow::{bail, Context};
use outbox_client::checkpoint::Checkpoint;
use outbox_client::job_lock::{run_exclusive, Exclusive};
use outbox_client::SchemaName;
use tokio_postgres::{Config, NoTls};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config: Config = outbox_tests::pg_url().parse().context("database url")?;
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["cron", schema, job] => cron(&config, &SchemaName::new(schema)?, job).await,
        ["checkpoint", schema, job, batch] => {
            checkpoint(&config, SchemaName::new(schema)?, job, batch.parse()?).await
        }
        _ => bail!("usage: cron <schema> <job> | checkpoint <schema> <job> <batch>"),
    }
}

async fn cron(config: &Config, schema: &SchemaName, job: &str) -> anyhow::Result<()> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(connection);
    let s = schema.quoted();
    let outcome = run_exclusive(config, job, |_lease| async {
        client
            .execute(
                &format!("INSERT INTO {s}.cron_runs (pid) VALUES ($1)"),
                &[&(std::process::id() as i64)],
            )
            .await?;
        // Hold the lock until the suite says so: the overlap is then certain,
        // not a matter of timing. The ceiling only stops a forgotten process.
        for _ in 0..2400 {
            let released: i64 = client
                .query_one(&format!("SELECT count(*) FROM {s}.cron_release"), &[])
                .await?
                .get(0);
            if released > 0 {
                return Ok::<(), tokio_postgres::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    })
    .await?;
    match outcome {
        Exclusive::Ran(result) | Exclusive::LostLock(result) => {
            result?;
            println!("ran");
            Ok(())
        }
        Exclusive::Busy => {
            println!("busy");
            std::process::exit(3);
        }
    }
}

async fn checkpoint(
    config: &Config,
    schema: SchemaName,
    job: &str,
    batch: i64,
) -> anyhow::Result<()> {
    let (mut client, connection) = config.connect(NoTls).await?;
    tokio::spawn(connection);
    let items = format!("{}.items", schema.quoted());
    let select = format!("SELECT id FROM {items} WHERE id > $1 ORDER BY id LIMIT $2");
    let effect = format!("UPDATE {items} SET hits = hits + 1 WHERE id = ANY($1)");
    let job = Checkpoint::new(schema, job)?;
    loop {
        let b = job.begin(&mut client).await?;
        let ids: Vec<i64> = b
            .transaction()
            .query(&select, &[&b.after(), &batch])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let Some(&last) = ids.last() else {
            b.finish().await?;
            return Ok(());
        };
        b.transaction().execute(&effect, &[&ids]).await?;
        b.commit(last).await?;
    }
}
