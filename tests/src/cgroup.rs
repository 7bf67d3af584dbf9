//! A real memory cap for a process under test: a child of this process's
//! cgroup (v1 `memory` controller, or v2) with a hard limit. The kernel
//! OOM-kills the capped process when it goes over, exactly as a container
//! runtime would enforce a pod's memory limit.

use std::path::PathBuf;

/// A memory cgroup with a limit, removed on drop.
pub struct MemoryCap {
    dir: PathBuf,
    v2: bool,
}

fn own_cgroup() -> Option<(PathBuf, bool)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            let base = PathBuf::from("/sys/fs/cgroup/memory");
            return Some((base.join(path.trim_start_matches('/')), false));
        }
    }
    // cgroup v2: one hierarchy, "0::/path".
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = PathBuf::from("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    dir.join("memory.max").exists().then_some((dir, true))
}

impl MemoryCap {
    /// A new cgroup capped at `bytes`, or why one cannot be made here.
    pub fn new(bytes: u64) -> Result<MemoryCap, String> {
        let (parent, v2) =
            own_cgroup().ok_or("no memory cgroup controller for this process".to_owned())?;
        let dir = parent.join(crate::unique("outbox-cap"));
        std::fs::create_dir(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let cap = MemoryCap { dir, v2 };
        if v2 {
            cap.write("memory.max", &bytes.to_string())?;
            cap.write("memory.swap.max", "0").ok();
        } else {
            cap.write("memory.limit_in_bytes", &bytes.to_string())?;
            // No swap to escape into, where the kernel accounts it.
            cap.write("memory.memsw.limit_in_bytes", &bytes.to_string())
                .ok();
        }
        Ok(cap)
    }

    fn write(&self, file: &str, value: &str) -> Result<(), String> {
        std::fs::write(self.dir.join(file), value)
            .map_err(|e| format!("write {value} to {}/{file}: {e}", self.dir.display()))
    }

    /// Moves process `pid` into the cgroup.
    pub fn add(&self, pid: i32) -> Result<(), String> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Highest memory use the kernel charged to the cgroup, in bytes.
    pub fn peak_bytes(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// How many processes the kernel OOM-killed in the cgroup.
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for MemoryCap {
    fn drop(&mut self) {
        // Anything still inside goes back to the parent first.
        if let (Ok(procs), Some(parent)) = (
            std::fs::read_to_string(self.dir.join("cgroup.procs")),
            self.dir.parent(),
        ) {
            for pid in procs.lines() {
                let _ = std::fs::write(parent.join("cgroup.procs"), pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
