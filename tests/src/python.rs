//! The suites' programs in another language (tests/consumers/*.py): started,
//! awaited until subscribed, and read as JSON lines.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// The path of `tests/consumers/<name>`.
pub fn script(name: &str) -> String {
    format!("{}/consumers/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A Python program that printed "ready" and prints one JSON line per event.
pub struct Reader {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Reader {
    /// Runs `python3 args...` and waits (up to a minute) for its "ready".
    pub async fn start(args: &[String]) -> Reader {
        let mut child = Command::new("python3")
            .args(args)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (tests/run.sh installs the suites' Python libraries)");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("python program ready in time")
            .expect("read")
            .expect("a line");
        assert_eq!(
            first, "ready",
            "python program failed to start (are its libraries installed?)"
        );
        Reader { child, lines }
    }

    /// Every JSON line until the program exits; fails unless it exits 0.
    pub async fn collect(mut self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        while let Some(line) = self.lines.next_line().await.expect("read") {
            out.push(serde_json::from_str(&line).expect("json line"));
        }
        let status = self.child.wait().await.expect("wait");
        assert!(status.success(), "python program exited with {status}");
        out
    }
}
