//! ONNX protobuf → [`Model`]. Every inconsistency is an [`Error::Model`] naming what is
//! wrong; features kiln does not run (maps, sparse tensors, subgraphs nested past
//! [`MAX_SUBGRAPH_DEPTH`]) are [`Error::Unsupported`]. Subgraphs (the bodies of If, Loop and
//! Scan) load as graphs of their own, their reads of outer-scope values resolved here.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;

use kiln_kernel_abi::DType;
use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::{type_proto, AttributeProto, GraphProto, Message, ModelProto, ValueInfoProto};

use super::{
    tensor_from_proto, AttrValue, Dim, ExternalData, Graph, Kind, Model, Node, Subgraph, Value, ValueId, ValueType,
};
use crate::{Error, Tensor};

/// Largest single tensor a model may declare, in bytes (64 GiB): beyond this a dimension is
/// taken as corrupt rather than attempted.
pub const MAX_TENSOR_BYTES: u64 = 64 << 30;

/// Loads `path`; external data is resolved against its folder.
pub fn load(path: &Path) -> Result<Model, Error> {
    let started = std::time::Instant::now();
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let mut m = load_bytes(&bytes, path.parent().map(Path::to_path_buf).or_else(|| Some(".".into())))?;
    m.path = Some(path.to_path_buf());
    tracing::info!(
        path = %path.display(),
        nodes = m.graph.nodes.len(),
        initializers = m.graph.initializers.len(),
        ms = started.elapsed().as_millis() as u64,
        "model loaded"
    );
    Ok(m)
}

/// Loads a serialized `ModelProto`; `base` is the folder external data is relative to.
pub fn load_bytes(bytes: &[u8], base: Option<std::path::PathBuf>) -> Result<Model, Error> {
    let proto = ModelProto::parse_from_bytes(bytes)
        .map_err(|e| Error::Model(format!("not a valid ONNX protobuf (truncated or not an .onnx file?): {e}")))?;
    let Some(g) = proto.graph.as_ref() else {
        return Err(Error::Model("the model has no graph".into()));
    };
    let mut opsets = HashMap::new();
    for o in &proto.opset_import {
        let d = if o.domain == "ai.onnx" { String::new() } else { o.domain.clone() };
        opsets.insert(d, o.version);
    }
    if proto.opset_import.is_empty() {
        return Err(Error::Model("the model imports no opset (opset_import is empty)".into()));
    }
    let ext = ExternalData::new(base);
    let (graph, _) = load_graph(g, None, &ext, 0)?;
    Ok(Model { path: None, ir_version: proto.ir_version, opsets, producer: proto.producer_name.clone(), graph })
}

/// Most levels of subgraphs inside subgraphs (an If in a Loop body is 2): deeper nesting is
/// refused at load as a model kiln does not run, rather than recursed into.
pub const MAX_SUBGRAPH_DEPTH: usize = 16;

/// The names a subgraph may read from the graphs around it (ONNX's outer scope): every value
/// each enclosing graph defines, the innermost first.
struct Scope<'a> {
    names: HashSet<String>,
    parent: Option<&'a Scope<'a>>,
}

impl Scope<'_> {
    fn visible(&self, name: &str) -> bool {
        self.names.contains(name) || self.parent.is_some_and(|p| p.visible(name))
    }
}

