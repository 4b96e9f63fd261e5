//! The built-in kernel packages of kiln, embedded in the binary.
//!
//! The build script compiles each package's shim (`kernels/<dir>/shim`, absent in the
//! header-only `kiln-cuda-std`) for `wasm32-unknown-unknown`, writes the package's `kernel.toml` with the sha256 of every
//! file, and embeds the files here. `kiln-registry` loads them through the same verification
//! as a package folder.

/// One built-in package: its folder name under `kernels/` and its files
/// (`(package-relative path, bytes)`, `kernel.toml` first).
#[derive(Debug)]
pub struct EmbeddedPackage {
    pub dir: &'static str,
    pub files: &'static [(&'static str, &'static [u8])],
}

include!(concat!(env!("OUT_DIR"), "/builtin.rs"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_package_has_a_manifest_and_a_shim_or_only_headers() {
        assert!(!PACKAGES.is_empty());
        for p in PACKAGES {
            assert_eq!(p.files[0].0, "kernel.toml", "{}", p.dir);
            match p.files.iter().find(|f| f.0 == "shim.wasm") {
                Some(shim) => assert_eq!(&shim.1[..4], b"\0asm", "{}: shim.wasm is not a wasm module", p.dir),
                None => {
                    assert_eq!(p.dir, "cuda-std", "only the header package has no shim");
                    assert!(p.files.iter().skip(1).all(|f| f.0.starts_with("include/")), "{:?}", p.files);
                }
            }
        }
    }
}
