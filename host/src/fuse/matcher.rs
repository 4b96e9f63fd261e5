//! Finding a fusion pattern in a graph: backtracking over the pattern's nodes in their
//! declared order, binding each to a graph node and each pattern variable to a value.

use std::collections::HashMap;

use kiln_kernel_abi::fusion::{Fusion, PatternNode};
use kiln_registry::normalize_domain;

use crate::model::{Graph, ValueId};

/// Who reads each value of a graph.
pub(super) struct Index {
    /// value → nodes that read it
    pub consumers: Vec<Vec<usize>>,
    pub is_output: Vec<bool>,
}

impl Index {
    pub fn new(g: &Graph) -> Index {
        let mut consumers = vec![Vec::new(); g.values.len()];
        let mut is_output = vec![false; g.values.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            for v in n.inputs.iter().flatten() {
                if !consumers[*v].contains(&i) {
                    consumers[*v].push(i);
                }
            }
        }
        for v in &g.outputs {
            is_output[*v] = true;
        }
        Index { consumers, is_output }
    }

    /// Whether `v` is read by a node outside `nodes` or is a graph output.
    pub fn escapes(&self, v: ValueId, nodes: &[usize]) -> bool {
        self.is_output[v] || self.consumers[v].iter().any(|c| !nodes.contains(c))
    }
}

/// A complete structural match: graph node per pattern node, value per variable.
#[derive(Clone, Debug)]
pub(super) struct Binding {
    pub nodes: Vec<usize>,
    pub vars: HashMap<String, ValueId>,
}

/// Every complete binding of `f`'s pattern whose first node is graph node `start`, none
/// touching a node of `used`. Small patterns, so the search is exhaustive.
pub(super) fn bindings_from(f: &Fusion, g: &Graph, ix: &Index, start: usize, used: &[bool]) -> Vec<Binding> {
    let mut out = Vec::new();
    let b = Binding { nodes: Vec::new(), vars: HashMap::new() };
    extend(f, g, ix, used, Some(start), b, &mut out);
    out
}

fn same_op(p: &PatternNode, n: &crate::model::Node) -> bool {
    p.op == n.op_type && normalize_domain(&p.domain) == normalize_domain(&n.domain)
}

fn extend(f: &Fusion, g: &Graph, ix: &Index, used: &[bool], start: Option<usize>, b: Binding, out: &mut Vec<Binding>) {
    let k = b.nodes.len();
    let Some(p) = f.pattern.get(k) else {
        out.push(b);
        return;
    };
    // Candidates: the readers of an already bound input, else every node (in order).
    let candidates: Vec<usize> = if let Some(s) = start {
        vec![s]
    } else if let Some(v) = p.inputs.iter().find_map(|v| b.vars.get(v)) {
        ix.consumers[*v].clone()
    } else {
        (0..g.nodes.len()).collect()
    };
    for c in candidates {
        let node = &g.nodes[c];
        if used[c] || b.nodes.contains(&c) || !same_op(p, node) {
            continue;
        }
        let orders: &[[usize; 2]] = if p.commutative { &[[0, 1], [1, 0]] } else { &[[0, 1]] };
        for order in orders {
            if let Some(next) = bind_node(p, node, c, order, ix, &b) {
                extend(f, g, ix, used, None, next, out);
            }
        }
    }
}

/// `b` with pattern node `p` bound to graph node `c` (inputs permuted by `order` when
/// commutative), or `None` if they disagree.
fn bind_node(
    p: &PatternNode,
    node: &crate::model::Node,
    c: usize,
    order: &[usize; 2],
    ix: &Index,
    b: &Binding,
) -> Option<Binding> {
    let mut b = b.clone();
    // Inputs past the pattern's must be absent.
    if node.inputs.iter().skip(p.inputs.len()).any(Option::is_some) {
        return None;
    }
    for (i, var) in p.inputs.iter().enumerate() {
        let slot = if p.commutative { order[i] } else { i };
        let actual = node.inputs.get(slot).copied().flatten();
        match (var.is_empty(), actual) {
            (true, None) => {}
            (true, Some(_)) | (false, None) => return None,
            (false, Some(v)) => match b.vars.get(var) {
                Some(&bound) if bound != v => return None,
                Some(_) => {}
                None => {
                    b.vars.insert(var.clone(), v);
                }
            },
        }
    }
    // Outputs the pattern leaves out must be unused.
    for (slot, actual) in node.outputs.iter().enumerate() {
        let var = p.outputs.get(slot).map(String::as_str).unwrap_or("");
        match (var.is_empty(), actual) {
            (true, Some(v)) if ix.is_output[*v] || !ix.consumers[*v].is_empty() => return None,
            (true, _) => {}
            (false, None) => return None,
            (false, Some(v)) => {
                // SSA: an output variable is new, unless an input bound it (a pattern cannot
                // read its own node's output).
                if b.vars.insert(var.to_string(), *v).is_some() {
                    return None;
                }
            }
        }
    }
    if p.outputs.len() > node.outputs.len() && p.outputs[node.outputs.len()..].iter().any(|v| !v.is_empty()) {
        return None;
    }
    b.nodes.push(c);
    Some(b)
}