/// Loads one graph: the main graph (`scope` `None`) or a subgraph at nesting `depth`, whose
/// reads of outer-scope values become graph inputs after its own (returned as their names, in
/// order: the captures a control-flow node feeds it).
fn load_graph(
    g: &GraphProto,
    scope: Option<&Scope<'_>>,
    ext: &ExternalData,
    depth: usize,
) -> Result<(Graph, Vec<String>), Error> {
    let mut b = Builder::default();
    let what = if scope.is_some() { format!("subgraph {:?}", g.name) } else { "the graph".to_string() };
    let prefix = if scope.is_some() { format!("{what}: ") } else { String::new() };
    for t in &g.initializer {
        if t.name.is_empty() {
            return Err(Error::Model(format!("an initializer of {what} has no name")));
        }
        let tensor = tensor_from_proto(t, &format!("initializer {:?}", t.name), ext)?;
        let id = b.define(&t.name, "initializer")?;
        b.graph.initializers.insert(id, tensor);
    }
    if !g.sparse_initializer.is_empty() {
        return Err(Error::Unsupported("sparse initializers".into()));
    }
    for vi in &g.input {
        let ty = value_type(vi)?;
        match b.ids.get(&vi.name) {
            // IR >= 4: an initializer may also be listed as an input (an overridable default).
            Some(&id) => b.graph.values[id].ty = ty,
            None => {
                let id = b.define(&vi.name, "graph input")?;
                b.graph.values[id].ty = ty;
                b.graph.inputs.push(id);
            }
        }
    }
    for (i, n) in g.node.iter().enumerate() {
        let label = if n.name.is_empty() { format!("{}#{i}", n.op_type) } else { n.name.clone() };
        let mut outputs = Vec::with_capacity(n.output.len());
        for o in &n.output {
            outputs.push(if o.is_empty() { None } else { Some(b.define(o, &format!("output of node {label:?}"))?) });
        }
        b.graph.nodes.push(Node {
            // Unnamed nodes get a name for messages, fixed at load (file order).
            name: label,
            op_type: n.op_type.clone(),
            domain: if n.domain == "ai.onnx" { String::new() } else { n.domain.clone() },
            inputs: Vec::new(),
            implicit_inputs: 0,
            outputs,
            attributes: Vec::new(),
        });
    }
    // What this graph's subgraphs see: every name it defines, and what its own scope sees.
    let inner = Scope { names: b.ids.keys().cloned().collect(), parent: scope };
    // Attributes and inputs after every output is defined, so that order problems are reported
    // as cycles, and a subgraph may read any value of this graph.
    for (i, n) in g.node.iter().enumerate() {
        let label = b.graph.nodes[i].name.clone();
        let mut attributes = Vec::with_capacity(n.attribute.len());
        let mut implicit: Vec<String> = Vec::new();
        for a in &n.attribute {
            let v = match attr_graphs(a) {
                Some(graphs) => {
                    if depth >= MAX_SUBGRAPH_DEPTH {
                        return Err(Error::Unsupported(format!(
                            "node {label:?}: attribute {:?} nests subgraphs more than {MAX_SUBGRAPH_DEPTH} deep",
                            a.name
                        )));
                    }
                    let mut subs = Vec::with_capacity(graphs.len());
                    for sg in graphs {
                        let (graph, captures) = load_graph(sg, Some(&inner), ext, depth + 1)
                            .map_err(|e| e.context(&format!("in node {label:?}'s subgraph {:?}: ", a.name)))?;
                        for c in &captures {
                            if !implicit.contains(c) {
                                implicit.push(c.clone());
                            }
                        }
                        subs.push(Arc::new(Subgraph { formal_inputs: graph.inputs.len() - captures.len(), graph }));
                    }
                    match a.type_.enum_value() {
                        Ok(AttributeType::GRAPH) => AttrValue::Graph(subs.pop().ok_or_else(|| {
                            Error::Model(format!("node {label:?}: GRAPH attribute {:?} has no graph", a.name))
                        })?),
                        _ => AttrValue::Graphs(subs),
                    }
                }
                None => attr_value(&label, a, ext)?,
            };
            attributes.push((a.name.clone(), v));
        }
        let mut inputs = Vec::with_capacity(n.input.len() + implicit.len());
        for name in &n.input {
            if name.is_empty() {
                inputs.push(None);
                continue;
            }
            let id = b.read(name, scope).ok_or_else(|| {
                Error::Model(format!(
                    "node {label:?} reads {name:?}, which no node produces and is neither an input nor an initializer"
                ))
            })?;
            inputs.push(Some(id));
        }
        for name in &implicit {
            // A subgraph only captures names its scope (ours included) defines.
            let id = b.read(name, scope).ok_or_else(|| {
                Error::Model(format!("node {label:?}: a subgraph reads {name:?}, which no enclosing graph defines"))
            })?;
            inputs.push(Some(id));
        }
        let node = &mut b.graph.nodes[i];
        node.implicit_inputs = implicit.len();
        node.inputs = inputs;
        node.attributes = attributes;
    }
    for vi in &g.output {
        let id = b
            .read(&vi.name, scope)
            .ok_or_else(|| Error::Model(format!("{prefix}graph output {:?} is never produced", vi.name)))?;
        if let Some(ty) = value_type(vi)? {
            b.graph.values[id].ty.get_or_insert(ty);
        }
        b.graph.outputs.push(id);
    }
    if b.graph.outputs.is_empty() {
        return Err(Error::Model(format!("{what} declares no outputs")));
    }
    for vi in &g.value_info {
        if let (Some(&id), Ok(Some(ty))) = (b.ids.get(&vi.name), value_type(vi)) {
            b.graph.values[id].ty.get_or_insert(ty);
        }
    }
    let captures: Vec<String> = b.captures.iter().map(|&id| b.graph.values[id].name.clone()).collect();
    let mut graph = b.graph;
    graph.inputs.extend(b.captures);
    graph.nodes = topological_order(&graph)?;
    Ok((graph, captures))
}

