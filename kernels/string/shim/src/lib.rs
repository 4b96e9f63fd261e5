//! Shim of `kiln-string`: ONNX's string ops on the CPU (Operators.md), over string tensors in
//! the ABI's layout (ABI.md §6):
//!
//! - StringConcat-20: `x + y` element by element, with multidirectional broadcasting.
//! - StringSplit-20: each element split at `delimiter` (every occurrence, consecutive ones giving
//!   empty strings) or, without one or with an empty one, at runs of whitespace (leading and
//!   trailing ignored), at most `maxsplit` times (negative: no limit; the rest in the last
//!   substring), as Python's `str.split`; Y is X's shape plus the most substrings of any element, padded with "", and
//!   Z (int64, X's shape) counts each element's substrings.
//! - StringNormalizer-10: the elements of a [C] or [1, C] X that are not `stopwords`
//!   (compared as they are with `is_case_sensitive`, else in lower case), then changed to
//!   `case_change_action` (`LOWER`, `UPPER`, `NONE`) character by character, by Unicode's
//!   one-to-one case mappings as C's `towupper`/`towlower` and onnxruntime (`locale` is not
//!   read); when no element remains, one "" ([1] or [1, 1]), as onnxruntime.
//! - Equal-19 of strings: byte-wise equality, with broadcasting, as bool.
//! - RegexFullMatch-20: whether each element matches `pattern` whole, as bool. The pattern is
//!   RE2's syntax as the regex crate reads it (regex-automata: no backreferences or
//!   lookaround, as RE2), with RE2's ASCII meaning of `\w`, `\d`, `\s`, `\b` and their
//!   negations ([`re2_classes`]); `.` and `(?i)` are Unicode-aware, as RE2's. An element that is
//!   not UTF-8 does not match.
//!
//! Elements are bytes; whitespace splitting and case changes need UTF-8 and refuse other bytes.
#![no_std]
extern crate alloc;

use alloc::string::String;
use alloc::vec::Vec;
use kiln_kernel_abi::guest::shape::{broadcast_map2, broadcast_shapes};
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Strings;

fn utf8<'s>(op: &str, s: &'s [u8]) -> Result<&'s str> {
    core::str::from_utf8(s).map_err(|_| ShimError::Failed(format!("{op}: an element is not UTF-8")))
}

/// Python's `str.isspace`: Unicode's White_Space and the ASCII separators U+001C to U+001F.
fn space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// StringSplit's substrings of one element.
fn split<'s>(s: &'s [u8], delimiter: &[u8], maxsplit: Option<usize>) -> Result<Vec<&'s [u8]>> {
    let max = maxsplit.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    if delimiter.is_empty() {
        // Runs of whitespace; leading and trailing ones ignored.
        let text = utf8("StringSplit", s)?;
        let mut rest = text.trim_start_matches(space);
        while !rest.is_empty() {
            if out.len() == max {
                out.push(rest.as_bytes()); // the rest as it is, as Python keeps it
                break;
            }
            let end = rest.find(space).unwrap_or(rest.len());
            out.push(&rest.as_bytes()[..end]);
            rest = rest[end..].trim_start_matches(space);
        }
        return Ok(out);
    }
    let mut start = 0;
    let mut i = 0;
    while i + delimiter.len() <= s.len() && out.len() < max {
        if &s[i..i + delimiter.len()] == delimiter {
            out.push(&s[start..i]);
            i += delimiter.len();
            start = i;
        } else {
            i += 1;
        }
    }
    out.push(&s[start..]);
    Ok(out)
}

/// StringSplit's attributes: the delimiter (empty: whitespace) and `maxsplit` (None: no limit).
fn split_attrs(call: &Call) -> Result<(Vec<u8>, Option<usize>)> {
    let delimiter = Vec::from(call.attr_s("delimiter", "")?.as_bytes());
    let maxsplit = match call.attr("maxsplit") {
        None => None,
        // A negative one is no limit, as Python's -1.
        Some(_) => usize::try_from(call.attr_i("maxsplit", 0)?).ok(),
    };
    Ok((delimiter, maxsplit))
}

/// StringSplit of every element of X, and the most substrings of any.
fn split_all(call: &Call, x: &[Vec<u8>]) -> Result<(Vec<Vec<Vec<u8>>>, usize)> {
    let (delimiter, maxsplit) = split_attrs(call)?;
    let parts: Vec<Vec<Vec<u8>>> = x
        .iter()
        .map(|s| split(s, &delimiter, maxsplit).map(|p| p.into_iter().map(Vec::from).collect()))
        .collect::<Result<_>>()?;
    let most = parts.iter().map(Vec::len).max().unwrap_or(0);
    Ok((parts, most))
}

