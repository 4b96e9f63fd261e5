//! The on-disk caches of native code: Cranelift-compiled shims (`sandbox`) and NVRTC CUBINs
//! (`cuda::nvrtc`), under [`cache_dir`].
//!
//! A cache entry becomes code that this process runs (wasmtime's `Module::deserialize` trusts its
//! input; a CUBIN runs on the GPU), so an entry is used only when
//! - its folder and the file itself belong to this user and no one else can write them: another
//!   user who can write there could plant code; and
//! - it is *sealed*: [`MAGIC`], the sha256 of the payload, then the payload. A torn, truncated or
//!   altered file fails the digest and is compiled again.
//!
//! Writes go to a new temporary file in the entry's folder (mode 0600), which is flushed to disk,
//! renamed over the entry, and the folder flushed, so a reader sees the old entry or the whole new
//! one. A cache that cannot be used costs a compile, never a failure: compiling again is always
//! correct.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The first 8 bytes of a sealed entry (format version 1).
pub const MAGIC: &[u8; 8] = b"KILNC\x01\0\0";
const HEADER: usize = MAGIC.len() + 32;

/// The cache folder: `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`, else
/// `kiln` in the temporary folder.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("kiln")
}

/// Makes `dir` (and its parents; new folders get mode 0700) and checks that it may hold native
/// code: a folder owned by this user that its group and others cannot write. A folder of this
/// user's that they may write (made by an older kiln under umask 002) loses those bits first:
/// every entry is still checked on its own. Errors: why not, for a warning (the caller then
/// compiles without the cache).
pub fn private_dir(dir: &Path) -> Result<(), String> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let md = std::fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !md.is_dir() {
        return Err(format!("{} is not a folder", dir.display()));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // SAFETY: geteuid has no preconditions and cannot fail.
        if md.uid() == unsafe { libc::geteuid() } && md.mode() & 0o022 != 0 {
            let mode = md.mode() & 0o7777 & !0o022;
            if std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).is_ok() {
                tracing::info!(folder = %dir.display(), "cache folder: group and others may no longer write it");
            }
            let md = std::fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
            return owner_only(&md).map_err(|why| format!("cache folder {}: {why}", dir.display()));
        }
    }
    owner_only(&md).map_err(|why| format!("cache folder {}: {why}", dir.display()))
}

/// The file or folder belongs to this process's effective user and only it may write it.
#[cfg(unix)]
fn owner_only(md: &std::fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(format!("it belongs to user {}, and this process runs as user {me}", md.uid()));
    }
    if md.mode() & 0o022 != 0 {
        return Err(format!("its group or other users may write it (mode {:o})", md.mode() & 0o7777));
    }
    Ok(())
}

#[cfg(not(unix))]
fn owner_only(_: &std::fs::Metadata) -> Result<(), String> {
    Ok(())
}

/// Logs why a cache is not used (see [`private_dir`]), once per reason and process.
pub fn warn_unusable(why: &str) {
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if !warned.iter().any(|w| w == why) {
        warned.push(why.to_string());
        tracing::warn!("{why}; compiling without the cache");
    }
}

/// The payload of the sealed entry at `path`: `Ok(None)` when there is none, `Err(why)` when
/// the file may not be used (not a regular file, not this user's, writable by others, not
/// sealed, or its digest does not match), so that the caller compiles again and replaces it.
pub fn read_sealed(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if !md.is_file() {
        return Err("not a regular file".into());
    }
    owner_only(&md)?;
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if bytes.len() < HEADER || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a sealed kiln cache entry".into());
    }
    if Sha256::digest(&bytes[HEADER..]).as_slice() != &bytes[MAGIC.len()..HEADER] {
        return Err("its sha256 does not match its contents (a torn or altered file)".into());
    }
    Ok(Some(bytes[HEADER..].to_vec()))
}

/// Writes `payload` sealed at `path`, atomically (see the module documentation). The folder
/// must exist (see [`private_dir`]).
pub fn write_sealed(path: &Path, payload: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = dir.join(format!(".{stem}.{}.{nanos}.tmp", std::process::id()));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = (|| {
        let mut f = options.open(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&Sha256::digest(payload))?;
        f.write_all(payload)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself reaches the disk with the folder.
        std::fs::File::open(dir).and_then(|d| d.sync_all()).or(Ok(()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_entry_reads_back_and_any_change_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.bin");
        assert_eq!(read_sealed(&path), Ok(None));
        write_sealed(&path, b"payload bytes").unwrap();
        assert_eq!(read_sealed(&path), Ok(Some(b"payload bytes".to_vec())));
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(read_sealed(&path).unwrap_err().contains("sha256"));
        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        assert!(read_sealed(&path).unwrap_err().contains("sha256"));
        std::fs::write(&path, &good[..10]).unwrap();
        assert!(read_sealed(&path).unwrap_err().contains("not a sealed"));
        // Rewriting replaces it whole, and leaves no temporary file behind.
        write_sealed(&path, b"other").unwrap();
        assert_eq!(read_sealed(&path), Ok(Some(b"other".to_vec())));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[cfg(unix)]
    #[test]
    fn entries_and_folders_others_may_write_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("a/b");
        private_dir(&cache).unwrap();
        assert_eq!(std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777, 0o700);
        let path = cache.join("e.bin");
        write_sealed(&path, b"x").unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(read_sealed(&path).unwrap_err().contains("may write it"));
        // This user's folder that others may write is tightened, then used.
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&cache).unwrap();
        assert_eq!(std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777, 0o755);
        // Another user's folder is refused (making one needs root: chown).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = dir.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            let c = std::ffi::CString::new(theirs.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 12345, 12345) }, 0);
            assert!(private_dir(&theirs).unwrap_err().contains("belongs to user 12345"), "refused");
        }
        // A symbolic link is not an entry, even to a good one.
        write_sealed(&path, b"x").unwrap();
        std::os::unix::fs::symlink(&path, cache.join("link.bin")).unwrap();
        assert_eq!(read_sealed(&cache.join("link.bin")), Err("not a regular file".into()));
    }
}
