//! The relay as a real OS process, so tests can SIGKILL, SIGTERM or SIGSTOP it.

use std::process::Stdio;

use tokio::process::{Child, Command};

/// A running `outbox-relay run`.
pub struct RelayProcess {
    child: Child,
}

impl RelayProcess {
    /// Starts `bin run` with `OUTBOX_*` settings from `env`. Suites pass
    /// `env!("CARGO_BIN_EXE_outbox-relay-under-test")`, which cargo defines only
    /// for integration tests.
    pub fn start(bin: &str, env: &[(&str, String)]) -> RelayProcess {
        let mut cmd = Command::new(bin);
        cmd.arg("run")
            .env("OUTBOX_DATABASE_URL", crate::pg_url())
            .env("OUTBOX_AMQP_URL", crate::amqp_url())
            .env(
                "OUTBOX_LOG",
                std::env::var("OUTBOX_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        RelayProcess {
            child: cmd.spawn().expect("spawn relay process"),
        }
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

    /// SIGKILL and reap.
    pub async fn kill9(mut self) {
        self.signal("KILL").await;
        let _ = self.child.wait().await;
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn wait(&mut self) -> Option<i32> {
        self.child.wait().await.ok().and_then(|s| s.code())
    }
}
