//! ONNX's sequence and optional ops, run by the executor on host values ([`HostValue`]), as
//! onnxruntime runs them on its CPU: SequenceEmpty, SequenceConstruct, SequenceInsert,
//! SequenceAt, SequenceErase, SequenceLength, SplitToSequence, ConcatFromSequence, Optional,
//! OptionalHasElement and OptionalGetElement (Operators.md; positions may be negative, counting
//! from the end). SequenceMap, which has a body, is control flow (`control`).

use kiln_kernel_abi::DType;

use super::host_tensor::{concat, normalize_axis, split, stack};
use super::HostValue;
use crate::model::{AttrValue, Node};
use crate::{Error, Result, Tensor};

/// Whether `node` is a sequence or optional op the executor runs (`kiln inspect` lists it as
/// the executor's, as it does control flow).
pub fn is_sequence_op(node: &Node) -> bool {
    node.domain.is_empty()
        && matches!(
            node.op_type.as_str(),
            "SequenceEmpty"
                | "SequenceConstruct"
                | "SequenceInsert"
                | "SequenceAt"
                | "SequenceErase"
                | "SequenceLength"
                | "SplitToSequence"
                | "ConcatFromSequence"
                | "Optional"
                | "OptionalHasElement"
                | "OptionalGetElement"
        )
}

/// Runs sequence or optional op `node` on `inputs`; returns its one output. Errors name the
/// node: a wrong kind of input, a position out of range, tensors that do not join.
pub(super) fn run(node: &Node, inputs: Vec<Option<HostValue>>) -> Result<Vec<Option<HostValue>>> {
    let at = format!("node {:?} ({}): ", node.name, node.op_type);
    compute(node, inputs).map(|v| vec![Some(v)]).map_err(|e| e.context(&at))
}

