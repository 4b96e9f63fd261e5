//! Rewriting a match: new constants, the replacement's nodes and values, removal of the
//! matched nodes, and a topological order again.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use kiln_kernel_abi::fusion::Fusion;

use crate::model::{Graph, Node, Value, ValueId};
use crate::Tensor;

use super::matcher::{Binding, Index};

/// A constant the replacement reads, made at load (`concat`, `transpose`).
pub(super) struct NewConstant {
    pub var: String,
    pub tensor: Tensor,
}

/// The `concat`, then the `transpose` constants of `f` for binding `b`, or why they cannot be
/// made (dtypes, ranks or the other dimensions differ).
pub(super) fn new_constants(g: &Graph, f: &Fusion, b: &Binding) -> Result<Vec<NewConstant>, String> {
    let mut out: Vec<NewConstant> = Vec::new();
    for c in &f.concat {
        let parts: Vec<&Tensor> = c.inputs.iter().map(|v| &g.initializers[&b.vars[v]]).collect();
        let t = concat(&parts, c.axis).map_err(|e| format!("concat {}: {e}", c.output))?;
        out.push(NewConstant { var: c.output.clone(), tensor: t });
    }
    for t in &f.transpose {
        let input = match out.iter().find(|c| c.var == t.input) {
            Some(c) => &c.tensor,
            None => &g.initializers[&b.vars[&t.input]],
        };
        let tensor = transpose(input).map_err(|e| format!("transpose {}: {e}", t.output))?;
        out.push(NewConstant { var: t.output.clone(), tensor });
    }
    Ok(out)
}

/// ONNX Transpose of a host tensor without `perm` (its axes reversed), byte-wise. Matrices are
/// copied in 32×32 tiles, so that a weight of hundreds of MB transposes at memory speed.
pub(crate) fn transpose(t: &Tensor) -> Result<Tensor, String> {
    let size = t.dtype.size().ok_or_else(|| format!("dtype {} has no fixed size", t.dtype))?;
    let shape: Vec<usize> = t.shape.iter().rev().copied().collect();
    let rank = t.shape.len();
    let n: usize = t.shape.iter().product();
    let mut data = vec![0u8; n * size];
    if rank == 2 {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        const TILE: usize = 32;
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..cols).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    for c in c0..(c0 + TILE).min(cols) {
                        let (src, dst) = ((r * cols + c) * size, (c * rows + r) * size);
                        data[dst..dst + size].copy_from_slice(&t.data[src..src + size]);
                    }
                }
            }
        }
    } else if rank > 2 {
        // Strides of the input, read in the output's (reversed) axis order.
        let mut strides = vec![1usize; rank];
        for a in (0..rank.saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * t.shape[a + 1];
        }
        let mut index = vec![0usize; rank];
        for dst in 0..n {
            let src: usize = index.iter().enumerate().map(|(a, &i)| i * strides[rank - 1 - a]).sum();
            data[dst * size..(dst + 1) * size].copy_from_slice(&t.data[src * size..(src + 1) * size]);
            for a in (0..rank).rev() {
                index[a] += 1;
                if index[a] < shape[a] {
                    break;
                }
                index[a] = 0;
            }
        }
    } else {
        data.copy_from_slice(&t.data);
    }
    Tensor::new(t.dtype, shape, data.into()).map_err(|e| e.to_string())
}

/// ONNX Concat of host tensors along `axis` (negative from the end), byte-wise.
pub(crate) fn concat(parts: &[&Tensor], axis: i64) -> Result<Tensor, String> {
    let first = parts.first().ok_or("no inputs")?;
    let rank = first.shape.len() as i64;
    let a = if axis < 0 { axis + rank } else { axis };
    if !(0..rank).contains(&a) {
        return Err(format!("axis {axis} is outside rank {rank}"));
    }
    let a = a as usize;
    for p in parts {
        if p.dtype != first.dtype {
            return Err(format!("dtypes {} and {} differ", first.dtype, p.dtype));
        }
        if p.shape.len() != first.shape.len()
            || p.shape.iter().zip(&first.shape).enumerate().any(|(i, (x, y))| i != a && x != y)
        {
            return Err(format!("shapes {:?} and {:?} differ outside axis {a}", first.shape, p.shape));
        }
    }
    let size = first.dtype.size().ok_or_else(|| format!("dtype {} has no fixed size", first.dtype))?;
    let outer: usize = first.shape[..a].iter().product();
    let chunk = |t: &Tensor| t.shape[a..].iter().product::<usize>() * size;
    let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
    for o in 0..outer {
        for p in parts {
            let n = chunk(p);
            data.extend_from_slice(&p.data[o * n..(o + 1) * n]);
        }
    }
    let mut shape = first.shape.clone();
    shape[a] = parts.iter().map(|p| p.shape[a]).sum();
    Tensor::new(first.dtype, shape, data.into()).map_err(|e| e.to_string())
}

