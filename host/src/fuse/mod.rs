//! Fusion at load: the `[[fusions]]` patterns packages declare (`kiln_kernel_abi::fusion`),
//! matched in the model's graph and rewritten into their replacements before the session
//! prepares it. The host knows no op here: what matches, what replaces it and which dtypes it
//! takes all come from the manifests; the replacement's ops resolve like any node.
//!
//! Order: patterns with more nodes first, then the declaring package by the op-resolution
//! rule (higher precedence, then higher version). A graph node belongs to at most one match of
//! a pattern; the nodes a replacement adds may be matched by patterns tried later. For each
//! node where a pattern could start, the first structurally complete match that a constraint
//! turns down is reported with its reason ([`crate::trace::Fusions`]); a match that a later
//! one-by-one rewrite would turn into a cycle is reported too.

mod matcher;
mod rewrite;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kiln_kernel_abi::fusion::Fusion;
use kiln_kernel_abi::DType;
use kiln_registry::{DeviceCaps, NodeQuery, OpRegistry, Package};

use crate::model::{Model, ValueId};
pub use crate::trace::Fusions;
use crate::trace::{FusionApplied, FusionRejected};

use matcher::{bindings_from, Binding, Index};

/// What a match that passed its constraints needs to be rewritten: the new constants and the
/// opsets the model must import for the replacement.
struct Accepted {
    constants: Vec<rewrite::NewConstant>,
    opsets: Vec<(String, i64)>,
    /// Each attribute variable's value on the match ([`attribute_vars`]).
    attribute_vars: HashMap<String, Option<crate::model::AttrValue>>,
}

/// A pattern and the package that declares it.
struct Candidate<'a> {
    package: &'a Arc<Package>,
    precedence: u32,
    fusion: &'a Fusion,
}

/// The fusions of every package, in the order they are tried (module docs). Of two packages
/// with the same name, only the one op resolution would prefer (higher precedence, then
/// higher version) contributes: a newer version that drops or changes a fusion wins.
fn candidates(registry: &OpRegistry) -> Vec<Candidate<'_>> {
    let mut best: HashMap<&str, (u32, &_)> = HashMap::new();
    for (p, prec) in registry.packages_with_precedence() {
        let e = best.entry(p.name()).or_insert((prec, p.version()));
        if (prec, p.version()) > *e {
            *e = (prec, p.version());
        }
    }
    let mut all: Vec<Candidate<'_>> = registry
        .packages_with_precedence()
        .filter(|(p, prec)| best.get(p.name()) == Some(&(*prec, p.version())))
        .flat_map(|(package, precedence)| {
            package.manifest.fusions.iter().map(move |fusion| Candidate { package, precedence, fusion })
        })
        .collect();
    all.sort_by(|a, b| {
        (b.fusion.pattern.len(), b.precedence, b.package.version())
            .cmp(&(a.fusion.pattern.len(), a.precedence, a.package.version()))
            .then_with(|| a.package.name().cmp(b.package.name()))
    });
    let mut seen = HashSet::new();
    all.retain(|c| seen.insert((c.package.name().to_string(), c.fusion.name.clone())));
    all
}

