//! Channels-last activations between convolutions in an execution plan.
//!
//! cuDNN's tensor-core convolutions read and write NHWC; given NCHW float16 tensors they
//! transpose X and Y around every call (`cuda::dnn`'s module docs). In a plan, a value that only
//! cuDNN convolutions touch (one writes it as Y, every reader reads it as X or as the residual
//! Z) can live channels-last instead: nothing else ever reads its bytes. This pass picks those
//! values, as onnxruntime's CUDA provider does with its NHWC layout transformation, but without
//! rewriting the graph: which convolutions qualify is only known once the shims have dispatched.
//!
//! A convolution qualifies when its node's launch plan is that one cuDNN step, it can compute
//! channels-last ([`takes_channels_last`]: 2-D, float16 or bfloat16, forward), its filter is a
//! resident initializer (the session keeps a transposed copy) and every operand starts at its
//! tensor's first byte. A qualifying convolution that reads or writes a channels-last value
//! computes channels-last; its other activations (a graph input, a pooling's output, a value
//! some other node reads) stay NCHW and are transformed in its workspace.

use std::collections::{HashMap, HashSet};

use kiln_kernel_abi::plan::{LaunchPlan, PlanStep};
use kiln_kernel_abi::wire::Conv;

use super::plan::{RecIn, RecOut};
use crate::cuda::{takes_channels_last, ConvLayout};
use crate::model::ValueId;

/// One recorded step of a plan, as the pass reads it: its launch plan, then its inputs and
/// outputs (present ones, in slot order).
pub(super) struct StepView<'a> {
    pub launch: &'a LaunchPlan,
    pub inputs: &'a [(RecIn, u64)],
    pub outputs: &'a [(RecOut, u64)],
}

/// The qualifying convolution of a step (module docs), if it is one.
fn lone_conv<'a>(s: &StepView<'a>) -> Option<&'a Conv> {
    let [PlanStep::Conv(c)] = s.launch.steps.as_slice() else { return None };
    let whole = [Some(c.x), Some(c.w), c.z, Some(c.y)].iter().flatten().all(|t| t.offset == 0);
    let resident_filter = matches!(s.inputs.get(c.w.handle as usize), Some((RecIn::Fixed(_), _)));
    (whole && resident_filter && takes_channels_last(c)).then_some(c)
}

/// The value a step writes at slot `handle` (after its inputs), if it is a named value.
fn written(s: &StepView<'_>, handle: u32) -> Option<ValueId> {
    let k = (handle as usize).checked_sub(s.inputs.len())?;
    match s.outputs.get(k) {
        Some((RecOut::Value(v), _)) => Some(*v),
        _ => None,
    }
}

