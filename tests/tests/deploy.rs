//! The files in deploy/ cannot run here (no container engine), so they are
//! checked against the code and by their own tools instead: every OUTBOX_*
//! variable they set is one the relay reads, every metric the dashboard and
//! alerts query is one the relay exports, the ports agree with the relay's
//! default; `promtool` checks and unit-tests the alert rules,
//! `systemd-analyze security` scores the unit, `kubernetes-validate --strict`
//! and a Pod Security "restricted" check read the manifests, and the compose
//! file's dependencies, secrets and healthchecks are checked as compose
//! would read them. `tests/run.sh` installs the tools.

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
    outbox_relay::cli::env_vars()
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
        if path.contains("/kubernetes/") {
            for (needle, what) in [
                ("containerPort: ", "container port"),
                ("port: ", "probe port"),
                ("prometheus.io/port: ", "scrape port"),
            ] {
                for (i, _) in text.match_indices(needle) {
                    let tail = &text[i + needle.len()..];
                    let value: String = tail
                        .trim_start_matches('"')
                        .chars()
                        .take_while(|c| c.is_ascii_digit())
                        .collect();
                    if !value.is_empty() {
                        assert_eq!(value, port, "{path}: {what}");
                    }
                }
            }
        }
        if path.ends_with("sidecar.yaml") || path.ends_with("relay.yaml") {
            assert!(text.contains(&format!("containerPort: {port}")), "{path}");
            assert!(
                text.contains(&format!("path: /healthz, port: {port}")),
                "{path}: liveness probe"
            );
        }
        if path.ends_with("compose.yaml") {
            assert!(text.contains(&format!("{port}:{port}")), "{path}");
        }
    }
}

