//! PgBouncer in front of the local Postgres, started per test with a config
//! of its own, in `transaction` or `session` pool mode. `tests/run.sh`
//! installs the Debian package when it is missing.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// A running PgBouncer, stopped on drop.
pub struct PgBouncer {
    /// Port it listens on, on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

fn binary() -> PathBuf {
    ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("pgbouncer is not installed (tests/run.sh installs it)")
}

impl PgBouncer {
    /// Starts PgBouncer with `pool_mode` ("transaction", "session",
    /// "statement") in front of 127.0.0.1:5432.
    pub async fn start(pool_mode: &str) -> PgBouncer {
        // A port found free can be taken by someone else (another suite's
        // pooler or relay) before PgBouncer binds it; PgBouncer then exits,
        // and a probe of the port would reach the other listener. So the
        // pooler counts as up only when its own log says it listens on the
        // port and it is still running; otherwise try another port.
        let mut last = String::new();
        for _ in 0..5 {
            match Self::try_start(pool_mode).await {
                Ok(bouncer) => return bouncer,
                Err(log) => last = log,
            }
        }
        panic!("pgbouncer did not start: {last}");
    }

    async fn try_start(pool_mode: &str) -> Result<PgBouncer, String> {
        let port = crate::free_port();
        let dir = std::env::temp_dir().join(crate::unique("pgbouncer"));
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        let users = dir.join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").expect("users file");
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 * = host=127.0.0.1 port=5432\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = {pool_mode}\n\
                 max_client_conn = 500\n\
                 default_pool_size = 40\n\
                 ignore_startup_parameters = extra_float_digits,options\n\
                 logfile = {log}\n\
                 pidfile = {pid}\n",
                users = users.display(),
                log = dir.join("pgbouncer.log").display(),
                pid = dir.join("pgbouncer.pid").display(),
            ),
        )
        .expect("pgbouncer.ini");
        // PgBouncer refuses to run as root; -u drops to the postgres user,
        // which must be able to read the config and write the log.
        let _ = Command::new("chmod")
            .args(["-R", "a+rwX"])
            .arg(&dir)
            .status()
            .await;
        let mut cmd = Command::new(binary());
        if nix_is_root() {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pgbouncer");
        let mut bouncer = PgBouncer { port, dir, child };
        let listening = format!("listening on 127.0.0.1:{port}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::time::Instant::now() < deadline {
            if !matches!(bouncer.child.try_wait(), Ok(None)) {
                break; // exited: the port was taken, or a bad config
            }
            if bouncer.log().contains(&listening)
                && tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            {
                return Ok(bouncer);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(bouncer.log())
    }

    /// A connection string for database `db` through the pooler.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next().map(|u| u == "0"))
        })
        .unwrap_or(false)
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