fn compute(node: &Node, inputs: Vec<Option<HostValue>>) -> Result<HostValue> {
    let mut inputs = inputs.into_iter();
    let mut next = |what: &str| inputs.next().flatten().ok_or_else(|| Error::Model(format!("{what} is left out")));
    Ok(match node.op_type.as_str() {
        "SequenceEmpty" => HostValue::Sequence(Vec::new()),
        "SequenceConstruct" => {
            let mut seq = Vec::new();
            while let Ok(v) = next("input") {
                seq.push(v.into_tensor("an input")?);
            }
            let Some(first) = seq.first() else {
                return Err(Error::Model("SequenceConstruct takes 1 or more inputs".into()));
            };
            if let Some(odd) = seq.iter().find(|t| t.dtype != first.dtype) {
                return Err(Error::Input(format!("the tensors' dtypes differ: {} and {}", first.dtype, odd.dtype)));
            }
            HostValue::Sequence(seq)
        }
        "SequenceInsert" => {
            let mut seq = next("input_sequence")?.into_sequence("input_sequence")?;
            let t = next("tensor")?.into_tensor("tensor")?;
            if let Some(odd) = seq.first().filter(|f| f.dtype != t.dtype) {
                return Err(Error::Input(format!("the tensor is {}, the sequence's are {}", t.dtype, odd.dtype)));
            }
            let n = seq.len();
            let pos = match next("position") {
                Ok(p) => position(&p.into_tensor("position")?, n, true)?,
                Err(_) => n,
            };
            seq.insert(pos, t);
            HostValue::Sequence(seq)
        }
        "SequenceAt" => {
            let seq = next("input_sequence")?.into_sequence("input_sequence")?;
            let pos = position(&next("position")?.into_tensor("position")?, seq.len(), false)?;
            HostValue::Tensor(seq.into_iter().nth(pos).ok_or_else(|| Error::Input("position is out of range".into()))?)
        }
        "SequenceErase" => {
            let mut seq = next("input_sequence")?.into_sequence("input_sequence")?;
            let n = seq.len();
            let pos = match next("position") {
                Ok(p) => position(&p.into_tensor("position")?, n, false)?,
                Err(_) if n > 0 => n - 1,
                Err(_) => return Err(Error::Input("erasing from an empty sequence".into())),
            };
            seq.remove(pos);
            HostValue::Sequence(seq)
        }
        "SequenceLength" => {
            let n = next("input_sequence")?.into_sequence("input_sequence")?.len() as i64;
            HostValue::Tensor(Tensor::new(DType::I64, vec![], n.to_le_bytes().to_vec().into())?)
        }
        "SplitToSequence" => {
            let t = next("input")?.into_tensor("input")?;
            let axis = normalize_axis(int_attr(node, "axis", 0)?, t.shape.len(), "SplitToSequence")?;
            let len = t.shape[axis];
            let (sizes, squeeze) = match next("split") {
                Err(_) => (vec![1; len], int_attr(node, "keepdims", 1)? == 0),
                Ok(s) => {
                    let s = s.into_tensor("split")?;
                    let v = ints(&s)?;
                    if v.iter().any(|&x| x < 0) {
                        return Err(Error::Input(format!("split {v:?} has a negative size")));
                    }
                    match (s.shape.len(), v.as_slice()) {
                        (0, [0]) => return Err(Error::Input("split must be positive".into())),
                        (0, [c]) => {
                            let c = *c as usize;
                            ((0..len.div_ceil(c)).map(|i| c.min(len - i * c)).collect(), false)
                        }
                        _ => (v.iter().map(|&x| x as usize).collect(), false),
                    }
                }
            };
            let mut parts = split(&t, axis, &sizes)?;
            if squeeze {
                parts.iter_mut().for_each(|p| {
                    p.shape.remove(axis);
                });
            }
            HostValue::Sequence(parts)
        }
        "ConcatFromSequence" => {
            let seq = next("input_sequence")?.into_sequence("input_sequence")?;
            let rank =
                seq.first().map(|t| t.shape.len()).ok_or_else(|| Error::Input("the sequence is empty".into()))?;
            let axis = int_attr(node, "axis", i64::MIN)?;
            if axis == i64::MIN {
                return Err(Error::Model("attribute axis is required".into()));
            }
            HostValue::Tensor(if int_attr(node, "new_axis", 0)? == 1 {
                stack(&seq, normalize_axis(axis, rank + 1, "ConcatFromSequence")?, false)?
            } else {
                concat(&seq, normalize_axis(axis, rank, "ConcatFromSequence")?)?
            })
        }
        "Optional" => HostValue::Optional(next("input").ok().map(Box::new)),
        "OptionalHasElement" => {
            let has = match next("input") {
                Ok(HostValue::Optional(v)) => v.is_some(),
                Ok(_) => true,
                Err(_) => false,
            };
            HostValue::Tensor(Tensor::new(DType::Bool, vec![], vec![has as u8].into())?)
        }
        "OptionalGetElement" => match next("input")? {
            HostValue::Optional(Some(v)) => *v,
            HostValue::Optional(None) => return Err(Error::Input("the optional is empty".into())),
            v => v,
        },
        other => return Err(Error::Model(format!("{other} is not a sequence op"))),
    })
}

/// An int attribute, or `default`.
fn int_attr(node: &Node, name: &str, default: i64) -> Result<i64> {
    match node.attributes.iter().find(|(n, _)| n == name).map(|(_, v)| v) {
        None => Ok(default),
        Some(AttrValue::Int(v)) => Ok(*v),
        Some(_) => Err(Error::Model(format!("attribute {name:?} must be an int"))),
    }
}

/// An int32 or int64 tensor's values.
fn ints(t: &Tensor) -> Result<Vec<i64>> {
    match t.dtype {
        DType::I32 => Ok(t.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect()),
        DType::I64 => t.to_i64(),
        other => Err(Error::Input(format!("positions and splits are int32 or int64, not {other}"))),
    }
}

/// A scalar position in a sequence of `n`: `-n..n` (`-n..=n` where `end` allows inserting after
/// the last), negative counting from the end.
fn position(t: &Tensor, n: usize, end: bool) -> Result<usize> {
    let [p] = ints(t)?[..] else { return Err(Error::Input(format!("position must be a scalar, not {:?}", t.shape))) };
    let n = n as i64;
    let hi = if end { n } else { n - 1 };
    if p < -n || p > hi {
        return Err(Error::Input(format!("position {p} is out of range for a sequence of {n}")));
    }
    Ok((if p < 0 { p + n } else { p }) as usize)
}
