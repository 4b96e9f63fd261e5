//! Kernel names (ABI.md §7.3, §7.3.1): a kernel is an `extern "C"` entry point named by a C identifier,
//! or (manifest schema 6) an instantiation of a `__global__` function template named by its C++
//! name expression, which NVRTC lowers to the mangled name it compiles. Shims spell such a name
//! with [`kernel_name`] and a dtype's template argument with [`crate::DType::cuda_tag`], so a
//! package keeps no table of kernel names.

use alloc::string::String;

/// Whether `s` is a kernel's name expression (manifest schema 6, ABI.md §7.3.1): the name of a
/// `__global__` function template, then its template arguments in angle brackets, each a C
/// identifier (a type such as `kiln_tag_f16`) or a decimal integer (optionally negative; no
/// leading zero, no `-0`, within the range of i64 or u64),
/// separated by exactly `", "` and with no other space: `kiln_cast<kiln_tag_f16>`,
/// `gqa_decode<kiln_tag_bf16, 4>`. The spelling is canonical, so that the shim's
/// [`kernel_name`] and the manifest agree byte for byte; NVRTC lowers it to the mangled name it
/// compiles (`nvrtcAddNameExpression`, `nvrtcGetLoweredName`).
pub fn is_name_expression(s: &str) -> bool {
    let Some((name, rest)) = s.split_once('<') else { return false };
    let Some(args) = rest.strip_suffix('>') else { return false };
    // A decimal integer in its one spelling: no leading zero, no "-0", within i64 or u64.
    let is_int = |a: &str| {
        let (neg, d) = a.strip_prefix('-').map_or((false, a), |d| (true, d));
        let digits = !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()) && (d == "0" || !d.starts_with('0'));
        digits && if neg { d != "0" && a.parse::<i64>().is_ok() } else { d.parse::<u64>().is_ok() }
    };
    is_identifier(name) && !args.is_empty() && args.split(", ").all(|a| is_identifier(a) || is_int(a))
}

/// The canonical name expression of template `name` with `args` (see [`is_name_expression`]):
/// `kernel_name("kiln_cast", &["kiln_tag_f16"])` is `"kiln_cast<kiln_tag_f16>"`. What a shim
/// passes to `launch` for a kernel its manifest declares as an instantiation.
pub fn kernel_name(name: &str, args: &[&str]) -> String {
    let mut s = String::from(name);
    s.push('<');
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(a);
    }
    s.push('>');
    s
}

pub(crate) fn is_identifier(s: &str) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}
