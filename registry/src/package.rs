//! Loading a kernel package and verifying its files.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use kiln_kernel_abi::manifest::Manifest;
use sha2::{Digest, Sha256};

use crate::RegistryError;

/// ABI versions this registry accepts.
pub const SUPPORTED_ABI: &[u32] = &[kiln_kernel_abi::ABI_VERSION];

/// A loaded, verified kernel package.
#[derive(Clone, Debug)]
pub struct Package {
    pub manifest: Manifest,
    /// Where it came from: a folder path or `builtin:<dir>`.
    pub origin: String,
    /// The shim module's bytes (WebAssembly).
    pub shim: Arc<[u8]>,
    /// CUDA sources by package-relative path.
    pub cuda_sources: BTreeMap<String, String>,
    /// The headers the package exports (`headers`), by the name a source includes them by
    /// (`<package>/<path under include/>`).
    pub headers: BTreeMap<String, String>,
    /// Every header its CUDA sources may include: its own and those of the packages it
    /// depends on, by include name, once [`crate::OpRegistry::link`] resolved them (until then
    /// its own only).
    pub includes: BTreeMap<String, String>,
    /// The public key (`ed25519:HEX`) whose signature on the package's registry index line
    /// verified; `None` for a package from elsewhere or published unsigned.
    pub signer: Option<String>,
}

impl Package {
    /// `name@version`.
    pub fn id(&self) -> String {
        format!("{}@{}", self.manifest.package.name, self.manifest.package.version)
    }

    pub fn name(&self) -> &str {
        &self.manifest.package.name
    }

    pub fn version(&self) -> &semver::Version {
        &self.manifest.package.version
    }

    /// Loads a package folder: `kernel.toml` plus every file it lists in `[files]`.
    pub fn load_dir(dir: &Path) -> Result<Package, RegistryError> {
        let origin = dir.display().to_string();
        let read = |rel: &str| {
            let path = dir.join(rel);
            std::fs::read(&path).map_err(|source| match source.kind() {
                std::io::ErrorKind::NotFound if rel != "kernel.toml" => {
                    RegistryError::Missing { origin: origin.clone(), file: rel.to_string() }
                }
                _ => RegistryError::Io { origin: origin.clone(), path, source },
            })
        };
        let text = read("kernel.toml")?;
        let manifest = parse_manifest(&origin, &text)?;
        let mut files = BTreeMap::new();
        for rel in manifest.files.keys() {
            files.insert(rel.clone(), read(rel)?);
        }
        Package::verify(origin, manifest, files)
    }

    /// Loads a package from in-memory files (`kernel.toml` among them), as the built-in
    /// packages are embedded.
    pub fn load_files(origin: &str, files: &[(&str, &[u8])]) -> Result<Package, RegistryError> {
        let get = |rel: &str| files.iter().find(|f| f.0 == rel).map(|f| f.1);
        let text = get("kernel.toml")
            .ok_or_else(|| RegistryError::Missing { origin: origin.into(), file: "kernel.toml".into() })?;
        let manifest = parse_manifest(origin, text)?;
        let mut map = BTreeMap::new();
        for rel in manifest.files.keys() {
            let bytes = get(rel).ok_or_else(|| RegistryError::Missing { origin: origin.into(), file: rel.clone() })?;
            map.insert(rel.clone(), bytes.to_vec());
        }
        Package::verify(origin.to_string(), manifest, map)
    }

