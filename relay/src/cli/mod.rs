//! The `outbox-relay` binary's body, kept in the library so test harnesses can
//! build the very same program.

use std::process::ExitCode;

use crate::config::{Cli, Command, DbArgs, DeadLetterAction, LogFormat, Switch};
use crate::ops;

mod render;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// The `outbox-relay` command line: parse flags, run, map the outcome to an exit
/// code (0 success, 1 failure, 2 bad usage).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    warn_unknown_env(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.runtime_threads.into())
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes.
            eprintln!("error: {e:#}");
            // A selection the command refuses, or a flag whose value turns
            // out unusable (an unreadable file, a bad certificate), is a usage
            // error, like clap's.
            let usage = matches!(
                e.downcast_ref::<ops::OpsError>(),
                Some(ops::OpsError::Selection(_))
            ) || e.downcast_ref::<crate::config::ConfigError>().is_some()
                || matches!(
                    e.downcast_ref::<crate::Error>(),
                    Some(crate::Error::Config(_))
                );
            if usage {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Every environment variable the relay reads as a setting: each flag's,
/// and `OUTBOX_LOG`, the log filter, which the binary reads itself.
pub fn env_vars() -> std::collections::BTreeSet<String> {
    fn walk(cmd: &clap::Command, out: &mut std::collections::BTreeSet<String>) {
        for a in cmd.get_arguments() {
            if let Some(e) = a.get_env() {
                out.insert(e.to_string_lossy().into_owned());
            }
        }
        for s in cmd.get_subcommands() {
            walk(s, out);
        }
    }
    let mut known = std::collections::BTreeSet::new();
    walk(&<Cli as clap::CommandFactory>::command(), &mut known);
    known.insert("OUTBOX_LOG".to_owned());
    known
}

/// The `OUTBOX_*` variables among `names` that name no setting, each with
/// the setting it is likely a misspelling of: one such variable
/// (`OUTBOX_SHUTDOWN_GRACE_PERIOD`) was ignored without a trace, and the
/// default applied. `OUTBOX_LOG` and the `OUTBOX_TEST_` hooks are read
/// directly.
pub fn unknown_env(names: impl Iterator<Item = String>) -> Vec<(String, Option<String>)> {
    let known = env_vars();
    let mut unknown: Vec<(String, Option<String>)> = names
        .filter(|n| n.starts_with("OUTBOX_") && !n.starts_with("OUTBOX_TEST_"))
        .filter(|n| !known.contains(n))
        .map(|n| {
            let near = known
                .iter()
                .map(|k| (edits(&n, k), k))
                .filter(|(d, _)| *d <= n.len() / 3)
                .min()
                .map(|(_, k)| k.clone());
            (n, near)
        })
        .collect();
    unknown.sort();
    unknown
}

/// Edits (insertions, deletions, substitutions) from `a` to `b`.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

fn warn_unknown_env(names: impl Iterator<Item = String>) {
    for (name, near) in unknown_env(names) {
        match near {
            Some(near) => tracing::warn!(
                variable = %name,
                "{name} is not a setting of outbox-relay and is ignored; did you mean {near}?"
            ),
            None => tracing::warn!(
                variable = %name,
                "{name} is not a setting of outbox-relay and is ignored"
            ),
        }
    }
}

/// The operator's "y/N" before a destructive command, at the CLI edge.
/// Asks "y/N" on the terminal unless `yes`; refuses when there is no terminal.
fn confirm(prompt: &str, yes: bool) -> Result<(), ops::OpsError> {
    if yes {
        return Ok(());
    }
    if !{
        use std::io::IsTerminal;
        std::io::stdin().is_terminal()
    } {
        return Err(ops::OpsError::NotConfirmed(format!(
            "{prompt}: not a terminal, so not asking; pass --yes to proceed"
        )));
    }
    eprint!("{prompt} [y/N] ");
    let _ = std::io::Write::flush(&mut std::io::stderr());
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(&mut std::io::stdin().lock(), &mut line);
    if matches!(line.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(ops::OpsError::NotConfirmed("cancelled".into()))
    }
}

/// GETs `path` from the relay's HTTP endpoint over plain HTTP/1.0; Ok with
/// the body's first line when it answers 200.
async fn ask_http(mut addr: std::net::SocketAddr, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| anyhow::anyhow!("no relay answers on {addr}: {e}"))?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut reply = Vec::new();
    // Health bodies are one line; cap what a stranger on the port can send.
    (&mut stream)
        .take(64 * 1024)
        .read_to_end(&mut reply)
        .await?;
    let reply = String::from_utf8_lossy(&reply);
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head.lines().next().unwrap_or("");
    let body = body.lines().next().unwrap_or("").trim().to_owned();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(body)
    } else {
        anyhow::bail!("{path} on {addr}: {status}: {body}")
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => {
            let config = args.into_config()?;
            let shutdown = CancellationToken::new();
            tokio::spawn(on_signal(shutdown.clone()));
            crate::run(config, shutdown).await?;
        }
        Command::Migrate(args) => {
            let db = &args.db;
            crate::source::wait_for_postgres(&db.database()?, args.wait)
                .await
                .map_err(crate::Error::from)?;
            crate::migrate(&db.database()?, &db.schema).await?;
            println!("schema {} is up to date", db.schema);
        }
        Command::Demo(args) => crate::demo::run(args).await?,
        Command::Healthcheck {
            http_addr,
            ready,
            timeout,
        } => {
            // Unhealthy (1), not a usage error (2): Docker reserves a
            // health check's exit code 2, and `off` is often inherited
            // from the relay's own environment.
            let Some(addr) = http_addr.0 else {
                anyhow::bail!("--http-addr is off: the relay serves no health endpoint to ask");
            };
            let path = if ready { "/readyz" } else { "/healthz" };
            let answer = tokio::time::timeout(timeout, ask_http(addr, path))
                .await
                .map_err(|_| {
                    anyhow::anyhow!("{path} on {addr} did not answer within {timeout:?}")
                })??;
            println!("{path}: {answer}");
        }
        Command::Status { db, json, order } => {
            let client = connect(&db).await?;
            let v = ops::status(&client, &db.schema, order.dead_letter_order.parks()).await?;
            print_out(&v, json, render::status_text);
            // A health check in a script: exit 1, after the report, when no
            // relay is running on this schema (nothing will publish).
            if v.replicas.is_empty() {
                anyhow::bail!("no relay replica is running on schema {}", db.schema);
            }
        }
        Command::Locate {
            db,
            id,
            json,
            order,
        } => {
            let mut client = connect(&db).await?;
            let park = order.dead_letter_order.parks();
            let v = ops::locate(&mut client, &db.schema, id, park).await?;
            print_out(&v, json, render::locate_text);
            // Scripts can tell "not here" from a message somewhere by the
            // exit code: 1, after the report.
            if v.location.is_unknown() {
                anyhow::bail!("message {id} is in neither the outbox, the dead letters nor the retained published rows");
            }
        }
        Command::DeadLetters { db, action } => {
            let client = connect(&db).await?;
            match action {
                DeadLetterAction::List {
                    filter,
                    limit,
                    json,
                } => {
                    let v = ops::dead_letters(&client, &db.schema, &filter.into(), limit, false)
                        .await?;
                    print_out(&v, json, |v| render::dead_letters_text(v, false));
                }
                DeadLetterAction::Show { id, json, payload } => {
                    let filter = ops::Filter {
                        id: Some(id),
                        ..ops::Filter::default()
                    };
                    let v = ops::dead_letters(&client, &db.schema, &filter, 1, payload).await?;
                    let Some(one) = v.first() else {
                        anyhow::bail!("no dead letter with message id {id}");
                    };
                    print_out(one, json, |d| {
                        render::dead_letters_text(std::slice::from_ref(d), true)
                    });
                }
                DeadLetterAction::Retry { filter, yes, json } => {
                    let filter = ops::Filter::from(filter);
                    ops::require_selection(&filter)?;
                    confirm("return the selected dead letters to the outbox?", yes)?;
                    let n = ops::retry(&client, &db.schema, &filter).await?;
                    print_out(&serde_json::json!({"retried": n}), json, |_| {
                        format!("{n} dead letters returned to the outbox\n")
                    });
                }
                DeadLetterAction::Discard { filter, yes, json } => {
                    let filter = ops::Filter::from(filter);
                    ops::require_selection(&filter)?;
                    confirm("delete the selected dead letters for good?", yes)?;
                    let n = ops::discard(&client, &db.schema, &filter).await?;
                    print_out(&serde_json::json!({"discarded": n}), json, |_| {
                        format!("{n} dead letters discarded\n")
                    });
                }
            }
        }
        Command::Pause {
            db,
            destination,
            reason,
        } => {
            let client = connect(&db).await?;
            let fresh =
                crate::ops::pause(&client, &db.schema, &destination, reason.as_deref()).await?;
            println!(
                "destination {destination:?} {}; its messages wait in the outbox until `resume`",
                if fresh {
                    "paused"
                } else {
                    "was already paused"
                }
            );
        }
        Command::Resume { db, destination } => {
            let client = connect(&db).await?;
            let back = crate::ops::resume(&client, &db.schema, &destination).await?;
            println!("destination {destination:?} resumed; {back} waiting messages released");
        }
        Command::Notify { db, state } => {
            let client = db.database()?.connect_spawned().await?;
            outbox_client::set_notify(&client, db.schema.as_str(), state == Switch::On).await?;
            println!(
                "notify is {}",
                if state == Switch::On { "on" } else { "off" }
            );
        }
    }
    Ok(())
}

