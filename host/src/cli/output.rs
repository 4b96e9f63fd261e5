//! Where the CLI's machine-readable output goes: `--json FILE` / `--report-json FILE`, with `-`
//! for standard output. Paths are checked before any work starts, so a bad one costs nothing;
//! while a JSON document owns standard output, the human-readable text goes to standard error.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Whether `path` names standard output (`-`).
pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Whether any of `targets` is standard output: then human-readable text goes to stderr.
pub fn json_on_stdout(targets: &[&Option<PathBuf>]) -> bool {
    targets.iter().any(|t| t.as_deref().is_some_and(is_stdout))
}

/// Checks an output path before the work that fills it: `-`, or a file (new or existing, not a
/// folder) in an existing, writable folder. Errors name `flag` and the path.
pub fn check_path(flag: &str, path: &Option<PathBuf>) -> Result<()> {
    let Some(path) = path.as_deref().filter(|p| !is_stdout(p)) else {
        return Ok(());
    };
    let bad = |why: String| Err(Error::Input(format!("{flag} {}: {why}", path.display())));
    if path.is_dir() {
        return bad("is a folder; give a file name".into());
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match std::fs::metadata(dir) {
        Err(_) => bad(format!("the folder {} does not exist", dir.display())),
        Ok(m) if !m.is_dir() => bad(format!("{} is not a folder", dir.display())),
        Ok(_) if !writable(dir) => bad(format!("the folder {} is not writable", dir.display())),
        Ok(_) if path.exists() && !writable(path) => bad("the file is not writable".into()),
        Ok(_) => Ok(()),
    }
}

/// Whether this process may write `path`: `access(2)` with `W_OK`, which knows the user, ACLs
/// and read-only mounts (permission bits alone do not). Elsewhere: assumed.
fn writable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: a NUL-terminated path that outlives the call.
        unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        true
    }
}

/// Writes `doc` as pretty JSON to `path`, or to standard output for `-`.
pub fn write_json(path: &Path, doc: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(doc).map_err(|e| Error::Input(format!("JSON: {e}")))?;
    if is_stdout(path) {
        let mut out = std::io::stdout().lock();
        return writeln!(out, "{text}").map_err(|source| Error::Io { path: path.to_path_buf(), source });
    }
    std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// `-q`: notes (what kiln chose, timing summaries) are not printed; errors, warnings and
/// results are.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, std::sync::atomic::Ordering::Relaxed);
}

pub fn quiet() -> bool {
    QUIET.load(std::sync::atomic::Ordering::Relaxed)
}

/// `note!("format", args…)`: a line on standard error, unless `-q`.
macro_rules! note {
    ($($arg:tt)*) => {
        if !$crate::cli::output::quiet() {
            eprintln!($($arg)*);
        }
    };
}
pub(crate) use note;

/// `say!(human, "format", args…)`: one line of human-readable text through a [`Human`].
macro_rules! say {
    ($human:expr, $($arg:tt)*) => {
        $human.line(&format!($($arg)*))
    };
}
pub(crate) use say;

/// Human-readable output: standard output, or standard error while JSON owns standard output.
#[derive(Clone, Copy)]
pub struct Human {
    to_stderr: bool,
}

impl Human {
    /// Text to stderr when any of `json_targets` is `-`.
    pub fn new(json_targets: &[&Option<PathBuf>]) -> Human {
        Human { to_stderr: json_on_stdout(json_targets) }
    }

    /// Prints `text` as it is (no newline added).
    pub fn print(&self, text: &str) {
        if self.to_stderr {
            eprint!("{text}");
        } else {
            print!("{text}");
            let _ = std::io::stdout().flush();
        }
    }

    /// Prints `text` and a newline.
    pub fn line(&self, text: &str) {
        self.print(&format!("{text}\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_paths_are_checked_before_the_work() {
        let dir = tempfile::tempdir().unwrap();
        assert!(check_path("--json", &None).is_ok());
        assert!(check_path("--json", &Some("-".into())).is_ok());
        assert!(check_path("--json", &Some(dir.path().join("new.json"))).is_ok());
        let e = check_path("--json", &Some(dir.path().join("missing/x.json"))).unwrap_err().to_string();
        assert!(e.contains("--json") && e.contains("does not exist"), "{e}");
        let e = check_path("--report-json", &Some(dir.path().to_path_buf())).unwrap_err().to_string();
        assert!(e.contains("--report-json") && e.contains("is a folder"), "{e}");
        assert!(json_on_stdout(&[&None, &Some("-".into())]));
        assert!(!json_on_stdout(&[&Some(dir.path().join("a.json"))]));
    }
}
