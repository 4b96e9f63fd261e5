//! `kiln.lock`: the exact kernel packages a model's runs may use, each pinned by name, version
//! and the digest of its manifest (whose `[files]` table holds every file's sha256, so the
//! digest covers the whole package). `kiln lock MODEL` writes one for the packages the model's
//! nodes resolve to; `--lock FILE` makes a run use exactly those packages or fail, naming the
//! one that is missing or differs.
//!
//! ```toml
//! version = 1
//!
//! [[package]]
//! name = "kiln-matmul"
//! version = "1.1.0"
//! source = "builtin:matmul"                     # where it was found (for the reader)
//! digest = "…"                                  # sha256 of the manifest, as TOML
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{OpRegistry, Package};

/// The lock file format version this host reads and writes.
pub const LOCK_VERSION: u32 = 1;

/// A `kiln.lock` (module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    pub version: u32,
    #[serde(default)]
    pub package: Vec<Locked>,
}

/// One pinned package.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Locked {
    pub name: String,
    pub version: semver::Version,
    /// Where the package was found when the lock was written (informational).
    pub source: String,
    /// [`digest`] of the package.
    pub digest: String,
}

/// sha256 of the package's manifest rendered as TOML, lower-case hex: it changes when any of
/// the package's files (their hashes are in `[files]`) or its declarations change.
pub fn digest(p: &Package) -> String {
    hex::encode(Sha256::digest(p.manifest.to_toml().as_bytes()))
}

impl Lock {
    /// A lock of `packages`, sorted by name.
    pub fn of<'a>(packages: impl IntoIterator<Item = &'a Package>) -> Lock {
        let mut package: Vec<Locked> = packages
            .into_iter()
            .map(|p| Locked {
                name: p.name().to_string(),
                version: p.version().clone(),
                source: p.origin.clone(),
                digest: digest(p),
            })
            .collect();
        package.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
        package.dedup_by(|a, b| a.name == b.name && a.version == b.version);
        Lock { version: LOCK_VERSION, package }
    }

    /// Reads `path`. Errors name the file: unreadable, not TOML of this format, another version.
    pub fn read(path: &Path) -> Result<Lock, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let lock: Lock = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if lock.version != LOCK_VERSION {
            return Err(format!(
                "{}: lock format {} (this kiln reads {LOCK_VERSION}); write it again with `kiln lock`",
                path.display(),
                lock.version
            ));
        }
        Ok(lock)
    }

    /// The lock as TOML, with a header comment.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).unwrap_or_default();
        format!("# kiln.lock: the kernel packages this model's runs may use (`kiln lock` writes it, `--lock` enforces it)\n{body}")
    }

    /// Leaves in `reg` exactly the locked packages. Errors: a locked package that is not
    /// available, or whose digest differs (the text names it, where it was and is, and the
    /// digests).
    pub fn apply(&self, reg: &mut OpRegistry) -> Result<(), String> {
        for l in &self.package {
            let Some(p) = reg.packages().find(|p| p.name() == l.name && p.version() == &l.version) else {
                let there: Vec<String> = reg
                    .packages()
                    .filter(|p| p.name() == l.name)
                    .map(|p| format!("{} ({})", p.version(), p.origin))
                    .collect();
                let there = reg.versions_note(&l.name, &there, "no version is available");
                return Err(format!(
                    "the lock pins {}@{} (from {}), which is not available; {there}",
                    l.name, l.version, l.source
                ));
            };
            let d = digest(p);
            if d != l.digest {
                return Err(format!(
                    "{}@{} ({}) is not the package the lock pins (from {}): its digest is {d}, the lock says {}",
                    l.name, l.version, p.origin, l.source, l.digest
                ));
            }
        }
        reg.retain(|p| self.package.iter().any(|l| l.name == p.name() && &l.version == p.version()));
        Ok(())
    }
}
