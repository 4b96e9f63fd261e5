//! `.kpkg` archives: a package folder as one file, for registry directories.
//!
//! An archive is a POSIX ustar file (the `tar` crate) holding `kernel.toml` and every file its
//! `[files]` table lists, at their package-relative paths, as regular files, nothing else.
//! [`pack`] writes one deterministically (sorted paths, mtime 0, mode 0644, uid/gid 0), so
//! the same folder always gives the same bytes and the same checksum. [`unpack`] reads one as
//! hostile input: it refuses, naming the entry, anything but a regular file, an absolute path
//! or one with `..`, a duplicate, more than [`MAX_ENTRIES`] entries, an entry over
//! [`MAX_ENTRY_BYTES`] or a total over [`MAX_TOTAL_BYTES`]; then the package is loaded from the
//! entries and every file checked against its sha256 in `kernel.toml`, as a folder is.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Component, Path};

use crate::{Package, RegistryError};

/// Most entries in one archive.
pub const MAX_ENTRIES: usize = 1024;
/// Largest entry, in bytes (64 MiB).
pub const MAX_ENTRY_BYTES: u64 = 64 << 20;
/// Largest sum of the entries, in bytes (256 MiB).
pub const MAX_TOTAL_BYTES: u64 = 256 << 20;

fn bad(origin: &str, why: String) -> RegistryError {
    RegistryError::Archive { origin: origin.to_string(), reason: why }
}

/// The archive of the package folder `dir`: the folder is loaded and verified first (a folder
/// that would not load makes no archive).
pub fn pack(dir: &Path) -> Result<Vec<u8>, RegistryError> {
    let pkg = Package::load_dir(dir)?;
    let origin = dir.display().to_string();
    let mut paths: Vec<&str> = pkg.manifest.files.keys().map(String::as_str).collect();
    paths.push("kernel.toml");
    paths.sort_unstable();
    let mut builder = tar::Builder::new(Vec::new());
    builder.mode(tar::HeaderMode::Deterministic);
    for rel in paths {
        let path = dir.join(rel);
        let data = std::fs::read(&path).map_err(|source| RegistryError::Io { origin: origin.clone(), path, source })?;
        let mut header = tar::Header::new_ustar();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, rel, data.as_slice())
            .map_err(|e| bad(&origin, format!("cannot add {rel}: {e}")))?;
    }
    builder.into_inner().map_err(|e| bad(&origin, format!("cannot finish the archive: {e}")))
}

/// The files of archive `bytes` (path, contents), checked as the module docs say. `origin`
/// names the archive in errors.
pub fn entries(origin: &str, bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
    let mut archive = tar::Archive::new(bytes);
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut seen = BTreeSet::new();
    let mut total = 0u64;
    let iter = archive.entries().map_err(|e| bad(origin, format!("not a tar archive: {e}")))?;
    for entry in iter {
        let mut entry = entry.map_err(|e| bad(origin, format!("unreadable entry: {e}")))?;
        let path = entry.path().map_err(|e| bad(origin, format!("entry with an unreadable path: {e}")))?.into_owned();
        let shown = path.display().to_string();
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(bad(origin, format!("{shown} is not a regular file ({:?})", entry.header().entry_type())));
        }
        let rel = path.to_str().ok_or_else(|| bad(origin, format!("{shown:?} is not UTF-8")))?.to_string();
        // Every segment a plain name: no root, no `.` or `..`, no empty segment (`a//b`), which
        // `Path::components` would normalize away.
        let plain = !rel.is_empty()
            && rel.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..")
            && path.components().all(|c| matches!(c, Component::Normal(_)));
        if !plain {
            return Err(bad(origin, format!("{shown:?} is not a plain relative path")));
        }
        if !seen.insert(rel.clone()) {
            return Err(bad(origin, format!("{rel} appears twice")));
        }
        if seen.len() > MAX_ENTRIES {
            return Err(bad(origin, format!("more than {MAX_ENTRIES} entries")));
        }
        // The entry's size as the reader applies it (a pax `size` record overrides the header).
        let size = entry.size();
        if size > MAX_ENTRY_BYTES {
            return Err(bad(origin, format!("{rel} is {size} bytes, over the {MAX_ENTRY_BYTES}-byte limit")));
        }
        total += size;
        if total > MAX_TOTAL_BYTES {
            return Err(bad(origin, format!("the entries add up to over {MAX_TOTAL_BYTES} bytes")));
        }
        let mut data = Vec::with_capacity((size as usize).min(bytes.len()));
        entry.by_ref().take(size).read_to_end(&mut data).map_err(|e| bad(origin, format!("{rel}: {e}")))?;
        if data.len() as u64 != size {
            return Err(bad(origin, format!("{rel} is truncated ({} of {size} bytes)", data.len())));
        }
        out.push((rel, data));
    }
    Ok(out)
}

