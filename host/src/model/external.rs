//! External data (ONNX IR, "External Data"): a tensor's bytes in a file beside the model,
//! named by a `location` relative to the model's folder, memory-mapped once per file.
//!
//! A location is refused unless it names a regular file inside the model's folder: empty,
//! absolute, `..` and a directory, device or FIFO are errors naming the tensor and the file.
//! Symbolic links are followed (a Hugging Face cache's snapshot links its files to blobs
//! outside the snapshot's folder); the folder's owner chose them.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;

use crate::Error;

/// Files of external data, memory-mapped once each, relative to the model's folder.
#[derive(Debug, Default)]
pub struct ExternalData {
    base: Option<PathBuf>,
    maps: Mutex<HashMap<PathBuf, Bytes>>,
}

impl ExternalData {
    /// External data resolved against `base` (the model's folder); `None` refuses external data
    /// (a model read from memory, a `.pb` tensor file).
    pub fn new(base: Option<PathBuf>) -> Self {
        ExternalData { base, maps: Mutex::default() }
    }

    /// `length` bytes at `offset` of `location` (the rest of the file when `length` is
    /// `None`). `what` names the tensor in errors (`initializer "W"`). Errors
    /// ([`Error::Model`]): no folder to resolve against, a location `check_location`
    /// refuses, a file that is not a regular file, a range past the file's end;
    /// [`Error::Io`] when the file cannot be opened or mapped.
    pub fn slice(&self, what: &str, location: &str, offset: u64, length: Option<u64>) -> Result<Bytes, Error> {
        let bad = |m: String| Error::Model(format!("{what}: external data {location:?}: {m}"));
        let base = self.base.as_ref().ok_or_else(|| {
            bad("external data is refused here (the model was not loaded from a file, or this is a tensor file)".into())
        })?;
        check_location(location).map_err(bad)?;
        let path = base.join(location);
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        let whole = match maps.get(&path) {
            Some(b) => b.clone(),
            None => {
                let b = map_file(&path).map_err(|e| match e {
                    MapError::NotAFile => bad(format!("{} is not a regular file", path.display())),
                    MapError::Io(source) => Error::Io { path: path.clone(), source },
                })?;
                maps.insert(path.clone(), b.clone());
                b
            }
        };
        let len = whole.len() as u64;
        let length = length.unwrap_or(len.saturating_sub(offset));
        match offset.checked_add(length) {
            Some(end) if end <= len => Ok(whole.slice(offset as usize..end as usize)),
            _ => Err(bad(format!("bytes {offset}..+{length} are past the end of {} ({len} bytes)", path.display()))),
        }
    }
}

/// Checks an external-data `location` before it touches the file system: it must be a
/// non-empty relative path with at least one file name and no `..` (a `.` is harmless).
/// Returns the reason it is refused.
pub(crate) fn check_location(location: &str) -> Result<(), String> {
    if location.is_empty() {
        return Err("the location is empty; it must name a file inside the model's folder".into());
    }
    let path = Path::new(location);
    let mut names = 0;
    for c in path.components() {
        match c {
            Component::Normal(_) => names += 1,
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(
                    "the location must be a relative path inside the model's folder (no '..', not absolute)".into()
                )
            }
        }
    }
    if names == 0 {
        return Err("the location names the model's folder, not a file in it".into());
    }
    Ok(())
}

enum MapError {
    NotAFile,
    Io(std::io::Error),
}

/// Maps `path` read-only, once it is known to be a regular file (opening a FIFO would block,
/// a device could be endless).
fn map_file(path: &Path) -> Result<Bytes, MapError> {
    if !std::fs::metadata(path).map_err(MapError::Io)?.is_file() {
        return Err(MapError::NotAFile);
    }
    // Opened without blocking and checked again as opened: a FIFO swapped in after the first
    // check would otherwise wait for a writer in open(2).
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let file: File = options.open(path).map_err(MapError::Io)?;
    let meta = file.metadata().map_err(MapError::Io)?;
    if !meta.is_file() {
        return Err(MapError::NotAFile);
    }
    if meta.len() == 0 {
        // mmap refuses an empty file; its every range is empty.
        return Ok(Bytes::new());
    }
    // SAFETY: the file is mapped read-only; kiln never writes it, and a model whose data file is
    // changed while it runs is outside what kiln guarantees (as for onnxruntime, which maps it
    // the same way).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(MapError::Io)?;
    Ok(Bytes::from_owner(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_outside_the_folder_or_naming_no_file_are_refused() {
        for (location, reason) in [
            ("", "the location is empty"),
            ("/etc/passwd", "no '..', not absolute"),
            ("../w.bin", "no '..', not absolute"),
            ("data/../../w.bin", "no '..', not absolute"),
            (".", "names the model's folder"),
            ("./", "names the model's folder"),
        ] {
            assert!(check_location(location).is_err_and(|e| e.contains(reason)), "{location:?}");
        }
        for ok in ["w.bin", "./w.bin", "data/w.bin"] {
            assert_eq!(check_location(ok), Ok(()), "{ok:?}");
        }
    }

    #[test]
    fn a_directory_an_empty_location_and_no_folder_name_the_tensor_and_file() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("empty.bin"), b"").unwrap();
        let ext = ExternalData::new(Some(d.path().to_path_buf()));
        let err = |location: &str| match ext.slice("initializer \"W\"", location, 0, Some(4)) {
            Err(Error::Model(m)) => m,
            other => panic!("{location:?}: {other:?}"),
        };
        assert_eq!(
            err(""),
            "initializer \"W\": external data \"\": the location is empty; it must name a file inside the model's folder"
        );
        let sub = d.path().join("sub");
        assert_eq!(
            err("sub"),
            format!("initializer \"W\": external data \"sub\": {} is not a regular file", sub.display())
        );
        let empty = d.path().join("empty.bin");
        assert_eq!(
            err("empty.bin"),
            format!(
                "initializer \"W\": external data \"empty.bin\": bytes 0..+4 are past the end of {} (0 bytes)",
                empty.display()
            )
        );
        assert!(ext.slice("w", "empty.bin", 0, None).unwrap().is_empty());
        // A FIFO would block the open until a writer came; it is refused unopened.
        if std::process::Command::new("mkfifo").arg(d.path().join("fifo")).status().is_ok_and(|s| s.success()) {
            let fifo = d.path().join("fifo");
            assert_eq!(
                err("fifo"),
                format!("initializer \"W\": external data \"fifo\": {} is not a regular file", fifo.display())
            );
        }
        let none = ExternalData::new(None).slice("tensor \"t\"", "w.bin", 0, None).unwrap_err().to_string();
        assert!(
            none.starts_with("invalid model: tensor \"t\": external data \"w.bin\": external data is refused"),
            "{none}"
        );
    }
}