/// A node outside `nodes` on a path from one of them to another (the match is not convex,
/// so no order could place its replacement), if any.
pub(super) fn node_between(g: &Graph, ix: &Index, nodes: &[usize]) -> Option<usize> {
    // Walk forward from the match's readers outside it; `origin` is the first outside node.
    let mut stack: Vec<(usize, usize)> = Vec::new();
    let mut seen = BTreeSet::new();
    for &n in nodes {
        for v in g.nodes[n].outputs.iter().flatten() {
            for &c in &ix.consumers[*v] {
                if !nodes.contains(&c) && seen.insert(c) {
                    stack.push((c, c));
                }
            }
        }
    }
    while let Some((n, origin)) = stack.pop() {
        for v in g.nodes[n].outputs.iter().flatten() {
            for &c in &ix.consumers[*v] {
                if nodes.contains(&c) {
                    return Some(origin);
                }
                if seen.insert(c) {
                    stack.push((c, origin));
                }
            }
        }
    }
    None
}

/// Appends the replacement of binding `b` (its constants, values and nodes) to `g`. The
/// matched nodes stay until [`finish`] removes them.
/// `attribute_vars` holds the match's attribute variables (`check`'s [`super::attribute_vars`]).
pub(super) fn apply(
    g: &mut Graph,
    f: &Fusion,
    b: &Binding,
    consts: Vec<NewConstant>,
    attribute_vars: &HashMap<String, Option<crate::model::AttrValue>>,
) {
    let base = g.nodes[*b.nodes.last().unwrap_or(&0)].name.clone();
    let mut vars: HashMap<String, ValueId> = b.vars.clone();
    for c in consts {
        let id = g.values.len();
        g.values.push(Value { name: format!("{base}/{}/{}", f.name, c.var), ty: None });
        g.initializers.insert(id, c.tensor);
        vars.insert(c.var, id);
    }
    let many = f.replace.len() > 1;
    for (i, r) in f.replace.iter().enumerate() {
        let mut var_id = |v: &str, g: &mut Graph| -> Option<ValueId> {
            if v.is_empty() {
                return None;
            }
            Some(*vars.entry(v.to_string()).or_insert_with(|| {
                g.values.push(Value { name: format!("{base}/{}/{v}", f.name), ty: None });
                g.values.len() - 1
            }))
        };
        let inputs = r.inputs.iter().map(|v| var_id(v, g)).collect();
        let outputs = r.outputs.iter().map(|v| var_id(v, g)).collect();
        let mut attributes = r.attributes_from.map(|a| g.nodes[b.nodes[a]].attributes.clone()).unwrap_or_default();
        // Integer (schema 13) and integer-list (schema 15) attributes the declaration sets, and
        // attribute variables' values from the match where it had one (schema 17), over any of
        // the same name.
        for (name, c) in &r.attributes {
            use kiln_kernel_abi::fusion::AttrConstraint;
            let value = match c {
                AttrConstraint::Int(v) => Some(crate::model::AttrValue::Int(*v)),
                AttrConstraint::Ints(v) => Some(crate::model::AttrValue::Ints(v.clone())),
                AttrConstraint::Dim(_) => match c.attribute_var() {
                    Some(var) => attribute_vars.get(var).cloned().flatten(),
                    None => continue,
                },
            };
            attributes.retain(|(a, _)| a != name);
            attributes.extend(value.map(|v| (name.clone(), v)));
        }
        g.nodes.push(Node {
            name: if many { format!("{base}/{}#{i}", f.name) } else { format!("{base}/{}", f.name) },
            op_type: r.op.clone(),
            domain: r.domain.clone(),
            inputs,
            implicit_inputs: 0,
            outputs,
            attributes,
        });
    }
}

/// How far the graph's nodes and values reached before a rewrite, to take it back.
pub(super) struct Mark {
    nodes: usize,
    values: usize,
}

impl Mark {
    pub fn of(g: &Graph) -> Mark {
        Mark { nodes: g.nodes.len(), values: g.values.len() }
    }

    /// The node count at the mark: the first index of what was appended since.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Drops what was appended since the mark: nodes, values and their initializers.
    pub fn undo(self, g: &mut Graph) {
        g.nodes.truncate(self.nodes);
        g.values.truncate(self.values);
        g.initializers.retain(|v, _| *v < self.values);
    }
}

/// Whether the nodes of `g` but those at `removed` can be ordered (no value needs itself).
pub(super) fn acyclic(g: &Graph, removed: &BTreeSet<usize>) -> bool {
    topological_order(g, removed, &HashMap::new()).is_some()
}

