//! Starting and stopping a live run's worker processes (the same binary, `worker`).
//!
//! No process outlives the launcher: on Linux each child asks the kernel for SIGTERM when its
//! parent dies, and every worker also leaves when its frontend link ends; whatever is still
//! running when [`Workers`] is dropped is killed.

use crate::ids::WorkerId;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The worker processes of a run.
pub struct Workers {
    children: Vec<(WorkerId, Child)>,
}

/// How to start each worker.
pub struct LaunchPlan<'a> {
    pub exe: &'a Path,
    pub frontend: String,
    pub out: PathBuf,
    /// Serve `/metrics` on an ephemeral loopback port.
    pub metrics: bool,
}

impl Workers {
    pub fn spawn(plan: &LaunchPlan<'_>, workers: &[WorkerId]) -> std::io::Result<Self> {
        let mut started = Workers { children: Vec::new() };
        for w in workers {
            let child = spawn_one(plan, *w)?;
            started.children.push((*w, child));
        }
        Ok(started)
    }

    pub fn pids(&self) -> Vec<(WorkerId, u32)> {
        self.children.iter().map(|(w, c)| (*w, c.id())).collect()
    }

    /// Waits up to `within` for every worker to exit; returns how each ended (`None`: still
    /// running, then killed).
    pub fn wait_all(&mut self, within: Duration) -> Vec<(WorkerId, Option<ExitStatus>)> {
        let until = Instant::now() + within;
        let mut ended: Vec<(WorkerId, Option<ExitStatus>)> = Vec::new();
        for (w, child) in &mut self.children {
            let status = loop {
                match child.try_wait() {
                    Ok(Some(s)) => break Some(s),
                    Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break None;
                    }
                }
            };
            ended.push((*w, status));
        }
        self.children.clear();
        ended
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn_one(plan: &LaunchPlan<'_>, w: WorkerId) -> std::io::Result<Child> {
    let mut command = Command::new(plan.exe);
    command
        .arg("worker")
        .arg("--role")
        .arg(w.role.as_str())
        .arg("--index")
        .arg(w.index.to_string())
        .arg("--frontend")
        .arg(&plan.frontend)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--out")
        .arg(&plan.out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if plan.metrics {
        command.arg("--metrics").arg("127.0.0.1:0");
    }
    die_with_parent(&mut command);
    command.spawn()
}

#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the child's own process state.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}