/// The layout of each step's convolution (the default, channels-first, for every step that is
/// not a qualifying convolution or touches no channels-last value). Steps flagged in `refused`
/// (cuDNN would not compute them channels-last) count as not qualifying.
pub(super) fn conv_layouts(steps: &[StepView<'_>], refused: &[bool]) -> Vec<ConvLayout> {
    let lone: Vec<Option<&Conv>> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| lone_conv(s).filter(|_| !refused.get(i).copied().unwrap_or(false)))
        .collect();
    let mut readers: HashMap<ValueId, Vec<(usize, usize)>> = HashMap::new();
    for (i, s) in steps.iter().enumerate() {
        for (slot, (input, _)) in s.inputs.iter().enumerate() {
            if let RecIn::Produced(v) = input {
                readers.entry(*v).or_default().push((i, slot));
            }
        }
    }
    // Read as an activation (X or Z) by a qualifying convolution, and as nothing else.
    let activation = |j: usize, slot: usize| {
        lone[j].is_some_and(|c| slot == c.x.handle as usize || c.z.is_some_and(|z| z.handle as usize == slot))
    };
    let last: HashSet<ValueId> = steps
        .iter()
        .zip(&lone)
        .filter_map(|(s, c)| {
            let v = written(s, (*c)?.y.handle)?;
            let r = readers.get(&v)?;
            r.iter().all(|&(j, slot)| activation(j, slot)).then_some(v)
        })
        .collect();
    steps
        .iter()
        .zip(&lone)
        .map(|(s, c)| {
            let Some(c) = c else { return ConvLayout::default() };
            let read_last = |handle: u32| {
                matches!(s.inputs.get(handle as usize), Some((RecIn::Produced(v), _)) if last.contains(v))
            };
            ConvLayout {
                x_last: read_last(c.x.handle),
                z_last: c.z.is_some_and(|z| read_last(z.handle)),
                y_last: written(s, c.y.handle).is_some_and(|v| last.contains(&v)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_kernel_abi::wire::{Epilogue, TensorAt};
    use kiln_kernel_abi::DType;

    /// A lone 3×3 float16 convolution step over 8 channels of 16×16, slots X, W, bias (, Z), Y.
    fn conv_plan(dtype: DType, z: bool) -> LaunchPlan {
        let at = |handle| TensorAt { handle, offset: 0 };
        let c = Conv {
            dtype,
            transposed: false,
            batch: 1,
            in_channels: 8,
            out_channels: 8,
            groups: 1,
            input: vec![16, 16],
            output: vec![16, 16],
            kernel: vec![3, 3],
            strides: vec![1, 1],
            dilations: vec![1, 1],
            pads_begin: vec![1, 1],
            x: at(0),
            w: at(1),
            bias: Some(at(2)),
            z: z.then(|| at(3)),
            y: at(if z { 4 } else { 3 }),
            epilogue: Epilogue::Relu,
        };
        LaunchPlan { scratch_bytes: vec![], steps: vec![PlanStep::Conv(c)] }
    }

    struct Rec {
        launch: LaunchPlan,
        inputs: Vec<(RecIn, u64)>,
        outputs: Vec<(RecOut, u64)>,
    }

    fn conv(x: RecIn, z: Option<RecIn>, y: ValueId) -> Rec {
        let mut inputs = vec![(x, 4096), (RecIn::Fixed(0x1000), 1152), (RecIn::Fixed(0x2000), 16)];
        let launch = conv_plan(DType::F16, z.is_some());
        inputs.extend(z.map(|z| (z, 4096)));
        Rec { launch, inputs, outputs: vec![(RecOut::Value(y), 4096)] }
    }

    /// Any other node: a launch (a pooling, say) reading `x`, writing `y`.
    fn other(x: RecIn, y: RecOut) -> Rec {
        let launch = LaunchPlan {
            scratch_bytes: vec![],
            steps: vec![PlanStep::Launch {
                kernel: "k".into(),
                grid: [1; 3],
                block: [1; 3],
                shared_mem_bytes: 0,
                args: vec![],
            }],
        };
        Rec { launch, inputs: vec![(x, 4096)], outputs: vec![(y, 4096)] }
    }

    fn layouts(recs: &[Rec]) -> Vec<(bool, bool, bool)> {
        let views: Vec<StepView<'_>> =
            recs.iter().map(|r| StepView { launch: &r.launch, inputs: &r.inputs, outputs: &r.outputs }).collect();
        conv_layouts(&views, &[]).into_iter().map(|l| (l.x_last, l.z_last, l.y_last)).collect()
    }

    #[test]
    fn values_only_convolutions_touch_live_channels_last_and_the_rest_stay_nchw() {
        use RecIn::{Feed, Produced};
        // A ResNet-like stretch: stem conv (graph input) → pool → two convs and a residual
        // block whose output an ordinary node reads, which writes the graph output.
        let recs = [
            conv(Feed(0), None, 1),                  // 0: stem; its Y goes to the pool
            other(Produced(1), RecOut::Value(2)),    // 1: pool
            conv(Produced(2), None, 3),              // 2: reads the pool's NCHW output
            conv(Produced(3), None, 4),              // 3: conv → conv
            conv(Produced(4), Some(Produced(2)), 5), // 4: Z is the pool's output (NCHW)
            conv(Produced(5), Some(Produced(4)), 6), // 5: Z is conv 3's Y, read by convs only
            other(Produced(6), RecOut::Bound(7)),    // 6: an ordinary reader of 6
        ];
        assert_eq!(
            layouts(&recs),
            vec![
                (false, false, false), // the stem's Y is read by the pool: NCHW throughout
                (false, false, false),
                (false, false, true), // X from the pool (NCHW), Y read by convs only
                (true, false, true),  // value 4 is read by conv 4 (X) and conv 5 (Z)
                (true, false, true),  // Z (value 2) is the pool's, NCHW; Y (5) read by conv 5 only
                (true, true, false),  // Y (6) is read by an ordinary node: NCHW
                (false, false, false),
            ]
        );
    }

    #[test]
    fn a_refused_convolution_keeps_its_values_nchw_and_the_others_keep_theirs() {
        use RecIn::{Feed, Produced};
        // Conv 0 → conv 1 → conv 2 → conv 3; cuDNN refuses conv 2 channels-last: values 2 and
        // 3 (its input and output) stay NCHW, value 1 (conv 0 → conv 1) stays NHWC.
        let recs = [
            conv(Feed(0), None, 1),
            conv(Produced(1), None, 2),
            conv(Produced(2), None, 3),
            conv(Produced(3), None, 4),
        ];
        let views: Vec<StepView<'_>> =
            recs.iter().map(|r| StepView { launch: &r.launch, inputs: &r.inputs, outputs: &r.outputs }).collect();
        let got: Vec<_> = conv_layouts(&views, &[false, false, true, false])
            .into_iter()
            .map(|l| (l.x_last, l.z_last, l.y_last))
            .collect();
        assert_eq!(got, vec![(false, false, true), (true, false, false), (false, false, false), (false, false, false)]);
    }

    #[test]
    fn a_value_read_as_a_filter_or_by_a_float32_convolution_stays_nchw() {
        use RecIn::{Feed, Produced};
        // Value 1 is conv 1's X and conv 2's filter (a computed filter: conv 2 does not
        // qualify, and value 1 stays NCHW). Value 3 is read by a float32 convolution.
        let mut recs = vec![conv(Feed(0), None, 1), conv(Produced(1), None, 2), conv(Feed(0), None, 9)];
        recs[2].inputs[1] = (Produced(1), 1152);
        recs.push(conv(Produced(2), None, 3));
        let mut f32_conv = conv(Produced(3), None, 4);
        f32_conv.launch = conv_plan(DType::F32, false);
        recs.push(f32_conv);
        assert_eq!(
            layouts(&recs),
            vec![
                (false, false, false),
                (false, false, true), // value 2 is read by conv 3 only
                (false, false, false),
                (true, false, false), // value 3 goes to the float32 conv: NCHW
                (false, false, false),
            ]
        );
    }
}
