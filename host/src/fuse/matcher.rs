//! Finding a fusion pattern in a graph: backtracking over the pattern's nodes in their
//! declared order, binding each to a graph node and each pattern variable to a value.

use std::collections::HashMap;

use kiln_kernel_abi::fusion::{Fusion, PatternNode};
use kiln_registry::normalize_domain;

use crate::model::{Graph, ValueId};

/// Who produces and who reads each value of a graph.
pub(super) struct Index {
    /// value → the node that produces it
    pub producer: Vec<Option<usize>>,
    /// value → nodes that read it
    pub consumers: Vec<Vec<usize>>,
    pub is_output: Vec<bool>,
}

impl Index {
    pub fn new(g: &Graph) -> Index {
        let mut producer = vec![None; g.values.len()];
        let mut consumers = vec![Vec::new(); g.values.len()];
        let mut is_output = vec![false; g.values.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            for v in n.outputs.iter().flatten() {
                producer[*v] = Some(i);
            }
            for v in n.inputs.iter().flatten() {
                if !consumers[*v].contains(&i) {
                    consumers[*v].push(i);
                }
            }
        }
        for v in &g.outputs {
            is_output[*v] = true;
        }
        Index { producer, consumers, is_output }
    }

    /// Whether `v` is read by a node outside `nodes` or is a graph output.
    pub fn escapes(&self, v: ValueId, nodes: &[usize]) -> bool {
        self.is_output[v] || self.consumers[v].iter().any(|c| !nodes.contains(c))
    }
}

/// A complete structural match: graph node per pattern node (in pattern order), value per
/// variable.
#[derive(Clone, Debug)]
pub(super) struct Binding {
    pub nodes: Vec<usize>,
    pub vars: HashMap<String, ValueId>,
}

/// The order the pattern's nodes are bound in: node 0 first, then always a node that shares
/// a variable with one already bound (patterns are connected, `Fusion::validate`), so that
/// each later node's candidates are the readers or the producer of a bound value instead of
/// the whole graph.
fn search_order(f: &Fusion) -> Vec<usize> {
    let vars = |k: usize| -> Vec<&str> {
        let p = &f.pattern[k];
        p.inputs.iter().chain(&p.outputs).map(String::as_str).filter(|v| !v.is_empty()).collect()
    };
    let mut order = vec![0];
    let mut seen: std::collections::HashSet<&str> = vars(0).into_iter().collect();
    while order.len() < f.pattern.len() {
        let next = (0..f.pattern.len())
            .filter(|k| !order.contains(k))
            .find(|&k| vars(k).iter().any(|v| seen.contains(v)))
            .or_else(|| (0..f.pattern.len()).find(|k| !order.contains(k)));
        let Some(k) = next else { break };
        seen.extend(vars(k));
        order.push(k);
    }
    order
}

/// Every complete binding of `f`'s pattern whose first node is graph node `start`, none
/// touching a node of `used`. Small patterns, so the search is exhaustive.
pub(super) fn bindings_from(f: &Fusion, g: &Graph, ix: &Index, start: usize, used: &[bool]) -> Vec<Binding> {
    let order = search_order(f);
    let mut out = Vec::new();
    let mut nodes = vec![usize::MAX; f.pattern.len()];
    extend(f, g, ix, used, &order, 0, Some(start), &mut nodes, HashMap::new(), &mut out);
    out
}

pub(super) fn same_op(p: &PatternNode, n: &crate::model::Node) -> bool {
    p.op == n.op_type && normalize_domain(&p.domain) == normalize_domain(&n.domain)
}

#[allow(clippy::too_many_arguments)]
fn extend(
    f: &Fusion,
    g: &Graph,
    ix: &Index,
    used: &[bool],
    order: &[usize],
    depth: usize,
    start: Option<usize>,
    nodes: &mut Vec<usize>,
    vars: HashMap<String, ValueId>,
    out: &mut Vec<Binding>,
) {
    let Some(&k) = order.get(depth) else {
        out.push(Binding { nodes: nodes.clone(), vars });
        return;
    };
    let p = &f.pattern[k];
    // Candidates: the readers of a bound input, the producer of a bound output, else every
    // node (only when the pattern has a node that shares nothing, which validation refuses).
    let candidates: Vec<usize> = if let Some(s) = start {
        vec![s]
    } else if let Some(v) = p.inputs.iter().find_map(|v| vars.get(v)) {
        ix.consumers[*v].clone()
    } else if let Some(v) = p.outputs.iter().find_map(|v| vars.get(v)) {
        ix.producer[*v].into_iter().collect()
    } else {
        (0..g.nodes.len()).collect()
    };
    for c in candidates {
        let node = &g.nodes[c];
        if used[c] || nodes.contains(&c) || !same_op(p, node) {
            continue;
        }
        let orders: &[[usize; 2]] = if p.commutative { &[[0, 1], [1, 0]] } else { &[[0, 1]] };
        for o in orders {
            if let Some(next) = bind_node(p, node, o, ix, &vars) {
                nodes[k] = c;
                extend(f, g, ix, used, order, depth + 1, None, nodes, next, out);
                nodes[k] = usize::MAX;
            }
        }
    }
}

/// `vars` with pattern node `p` bound to graph node `node` (inputs permuted by `order` when
/// commutative), or `None` if they disagree.
fn bind_node(
    p: &PatternNode,
    node: &crate::model::Node,
    order: &[usize; 2],
    ix: &Index,
    vars: &HashMap<String, ValueId>,
) -> Option<HashMap<String, ValueId>> {
    let mut vars = vars.clone();
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
            (false, Some(v)) => match vars.get(var) {
                Some(&bound) if bound != v => return None,
                Some(_) => {}
                None => {
                    vars.insert(var.clone(), v);
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
            (false, Some(v)) => match vars.get(var) {
                // Bound already by a reader bound earlier in the search order.
                Some(&bound) if bound != *v => return None,
                Some(_) => {}
                None => {
                    vars.insert(var.to_string(), *v);
                }
            },
        }
    }
    if p.outputs.len() > node.outputs.len() && p.outputs[node.outputs.len()..].iter().any(|v| !v.is_empty()) {
        return None;
    }
    Some(vars)
}