fn deploy_path(rel: &str) -> String {
    format!("{}/../{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// Runs a checker; its output is the failure message.
fn run_tool(program: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {program} ({e}); `bash tests/run.sh` installs the deploy tools")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `OUTBOX_TEST_PROMTOOL`, else where tests/services.sh unpacks it, else PATH.
fn promtool() -> String {
    if let Ok(p) = std::env::var("OUTBOX_TEST_PROMTOOL") {
        return p;
    }
    let cached = std::env::var("HOME")
        .map(|h| format!("{h}/.cache/outbox-relay-tests/promtool"))
        .unwrap_or_default();
    if std::path::Path::new(&cached).is_file() {
        return cached;
    }
    "promtool".into()
}

#[test]
fn alert_rules_pass_promtool_lint_and_their_unit_tests() {
    let rules = deploy_path("deploy/prometheus-alerts.yaml");
    let (ok, out) = run_tool(
        &promtool(),
        &["check", "rules", "--lint=all", "--lint-fatal", &rules],
    );
    assert!(ok, "promtool check rules:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");
    let (ok, out) = run_tool(
        &promtool(),
        &[
            "test",
            "rules",
            &deploy_path("tests/deploy/alerts.test.yaml"),
        ],
    );
    assert!(ok, "promtool test rules:\n{out}");
    let text = std::fs::read_to_string(&rules).expect("rules");
    let alerts = text.matches("- alert: ").count();
    assert!(alerts >= 6, "{alerts} alerts");
    assert_eq!(
        text.matches("runbook_url: ").count(),
        alerts,
        "a runbook per alert"
    );
    assert_eq!(
        text.matches("severity: ").count(),
        alerts,
        "a severity per alert"
    );
    let runbook = std::fs::read_to_string(deploy_path("docs/runbook.md")).expect("runbook");
    for name in text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            runbook.contains(&format!("## {name}")),
            "docs/runbook.md has no section for {name}"
        );
    }
}

#[test]
fn the_systemd_unit_scores_under_3_exposure() {
    let (_, out) = run_tool(
        "systemd-analyze",
        &[
            "security",
            "--offline=true",
            &deploy_path("deploy/outbox-relay.service"),
        ],
    );
    let score: f64 = out
        .lines()
        .find_map(|l| l.split("exposure level for outbox-relay.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure score in:\n{out}"));
    assert!(score < 3.0, "exposure {score}:\n{out}");
}

#[test]
fn kubernetes_manifests_pass_strict_schemas_and_pod_security_restricted() {
    let dir = deploy_path("deploy/kubernetes");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes")
        .flatten()
        .map(|e| e.path().display().to_string())
        .filter(|p| p.ends_with(".yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    // 1.29 is the first release with native sidecars on by default.
    let mut args = vec!["-m", "kubernetes_validate", "--strict", "-k", "1.29.0"];
    args.extend(files.iter().map(String::as_str));
    let (ok, out) = run_tool("python3", &args);
    assert!(ok, "kubernetes-validate --strict:\n{out}");
    let mut args = vec![deploy_path("tests/deploy/pod_security.py")];
    args.extend(files.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = run_tool("python3", &args);
    assert!(ok, "Pod Security restricted:\n{out}");
    let all: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).expect("manifest"))
        .collect();
    assert!(all.contains("kind: Job"), "a migrate Job");
    assert!(
        all.contains("kind: PodDisruptionBudget"),
        "a PodDisruptionBudget"
    );
    let sidecar = std::fs::read_to_string(format!("{dir}/sidecar.yaml")).expect("sidecar");
    let init = sidecar
        .split("initContainers:")
        .nth(1)
        .expect("native sidecar");
    let relay = init.split("containers:").next().unwrap_or(init);
    assert!(relay.contains("restartPolicy: Always"), "native sidecar");
    assert!(
        !relay.contains("readinessProbe"),
        "the sidecar's readiness would be the app pod's"
    );
}

#[test]
fn compose_runs_as_shipped() {
    let (ok, out) = run_tool(
        "python3",
        &[
            &deploy_path("tests/deploy/compose_check.py"),
            &deploy_path("deploy/compose.yaml"),
        ],
    );
    assert!(ok, "compose:\n{out}");
}

#[test]
fn the_dockerfile_builds_locked_from_pinned_bases_and_checks_its_own_health() {
    let text = std::fs::read_to_string(deploy_path("deploy/Dockerfile")).expect("Dockerfile");
    assert!(text.contains("cargo build --release --locked"), "--locked");
    for line in text
        .lines()
        .filter(|l| l.starts_with("ARG ") && l.contains("_IMAGE="))
    {
        let image = line.split('=').nth(1).unwrap_or("");
        let tag = image.rsplit(':').next().unwrap_or("");
        assert!(
            image.contains(':') && tag.starts_with(|c: char| c.is_ascii_digit()),
            "base not pinned to a version: {line}"
        );
    }
    assert!(!text.contains(":latest"), "no :latest");
    assert!(
        text.contains(r#"CMD ["/usr/local/bin/outbox-relay", "healthcheck"]"#),
        "HEALTHCHECK runs the relay's own subcommand"
    );
    for label in ["title", "version", "licenses", "source"] {
        assert!(
            text.contains(&format!("org.opencontainers.image.{label}=")),
            "OCI label {label}"
        );
    }
    let ignore = std::fs::read_to_string(deploy_path(".dockerignore")).expect(".dockerignore");
    assert!(ignore.lines().any(|l| l.trim() == "target/"), "{ignore}");
    assert!(ignore.lines().any(|l| l.trim() == ".git/"), "{ignore}");
}

#[test]
fn the_dashboard_has_a_uid_variables_and_rate_interval() {
    let text =
        std::fs::read_to_string(deploy_path("deploy/grafana-dashboard.json")).expect("dashboard");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert!(v["uid"].as_str().is_some_and(|u| !u.is_empty()), "uid");
    let vars: Vec<&str> = v["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        vars.contains(&"datasource") && vars.contains(&"job"),
        "{vars:?}"
    );
    for panel in v["panels"].as_array().expect("panels") {
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{panel}");
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            assert!(expr.contains(r#"job=~"$job""#), "job filter: {expr}");
            if expr.contains("rate(") {
                assert!(expr.contains("[$__rate_interval]"), "{expr}");
            }
        }
    }
}
