//! The CPU backend: a node runs through its package's CPU reference (`kiln_cpu`) on host
//! bytes. Outputs are zeroed buffers the shim writes through the `write` import (one bound in
//! place to an input starts as that input's bytes instead: `ep::shims`, ABI.md §7.8).

use bytes::Bytes;
use kiln_kernel_abi::DType;

use crate::sandbox::{Access, ArgTensor, CallOutcome};
use crate::tensor::byte_size;
use crate::{Error, Result, Tensor};

/// Writable output buffers for the inferred output types (`None`: absent output); a string
/// output grows to what the shim writes, up to `max_string_bytes` (the session's tensor limit).
/// Outputs are zeros, except output j where `starts[j]` is `(i, bytes)` of its size: bound in
/// place to input i (ABI.md §7.8), it starts as those bytes (input i's) and says so.
pub fn output_args(
    types: &[Option<(DType, Vec<usize>)>],
    max_string_bytes: u64,
    mut starts: Vec<Option<(u32, Vec<u8>)>>,
) -> Vec<Option<ArgTensor<'static>>> {
    starts.resize_with(types.len(), || None);
    types
        .iter()
        .zip(starts)
        .map(|(t, start)| {
            t.as_ref().map(|(dtype, shape)| {
                let mut in_place_of = None;
                let (n, access) = match dtype {
                    // Strings: as many bytes as the shim writes, up to the tensor limit.
                    DType::String => (max_string_bytes, Access::Strings(Vec::new())),
                    d => {
                        let n = byte_size(*d, shape).unwrap_or(0);
                        let bytes = match start {
                            Some((i, bytes)) if bytes.len() as u64 == n => {
                                in_place_of = Some(i);
                                bytes
                            }
                            _ => vec![0u8; n as usize],
                        };
                        (n, Access::Write(bytes))
                    }
                };
                ArgTensor {
                    dtype: Some(*dtype),
                    dims: Some(shape.iter().map(|&d| d as i64).collect()),
                    value: None,
                    nbytes: n,
                    access,
                    paged: None,
                    constant: false,
                    in_place_of,
                }
            })
        })
        .collect()
}

/// The output tensors of a CPU call: slots `n_inputs..` in output order.
pub fn collect_outputs(
    outcome: CallOutcome,
    n_inputs: usize,
    types: &[Option<(DType, Vec<usize>)>],
) -> Result<Vec<Option<Tensor>>> {
    let mut slots = outcome.slots.into_iter().skip(n_inputs);
    let mut out = Vec::with_capacity(types.len());
    for t in types {
        out.push(match t {
            None => None,
            Some((dtype, shape)) => match slots.next().map(|s| s.access) {
                Some(Access::Write(v)) => Some(Tensor::new(*dtype, shape.clone(), Bytes::from(v))?),
                Some(Access::Strings(v)) => Some(
                    Tensor::new(*dtype, shape.clone(), Bytes::from(v))
                        .map_err(|e| Error::Device(format!("the shim's string output is not one of its shape: {e}")))?,
                ),
                _ => return Err(Error::Device("a CPU output buffer went missing".into())),
            },
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::Slot;

    /// A string output is whatever the shim wrote, checked as a string tensor of its shape.
    #[test]
    fn string_outputs_grow_to_what_the_shim_wrote_and_are_checked() {
        let types = vec![Some((DType::String, vec![2]))];
        let args = output_args(&types, 1 << 20, vec![]);
        let out = args[0].as_ref().unwrap();
        assert!(matches!(&out.access, Access::Strings(v) if v.is_empty()));
        assert_eq!(out.nbytes, 1 << 20, "room to grow, up to the limit");
        let outcome = |bytes: Vec<u8>| CallOutcome {
            slots: vec![Slot { dtype: Some(DType::String), nbytes: 0, access: Access::Strings(bytes), writable: true }],
            ..Default::default()
        };
        let good = kiln_kernel_abi::strings::encode(&["ab", "c"]).unwrap();
        let t = collect_outputs(outcome(good.clone()), 0, &types).unwrap().remove(0).unwrap();
        assert_eq!(t.strings().unwrap(), [&b"ab"[..], b"c"]);
        let err = collect_outputs(outcome(good[..good.len() - 1].to_vec()), 0, &types).unwrap_err().to_string();
        assert!(err.contains("the shim's string output is not one of its shape"), "{err}");
    }
}