    fn verify(
        origin: String,
        manifest: Manifest,
        mut files: BTreeMap<String, Vec<u8>>,
    ) -> Result<Package, RegistryError> {
        if !SUPPORTED_ABI.contains(&manifest.abi) {
            return Err(RegistryError::AbiVersion { origin, found: manifest.abi, supported: SUPPORTED_ABI.to_vec() });
        }
        for (rel, expected) in &manifest.files {
            let actual = hex::encode(Sha256::digest(&files[rel]));
            if &actual != expected {
                return Err(RegistryError::Checksum { origin, file: rel.clone(), expected: expected.clone(), actual });
            }
        }
        let shim_file = (!manifest.shim.is_empty()).then_some(&manifest.shim);
        let needed = shim_file.into_iter().chain(manifest.cuda.iter().map(|c| &c.source)).chain(&manifest.headers);
        for rel in needed {
            if !manifest.files.contains_key(rel) {
                return Err(RegistryError::Unlisted { origin, file: rel.clone() });
            }
        }
        let shim: Arc<[u8]> = shim_file.and_then(|f| files.remove(f)).unwrap_or_default().into();
        let mut text = |rel: &String| {
            String::from_utf8(files.remove(rel).unwrap_or_default())
                .map_err(|_| RegistryError::NotText { origin: origin.clone(), file: rel.clone() })
        };
        let mut cuda_sources = BTreeMap::new();
        for c in &manifest.cuda {
            cuda_sources.insert(c.source.clone(), text(&c.source)?);
        }
        let mut headers = BTreeMap::new();
        for h in &manifest.headers {
            headers.insert(manifest.include_name(h), text(h)?);
        }
        let includes = headers.clone();
        Ok(Package { manifest, origin, shim, cuda_sources, headers, includes, signer: None })
    }
}

fn parse_manifest(origin: &str, bytes: &[u8]) -> Result<Manifest, RegistryError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| RegistryError::NotText { origin: origin.into(), file: "kernel.toml".into() })?;
    Manifest::parse(text).map_err(|source| RegistryError::Manifest { origin: origin.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_package(dir: &Path, shim: &[u8], listed_hash: Option<&str>) {
        let hash = listed_hash.map(String::from).unwrap_or_else(|| hex::encode(Sha256::digest(shim)));
        std::fs::write(dir.join("shim.wasm"), shim).unwrap();
        std::fs::write(
            dir.join("kernel.toml"),
            format!(
                "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"p\"\nversion = \"0.1.0\"\n[[ops]]\nop_types = [\"Relu\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 4\n[files]\n\"shim.wasm\" = \"{hash}\"\n"
            ),
        )
        .unwrap();
    }

    #[test]
    fn a_verified_folder_loads() {
        let d = tempfile::tempdir().unwrap();
        write_package(d.path(), b"\0asm", None);
        let p = Package::load_dir(d.path()).unwrap();
        assert_eq!(p.id(), "p@0.1.0");
        assert_eq!(&*p.shim, b"\0asm");
    }

    #[test]
    fn a_modified_file_is_refused_with_both_hashes() {
        let d = tempfile::tempdir().unwrap();
        write_package(d.path(), b"\0asm", Some(&"0".repeat(64)));
        let err = Package::load_dir(d.path()).unwrap_err().to_string();
        assert!(err.contains("sha256 of shim.wasm") && err.contains(&"0".repeat(64)), "{err}");
    }

    #[test]
    fn a_missing_file_and_a_missing_manifest_are_named() {
        let d = tempfile::tempdir().unwrap();
        write_package(d.path(), b"\0asm", None);
        std::fs::remove_file(d.path().join("shim.wasm")).unwrap();
        assert!(Package::load_dir(d.path())
            .unwrap_err()
            .to_string()
            .contains("shim.wasm listed in [files] is missing"));
        let e = tempfile::tempdir().unwrap();
        assert!(Package::load_dir(e.path()).unwrap_err().to_string().contains("kernel.toml"));
    }

    #[test]
    fn an_unlisted_shim_is_refused() {
        let text = "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"p\"\nversion = \"0.1.0\"\n[[ops]]\nop_types = [\"Relu\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 4\n";
        let err = Package::load_files("mem", &[("kernel.toml", text.as_bytes()), ("shim.wasm", b"\0asm")]).unwrap_err();
        assert!(err.to_string().contains("not listed in [files]"), "{err}");
    }

    #[test]
    fn another_abi_is_refused() {
        let text = "abi = 2\nshim = \"s\"\n[package]\nname = \"p\"\nversion = \"0.1.0\"\n[[ops]]\nop_types = [\"Relu\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 4\n";
        let err = Package::load_files("mem", &[("kernel.toml", text.as_bytes())]).unwrap_err();
        assert!(err.to_string().contains("kernel ABI 2"), "{err}");
    }
}
