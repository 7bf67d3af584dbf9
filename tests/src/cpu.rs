//! Where a benchmark phase's CPU went: CPU seconds per program (Postgres,
//! the broker, the benchmark's own process), read from /proc while the phase
//! runs, and how much of the machine stayed idle.
//!
//! A drain on a small machine shares its cores with Postgres and the broker.
//! Whether it is bound by them, by the relay or by waiting shows only when
//! every program's share is measured over the same interval.
//!
//! The readings run in the calling process, ten times a second, and their
//! own cost (a directory listing and a few small reads) counts under `self`.

use std::collections::HashMap;
use std::time::Duration;

/// Clock ticks per second of /proc's CPU times (USER_HZ, 100 on Linux).
const TICKS_PER_SECOND: u64 = 100;

/// How often the processes are read. A process that exits between two reads
/// loses at most this much of its CPU from the total.
const SAMPLE: Duration = Duration::from_millis(100);

/// CPU used over a phase.
#[derive(Debug, Clone)]
pub struct CpuSplit {
    /// CPU time per program, in the order they were asked for.
    pub programs: Vec<(String, Duration)>,
    /// Share of all cores' time that was idle (or waiting on I/O), 0 to 1.
    pub idle: f64,
}

impl CpuSplit {
    /// CPU time of `program`, zero when it is not one that was watched.
    pub fn of(&self, program: &str) -> Duration {
        self.programs
            .iter()
            .find(|(p, _)| p == program)
            .map_or(Duration::ZERO, |(_, d)| *d)
    }

    /// One line: each program's microseconds of CPU per message, for
    /// `messages` handled in the phase, and the machine's idle share.
    pub fn per_message(&self, messages: usize) -> String {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / messages.max(1) as f64;
        let parts: Vec<String> = self
            .programs
            .iter()
            .map(|(p, d)| format!("{p} {:.1}", per(*d)))
            .collect();
        format!(
            "CPU µs per message: {}; machine idle {:.0} %",
            parts.join(", "),
            self.idle * 100.0
        )
    }
}

/// Watches the CPU of the processes whose command name (`comm`) is one of
/// `programs`, and of this process under the name `self`, until
/// [`CpuWatch::stop`].
pub struct CpuWatch {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<CpuSplit>,
}

impl CpuWatch {
    pub fn start(programs: &[&str]) -> Self {
        let programs: Vec<String> = programs.iter().map(|p| (*p).to_owned()).collect();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        // The first reading is taken here, before the phase starts, not
        // whenever the task first runs.
        let idle_before = machine_ticks();
        let mut tracker = Tracker::new(&programs);
        tracker.sample();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(SAMPLE) => {}
                }
                tracker.sample();
            }
            tracker.sample();
            let idle = match (idle_before, machine_ticks()) {
                (Some((total0, idle0)), Some((total1, idle1))) if total1 > total0 => {
                    (idle1 - idle0) as f64 / (total1 - total0) as f64
                }
                _ => f64::NAN,
            };
            CpuSplit {
                programs: tracker.totals(),
                idle,
            }
        });
        CpuWatch { stop, task }
    }

    pub async fn stop(self) -> CpuSplit {
        let _ = self.stop.send(());
        self.task.await.expect("the CPU watch does not panic")
    }
}

/// CPU ticks per process of the watched programs: the first reading and the
/// last, so a process that started during the phase counts from zero and one
/// that was running before counts from when the phase began.
struct Tracker {
    programs: Vec<String>,
    own_pid: u32,
    /// pid -> (program, ticks at the first reading, ticks at the last).
    seen: HashMap<u32, (String, u64, u64)>,
    /// pids already looked at and not watched (or gone).
    ignored: std::collections::HashSet<u32>,
    first: bool,
}

impl Tracker {
    fn new(programs: &[String]) -> Self {
        Tracker {
            programs: programs.to_vec(),
            own_pid: std::process::id(),
            seen: HashMap::new(),
            ignored: Default::default(),
            first: true,
        }
    }

    fn sample(&mut self) {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if self.ignored.contains(&pid) {
                continue;
            }
            let Some((comm, ticks)) = crate::process::stat_of(pid) else {
                continue;
            };
            if let Some(entry) = self.seen.get_mut(&pid) {
                entry.2 = entry.2.max(ticks);
                continue;
            }
            let name = if pid == self.own_pid { "self" } else { &comm };
            match self.programs.iter().find(|p| *p == name).cloned() {
                Some(p) => {
                    // Running before the phase: count from now. Started
                    // during it: count all it used.
                    let from = if self.first { ticks } else { 0 };
                    self.seen.insert(pid, (p, from, ticks));
                }
                _ => {
                    self.ignored.insert(pid);
                }
            }
        }
        self.first = false;
    }

    fn totals(&self) -> Vec<(String, Duration)> {
        self.programs
            .iter()
            .map(|p| {
                let ticks: u64 = self
                    .seen
                    .values()
                    .filter(|(q, _, _)| q == p)
                    .map(|(_, from, to)| to - from)
                    .sum();
                (
                    p.clone(),
                    Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND),
                )
            })
            .collect()
    }
}

/// All cores' ticks since boot, and those idle or waiting on I/O.
fn machine_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<u64> = text
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    Some((cpu.iter().sum(), cpu.get(3)? + cpu.get(4)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watch counts this process's own CPU: after the process has used
    /// 200 ms of CPU (by its own /proc counter) the watch shows as much
    /// under `self`, and nothing under a program that is not running.
    #[tokio::test]
    async fn counts_the_cpu_of_this_process() {
        let watch = CpuWatch::start(&["self", "no-such-program"]);
        let pid = std::process::id();
        let before = crate::process::cpu_time_of(pid).expect("own CPU time");
        tokio::task::spawn_blocking(move || {
            let mut x = 0u64;
            while crate::process::cpu_time_of(pid).expect("own CPU time") - before
                < Duration::from_millis(200)
            {
                for _ in 0..100_000 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
            }
            std::hint::black_box(x);
        })
        .await
        .expect("the spinning task");
        let split = watch.stop().await;
        assert!(
            split.of("self") >= Duration::from_millis(200),
            "200 ms of this process's CPU counted as {:?}",
            split.of("self")
        );
        assert_eq!(split.of("no-such-program"), Duration::ZERO);
        assert!(split.per_message(1000).contains("self"));
    }
}
