//! The CPU backend: a node runs through its package's CPU reference (`kiln_cpu`) on host
//! bytes. Outputs are zeroed buffers the shim writes through the `write` import.

use bytes::Bytes;
use kiln_kernel_abi::DType;

use crate::sandbox::{Access, ArgTensor, CallOutcome};
use crate::tensor::byte_size;
use crate::{Error, Result, Tensor};

/// Writable output buffers for the inferred output types (`None`: absent output).
pub fn output_args(types: &[Option<(DType, Vec<usize>)>]) -> Vec<Option<ArgTensor<'static>>> {
    types
        .iter()
        .map(|t| {
            t.as_ref().map(|(dtype, shape)| {
                let n = byte_size(*dtype, shape).unwrap_or(0);
                ArgTensor {
                    dtype: Some(*dtype),
                    dims: Some(shape.iter().map(|&d| d as i64).collect()),
                    value: None,
                    nbytes: n,
                    access: Access::Write(vec![0u8; n as usize]),
                    paged: None,
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
                _ => return Err(Error::Device("a CPU output buffer went missing".into())),
            },
        });
    }
    Ok(out)
}