/// Rewrites every match of the registry's fusions in `model`. `device` is the GPU the
/// replacements must run on (`None` on the CPU). Returns no error: a match that cannot be
/// rewritten is left as it is, with its reason in the result. (A replacement whose op then
/// rejects its inputs' shapes fails the session like any node: `kiln verify` is where a
/// package proves its patterns.)
pub fn fuse(model: &mut Model, registry: &OpRegistry, device: Option<&DeviceCaps>) -> Fusions {
    let mut report = Fusions::default();
    constants_as_initializers(&mut model.graph);
    for c in candidates(registry) {
        let ix = Index::new(&model.graph);
        let mut used = vec![false; model.graph.nodes.len()];
        let mut accepted: Vec<(Binding, Accepted)> = Vec::new();
        let Some(first) = c.fusion.pattern.first() else { continue };
        for start in 0..model.graph.nodes.len() {
            if used[start] || !matcher::same_op(first, &model.graph.nodes[start]) {
                continue;
            }
            let mut first_reason = None;
            for b in bindings_from(c.fusion, &model.graph, &ix, start, &used) {
                match check(&c, model, &ix, &b, registry, device) {
                    Ok(a) => {
                        for &i in &b.nodes {
                            used[i] = true;
                        }
                        accepted.push((b, a));
                        first_reason = None;
                        break;
                    }
                    Err(reason) => {
                        first_reason.get_or_insert((b, reason));
                    }
                }
            }
            if let Some((b, reason)) = first_reason {
                report.rejected.push(FusionRejected {
                    fusion: c.fusion.name.clone(),
                    package: c.package.id(),
                    nodes: b.nodes.iter().map(|&i| model.graph.nodes[i].name.clone()).collect(),
                    reason,
                });
            }
        }
        if accepted.is_empty() {
            continue;
        }
        // Each match is convex on its own; two of them together could still need each other's
        // outputs. Rewrite them one by one and undo one that would make a cycle.
        let mut removed = std::collections::BTreeSet::new();
        let mut places = HashMap::new();
        for (b, Accepted { constants, opsets, attribute_vars }) in accepted {
            let names: Vec<String> = b.nodes.iter().map(|&i| model.graph.nodes[i].name.clone()).collect();
            let mark = rewrite::Mark::of(&model.graph);
            rewrite::apply(&mut model.graph, c.fusion, &b, constants, &attribute_vars);
            removed.extend(b.nodes.iter().copied());
            let last = b.nodes.iter().copied().max().unwrap_or(0);
            places.extend((mark.nodes()..model.graph.nodes.len()).map(|i| (i, last)));
            if !rewrite::acyclic(&model.graph, &removed) {
                mark.undo(&mut model.graph);
                for n in &b.nodes {
                    removed.remove(n);
                }
                report.rejected.push(FusionRejected {
                    fusion: c.fusion.name.clone(),
                    package: c.package.id(),
                    nodes: names,
                    reason: "rewritten together with an earlier match of the pattern it would make a cycle".into(),
                });
                continue;
            }
            for (domain, v) in opsets {
                let e = model.opsets.entry(domain).or_insert(v);
                *e = (*e).max(v);
            }
            report.applied.push(FusionApplied { fusion: c.fusion.name.clone(), package: c.package.id(), nodes: names });
        }
        rewrite::finish(&mut model.graph, &removed, &places);
    }
    report
}

/// Replaces each ONNX `Constant` node whose value is a tensor, a float, an integer or a list of
/// them by an initializer of that value, and each `Identity` of an initializer by a copy of it
/// (torch.onnx writes one initializer and Identity nodes for equal weights, such as freshly
/// initialized zero biases), so that patterns see exporters' constants (a GELU's √2, a bias)
/// as constants. A session would fold these nodes at preparation anyway.
fn constants_as_initializers(g: &mut crate::model::Graph) {
    use crate::model::AttrValue;
    let graph_outputs: HashSet<ValueId> = g.outputs.iter().copied().collect();
    g.nodes.retain(|n| {
        let onnx = n.domain.is_empty() || n.domain == "ai.onnx";
        if let (true, "Identity", [Some(input)], [Some(out)]) =
            (onnx, n.op_type.as_str(), n.inputs.as_slice(), n.outputs.as_slice())
        {
            let Some(t) = g.initializers.get(input).filter(|_| !graph_outputs.contains(out)) else { return true };
            let t = t.clone();
            g.initializers.insert(*out, t);
            return false;
        }
        let (true, "Constant", [Some(out)], [(_, value)]) =
            (onnx, n.op_type.as_str(), n.outputs.as_slice(), n.attributes.as_slice())
        else {
            return true;
        };
        let tensor = match value {
            AttrValue::Tensor(t) => Ok(t.clone()),
            AttrValue::Float(x) => crate::Tensor::new(DType::F32, vec![], x.to_le_bytes().to_vec().into()),
            AttrValue::Int(x) => crate::Tensor::new(DType::I64, vec![], x.to_le_bytes().to_vec().into()),
            AttrValue::Floats(v) => crate::Tensor::new(
                DType::F32,
                vec![v.len()],
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>().into(),
            ),
            AttrValue::Ints(v) => crate::Tensor::new(
                DType::I64,
                vec![v.len()],
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>().into(),
            ),
            _ => return true,
        };
        match tensor {
            Ok(t) if !g.initializers.contains_key(out) => {
                g.initializers.insert(*out, t);
                false
            }
            _ => true,
        }
    });
}

