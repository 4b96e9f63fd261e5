//! String tensors' bytes (ABI.md §6, manifest schema 12): a string tensor of `n` elements is
//! `n + 1` little-endian `u32` offsets, then the elements' bytes one after another. Offset 0 is
//! 0, offsets never decrease, and element `i` is bytes `offsets[i] .. offsets[i + 1]` of the text
//! that follows the table; the text's length is `offsets[n]`, and nothing follows it. Elements
//! are bytes, as ONNX's `TensorProto.string_data` (UTF-8 by convention, not checked here).

use alloc::vec::Vec;

/// Why bytes are not a string tensor of the expected size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StringsError {
    /// Fewer bytes than the offset table, or than the text it describes.
    Truncated,
    /// An offset below the one before it, or a first offset other than 0.
    Offsets,
    /// Bytes after the text.
    Trailing,
    /// More than 4 GiB of text or 2^32 − 1 elements.
    TooLarge,
}

impl core::fmt::Display for StringsError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            StringsError::Truncated => "the bytes end before the offsets or the text they describe",
            StringsError::Offsets => "the offsets do not start at 0 and never decrease",
            StringsError::Trailing => "bytes follow the text",
            StringsError::TooLarge => "more than 4 GiB of text or 2^32 - 1 elements",
        })
    }
}

/// The bytes of a string tensor holding `elements`, in order.
pub fn encode<S: AsRef<[u8]>>(elements: &[S]) -> Result<Vec<u8>, StringsError> {
    let text: usize = elements.iter().map(|e| e.as_ref().len()).sum();
    if u32::try_from(text).is_err() || u32::try_from(elements.len()).is_err() {
        return Err(StringsError::TooLarge);
    }
    let mut out = Vec::with_capacity(4 * (elements.len() + 1) + text);
    let mut at = 0u32;
    out.extend_from_slice(&at.to_le_bytes());
    for e in elements {
        at += e.as_ref().len() as u32;
        out.extend_from_slice(&at.to_le_bytes());
    }
    for e in elements {
        out.extend_from_slice(e.as_ref());
    }
    Ok(out)
}

/// The bytes the offset table of `numel` elements takes, or `None` past `u32` elements.
pub fn table_bytes(numel: usize) -> Option<usize> {
    u32::try_from(numel).ok()?;
    numel.checked_add(1)?.checked_mul(4)
}

/// The `numel` elements of a string tensor's `bytes`, checked (see the module's layout).
pub fn decode(bytes: &[u8], numel: usize) -> Result<Vec<&[u8]>, StringsError> {
    let table = table_bytes(numel).ok_or(StringsError::TooLarge)?;
    if bytes.len() < table {
        return Err(StringsError::Truncated);
    }
    let offset = |i: usize| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    if offset(0) != 0 {
        return Err(StringsError::Offsets);
    }
    let text = &bytes[table..];
    let end = offset(numel) as usize;
    if text.len() < end {
        return Err(StringsError::Truncated);
    }
    if text.len() > end {
        return Err(StringsError::Trailing);
    }
    let mut out = Vec::with_capacity(numel);
    for i in 0..numel {
        let (a, b) = (offset(i) as usize, offset(i + 1) as usize);
        if b < a || b > end {
            return Err(StringsError::Offsets);
        }
        out.push(&text[a..b]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_round_trip_and_broken_bytes_are_refused() {
        let e = encode(&["abc", "", "的"]).unwrap();
        assert_eq!(&e[..16], &[0, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0, 0, 6, 0, 0, 0]);
        assert_eq!(decode(&e, 3).unwrap(), [&b"abc"[..], b"", "的".as_bytes()]);
        assert_eq!(decode(&encode::<&str>(&[]).unwrap(), 0).unwrap().len(), 0);
        for cut in 0..e.len() {
            assert!(decode(&e[..cut], 3).is_err(), "cut at {cut}");
        }
        let mut long = e.clone();
        long.push(b'x');
        assert_eq!(decode(&long, 3), Err(StringsError::Trailing));
        let mut down = e.clone();
        down[8] = 1; // offsets 0, 3, 1, 6
        assert_eq!(decode(&down, 3), Err(StringsError::Offsets));
        assert_eq!(decode(&e, 2), Err(StringsError::Trailing), "another element count");
    }
}
