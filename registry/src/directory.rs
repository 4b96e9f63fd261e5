//! Registry directories: folders that publishers add `.kpkg` archives to and runs load packages
//! from. The format is specified in `docs/REGISTRY.md`; in short:
//!
//! ```text
//! REGISTRY/
//!   .lock                              taken (flock) by every writer
//!   index/NAME                         one JSON line per published version, oldest first
//!   packages/NAME/NAME-VERSION.kpkg    the archives
//! ```
//!
//! Writers take the lock, write the new file beside its final name, fsync it, rename it over
//! the final name and fsync the folder, so a reader sees the old index or the new one, never a
//! torn line, and a publisher killed mid-write leaves at most an orphaned temporary file or an
//! archive no index line names (a later publish of that version replaces it). Readers take no
//! lock. Loading checks each archive's sha256 against its index line and the manifest inside
//! against the line's name, version and ABI.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use kiln_kernel_abi::manifest::{DeviceRequirements, OpEntry};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{archive, Package, RegistryError};

/// One published version: a line of `index/NAME` (docs/REGISTRY.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexLine {
    pub name: String,
    pub vers: semver::Version,
    /// The kernel ABI of the package's shim.
    pub abi: u32,
    /// sha256 of the archive, lower-case hex.
    pub cksum: String,
    /// The manifest's `[[ops]]`, so that a search needs no archive.
    pub ops: Vec<OpEntry>,
    /// The manifest's `[device]`.
    pub device: DeviceRequirements,
    /// The manifest's `[dependencies]` (schema 4): packages whose headers its sources include.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub deps: std::collections::BTreeMap<String, semver::VersionReq>,
    /// A yanked version stays readable but is not chosen for new runs.
    pub yanked: bool,
    /// The publisher's signature (`crate::signing`), when the version was published signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<crate::signing::LineSignature>,
}

impl IndexLine {
    /// `name@version`.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.vers)
    }

    /// Whether one of its op entries provides `op` (`OP` in any domain, or `DOMAIN::OP`).
    pub fn provides(&self, op: &str) -> bool {
        let (domain, op_type) = match op.rsplit_once("::") {
            Some((d, o)) => (Some(crate::normalize_domain(d)), o),
            None => (None, op),
        };
        self.ops.iter().any(|e| {
            e.op_types.iter().any(|t| t == op_type) && domain.is_none_or(|d| crate::normalize_domain(&e.domain) == d)
        })
    }
}

/// Parses the index file of package `name` (read from `path`, which errors name): one JSON
/// [`IndexLine`] per non-blank line, oldest first. Errors ([`RegistryError::Index`], with the
/// line number; 0 for the whole file): text that is not UTF-8, a line that does not parse, a
/// line naming another package, a `cksum` that is not 64 lower-case hex digits, a version
/// listed twice. A signature is not verified here ([`crate::signing::verify`] does, at load).
pub fn parse_index(name: &str, path: &Path, bytes: &[u8]) -> Result<Vec<IndexLine>, RegistryError> {
    let bad = |line: usize, reason: String| RegistryError::Index { path: path.to_path_buf(), line, reason };
    let text = std::str::from_utf8(bytes).map_err(|_| bad(0, "not UTF-8 text".into()))?;
    let mut out: Vec<IndexLine> = Vec::new();
    // A set, so that a 64 MiB index of distinct versions is not a quadratic scan.
    let mut seen = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let parsed: IndexLine = serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        if parsed.name != name {
            return Err(bad(i + 1, format!("names package {:?} in the index of {name:?}", parsed.name)));
        }
        if parsed.cksum.len() != 64 || !parsed.cksum.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(bad(i + 1, format!("cksum {:?} is not 64 lower-case hex digits", parsed.cksum)));
        }
        if !seen.insert(parsed.vers.clone()) {
            return Err(bad(i + 1, format!("version {} appears twice", parsed.vers)));
        }
        out.push(parsed);
    }
    Ok(out)
}

/// Largest index file a reader takes (64 MiB: some 100,000 versions).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// A registry directory (module docs).
#[derive(Clone, Debug)]
pub struct RegistryDir {
    pub root: PathBuf,
}

impl RegistryDir {
    pub fn new(root: impl Into<PathBuf>) -> RegistryDir {
        RegistryDir { root: root.into() }
    }

    fn origin(&self) -> String {
        self.root.display().to_string()
    }