/// The dtype of `v` where the load knows it: an initializer or a declared type.
fn known_dtype(model: &Model, v: ValueId) -> Option<DType> {
    model.graph.declared_dtype(v)
}

/// The shape of `v` as far as the load knows it: an initializer's, or a declared one whose
/// every dimension is a number or a named (symbolic) dimension. Two values with the same named
/// dimension have the same size at run time (ONNX's `dim_param`).
fn known_shape(model: &Model, v: ValueId) -> Option<Vec<crate::model::Dim>> {
    use crate::model::Dim;
    let g = &model.graph;
    if let Some(t) = g.initializers.get(&v) {
        return Some(t.shape.iter().map(|&n| Dim::Known(n)).collect());
    }
    let dims = g.values[v].ty.as_ref()?.dims.as_ref()?;
    if dims.contains(&Dim::Unknown) {
        return None;
    }
    Some(dims.clone())
}

/// The dimensions of pattern variable `var` as far as the load knows them (for `"VAR.AXIS"`).
fn shape_of(model: &Model, b: &Binding, var: &str) -> Option<Vec<Option<i64>>> {
    use crate::model::Dim;
    let dims = known_shape(model, *b.vars.get(var)?)?;
    Some(dims.iter().map(|d| if let Dim::Known(n) = d { Some(*n as i64) } else { None }).collect())
}

/// Pattern node `p`'s attribute constraints (manifest schema 13) on graph node `node`: each
/// named attribute an integer equal to the constraint's value, where that value is known at
/// load (a dimension the load does not know is not checked; `"*"` takes any value or none), or
/// an integer list equal to the constraint's list (schema 15).
fn check_attributes(
    model: &Model,
    b: &Binding,
    p: &kiln_kernel_abi::fusion::PatternNode,
    node: &crate::model::Node,
) -> Result<(), String> {
    use crate::model::AttrValue;
    for (name, c) in &p.attributes {
        if c.is_any() || c.attribute_var().is_some() {
            continue;
        }
        let value = node.attributes.iter().find(|(a, _)| a == name).map(|(_, v)| v);
        if let kiln_kernel_abi::fusion::AttrConstraint::Ints(want) = c {
            match value {
                Some(AttrValue::Ints(actual)) if actual == want => continue,
                Some(AttrValue::Ints(actual)) => {
                    return Err(format!(
                        "node {}: attribute {name} is {actual:?}, the pattern needs {want:?}",
                        node.name
                    ))
                }
                _ => return Err(format!("node {} has no integer-list attribute {name}", node.name)),
            }
        }
        let Some(AttrValue::Int(actual)) = value else {
            return Err(format!("node {} has no integer attribute {name}", node.name));
        };
        let want = c.resolve(|var| shape_of(model, b, var));
        if let Some(want) = want.filter(|w| w != actual) {
            return Err(format!("node {}: attribute {name} is {actual}, the pattern needs {want}", node.name));
        }
    }
    Ok(())
}

