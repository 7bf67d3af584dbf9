//! The relay as a real OS process, so tests can SIGKILL, SIGTERM or SIGSTOP it.

use std::process::Stdio;

use tokio::process::{Child, Command};

/// A running `outbox-relay run`. Its log goes on to the test's stderr, and
/// every line is scanned: a workload payload's sentinel, the Postgres
/// password sentinel or the AMQP credentials in a log fail the test when
/// the process is dropped.
pub struct RelayProcess {
    child: Child,
    leaks: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Closes the reading end of the relay's stderr when sent.
    close_log: Option<tokio::sync::oneshot::Sender<()>>,
}

/// What must never reach a relay's log.
fn secrets_in_logs() -> Vec<String> {
    let mut out = vec![
        crate::PAYLOAD_SENTINEL.to_owned(),
        crate::PASSWORD_SENTINEL.to_owned(),
    ];
    // The AMQP URL's user:password, as configured.
    if let Some(creds) = crate::amqp_url()
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split_once('@'))
        .map(|(creds, _)| creds.to_owned())
        .filter(|c| c.contains(':'))
    {
        out.push(format!("{creds}@"));
    }
    out
}

/// The test database URL with [`crate::PASSWORD_SENTINEL`] as its password
/// when it has none.
fn url_with_password_sentinel() -> String {
    let url = crate::pg_url();
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) if !user.contains(':') => {
                format!("{scheme}://{user}:{}@{host}", crate::PASSWORD_SENTINEL)
            }
            _ => url,
        },
        None => url,
    }
}

impl RelayProcess {
    /// Starts `bin run` with `OUTBOX_*` settings from `env`. Suites pass
    /// `env!("CARGO_BIN_EXE_outbox-relay-under-test")`, which cargo defines only
    /// for integration tests.
    pub fn start(bin: &str, env: &[(&str, String)]) -> RelayProcess {
        let mut cmd = Command::new(bin);
        cmd.arg("run")
            .env("OUTBOX_DATABASE_URL", url_with_password_sentinel())
            .env("OUTBOX_AMQP_URL", crate::amqp_url())
            // Many relays run side by side in the suites: an ephemeral port each.
            .env("OUTBOX_HTTP_ADDR", "127.0.0.1:0")
            .env(
                "OUTBOX_LOG",
                std::env::var("OUTBOX_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn relay process");
        let leaks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (close_log, mut closed) = tokio::sync::oneshot::channel();
        if let Some(stderr) = child.stderr.take() {
            let leaks = std::sync::Arc::clone(&leaks);
            let secrets = secrets_in_logs();
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                loop {
                    let line = tokio::select! {
                        _ = &mut closed => break,
                        line = lines.next_line() => line,
                    };
                    let Ok(Some(line)) = line else { break };
                    eprintln!("{line}");
                    for s in &secrets {
                        if line.contains(s.as_str()) {
                            leaks
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(format!("{s:?} in: {line}"));
                        }
                    }
                }
            });
        }
        RelayProcess {
            child,
            leaks,
            close_log: Some(close_log),
        }
    }

    /// Closes the reading end of the relay's stderr, as a log shipper that
    /// stopped would: from then on every write of the relay's log fails.
    pub fn close_log(&mut self) {
        if let Some(close) = self.close_log.take() {
            let _ = close.send(());
        }
    }

    /// Log lines so far that carried a payload sentinel or a secret.
    pub fn leaks(&self) -> Vec<String> {
        self.leaks.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The OS process id.
    pub fn pid(&self) -> i32 {
        self.child.id().map(|p| p as i32).unwrap_or(-1)
    }

    /// Sends `signal` (e.g. "KILL", "TERM", "STOP", "CONT") via kill(1).
    pub async fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .await
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Resident memory in KiB, from /proc (None once the process is gone).
    pub fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// CPU time (user + system) used so far, from /proc.
    pub fn cpu_time(&self) -> Option<std::time::Duration> {
        cpu_time_of(self.pid() as u32)
    }

    /// SIGKILL and reap.
    pub async fn kill9(mut self) {
        self.signal("KILL").await;
        let _ = self.child.wait().await;
    }

    /// The exit status if the process has ended (without waiting).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn wait(&mut self) -> Option<i32> {
        self.child.wait().await.ok().and_then(|s| s.code())
    }
}