    fn io(&self, path: &Path) -> impl Fn(std::io::Error) -> RegistryError + '_ {
        let path = path.to_path_buf();
        move |source| RegistryError::Io { origin: self.origin(), path: path.clone(), source }
    }

    fn index_path(&self, name: &str) -> PathBuf {
        self.root.join("index").join(name)
    }

    fn refuse(&self, reason: String) -> RegistryError {
        RegistryError::Registry { registry: self.origin(), reason }
    }

    fn check_name(&self, name: &str) -> Result<(), RegistryError> {
        if kiln_kernel_abi::manifest::is_package_name(name) {
            Ok(())
        } else {
            Err(self.refuse(format!("{name:?} is not a package name (1 to 64 characters of a-z, 0-9, '-', '_')")))
        }
    }

    /// The bytes of `path`, refused past `limit` bytes before they are read.
    fn read_limited(&self, path: &Path, limit: u64) -> Result<Vec<u8>, RegistryError> {
        let len = std::fs::metadata(path).map_err(self.io(path))?.len();
        if len > limit {
            return Err(self.refuse(format!("{} is {len} bytes, over the {limit}-byte limit", path.display())));
        }
        std::fs::read(path).map_err(self.io(path))
    }

    /// Where the archive of `name@vers` lives.
    pub fn archive_path(&self, name: &str, vers: &semver::Version) -> PathBuf {
        self.root.join("packages").join(name).join(format!("{name}-{vers}.kpkg"))
    }

    /// The exclusive writer lock, held until the returned file is dropped (or the process dies).
    fn lock(&self) -> Result<File, RegistryError> {
        std::fs::create_dir_all(&self.root).map_err(self.io(&self.root))?;
        let path = self.root.join(".lock");
        let f = OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(self.io(&path))?;
        f.lock().map_err(self.io(&path))?;
        Ok(f)
    }

    /// The published versions of `name`, oldest first; none when it was never published.
    /// Errors: an unreadable index or a line that does not parse (file and line named).
    pub fn versions(&self, name: &str) -> Result<Vec<IndexLine>, RegistryError> {
        self.check_name(name)?;
        let path = self.index_path(name);
        if !path.exists() {
            return Ok(Vec::new());
        }
        let bytes = self.read_limited(&path, MAX_INDEX_BYTES)?;
        parse_index(name, &path, &bytes)
    }

    /// Every package name with an index file, sorted.
    pub fn names(&self) -> Result<Vec<String>, RegistryError> {
        let dir = self.root.join("index");
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.root.is_dir() => return Ok(Vec::new()),
            Err(e) => return Err(self.io(&dir)(e)),
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| kiln_kernel_abi::manifest::is_package_name(n))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Publishes archive `bytes` (a `.kpkg`, see [`archive`]): the archive is verified, then
    /// written with its index line under the lock. Errors: a bad archive; a version that is
    /// already published (republishing is refused, yanked or not); I/O.
    pub fn publish(&self, origin: &str, bytes: &[u8]) -> Result<IndexLine, RegistryError> {
        self.publish_signed(origin, bytes, None)
    }

    /// [`RegistryDir::publish`], the index line signed with `key` when given
    /// (`crate::signing`).
    pub fn publish_signed(
        &self,
        origin: &str,
        bytes: &[u8],
        key: Option<&crate::signing::SecretKey>,
    ) -> Result<IndexLine, RegistryError> {
        let pkg = archive::unpack(origin, bytes)?;
        let m = &pkg.manifest;
        let mut line = IndexLine {
            name: m.package.name.clone(),
            vers: m.package.version.clone(),
            abi: m.abi,
            cksum: hex::encode(Sha256::digest(bytes)),
            ops: m.ops.clone(),
            device: m.device.clone(),
            deps: m.dependencies.clone(),
            yanked: false,
            signature: None,
        };
        if let Some(key) = key {
            crate::signing::sign(&mut line, key);
        }
        let _lock = self.lock()?;
        let mut lines = self.versions(&line.name)?;
        if lines.iter().any(|l| l.vers == line.vers) {
            return Err(RegistryError::AlreadyPublished { registry: self.origin(), id: line.id() });
        }
        // Archive names must not collide on a case-insensitive file system (1.0.0-RC, 1.0.0-rc).
        let shown = line.vers.to_string();
        if let Some(l) = lines.iter().find(|l| l.vers.to_string().eq_ignore_ascii_case(&shown)) {
            return Err(self.refuse(format!("{} differs from the published {} only in case", line.id(), l.id())));
        }
        let archive_path = self.archive_path(&line.name, &line.vers);
        self.write_atomically(&archive_path, bytes)?;
        lines.push(line.clone());
        self.write_index(&line.name, &lines)?;
        Ok(line)
    }

    /// Marks `name@vers` yanked (or not): it stays loadable by exact version but is no longer
    /// chosen. Errors: no such version; I/O.
    pub fn yank(&self, name: &str, vers: &semver::Version, yanked: bool) -> Result<IndexLine, RegistryError> {
        self.check_name(name)?;
        if !self.root.is_dir() {
            return Err(self.refuse("no such registry directory".into()));
        }
        let _lock = self.lock()?;
        let mut lines = self.versions(name)?;
        let Some(l) = lines.iter_mut().find(|l| &l.vers == vers) else {
            return Err(RegistryError::NotPublished { registry: self.origin(), id: format!("{name}@{vers}") });
        };
        l.yanked = yanked;
        let out = l.clone();
        self.write_index(name, &lines)?;
        Ok(out)
    }

    /// Every index line, of every package, that provides `op` (see [`IndexLine::provides`]).
    pub fn search(&self, op: &str) -> Result<Vec<IndexLine>, RegistryError> {
        let mut out = Vec::new();
        for name in self.names()? {
            out.extend(self.versions(&name)?.into_iter().filter(|l| l.provides(op)));
        }
        Ok(out)
    }

    /// The package of one index line, its archive checked against the line's checksum and its
    /// manifest against the line's name, version and ABI.
    pub fn load(&self, line: &IndexLine) -> Result<Package, RegistryError> {
        self.check_name(&line.name)?;
        let path = self.archive_path(&line.name, &line.vers);
        let limit = archive::MAX_TOTAL_BYTES + (archive::MAX_ENTRIES as u64 + 2) * 1024;
        let bytes = self.read_limited(&path, limit)?;
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != line.cksum {
            return Err(RegistryError::Tampered { path, expected: line.cksum.clone(), actual });
        }
        let pkg = archive::unpack(&path.display().to_string(), &bytes)?;
        let m = &pkg.manifest;
        if (m.package.name.as_str(), &m.package.version, m.abi) != (line.name.as_str(), &line.vers, line.abi) {
            let reason = format!(
                "the archive holds {}@{} (ABI {}) but its index line says {} (ABI {})",
                m.package.name,
                m.package.version,
                m.abi,
                line.id(),
                line.abi
            );
            return Err(RegistryError::Archive { origin: path.display().to_string(), reason });
        }
        if m.dependencies != line.deps {
            let reason = format!(
                "the archive's [dependencies] {:?} differ from its index line's {:?}",
                m.dependencies, line.deps
            );
            return Err(RegistryError::Archive { origin: path.display().to_string(), reason });
        }
        let mut pkg = pkg;
        pkg.signer = crate::signing::verify(line)
            .map_err(|reason| RegistryError::Archive { origin: path.display().to_string(), reason })?
            .map(|k| k.to_string());
        Ok(pkg)
    }

    /// `name@version` whether yanked or not (a lock may pin a yanked version), or `None` when
    /// the registry does not have it.
    pub fn load_exact(&self, name: &str, version: &semver::Version) -> Result<Option<Package>, RegistryError> {
        if !self.root.is_dir() || !kiln_kernel_abi::manifest::is_package_name(name) {
            return Ok(None);
        }
        let lines = match self.versions(name) {
            Ok(l) => l,
            Err(_) if !self.index_path(name).exists() => return Ok(None),
            Err(e) => return Err(e),
        };
        lines.iter().find(|l| &l.vers == version).map(|l| self.load(l)).transpose()
    }

    /// Every version that is not yanked and whose ABI this host speaks, loaded; each result on
    /// its own, so that one bad archive does not hide the others. Failures are
    /// [`RegistryError::Published`], but a root that is not a folder, which is
    /// [`RegistryError::Registry`].
    pub fn load_all(&self) -> Vec<Result<Package, RegistryError>> {
        if !self.root.is_dir() {
            // A mistyped --registry is the user's error, not a bad upload: not skipped.
            return vec![Err(self.refuse("no such registry directory".into()))];
        }
        let wrap = |e: RegistryError| RegistryError::Published { registry: self.origin(), source: Box::new(e) };
        let names = match self.names() {
            Ok(n) => n,
            Err(e) => return vec![Err(wrap(e))],
        };
        let mut out = Vec::new();
        for name in names {
            match self.versions(&name) {
                Ok(lines) => out.extend(
                    lines
                        .iter()
                        .filter(|l| !l.yanked && crate::package::SUPPORTED_ABI.contains(&l.abi))
                        .map(|l| self.load(l).map_err(wrap)),
                ),
                Err(e) => out.push(Err(wrap(e))),
            }
        }
        out
    }

    fn write_index(&self, name: &str, lines: &[IndexLine]) -> Result<(), RegistryError> {
        let mut text = String::new();
        for l in lines {
            let json = serde_json::to_string(l).map_err(|e| RegistryError::Index {
                path: self.index_path(name),
                line: 0,
                reason: e.to_string(),
            })?;
            text.push_str(&json);
            text.push('\n');
        }
        self.write_atomically(&self.index_path(name), text.as_bytes())
    }

    /// Writes `bytes` to a temporary file beside `path`, fsyncs it, renames it to `path` and
    /// fsyncs the folder (and the folders above it up to the root, which may be new). A failed
    /// write removes its temporary file.
    fn write_atomically(&self, path: &Path, bytes: &[u8]) -> Result<(), RegistryError> {
        let dir = path.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(dir).map_err(self.io(dir))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let tmp = dir.join(format!(".{file_name}.{}.{nanos}.tmp", std::process::id()));
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(bytes).and_then(|_| f.sync_all()))
            .and_then(|_| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(self.io(path)(e));
        }
        let mut d = Some(dir);
        while let Some(folder) = d {
            File::open(folder).and_then(|f| f.sync_all()).map_err(self.io(folder))?;
            d = folder.parent().filter(|_| folder != self.root.as_path());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive_of(name: &str, version: &str) -> Vec<u8> {
        let d = tempfile::tempdir().unwrap();
        archive::tests::write_package(d.path(), name, version);
        archive::pack(d.path()).unwrap()
    }

    #[test]
    fn publish_search_yank_and_load() {
        let r = tempfile::tempdir().unwrap();
        let reg = RegistryDir::new(r.path());
        assert!(reg.names().unwrap().is_empty());
        for v in ["1.0.0", "1.1.0"] {
            let line = reg.publish("p.kpkg", &archive_of("p", v)).unwrap();
            assert_eq!(line.id(), format!("p@{v}"));
        }
        let err = reg.publish("p.kpkg", &archive_of("p", "1.1.0")).unwrap_err().to_string();
        assert!(err.contains("p@1.1.0 is already published"), "{err}");
        assert_eq!(reg.search("Relu").unwrap().len(), 2);
        assert_eq!(reg.search("ai.onnx::Relu").unwrap().len(), 2);
        assert!(reg.search("com.microsoft::Relu").unwrap().is_empty());
        reg.yank("p", &"1.1.0".parse().unwrap(), true).unwrap();
        let loaded: Vec<String> = reg.load_all().into_iter().map(|p| p.unwrap().id()).collect();
        assert_eq!(loaded, vec!["p@1.0.0"]);
        assert!(reg
            .yank("p", &"9.0.0".parse().unwrap(), true)
            .unwrap_err()
            .to_string()
            .contains("p@9.0.0 is not published"));
    }

    #[test]
    fn a_tampered_archive_or_index_line_is_refused_naming_the_file() {
        let r = tempfile::tempdir().unwrap();
        let reg = RegistryDir::new(r.path());
        let line = reg.publish("p.kpkg", &archive_of("p", "1.0.0")).unwrap();
        let path = reg.archive_path("p", &line.vers);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n / 3] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = reg.load(&line).unwrap_err().to_string();
        assert!(err.contains("p-1.0.0.kpkg") && err.contains("sha256"), "{err}");
        // A torn index line.
        let index = r.path().join("index/p");
        let text = std::fs::read_to_string(&index).unwrap();
        std::fs::write(&index, &text[..text.len() / 2]).unwrap();
        let err = reg.versions("p").unwrap_err().to_string();
        assert!(err.contains("index/p") && err.contains("line 1"), "{err}");
    }

    #[test]
    fn an_index_of_many_versions_parses_and_a_repeated_one_is_named() {
        let line = |v: &str| {
            format!(
                r#"{{"name":"p","vers":"{v}","abi":1,"cksum":"{}","ops":[],"device":{{}},"yanked":false}}"#,
                "0".repeat(64)
            )
        };
        let text: String = (0..20_000).map(|i| line(&format!("1.0.{i}")) + "\n").collect();
        let path = Path::new("index/p");
        assert_eq!(parse_index("p", path, text.as_bytes()).unwrap().len(), 20_000);
        let repeated = format!("{}\n\n{}\n", line("1.0.0"), line("1.0.0"));
        let err = parse_index("p", path, repeated.as_bytes()).unwrap_err().to_string();
        assert_eq!(err, "index/p: line 3: version 1.0.0 appears twice");
        let err = parse_index("q", path, line("1.0.0").as_bytes()).unwrap_err().to_string();
        assert_eq!(err, "index/p: line 1: names package \"p\" in the index of \"q\"");
        let err = parse_index("p", path, b"\xff").unwrap_err().to_string();
        assert_eq!(err, "index/p: line 0: not UTF-8 text");
    }
}
