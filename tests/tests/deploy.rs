//! The files in deploy/ cannot run here (no container engine), so they are
//! checked against the code instead: every OUTBOX_* variable they set is one
//! the relay reads, every metric the dashboard and alerts query is one the relay
//! exports, and the ports agree with the relay's default.

use std::collections::BTreeSet;

use clap::CommandFactory;

fn deploy_files() -> Vec<(String, String)> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    let mut out = Vec::new();
    let mut dirs = vec![std::path::PathBuf::from(root)];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("deploy dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                let text = std::fs::read_to_string(&p).expect("text file");
                out.push((p.display().to_string(), text));
            }
        }
    }
    assert!(
        out.len() >= 6,
        "deploy/ is missing files: {out:?}",
        out = out.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    out
}

/// Tokens made of `[A-Za-z0-9_]` that start with `prefix`.
fn tokens(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        found.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    found
}

fn cli_env_vars() -> BTreeSet<String> {
    fn walk(cmd: &clap::Command, out: &mut BTreeSet<String>) {
        for a in cmd.get_arguments() {
            if let Some(e) = a.get_env() {
                out.insert(e.to_string_lossy().into_owned());
            }
        }
        for s in cmd.get_subcommands() {
            walk(s, out);
        }
    }
    let mut out = BTreeSet::new();
    walk(&outbox_relay::config::Cli::command(), &mut out);
    // Read by the binary itself rather than a flag: the log filter.
    out.insert("OUTBOX_LOG".to_owned());
    out
}

#[test]
fn every_env_var_in_deploy_is_read_by_the_relay() {
    let known = cli_env_vars();
    let mut used = BTreeSet::new();
    for (path, text) in deploy_files() {
        for var in tokens(&text, "OUTBOX_") {
            assert!(
                known.contains(&var),
                "{path} sets {var}, which the relay does not read"
            );
            used.insert(var);
        }
    }
    for needed in [
        "OUTBOX_DATABASE_URL_FILE",
        "OUTBOX_AMQP_URL_FILE",
        "OUTBOX_HTTP_ADDR",
    ] {
        assert!(used.contains(needed), "no deploy file sets {needed}");
    }
}

#[test]
fn every_metric_in_dashboard_and_alerts_is_exported() {
    let exported: BTreeSet<&str> = outbox_relay::metrics::ALL.iter().copied().collect();
    let mut queried = BTreeSet::new();
    for (path, text) in deploy_files() {
        if !(path.ends_with("grafana-dashboard.json") || path.ends_with("prometheus-alerts.yaml")) {
            continue;
        }
        for m in tokens(&text, "outbox_") {
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| m.strip_suffix(s))
                .unwrap_or(&m)
                .to_owned();
            assert!(
                exported.contains(base.as_str()),
                "{path} queries {m}, which the relay does not export"
            );
            queried.insert(base);
        }
    }
    for m in [
        outbox_relay::metrics::OLDEST_PENDING,
        outbox_relay::metrics::READY,
        outbox_relay::metrics::PARTITIONS_UNOWNED,
    ] {
        assert!(queried.contains(m), "nothing watches {m}");
    }
    // The dashboard is valid JSON with one query per panel.
    let dash = deploy_files()
        .into_iter()
        .find(|(p, _)| p.ends_with("grafana-dashboard.json"))
        .expect("dashboard");
    let v: serde_json::Value = serde_json::from_str(&dash.1).expect("dashboard is JSON");
    assert!(v["panels"].as_array().is_some_and(|p| p.len() >= 8));
}

#[test]
fn ports_agree_with_the_relay_default() {
    let cmd = outbox_relay::config::Cli::command();
    let run = cmd.find_subcommand("run").expect("run");
    let default = run
        .get_arguments()
        .find(|a| a.get_id() == "http_addr")
        .and_then(|a| {
            a.get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned())
        })
        .expect("--http-addr default");
    let port = default.rsplit(':').next().expect("port").to_owned();
    for (path, text) in deploy_files() {
        if path.ends_with("Dockerfile") {
            assert!(
                text.contains(&format!("EXPOSE {port}")),
                "{path} exposes another port"
            );
        }
        if path.ends_with("sidecar.yaml") {
            assert!(text.contains(&format!("containerPort: {port}")), "{path}");
            assert!(
                text.contains(&format!("path: /healthz, port: {port}")),
                "{path}: liveness probe"
            );
            assert!(
                text.contains(&format!("path: /readyz, port: {port}")),
                "{path}: readiness probe"
            );
        }
        if path.ends_with("compose.yaml") {
            assert!(text.contains(&format!("{port}:{port}")), "{path}");
        }
    }
}
