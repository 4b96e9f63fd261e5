//! NVRTC: compile a package's CUDA source to a CUBIN for the GPU present
//! (`--gpu-architecture=sm_XY`, so loading needs no PTX JIT),
//! with in-memory headers only (NVRTC never gets an include path): the host's prelude
//! `kiln.cuh` and the headers of the package and of the packages it depends on
//! (`Package::includes`, as `"<package>/<file>"`), cached on disk by sha256 of (every header's
//! name and text, source, arch, NVRTC version, options, name expressions) as sealed entries of
//! `native_cache` in its `nvrtc/` folder. Kernels a manifest names by C++ name expressions (schema 6,
//! `kiln_cast<kiln_tag_f16>`) are instantiated with `nvrtcAddNameExpression` and found by the
//! mangled names `nvrtcGetLoweredName` gives, which the cache keeps beside the CUBIN.

use std::collections::BTreeMap;
use std::ffi::CString;

use sha2::{Digest, Sha256};

use crate::{native_cache, Error, Result};

/// The prelude every source includes as `kiln.cuh`.
pub const PRELUDE: &str = include_str!("../../cuda/kiln.cuh");

/// NVRTC options besides the architecture, for NVRTC `version` (major, minor). From 12.4 on
/// (a conservative bound: 13.0 is the version checked), `--split-compile` spreads the device
/// code's optimization over threads: a fixed 8, not the host's core count, so that a CUBIN and
/// its cache key are the same on every machine (a staged cache, `scripts/stage-gpu.sh`, stays
/// valid on the GPU machine). On 2 cores, every built-in package cold: 200 → 132 s.
fn options(version: (i32, i32)) -> Vec<&'static str> {
    let mut options = vec!["--std=c++17", "-default-device"];
    if version >= (12, 4) {
        options.push("--split-compile=8");
    }
    options
}

/// The CUBIN (machine code for the device's `sm_XY`) of one source, the mangled name of each
/// name expression it was compiled with, and whether it came from the cache.
pub struct CompiledSource {
    /// The CUBIN, for the architecture compiled for.
    pub cubin: Vec<u8>,
    /// Name expression (`kiln_cast<kiln_tag_f16>`) → the symbol the CUBIN defines for it.
    pub lowered: BTreeMap<String, String>,
    /// Whether it came from the on-disk cache (nothing compiled).
    pub cache_hit: bool,
}

impl CompiledSource {
    /// The CUBIN's symbol for kernel `kernel` of the manifest: its lowered name for a name
    /// expression, else the name itself (an `extern "C"` kernel).
    pub fn symbol<'a>(&'a self, kernel: &'a str) -> &'a str {
        self.lowered.get(kernel).map_or(kernel, String::as_str)
    }
}

/// The cache's text of lowered names: a line `expression<TAB>symbol` each.
fn encode_lowered(lowered: &BTreeMap<String, String>) -> String {
    lowered.iter().map(|(e, l)| format!("{e}\t{l}\n")).collect()
}