/// The nodes of `g` but those at `removed` in a topological order (Kahn's algorithm, the
/// lowest place first among the ready ones, so an order that already is one stays), or `None`
/// when some value needs itself. A node's place is its index, or for a replacement appended by
/// [`apply`] the index of the last node it replaces (`places`), so that it takes that node's
/// turn: nodes whose order the graph does not fix (a node that rewrites a fed buffer in place
/// after the others read it) keep their order around it.
fn topological_order(g: &Graph, removed: &BTreeSet<usize>, places: &HashMap<usize, usize>) -> Option<Vec<usize>> {
    let place = |i: usize| (places.get(&i).copied().unwrap_or(i), i);
    let live: Vec<usize> = (0..g.nodes.len()).filter(|i| !removed.contains(i)).collect();
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    for &i in &live {
        for v in g.nodes[i].outputs.iter().flatten() {
            producer.insert(*v, i);
        }
    }
    let mut waiting: HashMap<usize, usize> = HashMap::new();
    let mut readers: HashMap<usize, Vec<usize>> = HashMap::new();
    for &i in &live {
        let deps: BTreeSet<usize> =
            g.nodes[i].inputs.iter().flatten().filter_map(|v| producer.get(v).copied()).collect();
        waiting.insert(i, deps.len());
        for d in deps {
            readers.entry(d).or_default().push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, usize)>> =
        live.iter().filter(|i| waiting[i] == 0).map(|&i| Reverse(place(i))).collect();
    let mut order = Vec::with_capacity(live.len());
    while let Some(Reverse((_, i))) = ready.pop() {
        order.push(i);
        for r in readers.get(&i).into_iter().flatten() {
            if let Some(w) = waiting.get_mut(r) {
                *w -= 1;
                if *w == 0 {
                    ready.push(Reverse(place(*r)));
                }
            }
        }
    }
    (order.len() == live.len()).then_some(order)
}

/// Removes the nodes at `removed`, the initializers nothing reads any more, and puts the
/// nodes back in a topological order: the original order where it is one, each replacement in
/// the place of the last node it replaces (`places`, by node index before the removal).
pub(super) fn finish(g: &mut Graph, removed: &BTreeSet<usize>, places: &HashMap<usize, usize>) {
    // A cycle is never made (each match is convex and each rewrite checked with `acyclic`);
    // were it, the order would stay.
    let order = topological_order(g, removed, places)
        .unwrap_or_else(|| (0..g.nodes.len()).filter(|i| !removed.contains(i)).collect());
    let mut nodes: Vec<Option<Node>> = std::mem::take(&mut g.nodes).into_iter().map(Some).collect();
    g.nodes = order.into_iter().filter_map(|i| nodes[i].take()).collect();
    let read: BTreeSet<ValueId> = g.nodes.iter().flat_map(|n| n.inputs.iter().flatten().copied()).collect();
    let outputs: BTreeSet<ValueId> = g.outputs.iter().copied().collect();
    g.initializers.retain(|v, _| read.contains(v) || outputs.contains(v));
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_kernel_abi::DType;

    fn f32_tensor(shape: Vec<usize>) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        Tensor::new(DType::F32, shape, data.into()).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.data.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    #[test]
    fn transpose_reverses_the_axes() {
        // A matrix wider than one 32×32 tile: out[c][r] = in[r][c].
        let (rows, cols) = (3, 70);
        let t = transpose(&f32_tensor(vec![rows, cols])).unwrap();
        assert_eq!(t.shape, vec![cols, rows]);
        let v = values(&t);
        for c in 0..cols {
            for r in 0..rows {
                assert_eq!(v[c * rows + r], (r * cols + c) as f32);
            }
        }
        // Rank 3: out[k][j][i] = in[i][j][k].
        let t = transpose(&f32_tensor(vec![2, 3, 4])).unwrap();
        assert_eq!(t.shape, vec![4, 3, 2]);
        let v = values(&t);
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    assert_eq!(v[k * 6 + j * 2 + i], (i * 12 + j * 4 + k) as f32);
                }
            }
        }
    }

    /// A replacement takes the turn of the last node it replaces: a node that only reads graph
    /// inputs (AppendAttentionMask, which rewrites them in place) stays after it, as before the
    /// rewrite, instead of moving ahead of a replacement appended at the end.
    #[test]
    fn a_replacement_keeps_the_place_of_the_nodes_it_replaces() {
        let node = |name: &str, inputs: Vec<usize>, outputs: Vec<usize>| Node {
            name: name.into(),
            op_type: name.into(),
            domain: String::new(),
            inputs: inputs.into_iter().map(Some).collect(),
            implicit_inputs: 0,
            outputs: outputs.into_iter().map(Some).collect(),
            attributes: Vec::new(),
        };
        let values = (0..5).map(|i| Value { name: format!("v{i}"), ty: None }).collect();
        // v0 → A → v1 → B → v2 (A and B fused into F); C reads v0 only.
        let mut g = Graph {
            values,
            nodes: vec![node("A", vec![0], vec![1]), node("B", vec![1], vec![2]), node("C", vec![0], vec![3])],
            inputs: vec![0],
            outputs: vec![2, 3],
            initializers: HashMap::new(),
        };
        g.nodes.push(node("F", vec![0], vec![2]));
        let removed: BTreeSet<usize> = [0, 1].into();
        finish(&mut g, &removed, &HashMap::from([(3, 1)]));
        let order: Vec<&str> = g.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(order, ["F", "C"]);
    }
}
