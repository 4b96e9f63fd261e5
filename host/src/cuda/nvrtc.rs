//! NVRTC: compile a package's CUDA source to a CUBIN for the GPU present
//! (`--gpu-architecture=sm_XY`, so loading needs no PTX JIT),
//! with in-memory headers only (NVRTC never gets an include path): the host's prelude
//! `kiln.cuh` and the headers of the package and of the packages it depends on
//! (`Package::includes`, as `"<package>/<file>"`), cached on disk by sha256 of (every header's
//! name and text, source, arch, NVRTC version, options) as sealed entries of `native_cache` in
//! its `nvrtc/` folder.

use std::collections::BTreeMap;
use std::ffi::CString;

use sha2::{Digest, Sha256};

use crate::{native_cache, Error, Result};

/// The prelude every source includes as `kiln.cuh`.
pub const PRELUDE: &str = include_str!("../../cuda/kiln.cuh");

/// NVRTC options besides the architecture.
const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// The CUBIN (machine code for the device's `sm_XY`) of one source, and whether it came from
/// the cache.
pub struct CompiledSource {
    pub cubin: Vec<u8>,
    pub cache_hit: bool,
}

/// NVRTC's (major, minor).
pub fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: dlopen probe, then a call writing two ints.
    unsafe {
        if !cudarc::nvrtc::sys::is_culib_present() {
            return None;
        }
        let (mut a, mut b) = (0, 0);
        (cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS)
            .then_some((a, b))
    }
}

/// The architectures NVRTC compiles for, as compute capabilities ×10 (90 for sm_90), lowest
/// first; empty without NVRTC.
pub fn nvrtc_archs() -> Vec<i32> {
    if nvrtc_version().is_none() {
        return Vec::new();
    }
    use cudarc::nvrtc::sys::{nvrtcGetNumSupportedArchs, nvrtcGetSupportedArchs, nvrtcResult::NVRTC_SUCCESS};
    let mut n = 0;
    // SAFETY: NVRTC is loaded; the second call fills exactly `n` ints.
    unsafe {
        if nvrtcGetNumSupportedArchs(&mut n) != NVRTC_SUCCESS || n <= 0 {
            return Vec::new();
        }
        let mut archs = vec![0i32; n as usize];
        if nvrtcGetSupportedArchs(archs.as_mut_ptr()) != NVRTC_SUCCESS {
            return Vec::new();
        }
        archs.sort_unstable();
        archs
    }
}

