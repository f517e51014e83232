//! A pipeline's output directory: what a run writes there, and clearing an earlier run.

use std::path::Path;

use crate::error::{PipelineError, Result};

/// Removes an earlier run's checkpoints, TensorBoard events, `training_log.txt`,
/// `trainer_state.json` and the pipeline's own files named in `also` (never the teacher
/// cache).
pub fn clear_run(out: &Path, also: &[&str]) -> Result<()> {
    let entries = std::fs::read_dir(out).map_err(|e| PipelineError::io(out, e))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let ours = name.starts_with("checkpoint-")
            || name == "runs"
            || ["training_log.txt", kd_train::checkpoint::TRAINER_STATE_FILE]
                .contains(&name.as_str())
            || also.contains(&name.as_str());
        if !ours {
            continue;
        }
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| PipelineError::io(&path, e))?;
    }
    Ok(())
}

/// The lock file a run holds in its output directory ([`RunLock`]).
pub const LOCK_FILE: &str = ".kd-run.lock";

/// An exclusive lock on an output directory for the lifetime of a run: a second run into the
/// same directory is refused with the holder's PID and host. It is the operating system's
/// advisory file lock (`flock` on Unix, `LockFileEx` on Windows), so a holder that dies, even
/// by SIGKILL, releases it; the file itself stays, harmless.
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

/// `PID p on host h, started at t` as written in the lock file.
fn holder_line() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into());
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{} {host} {started}", std::process::id())
}

/// The holder as a phrase, from the lock file's line.
fn describe_holder(line: &str) -> String {
    let mut parts = line.split_whitespace();
    let (Some(pid), Some(host), Some(started)) = (parts.next(), parts.next(), parts.next()) else {
        return "a run whose PID is not recorded yet".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let ago = started
        .parse::<u64>()
        .map(|s| format!(", started {} s ago", now.saturating_sub(s)))
        .unwrap_or_default();
    format!("PID {pid} on {host}{ago}")
}

/// Checks that `out` can be an output directory: absent, or a directory.
fn check_dir(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(PipelineError::OutputDir {
            path: out.to_path_buf(),
            message: "is a file, not a directory: choose another output directory".into(),
        });
    }
    Ok(())
}

/// Checks, writing nothing that stays, that `out` can be created and written: a file is
/// created and removed in `out`, or in its nearest existing ancestor when `out` is missing.
fn check_writable(out: &Path) -> Result<()> {
    let existing = out
        .ancestors()
        .find(|a| a.as_os_str().is_empty() || a.exists())
        .map(|a| {
            if a.as_os_str().is_empty() {
                Path::new(".")
            } else {
                a
            }
        })
        .unwrap_or(Path::new("."));
    let refuse = |why: String| PipelineError::OutputDir {
        path: out.to_path_buf(),
        message: format!("cannot be written: {why}; choose another output directory"),
    };
    if !existing.is_dir() {
        return Err(refuse(format!("{} is not a directory", existing.display())));
    }
    let probe = existing.join(format!(".kd-write-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(refuse(format!(
            "creating a file in {} fails ({e})",
            existing.display()
        ))),
    }
}

impl RunLock {
    /// Creates `out` when missing and locks it; an error naming the holder when another
    /// process holds the lock, or naming `out` when it is a file or cannot be written.
    pub fn acquire(out: &Path) -> Result<Self> {
        use std::io::{Read, Seek, Write};
        check_dir(out)?;
        std::fs::create_dir_all(out).map_err(|e| PipelineError::OutputDir {
            path: out.to_path_buf(),
            message: format!("cannot be created ({e}): choose another output directory"),
        })?;
        let path = out.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| PipelineError::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut line = String::new();
                let _ = file.read_to_string(&mut line);
                return Err(PipelineError::OutputDir {
                    path: out.to_path_buf(),
                    message: format!(
                        "is in use by another run ({}): wait for it to end or stop it, or \
                         choose another output directory",
                        describe_holder(&line)
                    ),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(PipelineError::io(&path, e)),
        }
        let written = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(holder_line().as_bytes()))
            .and_then(|()| file.flush());
        written.map_err(|e| PipelineError::io(&path, e))?;
        Ok(Self { _file: file })
    }

    /// For dry runs: who holds the lock on `out` now, if anyone (`None` also when `out` or
    /// its lock file does not exist). Takes no lock that outlives the call. An error when
    /// `out` is a file or cannot be created or written (checked with a file created and
    /// removed at once).
    pub fn holder(out: &Path) -> Result<Option<String>> {
        use std::io::Read;
        check_dir(out)?;
        check_writable(out)?;
        let path = out.join(LOCK_FILE);
        let Ok(mut file) = std::fs::File::open(&path) else {
            return Ok(None);
        };
        match file.try_lock_shared() {
            Ok(()) => Ok(None),
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut line = String::new();
                let _ = file.read_to_string(&mut line);
                Ok(Some(describe_holder(&line)))
            }
            Err(std::fs::TryLockError::Error(e)) => Err(PipelineError::io(&path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::*;

    /// Set in the child process of the SIGKILL case: the directory it locks.
    const CHILD_ENV: &str = "KD_TEST_RUN_LOCK_CHILD";

    #[test]
    fn a_second_run_is_refused_until_the_first_ends() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        assert_eq!(RunLock::holder(&out).unwrap(), None);
        let first = RunLock::acquire(&out).unwrap();
        let me = format!("PID {}", std::process::id());
        let held = RunLock::holder(&out).unwrap().unwrap();
        assert!(held.contains(&me), "{held}");
        let e = RunLock::acquire(&out).unwrap_err().to_string();
        assert!(
            e.contains("in use by another run") && e.contains(&me),
            "{e}"
        );
        drop(first);
        assert_eq!(RunLock::holder(&out).unwrap(), None);
        drop(RunLock::acquire(&out).unwrap());
        // clear_run leaves the lock file alone.
        clear_run(&out, &[]).unwrap();
        assert!(out.join(LOCK_FILE).is_file());
        // A file where the directory should be.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = RunLock::acquire(&file).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
        assert!(RunLock::holder(&file).is_err());
        // Under a file, or where nothing can be created: refused by the dry run's check too.
        let under = file.join("out");
        for e in [
            RunLock::acquire(&under),
            RunLock::holder(&under).map(|_| unreachable!()),
        ] {
            let e = e.unwrap_err().to_string();
            assert!(
                e.contains(under.to_str().unwrap()) && e.contains("cannot be"),
                "{e}"
            );
        }
        let proc_dir = Path::new("/proc/kd-no-such-dir/out");
        if cfg!(target_os = "linux") {
            let e = RunLock::holder(proc_dir).unwrap_err().to_string();
            assert!(e.contains("cannot be written"), "{e}");
        }
        // The probe leaves nothing behind.
        let fine = dir.path().join("new/out");
        assert_eq!(RunLock::holder(&fine).unwrap(), None);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    #[test]
    fn a_killed_holder_releases_the_lock() {
        if let Ok(dir) = std::env::var(CHILD_ENV) {
            let dir = Path::new(&dir);
            let _lock = RunLock::acquire(dir).unwrap();
            std::fs::write(dir.join("locked"), b"").unwrap();
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "output_dir::tests::a_killed_holder_releases_the_lock",
            ])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !dir.path().join("locked").exists() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the child never locked"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "the child exited early"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let e = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(e.contains(&format!("PID {}", child.id())), "{e}");
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        drop(RunLock::acquire(dir.path()).unwrap());
    }
}
