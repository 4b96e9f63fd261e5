//! The graph IR: what the host knows of an ONNX model after loading.
//!
//! Values (graph inputs, initializers, node outputs) are numbered by [`ValueId`]; nodes are
//! kept in a topological order; initializers (and `Constant`-free constants) are host
//! [`Tensor`]s, external data memory-mapped.

mod external;
mod load;
mod tensor_proto;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_kernel_abi::wire;
use kiln_kernel_abi::DType;

use crate::Tensor;

pub use external::ExternalData;
pub use load::{initializer, load, load_bytes, MAX_SUBGRAPH_DEPTH, MAX_TENSOR_BYTES};
pub use tensor_proto::tensor_from_proto;

/// Index of a value in [`Graph::values`].
pub type ValueId = usize;

/// One dimension of a declared shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Known(usize),
    /// A named (symbolic) dimension such as `batch`.
    Symbolic(String),
    Unknown,
}

impl std::fmt::Display for Dim {
    /// `8`, `batch`, or `?` for an unknown dimension.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Known(n) => write!(f, "{n}"),
            Dim::Symbolic(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A declared shape as people write it: `[batch, 8]` (`?` for an unknown dimension).
pub fn format_dims(dims: &[Dim]) -> String {
    format!("[{}]", dims.iter().map(Dim::to_string).collect::<Vec<_>>().join(", "))
}

/// What a value holds (ONNX's TypeProto): a tensor, a sequence of tensors, or an optional of
/// either (If, Loop and the sequence ops carry the last two; packages take tensors only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    #[default]
    Tensor,
    Sequence,
    Optional(Box<Kind>),
}

impl std::fmt::Display for Kind {
    /// `tensor`, `sequence`, `optional tensor`, `optional sequence`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Tensor => f.write_str("tensor"),
            Kind::Sequence => f.write_str("sequence"),
            Kind::Optional(k) => write!(f, "optional {k}"),
        }
    }
}

/// The declared type of a value (from graph inputs, outputs and `value_info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueType {
    /// The element type (of the tensor, or of the sequence's or optional's tensors).
    pub dtype: DType,
    /// `None` when the rank is unknown, and for sequences and optionals.
    pub dims: Option<Vec<Dim>>,
    pub kind: Kind,
}

/// A named value of the graph.
#[derive(Clone, Debug)]
pub struct Value {
    pub name: String,
    pub ty: Option<ValueType>,
}

/// An attribute value (ONNX `AttributeProto`; sparse tensors, tensor lists and type lists are
/// refused at load as unsupported).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Float(f32),
    Int(i64),
    String(String),
    Tensor(Tensor),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
    /// A subgraph (If's branches, Loop's and Scan's body): run by the executor, never passed to
    /// a package.
    Graph(Arc<Subgraph>),
    Graphs(Vec<Arc<Subgraph>>),
    /// A type (Optional's `type`): read by the executor, never passed to a package.
    Type(ValueType),
}

/// A subgraph of a control-flow node. Its graph inputs are its formal inputs (the first
/// `formal_inputs`), then the outer-scope values it reads, each under its outer name; the node
/// that holds it lists those values as its implicit inputs.
#[derive(Debug)]
pub struct Subgraph {
    pub graph: Graph,
    pub formal_inputs: usize,
}

impl Subgraph {
    /// The outer-scope values the subgraph reads (its inputs after the formal ones).
    pub fn captures(&self) -> &[ValueId] {
        &self.graph.inputs[self.formal_inputs..]
    }
}

impl PartialEq for Subgraph {
    /// The same subgraph (graphs are not compared by content).
    fn eq(&self, other: &Subgraph) -> bool {
        std::ptr::eq(self, other)
    }
}

/// A node of the graph.
#[derive(Clone, Debug)]
pub struct Node {
    /// The node's name; `op_type#index` (position in the file) for unnamed nodes.
    pub name: String,
    pub op_type: String,
    /// `""` for ai.onnx.
    pub domain: String,
    /// `None` for an absent optional input (empty name). A control-flow node's last
    /// `implicit_inputs` are the outer-scope values its subgraphs read (ONNX's implicit inputs),
    /// after the op's own.
    pub inputs: Vec<Option<ValueId>>,
    /// How many of `inputs`, at the end, are implicit (0 but for control flow).
    pub implicit_inputs: usize,
    /// `None` for an output left out.
    pub outputs: Vec<Option<ValueId>>,
    pub attributes: Vec<(String, AttrValue)>,
}