/// The subgraphs of a GRAPH or GRAPHS attribute (`None`: another type).
fn attr_graphs(a: &AttributeProto) -> Option<Vec<&GraphProto>> {
    match a.type_.enum_value() {
        Ok(AttributeType::GRAPH) => Some(a.g.as_ref().into_iter().collect()),
        Ok(AttributeType::GRAPHS) => Some(a.graphs.iter().collect()),
        _ => None,
    }
}

#[derive(Default)]
struct Builder {
    graph: Graph,
    ids: HashMap<String, ValueId>,
    /// Values read from an outer scope (a subgraph's captures), in the order first read.
    captures: Vec<ValueId>,
}

impl Builder {
    /// Defines a new value; a name defined twice breaks ONNX's single assignment.
    fn define(&mut self, name: &str, what: &str) -> Result<ValueId, Error> {
        if self.ids.contains_key(name) {
            return Err(Error::Model(format!("value {name:?} ({what}) is defined twice")));
        }
        let id = self.graph.values.len();
        self.graph.values.push(Value { name: name.to_string(), ty: None });
        self.ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// The value `name` reads: one of this graph's, or an outer-scope value `scope` sees, which
    /// becomes a capture on its first read. `None`: no graph defines it.
    fn read(&mut self, name: &str, scope: Option<&Scope<'_>>) -> Option<ValueId> {
        if let Some(&id) = self.ids.get(name) {
            return Some(id);
        }
        if !scope?.visible(name) {
            return None;
        }
        let id = self.define(name, "outer-scope value").ok()?;
        self.captures.push(id);
        Some(id)
    }
}

fn value_type(vi: &ValueInfoProto) -> Result<Option<ValueType>, Error> {
    match vi.type_.as_ref() {
        None => Ok(None),
        Some(tp) => type_of(tp, &vi.name),
    }
}

/// A TypeProto as kiln runs it: a tensor, a sequence of tensors, or an optional of either.
fn type_of(tp: &onnx_protobuf::TypeProto, name: &str) -> Result<Option<ValueType>, Error> {
    let unsupported = |what: &str| {
        Err(Error::Unsupported(format!(
            "value {name:?} has {what} type; kiln runs tensors, sequences of tensors and optionals of them"
        )))
    };
    match &tp.value {
        None => Ok(None),
        Some(type_proto::Value::TensorType(t)) => {
            let dtype = DType::from_code(t.elem_type).ok_or_else(|| {
                Error::Unsupported(format!(
                    "value {name:?} has element type {} (ONNX code), which kiln does not support",
                    t.elem_type
                ))
            })?;
            let dims = t.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimValue(v)) if *v >= 0 => {
                            Dim::Known(*v as usize)
                        }
                        Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimParam(p)) => {
                            Dim::Symbolic(p.clone())
                        }
                        _ => Dim::Unknown,
                    })
                    .collect()
            });
            Ok(Some(ValueType { dtype, dims, kind: Kind::Tensor }))
        }
        Some(type_proto::Value::SequenceType(s)) => {
            match s.elem_type.as_ref().map(|e| type_of(e, name)).transpose()?.flatten() {
                Some(ValueType { dtype, kind: Kind::Tensor, .. }) => {
                    Ok(Some(ValueType { dtype, dims: None, kind: Kind::Sequence }))
                }
                Some(_) => unsupported("a sequence of non-tensors"),
                None => unsupported("a sequence of an undeclared element"),
            }
        }
        Some(type_proto::Value::OptionalType(o)) => {
            match o.elem_type.as_ref().map(|e| type_of(e, name)).transpose()?.flatten() {
                Some(ValueType { dtype, kind: kind @ (Kind::Tensor | Kind::Sequence), .. }) => {
                    Ok(Some(ValueType { dtype, dims: None, kind: Kind::Optional(Box::new(kind)) }))
                }
                Some(_) => unsupported("an optional of an optional"),
                None => unsupported("an optional of an undeclared element"),
            }
        }
        Some(type_proto::Value::MapType(_)) => unsupported("a map"),
        Some(type_proto::Value::SparseTensorType(_)) => unsupported("a sparse tensor"),
        Some(_) => unsupported("a non-tensor"),
    }
}