/// The value of each attribute variable (`"$NAME"`, manifest schema 17) on binding `b`: the
/// attribute of the first match node that names it, `None` where that node has none. Errors:
/// two match nodes that name one variable carry different values, or one carries none (an
/// attribute set to its default and one left out count as different: the pattern sees the
/// model's attributes, not the op's defaults).
fn attribute_vars(
    f: &kiln_kernel_abi::fusion::Fusion,
    g: &crate::model::Graph,
    b: &Binding,
) -> Result<HashMap<String, Option<crate::model::AttrValue>>, String> {
    let mut values: HashMap<String, (Option<crate::model::AttrValue>, usize)> = HashMap::new();
    for (k, p) in f.pattern.iter().enumerate() {
        let node = &g.nodes[b.nodes[k]];
        for (name, c) in &p.attributes {
            let Some(var) = c.attribute_var() else { continue };
            let value = node.attributes.iter().find(|(a, _)| a == name).map(|(_, v)| v.clone());
            match values.get(var) {
                None => {
                    values.insert(var.to_string(), (value, k));
                }
                Some((first, j)) if *first != value => {
                    let show =
                        |v: &Option<crate::model::AttrValue>| v.as_ref().map_or("absent".into(), |v| format!("{v:?}"));
                    return Err(format!(
                        "attribute variable ${var} is {} at node {} but {} at node {}",
                        show(first),
                        g.nodes[b.nodes[*j]].name,
                        show(&value),
                        node.name
                    ));
                }
                Some(_) => {}
            }
        }
    }
    Ok(values.into_iter().map(|(k, (v, _))| (k, v)).collect())
}