/// Reads [`encode_lowered`]'s text back; `None` when it is not that text or lacks one of
/// `expressions`.
fn decode_lowered(text: &[u8], expressions: &[&str]) -> Option<BTreeMap<String, String>> {
    let text = std::str::from_utf8(text).ok()?;
    let map: BTreeMap<String, String> =
        text.lines().map(|l| l.split_once('\t').map(|(e, s)| (e.to_string(), s.to_string()))).collect::<Option<_>>()?;
    expressions.iter().all(|e| map.contains_key(*e)).then_some(map)
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
/// with the prelude as `kiln.cuh` and `headers` (include name → text) as in-memory headers,
/// instantiating each of `expressions` (kernel name expressions, [`kiln_kernel_abi::names`]). A
/// compile error carries NVRTC's full log, whose messages name the source or header and line;
/// an expression the source does not instantiate is an error naming it.
pub fn compile_cached(
    package: &str,
    file: &str,
    source: &str,
    headers: &BTreeMap<String, String>,
    arch: &str,
    expressions: &[&str],
) -> Result<CompiledSource> {
    let version = nvrtc_version().ok_or_else(|| Error::Device("NVRTC (libnvrtc) is not available".into()))?;
    let mut all: Vec<(&str, &str)> = vec![("kiln.cuh", PRELUDE)];
    all.extend(headers.iter().map(|(n, t)| (n.as_str(), t.as_str())));
    let mut h = Sha256::new();
    let options = options(version);
    let version = format!("{version:?}");
    let joined = options.join(" ");
    let parts = all
        .iter()
        .flat_map(|(n, t)| [*n, *t])
        .chain([source, arch, version.as_str(), joined.as_str()])
        .chain(expressions.iter().copied());
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
    let names_path = cache.as_ref().map(|p| p.with_extension("names"));
    if let (Some(path), Some(names_path)) = (&cache, &names_path) {
        let lowered = if expressions.is_empty() {
            Ok(Some(BTreeMap::new()))
        } else {
            native_cache::read_sealed(names_path).map(|t| t.and_then(|t| decode_lowered(&t, expressions)))
        };
        match (native_cache::read_sealed(path), lowered) {
            (Ok(Some(cubin)), Ok(Some(lowered))) if !cubin.is_empty() => {
                tracing::debug!(package, file, "NVRTC: from the cache");
                // An entry's modification time is its last use (best effort), so that a cache
                // can be pruned, or packed, by use (scripts/stage-gpu.sh).
                let now = std::time::SystemTime::now();
                for p in [path, names_path] {
                    let _ = std::fs::File::options().append(true).open(p).and_then(|f| f.set_modified(now));
                }
                return Ok(CompiledSource { cubin, lowered, cache_hit: true });
            }
            (Err(why), _) | (_, Err(why)) => {
                tracing::warn!(file = %path.display(), "NVRTC cache entry not used, compiling again: {why}")
            }
            _ => {}
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
    let exprs = expressions.iter().map(|e| c(e, "a kernel name expression")).collect::<Result<Vec<_>>>()?;
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
    for (e, text) in exprs.iter().zip(expressions) {
        // SAFETY: prog is a live program; e is a NUL-terminated string.
        let added = unsafe { cudarc::nvrtc::sys::nvrtcAddNameExpression(prog, e.as_ptr()) };
        if added != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
            return Err(fail(format!("nvrtcAddNameExpression({text}): {added:?}")));
        }
    }
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    opts.extend(options.iter().map(|s| s.to_string()));
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
    let mut lowered = BTreeMap::new();
    for (e, text) in exprs.iter().zip(expressions) {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: prog compiled with e added; NVRTC owns the returned string until the program
        // is destroyed, and it is copied before that.
        let got = unsafe { cudarc::nvrtc::sys::nvrtcGetLoweredName(prog, e.as_ptr(), &mut name) };
        if got != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS || name.is_null() {
            unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
            return Err(fail(format!(
                "kernel.toml names kernel {text}, which this source does not instantiate \
                 (nvrtcGetLoweredName: {got:?}); it must be a __global__ function template of that name"
            )));
        }
        // SAFETY: a NUL-terminated string NVRTC returned.
        let symbol = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned();
        lowered.insert(text.to_string(), symbol);
    }
    unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
    if cubin.is_empty() {
        return Err(fail("NVRTC produced no CUBIN".into()));
    }
    tracing::info!(package, file, arch, ms = started.elapsed().as_millis() as u64, "NVRTC: compiled");
    if let (Some(path), Some(names_path)) = (&cache, &names_path) {
        // The names first: a CUBIN entry is used only beside them.
        let names = if lowered.is_empty() {
            Ok(())
        } else {
            native_cache::write_sealed(names_path, encode_lowered(&lowered).as_bytes())
        };
        if let Err(e) = names.and_then(|()| native_cache::write_sealed(path, &cubin)) {
            tracing::warn!(file = %path.display(), "NVRTC cache entry not written: {e}");
        }
    }
    Ok(CompiledSource { cubin, lowered, cache_hit: false })
}

/// Compiles every CUDA source of a package folder `dir` (its manifest `manifest`, the headers
/// its sources may include `headers`: its own and its dependencies', by include name) for
/// `arch` (`sm_XY`) with NVRTC, as a run on such a GPU will, and checks that each kernel the manifest
/// lists for a source is an entry of its CUBIN (an `extern "C" __global__` function of that
/// name, or the lowered name of a name expression). No GPU is needed. Returns how many sources
/// it compiled. Errors, for `kiln package build` to report before anything is packed: NVRTC missing, a source that cannot be read or
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
        let compiled = compile_cached(name, &c.source, &text, headers, arch, &c.name_expressions())
            .map_err(|e| Error::Input(e.to_string()))?;
        if let Some(k) = c.kernels.iter().find(|k| !defines(&compiled.cubin, compiled.symbol(k))) {
            return Err(Error::Input(format!(
                "package {name}: kernel.toml lists kernel {k} for {}, but the source compiled for {arch} defines no \
                 such kernel (an extern \"C\" __global__ function of that name, or an instantiation of a \
                 __global__ function template for a name expression)",
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
    use super::{decode_lowered, defines, encode_lowered};

    /// Every dtype's tag a shim names in a name expression (`DType::cuda_tag`) is a type of the
    /// prelude, with its element's C type as `storage`; the float8, 4-bit and 2-bit types are
    /// taken by code instead (kiln-cuda-std's `minifloat.cuh`).
    #[test]
    fn the_prelude_defines_the_tag_of_every_dtype() {
        use kiln_kernel_abi::DType;
        let tags: Vec<_> = DType::ALL.iter().filter_map(|d| d.cuda_tag()).collect();
        let by_code = DType::ALL.iter().filter(|d| d.since_schema_11()).count();
        assert_eq!(tags.len(), DType::ALL.len() - 1 - by_code, "every dtype but string and those taken by code");
        for tag in tags {
            assert!(super::PRELUDE.contains(&format!("struct {tag} {{ typedef ")), "kiln.cuh lacks {tag}");
        }
    }

    #[test]
    fn split_compile_is_given_a_fixed_count_from_nvrtc_12_4_only() {
        assert_eq!(super::options((13, 0)), ["--std=c++17", "-default-device", "--split-compile=8"]);
        assert_eq!(super::options((12, 4)).last(), Some(&"--split-compile=8"));
        assert_eq!(super::options((12, 3)), ["--std=c++17", "-default-device"], "an older NVRTC gets no split");
        assert_eq!(super::options((11, 8)), ["--std=c++17", "-default-device"]);
    }

    #[test]
    fn lowered_names_survive_the_cache_text_and_a_missing_one_is_a_miss() {
        let lowered: std::collections::BTreeMap<String, String> = [
            ("kiln_cast<kiln_tag_f16>", "_Z9kiln_castI12kiln_tag_f16EvPKN_7storageEPvyj"),
            ("gqa<kiln_tag_f32, 4>", "_Z3gqaI12kiln_tag_f32Li4EEvv"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        let text = encode_lowered(&lowered);
        assert_eq!(decode_lowered(text.as_bytes(), &["gqa<kiln_tag_f32, 4>"]), Some(lowered.clone()));
        assert_eq!(decode_lowered(text.as_bytes(), &["kiln_cast<kiln_tag_bf16>"]), None, "an expression it lacks");
        assert_eq!(decode_lowered(b"no tab here\n", &[]), None, "not the cache's text");
        assert_eq!(decode_lowered(&[0xff, 0xfe], &[]), None, "not UTF-8");
    }

    #[test]
    fn a_symbol_is_found_only_whole() {
        let strtab = b"\0.text.kiln_relu_f32\0kiln_relu_f32\0kiln_relu_f16x\0";
        assert!(defines(strtab, "kiln_relu_f32"));
        assert!(!defines(strtab, "kiln_relu_f16"), "a prefix of another name is not a symbol");
        assert!(!defines(strtab, "relu_f32"), "nor is a suffix");
    }
}
