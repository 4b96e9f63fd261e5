//! NVRTC: compile a package's CUDA source to a CUBIN for the GPU present
//! (`--gpu-architecture=sm_XY`, so loading needs no PTX JIT),
//! with the host's prelude `kiln.cuh`, cached on disk by sha256 of (prelude, source, arch,
//! NVRTC version, options) as sealed entries of `native_cache` in its `nvrtc/` folder.

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

/// Compiles `source` (named `file` of package `package` for messages) for `arch` (`sm_90`).
/// A compile error carries NVRTC's full log.
pub fn compile_cached(package: &str, file: &str, source: &str, arch: &str) -> Result<CompiledSource> {
    let version = nvrtc_version().ok_or_else(|| Error::Device("NVRTC (libnvrtc) is not available".into()))?;
    let mut h = Sha256::new();
    for part in [PRELUDE, source, arch, &format!("{version:?}"), &OPTIONS.join(" ")] {
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
    let full = source.replace("#include \"kiln.cuh\"", PRELUDE);
    let fail = |m: String| Error::Device(format!("NVRTC: package {package}, {file}: {m}"));
    let src = CString::new(full).map_err(|_| fail("the source holds a NUL byte".into()))?;
    let name = CString::new(file.replace('\0', "")).unwrap_or_default();
    let prog = cudarc::nvrtc::result::create_program(&src, Some(&name)).map_err(|e| fail(e.to_string()))?;
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