/// SIGTERM and Ctrl-C both start a drain: in-flight batches finish, up to
/// the shutdown grace. A second signal stops the process at once, as an
/// operator pressing Ctrl-C again expects: what was in flight stays in the
/// outbox and goes again (at least once), never lost.
async fn on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the relay");
                let _ = tokio::signal::ctrl_c().await;
                shutdown.cancel();
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!(
            "shutdown requested; finishing in-flight batches (a second signal stops at once)"
        );
        shutdown.cancel();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::warn!("second shutdown signal; stopping now: batches in flight stay in the outbox and go again");
        std::process::exit(130);
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown requested; finishing in-flight batches");
        shutdown.cancel();
    }
}

/// Dependencies whose logs stay off unless `OUTBOX_LOG` names them: lapin
/// logs a returned message whole (payload included) at WARN and every
/// missing-exchange check as an ERROR; refinery and tokio-postgres narrate
/// each step. The relay reports what matters itself, one line per event.
const QUIET_DEPENDENCIES: [(&str, &str); 5] = [
    ("lapin", "off"),
    ("amq_protocol", "off"),
    ("refinery_core", "warn"),
    ("tokio_postgres", "warn"),
    ("rdkafka", "warn"),
];

/// The log filter: `OUTBOX_LOG` (default `info`), with the dependencies
/// above kept quiet unless it names them.
fn log_filter(spec: Option<&str>) -> EnvFilter {
    let spec = spec.filter(|s| !s.trim().is_empty()).unwrap_or("info");
    let mut directives = vec![spec.to_owned()];
    for (target, level) in QUIET_DEPENDENCIES {
        if !spec.contains(target) {
            directives.push(format!("{target}={level}"));
        }
    }
    EnvFilter::try_new(directives.join(",")).unwrap_or_else(|_| EnvFilter::new("info"))
}

fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = log_filter(std::env::var("OUTBOX_LOG").ok().as_deref());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour only for a person at a terminal, never into a file or pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        // A line that cannot be written (the pipe to a log shipper that
        // stopped) is dropped. Reporting it would print to the same
        // stderr, and a failed print panics: every task that logged would
        // end there, and the relay would run on doing nothing.
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder.init(),
        // The event's message and fields at the top level of each object.
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// A connection for an inspection or operator command, refusing an outbox
/// that was never migrated with the command that fixes it.
async fn connect(db: &DbArgs) -> anyhow::Result<tokio_postgres::Client> {
    let pg = |e: tokio_postgres::Error| anyhow::anyhow!("postgres: {}", crate::source::PgError(&e));
    let client = db.database()?.connect_spawned().await.map_err(pg)?;
    let table = format!("{}.messages", db.schema.quoted());
    let migrated: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(pg)?
        .get(0);
    if !migrated {
        anyhow::bail!(
            "outbox schema {:?} is not migrated; run `outbox-relay migrate` first",
            db.schema.as_str()
        );
    }
    Ok(client)
}

fn print_out<T: serde::Serialize>(v: &T, json: bool, text: impl Fn(&T) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        print!("{}", text(v));
    }
}

#[cfg(test)]
mod tests {
    use super::{log_filter, unknown_env};

    /// A misspelled variable was ignored without a word, and its default
    /// applied: now it is named, with the setting it likely meant.
    #[test]
    fn variables_that_name_no_setting_are_named_with_the_likely_one() {
        let names = [
            "OUTBOX_SHUTDOWN_GRACE_PERIOD",
            "OUTBOX_BATCHSIZE",
            "OUTBOX_SCHEMA",
            "OUTBOX_LOG",
            "OUTBOX_TEST_MUTANT",
            "OUTBOX_ZZZZZZZZZZZZZZZZZZ",
            "PATH",
        ]
        .map(str::to_owned);
        assert_eq!(
            unknown_env(names.into_iter()),
            vec![
                (
                    "OUTBOX_BATCHSIZE".to_owned(),
                    Some("OUTBOX_BATCH_SIZE".to_owned())
                ),
                (
                    "OUTBOX_SHUTDOWN_GRACE_PERIOD".to_owned(),
                    Some("OUTBOX_SHUTDOWN_GRACE".to_owned())
                ),
                ("OUTBOX_ZZZZZZZZZZZZZZZZZZ".to_owned(), None),
            ]
        );
    }

    #[test]
    fn dependencies_stay_quiet_unless_named() {
        let f = log_filter(Some("debug")).to_string();
        assert!(f.contains("lapin=off") && f.contains("debug"), "{f}");
        let f = log_filter(Some("info,lapin=debug")).to_string();
        assert!(f.contains("lapin=debug") && !f.contains("lapin=off"), "{f}");
        let f = log_filter(None).to_string();
        assert!(
            f.contains("info") && f.contains("refinery_core=warn"),
            "{f}"
        );
    }
}