/// The constraints of `c` on binding `b`: what the rewrite needs, or why the match is not
/// rewritten.
fn check(
    c: &Candidate<'_>,
    model: &Model,
    ix: &Index,
    b: &Binding,
    registry: &OpRegistry,
    device: Option<&DeviceCaps>,
) -> Result<Accepted, String> {
    let f = c.fusion;
    let g = &model.graph;
    let name = |v: ValueId| g.values[v].name.clone();
    for var in &f.constant {
        let v = b.vars[var];
        let Some(t) = g.initializers.get(&v) else {
            return Err(format!("{var} ({}) is not a constant", name(v)));
        };
        if let Some(&rank) = f.ranks.get(var) {
            if t.shape.len() != rank {
                return Err(format!("{var} ({}) has rank {}, not {rank}", name(v), t.shape.len()));
            }
        }
    }
    for (var, want) in &f.values {
        let v = b.vars[var];
        let t = &g.initializers[&v];
        // At most rank 1: a [1, 1, 1] constant would broadcast the unfused result to rank 3.
        match t.scalar_f64().filter(|_| t.shape.len() <= 1) {
            None => return Err(format!("{var} ({}) is not a single float value of rank 0 or 1", name(v))),
            Some(x) => {
                let rounded = crate::Tensor::from_f64s(t.dtype, vec![], &[*want]).ok().and_then(|r| r.scalar_f64());
                if rounded != Some(x) {
                    return Err(format!("{var} ({}) is {x}, the pattern needs {want}", name(v)));
                }
            }
        }
    }
    for (var, dims) in &f.shapes {
        let v = b.vars[var];
        let Some(shape) = known_shape(model, v) else {
            return Err(format!("the shape of {var} ({}) is not known at load", name(v)));
        };
        let want: Vec<Option<i64>> = dims.iter().map(|d| d.resolve(|x| shape_of(model, b, x))).collect();
        let fits = shape.len() == want.len()
            && shape.iter().zip(&want).all(|(d, w)| match (d, w) {
                (crate::model::Dim::Known(n), Some(w)) => *n as i64 == *w,
                (_, None) => true,
                _ => false,
            });
        if !fits {
            let want: Vec<String> = want.iter().map(|w| w.map_or("?".into(), |n| n.to_string())).collect();
            return Err(format!(
                "{var} ({}) has shape {}, the pattern needs [{}]",
                name(v),
                crate::model::format_dims(&shape),
                want.join(", ")
            ));
        }
    }
    for (var, allowed) in &f.dtypes {
        let v = b.vars[var];
        let Some(d) = known_dtype(model, v) else {
            return Err(format!("the dtype of {var} ({}) is not known at load", name(v)));
        };
        if !allowed.iter().any(|a| a == d.name()) {
            return Err(format!("{var} ({}) is {d}, not one of [{}]", name(v), allowed.join(", ")));
        }
    }
    // Pattern inputs come from outside the match (Mul(a, s) must not bind `u` to `s`).
    for var in f.pattern_inputs() {
        let v = b.vars[var];
        if ix.producer[v].is_some_and(|p| b.nodes.contains(&p)) {
            return Err(format!("{var} ({}) would be an input of the match but is produced inside it", name(v)));
        }
    }
    for group in &f.same_shape {
        let shapes: Vec<Option<Vec<crate::model::Dim>>> =
            group.iter().map(|var| known_shape(model, b.vars[var])).collect();
        if let Some(i) = shapes.iter().position(Option::is_none) {
            let v = b.vars[&group[i]];
            return Err(format!("the shape of {} ({}) is not known at load", group[i], name(v)));
        }
        if shapes.windows(2).any(|w| w[0] != w[1]) {
            let list: Vec<String> = group
                .iter()
                .zip(&shapes)
                .map(|(v, s)| format!("{v} {}", crate::model::format_dims(s.as_deref().unwrap_or(&[]))))
                .collect();
            return Err(format!("shapes differ: {}", list.join(", ")));
        }
    }
    // A matched node's attributes must carry over to a replacement node or be named by the
    // pattern's constraints, else the pattern would match whatever attributes the node has.
    for (k, &n) in b.nodes.iter().enumerate() {
        let node = &g.nodes[n];
        let p = &f.pattern[k];
        check_attributes(model, b, p, node)?;
        if f.replace.iter().any(|r| r.attributes_from == Some(k)) {
            continue;
        }
        let free: Vec<&str> =
            node.attributes.iter().map(|(a, _)| a.as_str()).filter(|a| !p.attributes.contains_key(*a)).collect();
        if !free.is_empty() {
            return Err(format!(
                "node {} has attributes ({}) the replacement does not take",
                node.name,
                free.join(", ")
            ));
        }
    }
    let attribute_vars = attribute_vars(f, g, b)?;
    // Intermediates must stay inside the match.
    for node in &b.nodes {
        for v in g.nodes[*node].outputs.iter().flatten() {
            let declared = b.vars.iter().any(|(k, x)| *x == *v && f.outputs.iter().any(|o| o == k));
            if !declared && ix.escapes(*v, &b.nodes) {
                return Err(format!("{} is read outside the match", name(*v)));
            }
        }
    }
    if let Some(between) = rewrite::node_between(g, ix, &b.nodes) {
        return Err(format!("node {} lies between matched nodes", g.nodes[between].name));
    }
    let consts = rewrite::new_constants(g, f, b)?;
    // Every replacement node must resolve, with the dtype of its first input where known (an
    // output of an earlier replacement node taking that node's dtype): Linear(h, Bd, Sd) of
    // skip-rmsnorm-mlp-nbits resolves as h's float type, not as its uint8 weight's.
    let mut opsets = Vec::new();
    let mut made: HashMap<&str, Option<DType>> = HashMap::new();
    for r in &f.replace {
        let dtype = r.inputs.first().filter(|v| !v.is_empty()).and_then(|v| {
            b.vars
                .get(v)
                .and_then(|&x| known_dtype(model, x))
                .or_else(|| consts.iter().find(|k| &k.var == v).map(|k| k.tensor.dtype))
                .or_else(|| made.get(v.as_str()).copied().flatten())
        });
        made.extend(r.outputs.iter().map(|o| (o.as_str(), dtype)));
        let imported = model.opset(&r.domain);
        let q = NodeQuery {
            domain: &r.domain,
            op_type: &r.op,
            opset: imported.unwrap_or(i64::MAX),
            input_dtypes: vec![dtype],
            max_rank: None,
            device,
        };
        let res = registry.resolve(&q).map_err(|e| format!("the replacement does not resolve: {e}"))?;
        if imported.is_none() {
            opsets.push((r.domain.clone(), res.entry.since_opset));
        }
    }
    Ok(Accepted { constants: consts, opsets, attribute_vars })
}