/// The tansu binary (Kafka-protocol broker): `OUTBOX_TEST_TANSU_BIN`, then PATH,
/// then cargo's bin directory. `tests/run.sh` installs it when missing.
pub fn tansu_bin() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("OUTBOX_TEST_TANSU_BIN") {
        return p.into();
    }
    let candidates = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("tansu"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .chain(std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo/bin/tansu")));
    for c in candidates {
        if c.is_file() {
            return c;
        }
    }
    panic!("tansu not found: run the suites through tests/run.sh, which installs it")
}

/// A private tansu broker listening on `listen_port` and advertising
/// `advertised_port` (e.g. a proxy's), storing in memory.
pub struct Tansu {
    child: Child,
}

impl Tansu {
    /// Starts it; the caller waits for the port.
    pub fn start(listen_port: u16, advertised_port: u16) -> Tansu {
        let child = Command::new(tansu_bin())
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{listen_port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{advertised_port}"))
            .arg("--storage-engine")
            .arg("memory://tansu/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn tansu");
        Tansu { child }
    }

    /// Stops it.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A private tansu that advertises a proxy's port, with the proxy in front of
/// it: every Kafka connection, the relay's and the consumers', crosses the
/// proxy, so cutting it cuts the broker off. Returns the broker, the proxy
/// and the bootstrap address to use.
pub async fn tansu_behind_proxy() -> (Tansu, crate::proxy::Proxy, String) {
    let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind proxy");
    let proxy_port = proxy_listener.local_addr().expect("addr").port();
    let broker_port = crate::free_port();
    let tansu = Tansu::start(broker_port, proxy_port);
    let proxy = crate::proxy::Proxy::start_on(proxy_listener, &format!("127.0.0.1:{broker_port}"));
    assert!(
        crate::eventually(std::time::Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", broker_port))
                .await
                .is_ok()
        })
        .await,
        "private tansu did not start"
    );
    (tansu, proxy, format!("127.0.0.1:{proxy_port}"))
}

/// Runs the relay binary `bin` once with `args` against `schema` on the test
/// database (no standard input) and returns (exit code, stdout, stderr).
pub async fn cli(bin: &str, schema: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin)
        .args(args)
        .env("OUTBOX_DATABASE_URL", crate::pg_url())
        .env("OUTBOX_SCHEMA", schema)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run the relay cli");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// CPU time (user + system) process `pid` used so far, from /proc.
pub fn cpu_time_of(pid: u32) -> Option<std::time::Duration> {
    let (_, ticks) = stat_of(pid)?;
    Some(std::time::Duration::from_millis(ticks * 10))
}

/// Process `pid`'s command name and the CPU (user + system) it used so
/// far, in clock ticks (100 per second on Linux), from /proc.
pub fn stat_of(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // utime and stime are the 14th and 15th fields overall, after the
    // parenthesised command name (which may itself hold spaces).
    let (head, after) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((comm, ticks))
}

/// The local ports of this process's TCP sockets, from /proc: on the client
/// side of a connection to Postgres, `pg_stat_activity.client_port`. Tells
/// this process's sessions (an in-process relay's) from another process's
/// on the same database.
pub fn own_tcp_ports() -> Vec<i32> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    l.to_str()?
                        .strip_prefix("socket:[")?
                        .strip_suffix(']')
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut ports = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when
        // retrnsmt uid timeout inode ...; addresses as HEX_IP:HEX_PORT.
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(inode)) = (fields.get(1), fields.get(9)) else {
                continue;
            };
            if !inodes.contains(*inode) {
                continue;
            }
            if let Some(port) = local
                .rsplit_once(':')
                .and_then(|(_, p)| i32::from_str_radix(p, 16).ok())
            {
                ports.push(port);
            }
        }
    }
    ports
}

/// Peak resident memory (VmHWM) of process `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The release relay binary beside the running benchmark's own
/// (`cargo build --release -p outbox-relay`), or `OUTBOX_BENCH_RELAY`.
pub fn release_relay_binary() -> anyhow::Result<std::path::PathBuf> {
    // Another build of the relay (e.g. the previous release) for a paired run.
    if let Some(other) = std::env::var_os("OUTBOX_BENCH_RELAY") {
        return Ok(other.into());
    }
    let me = std::env::current_exe()?;
    me.parent()
        .map(|d| d.join("outbox-relay"))
        .filter(|p| p.exists())
        .ok_or_else(|| {
            anyhow::anyhow!("build the relay first: cargo build --release -p outbox-relay")
        })
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let leaks = self.leaks();
        if !leaks.is_empty() && !std::thread::panicking() {
            panic!(
                "the relay logged what must never reach a log:\n{}",
                leaks.join("\n")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    /// A connection this process opens shows among its ports; one of
    /// another process (none here) would not.
    #[test]
    fn own_tcp_ports_names_this_processs_connections() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let port = i32::from(client.local_addr().expect("local").port());
        assert!(
            super::own_tcp_ports().contains(&port),
            "port {port} of this process's connection not found"
        );
    }
}