/// Compiles `source` (named `file` of package `package` for messages) for `arch` (`sm_90`),
/// with the prelude as `kiln.cuh` and `headers` (include name → text) as in-memory headers. A
/// compile error carries NVRTC's full log, whose messages name the source or header and line.
pub fn compile_cached(
    package: &str,
    file: &str,
    source: &str,
    headers: &BTreeMap<String, String>,
    arch: &str,
) -> Result<CompiledSource> {
    let version = nvrtc_version().ok_or_else(|| Error::Device("NVRTC (libnvrtc) is not available".into()))?;
    let mut all: Vec<(&str, &str)> = vec![("kiln.cuh", PRELUDE)];
    all.extend(headers.iter().map(|(n, t)| (n.as_str(), t.as_str())));
    let mut h = Sha256::new();
    let version = format!("{version:?}");
    let options = OPTIONS.join(" ");
    let parts = all.iter().flat_map(|(n, t)| [*n, *t]).chain([source, arch, version.as_str(), options.as_str()]);
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let key = hex::encode(h.finalize());
    let dir = native_cache::cache_dir().join("nvrtc");
    let cache = match native_cache::private_dir(&dir) {
        Ok(()) => Some(dir.join(format!("{key}.cubin"))),
        Err(why) => {
            native_cache::warn_unusable(&why);
            None
        }
    };
    if let Some(path) = &cache {
        match native_cache::read_sealed(path) {
            Ok(Some(cubin)) if !cubin.is_empty() => {
                tracing::debug!(package, file, "NVRTC: from the cache");
                return Ok(CompiledSource { cubin, cache_hit: true });
            }
            Ok(_) => {}
            Err(why) => tracing::warn!(file = %path.display(), "NVRTC cache entry not used, compiling again: {why}"),
        }
    }
    let started = std::time::Instant::now();
    let fail = |m: String| Error::Device(format!("NVRTC: package {package}, {file}: {m}"));
    let c = |t: &str, what: &str| CString::new(t).map_err(|_| fail(format!("{what} holds a NUL byte")));
    let src = c(source, "the source")?;
    let name = c(file, "the file name")?;
    let texts = all.iter().map(|(n, t)| c(t, &format!("header {n}"))).collect::<Result<Vec<_>>>()?;
    let names = all.iter().map(|(n, _)| c(n, "a header name")).collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<*const std::ffi::c_char> = texts.iter().map(|t| t.as_ptr()).collect();
    let name_ptrs: Vec<*const std::ffi::c_char> = names.iter().map(|t| t.as_ptr()).collect();
    let mut prog = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string; the arrays hold `all.len()` each.
    let created = unsafe {
        cudarc::nvrtc::sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            all.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    };
    if created != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail(format!("nvrtcCreateProgram: {created:?}")));
    }
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    opts.extend(OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: prog is a live program; options are valid strings.
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(prog, &opts) };
    let log = unsafe { cudarc::nvrtc::result::get_program_log(prog) }
        .map(|l| l.iter().map(|&c| c as u8).take_while(|&c| c != 0).map(char::from).collect::<String>())
        .unwrap_or_default();
    if let Err(e) = compiled {
        unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
        return Err(fail(format!("compilation failed ({e}):\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: prog compiled for a real architecture (sm_XY), so it holds a CUBIN.
    let cubin = unsafe {
        use cudarc::nvrtc::sys::{nvrtcGetCUBIN, nvrtcGetCUBINSize, nvrtcResult::NVRTC_SUCCESS};
        let mut buf = Vec::new();
        if nvrtcGetCUBINSize(prog, &mut size) == NVRTC_SUCCESS && size > 0 {
            buf = vec![0u8; size];
            if nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) != NVRTC_SUCCESS {
                buf.clear();
            }
        }
        buf
    };
    unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
    if cubin.is_empty() {
        return Err(fail("NVRTC produced no CUBIN".into()));
    }
    tracing::info!(package, file, arch, ms = started.elapsed().as_millis() as u64, "NVRTC: compiled");
    if let Some(path) = &cache {
        if let Err(e) = native_cache::write_sealed(path, &cubin) {
            tracing::warn!(file = %path.display(), "NVRTC cache entry not written: {e}");
        }
    }
    Ok(CompiledSource { cubin, cache_hit: false })
}

/// Compiles every CUDA source of a package folder `dir` (its manifest `manifest`, the headers
/// its sources may include `headers`: its own and its dependencies', by include name) for
/// `arch` (`sm_XY`) with NVRTC, as a run on such a GPU will, and checks that each kernel the manifest
/// lists for a source is an entry of its CUBIN (an `extern "C" __global__` function of that
/// name). No GPU is needed. Returns how many sources it compiled. Errors, for `kiln package
/// build` to report before anything is packed: NVRTC missing, a source that cannot be read or
/// does not compile (NVRTC's log, with the file and line), or a listed kernel the source does
/// not define (named with its file).
pub fn compile_package(
    dir: &std::path::Path,
    manifest: &kiln_kernel_abi::manifest::Manifest,
    headers: &BTreeMap<String, String>,
    arch: &str,
) -> Result<usize> {
    let name = &manifest.package.name;
    for c in &manifest.cuda {
        let path = dir.join(&c.source);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let compiled =
            compile_cached(name, &c.source, &text, headers, arch).map_err(|e| Error::Input(e.to_string()))?;
        if let Some(k) = c.kernels.iter().find(|k| !defines(&compiled.cubin, k)) {
            return Err(Error::Input(format!(
                "package {name}: kernel.toml lists kernel {k} for {}, but the source compiled for {arch} defines no \
                 such kernel (an extern \"C\" __global__ function of that name)",
                c.source
            )));
        }
    }
    Ok(manifest.cuda.len())
}

/// Whether `cubin` has a symbol named `kernel` (a NUL-delimited entry of its string table).
fn defines(cubin: &[u8], kernel: &str) -> bool {
    let needle: Vec<u8> = [&[0u8][..], kernel.as_bytes(), &[0u8][..]].concat();
    cubin.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::defines;

    #[test]
    fn a_symbol_is_found_only_whole() {
        let strtab = b"\0.text.kiln_relu_f32\0kiln_relu_f32\0kiln_relu_f16x\0";
        assert!(defines(strtab, "kiln_relu_f32"));
        assert!(!defines(strtab, "kiln_relu_f16"), "a prefix of another name is not a symbol");
        assert!(!defines(strtab, "relu_f32"), "nor is a suffix");
    }
}
