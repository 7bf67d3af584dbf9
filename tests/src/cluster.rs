//! A private Postgres cluster, for server settings the shared one cannot
//! take without a restart (`max_prepared_transactions`, which is 0 by
//! default and on most servers). Started with the machine's own Postgres
//! binaries, on a free port, and stopped when dropped.

use std::path::PathBuf;
use std::process::Command;

/// A running private cluster.
pub struct PrivateCluster {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
    settings: Vec<(String, String)>,
    /// Whether a server was started here and not yet stopped, for `Drop`.
    running: bool,
}

/// The directory holding `initdb` and `pg_ctl`: `OUTBOX_TEST_PG_BIN`, else
/// the newest `/usr/lib/postgresql/<version>/bin` (Debian's layout).
fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("OUTBOX_TEST_PG_BIN") {
        return Ok(dir.into());
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        anyhow::anyhow!(
            "no Postgres server binaries under /usr/lib/postgresql; set OUTBOX_TEST_PG_BIN"
        )
    })
}

impl PrivateCluster {
    /// Creates and starts a cluster with `settings` (name, value) on top of
    /// a test-friendly base (trust auth, no fsync, autovacuum off). Postgres
    /// refuses to run as root, so as root it runs as the `postgres` user.
    pub fn start(settings: &[(&str, &str)]) -> anyhow::Result<Self> {
        let mut cluster = Self::new(settings)?;
        run(cluster
            .command("initdb")
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
                "-D",
            ])
            .arg(cluster.data()))?;
        cluster.launch()?;
        Ok(cluster)
    }

    /// Creates and starts a streaming standby of this cluster
    /// (`pg_basebackup -R`), with `settings` of its own. With
    /// `synchronous_standby_names` on the primary, its commits wait for
    /// this standby to have their WAL.
    pub fn start_standby(&self, settings: &[(&str, &str)]) -> anyhow::Result<Self> {
        let mut standby = Self::new(settings)?;
        run(standby
            .command("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-R", "-X", "stream", "--no-sync", "-D"])
            .arg(standby.data()))?;
        standby.launch()?;
        Ok(standby)
    }

    /// A failover: `primary` crashes (`-m immediate`, and it stays down),
    /// this standby is promoted and takes over the primary's port, so that
    /// clients reconnecting to the same address find it, as behind a
    /// floating address or a proxy. What the primary committed but had not
    /// sent is lost.
    /// A standby stopped beforehand ([`PrivateCluster::stop`]) starts again
    /// only once the primary is down, so it takes over with no more than it
    /// had when it stopped.
    pub fn take_over(&mut self, mut primary: PrivateCluster) -> anyhow::Result<()> {
        run(primary
            .command("pg_ctl")
            .args(["-m", "immediate", "-D"])
            .arg(primary.data())
            .arg("stop"))?;
        primary.running = false;
        let port = primary.port;
        if !self.running {
            self.launch()?;
        }
        run(self
            .command("pg_ctl")
            .args(["-w", "-t", "60", "-D"])
            .arg(self.data())
            .arg("promote"))?;
        run(self
            .command("pg_ctl")
            .args(["-w", "-t", "60", "-m", "fast", "-D"])
            .arg(self.data())
            .arg("stop"))?;
        self.port = port;
        self.launch()
    }

    /// Stops the server cleanly (`-m fast`), as a standby taken down for
    /// maintenance or cut off from its primary would stop receiving WAL.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        run(self
            .command("pg_ctl")
            .args(["-w", "-t", "60", "-m", "fast", "-D"])
            .arg(self.data())
            .arg("stop"))?;
        self.running = false;
        Ok(())
    }

    /// A new directory, owned by the user the server runs as, and a free
    /// port; nothing started.
    fn new(settings: &[(&str, &str)]) -> anyhow::Result<Self> {
        let bin = bin_dir()?;
        let as_postgres = Command::new("id").arg("-u").output()?.stdout == b"0\n";
        let dir = std::env::temp_dir().join(crate::unique("pgcluster"));
        std::fs::create_dir_all(&dir)?;
        if as_postgres {
            run(Command::new("chown").arg("postgres:").arg(&dir))?;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        Ok(PrivateCluster {
            dir,
            bin,
            port,
            as_postgres,
            settings: settings
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            running: false,
        })
    }

    /// Starts the server in its directory on its port.
    fn launch(&mut self) -> anyhow::Result<()> {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c autovacuum=off",
            self.port,
            self.dir.display()
        );
        for (name, value) in &self.settings {
            options.push_str(&format!(" -c {name}={value}"));
        }
        let started = run(self
            .command("pg_ctl")
            .args(["-w", "-t", "60", "-D"])
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-o", &options, "start"]));
        if let Err(e) = started {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            anyhow::bail!("the private cluster did not start: {e}\n{log}");
        }
        self.running = true;
        Ok(())
    }

    /// Its connection string, as the `postgres` superuser.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once, as a crash would (`-m immediate`: no
    /// shutdown checkpoint, recovery at start), and starts it again with the
    /// same settings. Prepared transactions survive it.
    pub fn crash_restart(&self) -> anyhow::Result<()> {
        run(self
            .command("pg_ctl")
            .args(["-w", "-t", "60", "-m", "immediate", "-D"])
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .arg("restart"))
    }

    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        if self.running {
            let _ = run(self
                .command("pg_ctl")
                .args(["-m", "immediate", "-D"])
                .arg(self.data())
                .arg("stop"));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `command` to its end; an error names it, with its output.
fn run(command: &mut Command) -> anyhow::Result<()> {
    let out = command.output()?;
    anyhow::ensure!(
        out.status.success(),
        "{command:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