/// The verified package in archive `bytes` (see [`entries`]); every entry must be `kernel.toml`
/// or listed in its `[files]`.
pub fn unpack(origin: &str, bytes: &[u8]) -> Result<Package, RegistryError> {
    let files = entries(origin, bytes)?;
    let refs: Vec<(&str, &[u8])> = files.iter().map(|(p, d)| (p.as_str(), d.as_slice())).collect();
    let pkg = Package::load_files(origin, &refs)?;
    if let Some((extra, _)) = files.iter().find(|(p, _)| p != "kernel.toml" && !pkg.manifest.files.contains_key(p)) {
        return Err(bad(origin, format!("{extra} is not listed in [files] of kernel.toml")));
    }
    Ok(pkg)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    pub(crate) fn write_package(dir: &Path, name: &str, version: &str) {
        let shim = b"\0asm\x01\0\0\0";
        std::fs::write(dir.join("shim.wasm"), shim).unwrap();
        let hash = hex::encode(Sha256::digest(shim));
        std::fs::write(
            dir.join("kernel.toml"),
            format!(
                "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"{name}\"\nversion = \"{version}\"\n[[ops]]\nop_types = [\"Relu\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 4\n[files]\n\"shim.wasm\" = \"{hash}\"\n"
            ),
        )
        .unwrap();
    }

    /// A tar of raw entries: (path bytes, type, data), headers written by hand so that the
    /// hostile cases the builder refuses to write can be made.
    fn raw_tar(entries: &[(&[u8], tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_old();
            h.as_old_mut().name[..path.len()].copy_from_slice(path);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(*kind);
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.resize(out.len() + 1024, 0);
        out
    }

    #[test]
    fn a_packed_folder_unpacks_to_the_same_package_and_packs_the_same_bytes() {
        let d = tempfile::tempdir().unwrap();
        write_package(d.path(), "p", "1.2.3");
        let a = pack(d.path()).unwrap();
        assert_eq!(a, pack(d.path()).unwrap(), "deterministic");
        let p = unpack("p.kpkg", &a).unwrap();
        assert_eq!(p.id(), "p@1.2.3");
        assert_eq!(&*p.shim, b"\0asm\x01\0\0\0");
    }

    #[test]
    fn hostile_archives_are_refused_naming_the_entry() {
        let d = tempfile::tempdir().unwrap();
        write_package(d.path(), "p", "1.0.0");
        let toml = std::fs::read(d.path().join("kernel.toml")).unwrap();
        let shim = std::fs::read(d.path().join("shim.wasm")).unwrap();
        let reg = tar::EntryType::Regular;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (raw_tar(&[(b"../kernel.toml", reg, &toml)]), "not a plain relative path"),
            (raw_tar(&[(b"/etc/passwd", reg, b"x")]), "not a plain relative path"),
            (raw_tar(&[(b"cuda//k.cu", reg, b"x")]), "not a plain relative path"),
            (raw_tar(&[(b"cuda/./k.cu", reg, b"x")]), "not a plain relative path"),
            (raw_tar(&[(b"kernel.toml", tar::EntryType::Symlink, b"")]), "not a regular file"),
            (raw_tar(&[(b"kernel.toml", reg, &toml), (b"kernel.toml", reg, &toml)]), "appears twice"),
            (
                raw_tar(&[(b"kernel.toml", reg, &toml), (b"shim.wasm", reg, &shim), (b"extra.bin", reg, b"1")]),
                "extra.bin is not listed",
            ),
            (raw_tar(&[(b"kernel.toml", reg, &toml), (b"shim.wasm", reg, b"\0asm\x02\0\0\0")]), "sha256 of shim.wasm"),
            (raw_tar(&[(b"kernel.toml", reg, &toml)]), "shim.wasm listed in [files] is missing"),
        ];
        for (bytes, needle) in cases {
            let err = unpack("evil.kpkg", &bytes).unwrap_err().to_string();
            assert!(err.contains("evil.kpkg") && err.contains(needle), "{err:?} should say {needle:?}");
        }
        // A truncated archive.
        let good = pack(d.path()).unwrap();
        let err = unpack("cut.kpkg", &good[..700]).unwrap_err().to_string();
        assert!(err.contains("cut.kpkg"), "{err}");
        // An entry that claims more than the limit.
        let mut h = tar::Header::new_ustar();
        h.set_path("kernel.toml").unwrap();
        h.set_size(MAX_ENTRY_BYTES + 1);
        h.set_entry_type(reg);
        h.set_cksum();
        let mut big = h.as_bytes().to_vec();
        big.resize(4096, 0);
        let err = unpack("big.kpkg", &big).unwrap_err().to_string();
        assert!(err.contains("over the"), "{err}");
    }
}