fn attr_value(node: &str, a: &AttributeProto, ext: &ExternalData) -> Result<AttrValue, Error> {
    let unsupported = |what: &str| Err(Error::Unsupported(format!("node {node:?}: attribute {:?} is {what}", a.name)));
    if !a.ref_attr_name.is_empty() {
        return unsupported("a reference to a function attribute");
    }
    let ty = a
        .type_
        .enum_value()
        .map_err(|v| Error::Model(format!("node {node:?}: attribute {:?} has unknown type {v}", a.name)))?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok(match ty {
        AttributeType::FLOAT => AttrValue::Float(a.f),
        AttributeType::INT => AttrValue::Int(a.i),
        AttributeType::STRING => AttrValue::String(text(&a.s)),
        AttributeType::TENSOR => match a.t.as_ref() {
            Some(t) => AttrValue::Tensor(tensor_from_proto(t, &format!("node {node:?}: attribute {:?}", a.name), ext)?),
            None => return Err(Error::Model(format!("node {node:?}: TENSOR attribute {:?} has no tensor", a.name))),
        },
        AttributeType::FLOATS => AttrValue::Floats(a.floats.clone()),
        AttributeType::INTS => AttrValue::Ints(a.ints.clone()),
        AttributeType::STRINGS => AttrValue::Strings(a.strings.iter().map(|s| text(s)).collect()),
        AttributeType::GRAPH | AttributeType::GRAPHS => {
            return Err(Error::Model(format!("node {node:?}: subgraph attribute {:?} reached attr_value", a.name)))
        }
        AttributeType::SPARSE_TENSOR | AttributeType::SPARSE_TENSORS => return unsupported("a sparse tensor"),
        AttributeType::TENSORS => return unsupported("a list of tensors"),
        AttributeType::TYPE_PROTO => match a
            .tp
            .as_ref()
            .map(|tp| type_of(tp, &a.name))
            .transpose()
            .map_err(|e| e.context(&format!("node {node:?}: attribute {:?}: ", a.name)))?
            .flatten()
        {
            Some(ty) => AttrValue::Type(ty),
            None => return Err(Error::Model(format!("node {node:?}: TYPE_PROTO attribute {:?} has no type", a.name))),
        },
        AttributeType::TYPE_PROTOS => return unsupported("a list of types"),
        AttributeType::UNDEFINED => {
            return Err(Error::Model(format!("node {node:?}: attribute {:?} has no type", a.name)));
        }
    })
}

/// Kahn's algorithm, stable in file order; a cycle is an error naming a node on it.
fn topological_order(g: &Graph) -> Result<Vec<Node>, Error> {
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in n.outputs.iter().flatten() {
            producer.insert(*o, i);
        }
    }
    let mut indegree = vec![0usize; g.nodes.len()];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        let deps: HashSet<usize> = n.inputs.iter().flatten().filter_map(|v| producer.get(v).copied()).collect();
        indegree[i] = deps.len();
        for d in deps {
            users[d].push(i);
        }
    }
    let mut ready: VecDeque<usize> = (0..g.nodes.len()).filter(|&i| indegree[i] == 0).collect();
    let mut order = Vec::with_capacity(g.nodes.len());
    while let Some(i) = ready.pop_front() {
        order.push(i);
        for &u in &users[i] {
            indegree[u] -= 1;
            if indegree[u] == 0 {
                ready.push_back(u);
            }
        }
    }
    if order.len() != g.nodes.len() {
        let stuck = (0..g.nodes.len()).find(|i| indegree[*i] > 0).unwrap_or(0);
        return Err(Error::Model(format!("the graph has a cycle through node {:?}", g.nodes[stuck].name.clone())));
    }
    Ok(order.into_iter().map(|i| g.nodes[i].clone()).collect())
}

/// Unused-tensor helper for tests: the tensor of an initializer by name.
pub fn initializer<'m>(m: &'m Model, name: &str) -> Option<&'m Tensor> {
    m.graph.value_id(name).and_then(|id| m.graph.initializers.get(&id))
}