impl Node {
    /// Whether this is control flow the executor runs rather than a package (ai.onnx If, Loop,
    /// Scan, SequenceMap: the ops with subgraphs).
    pub fn is_control_flow(&self) -> bool {
        self.domain.is_empty() && matches!(self.op_type.as_str(), "If" | "Loop" | "Scan" | "SequenceMap")
    }

    /// The op's own inputs (without the implicit ones).
    pub fn explicit_inputs(&self) -> &[Option<ValueId>] {
        &self.inputs[..self.inputs.len() - self.implicit_inputs]
    }

    /// Attributes in the ABI's borrowed form (subgraphs and types, which no package reads, left
    /// out).
    pub fn wire_attributes(&self) -> Vec<wire::Attribute<'_>> {
        self.attributes
            .iter()
            .filter_map(|(name, v)| {
                let value = match v {
                    AttrValue::Float(x) => wire::AttrValue::Float(*x),
                    AttrValue::Int(x) => wire::AttrValue::Int(*x),
                    AttrValue::String(s) => wire::AttrValue::String(s),
                    AttrValue::Tensor(t) => {
                        wire::AttrValue::Tensor(wire::TensorValue { dtype: t.dtype, dims: t.dims_i64(), data: &t.data })
                    }
                    AttrValue::Floats(x) => wire::AttrValue::Floats(x.clone()),
                    AttrValue::Ints(x) => wire::AttrValue::Ints(x.clone()),
                    AttrValue::Strings(x) => wire::AttrValue::Strings(x.iter().map(String::as_str).collect()),
                    AttrValue::Graph(_) | AttrValue::Graphs(_) | AttrValue::Type(_) => return None,
                };
                Some(wire::Attribute { name, value })
            })
            .collect()
    }
}

/// The graph: values, nodes in topological order, graph inputs/outputs, initializers.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    /// Graph inputs the caller must feed (initializers excluded).
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub initializers: HashMap<ValueId, Tensor>,
}

impl Graph {
    /// The dtype of tensor `v` known before a run: an initializer's, or the declared one
    /// (`None` for a sequence or optional).
    pub fn declared_dtype(&self, v: ValueId) -> Option<DType> {
        self.initializers.get(&v).map(|t| t.dtype).or_else(|| {
            let ty = self.values.get(v)?.ty.as_ref()?;
            (ty.kind == Kind::Tensor).then_some(ty.dtype)
        })
    }

    /// The declared kind of `v` (a tensor when undeclared).
    pub fn kind(&self, v: ValueId) -> Kind {
        self.values.get(v).and_then(|x| x.ty.as_ref()).map(|t| t.kind.clone()).unwrap_or_default()
    }

    /// Every node with the graph it is in: this graph's, then, depth first, those of the
    /// subgraphs its nodes hold.
    pub fn nodes_with_subgraphs(&self) -> Vec<(&Graph, &Node)> {
        let mut out = Vec::new();
        for n in &self.nodes {
            out.push((self, n));
            for (_, v) in &n.attributes {
                let subs: &[Arc<Subgraph>] = match v {
                    AttrValue::Graph(g) => std::slice::from_ref(g),
                    AttrValue::Graphs(gs) => gs,
                    _ => &[],
                };
                for sub in subs {
                    out.extend(sub.graph.nodes_with_subgraphs());
                }
            }
        }
        out
    }

    pub fn value_id(&self, name: &str) -> Option<ValueId> {
        self.values.iter().position(|v| v.name == name)
    }
}

/// A loaded model.
#[derive(Clone, Debug)]
pub struct Model {
    /// The file it came from, if any.
    pub path: Option<PathBuf>,
    pub ir_version: i64,
    /// Opset version per domain (`""` for ai.onnx).
    pub opsets: HashMap<String, i64>,
    pub producer: String,
    pub graph: Graph,
}

impl Model {
    /// The model's opset for `domain` (`""` and `ai.onnx` are the same).
    pub fn opset(&self, domain: &str) -> Option<i64> {
        let d = if domain == "ai.onnx" { "" } else { domain };
        self.opsets.get(d).copied()
    }
}