/// StringNormalizer's kept elements, case changed.
fn normalize(call: &Call, x: &[Vec<u8>]) -> Result<Vec<String>> {
    let op = "StringNormalizer";
    let sensitive = call.attr_i("is_case_sensitive", 0)? != 0;
    let action = call.attr_s("case_change_action", "NONE")?;
    if !matches!(action, "NONE" | "LOWER" | "UPPER") {
        bail!("{op}: case_change_action {action:?} is not NONE, LOWER or UPPER");
    }
    let key = |s: &str| if sensitive { String::from(s) } else { s.to_lowercase() };
    let stop: Vec<String> = match call.attr("stopwords") {
        Some(AttrValue::Strings(v)) => v.iter().map(|s| key(s)).collect(),
        Some(_) => bail!("{op}: stopwords must be a list of strings"),
        None => Vec::new(),
    };
    let mut out = Vec::new();
    for s in x {
        let s = utf8(op, s)?;
        if stop.contains(&key(s)) {
            continue;
        }
        out.push(match action {
            "LOWER" => s.chars().map(|c| simple_case(c, c.to_lowercase())).collect(),
            "UPPER" => s.chars().map(|c| simple_case(c, c.to_uppercase())).collect(),
            _ => String::from(s),
        });
    }
    Ok(out)
}

/// A character's case mapping where it is one character, else the character itself: the
/// one-to-one mapping of C's `towupper`/`towlower`, which onnxruntime applies (`ß` stays `ß`
/// in upper case, where Unicode's full mapping gives `SS`).
fn simple_case(c: char, mut mapped: impl Iterator<Item = char>) -> char {
    match (mapped.next(), mapped.next()) {
        (Some(m), None) => m,
        _ => c,
    }
}

/// StringNormalizer's output shape for X's and `kept` elements (one "" when none is kept).
fn normalized_shape(op: &str, x: &[usize], kept: usize) -> Result<Vec<usize>> {
    let c = kept.max(1);
    match x {
        [_] => Ok(alloc::vec![c]),
        [1, _] => Ok(alloc::vec![1, c]),
        _ => bail!("{op}: X must be [C] or [1, C], not {x:?}"),
    }
}

/// `pattern` with RE2's ASCII Perl classes in place of the regex crate's Unicode ones: `\w`,
/// `\d`, `\s` (and `\W`, `\D`, `\S`) become the ASCII classes `[:word:]`, `[:digit:]` and
/// RE2's `[\t\n\f\r ]`, inside or outside brackets, and `\b`, `\B` ASCII word boundaries.
/// Other escapes pass through whole, so an escaped backslash never starts one.
fn re2_classes(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut depth = 0usize; // nesting of [...] classes
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let Some(e) = chars.next() else {
                    out.push('\\');
                    break;
                };
                let class = match e {
                    'w' => Some(("[:word:]", "[[:word:]]")),
                    'W' => Some(("[:^word:]", "[^[:word:]]")),
                    'd' => Some(("[:digit:]", "[[:digit:]]")),
                    'D' => Some(("[:^digit:]", "[^[:digit:]]")),
                    's' => Some((r"\t\n\x0C\r ", r"[\t\n\x0C\r ]")),
                    // Inside brackets POSIX's class, which also excludes \v.
                    'S' => Some(("[:^space:]", r"[^\t\n\x0C\r ]")),
                    _ => None,
                };
                match (e, class) {
                    (_, Some((inside, outside))) => out.push_str(if depth > 0 { inside } else { outside }),
                    ('b' | 'B', _) if depth == 0 => {
                        out.push_str("(?-u:\\");
                        out.push(e);
                        out.push(')');
                    }
                    _ => {
                        out.push('\\');
                        out.push(e);
                    }
                }
            }
            '[' => {
                depth += 1;
                out.push(c);
                // A leading `]` (or `^]`) is a literal, not the end of the class.
                if chars.peek() == Some(&'^') {
                    out.push(chars.next().unwrap_or('^'));
                }
                if chars.peek() == Some(&']') {
                    out.push(chars.next().unwrap_or(']'));
                }
            }
            ']' if depth > 0 => {
                depth -= 1;
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

/// RegexFullMatch's matcher: `pattern` (RE2's classes, [`re2_classes`]) anchored at both ends.
fn full_match(call: &Call) -> Result<regex_automata::meta::Regex> {
    let pattern = call.attr_s("pattern", "")?;
    let bad = |e: regex_automata::meta::BuildError| {
        // The parser's own message says what is wrong and where.
        let why = match e.syntax_error() {
            Some(syntax) => format!("{syntax}"),
            None => format!("{e}"),
        };
        ShimError::Failed(format!("RegexFullMatch: pattern {pattern:?} is not a valid regular expression: {why}"))
    };
    // The pattern alone first: one like `a)|(b` must not become valid inside the anchors.
    let classes = re2_classes(pattern);
    regex_automata::meta::Regex::new(&classes).map_err(bad)?;
    regex_automata::meta::Regex::new(&format!(r"\A(?:{classes})\z")).map_err(bad)
}

fn strings_of(t: &Tensor) -> Result<Vec<Vec<u8>>> {
    t.read_strings()
}

impl Shim for Strings {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let x = call.input(0)?;
        if x.dtype()? != DType::String {
            unsupported!("{}: X is {}, not string", call.op_type(), x.dtype()?);
        }
        let shape = x.shape()?;
        match call.op_type() {
            "StringConcat" | "Equal" => {
                let y = call.input(1)?;
                if y.dtype()? != DType::String {
                    bail!("{}: the second input is {}, not string", call.op_type(), y.dtype()?);
                }
                let out = broadcast_shapes(&[&shape, &y.shape()?])?;
                let dtype = if call.op_type() == "Equal" { DType::Bool } else { DType::String };
                Ok(alloc::vec![TensorType::new(dtype, out)])
            }
            "StringSplit" => {
                let (_, most) = split_all(call, &strings_of(&x)?)?;
                let mut y = shape.clone();
                y.push(most);
                Ok(alloc::vec![TensorType::new(DType::String, y), TensorType::new(DType::I64, shape)])
            }
            "RegexFullMatch" => {
                full_match(call)?;
                Ok(alloc::vec![TensorType::new(DType::Bool, shape)])
            }
            "StringNormalizer" => {
                let kept = normalize(call, &strings_of(&x)?)?.len();
                Ok(alloc::vec![TensorType::new(DType::String, normalized_shape("StringNormalizer", &shape, kept)?)])
            }
            other => unsupported!("kiln-string does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        let x = call.input(0)?;
        let xs = strings_of(&x)?;
        match call.op_type() {
            "StringConcat" | "Equal" => {
                let y = call.input(1)?;
                let ys = strings_of(&y)?;
                let a: Vec<&[u8]> = xs.iter().map(Vec::as_slice).collect();
                let b: Vec<&[u8]> = ys.iter().map(Vec::as_slice).collect();
                let (xshape, yshape) = (x.shape()?, y.shape()?);
                if call.op_type() == "Equal" {
                    let (eq, _) = broadcast_map2(&a, &xshape, &b, &yshape, |p, q| Bool(p == q))?;
                    return call.output(0)?.write_vec(&eq);
                }
                let (cat, _) = broadcast_map2(&a, &xshape, &b, &yshape, |p, q| [p, q].concat())?;
                call.output(0)?.write_strings(&cat)
            }
            "StringSplit" => {
                let (parts, most) = split_all(call, &xs)?;
                let mut y: Vec<&[u8]> = Vec::with_capacity(parts.len() * most);
                for p in &parts {
                    y.extend(p.iter().map(Vec::as_slice));
                    y.extend(core::iter::repeat_n(&b""[..], most - p.len()));
                }
                call.output(0)?.write_strings(&y)?;
                if let Some(z) = call.output_opt(1) {
                    z.write_vec(&parts.iter().map(|p| p.len() as i64).collect::<Vec<_>>())?;
                }
                Ok(())
            }
            "RegexFullMatch" => {
                let re = full_match(call)?;
                let m: Vec<Bool> =
                    xs.iter().map(|s| Bool(core::str::from_utf8(s).is_ok_and(|s| re.is_match(s)))).collect();
                call.output(0)?.write_vec(&m)
            }
            "StringNormalizer" => {
                let mut kept = normalize(call, &xs)?;
                if kept.is_empty() {
                    kept.push(String::new());
                }
                call.output(0)?.write_strings(&kept)
            }
            other => unsupported!("kiln-string does not implement {other}"),
        }
    }
}

export_shim!(Strings);
