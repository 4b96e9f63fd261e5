//! Fusion patterns a package declares in `kernel.toml` (`[[fusions]]`, ABI.md §7.1): a
//! subgraph of ONNX nodes (`match`) and the nodes that replace it (`replace`), usually one
//! fused op of the package.
//!
//! ```toml
//! [[fusions]]
//! name = "gate-up-swiglu"                    # [a-z0-9_-], unique in the package
//! description = "SiLU(x·Wg)·(x·Wu) as one GEMM and one elementwise kernel"
//! match = [                                  # in topological order
//!   { op = "MatMul", inputs = ["x", "Wg"], outputs = ["g"] },
//!   { op = "MatMul", inputs = ["x", "Wu"], outputs = ["u"] },
//!   { op = "Sigmoid", inputs = ["g"], outputs = ["s"] },
//!   { op = "Mul", inputs = ["g", "s"], outputs = ["a"], commutative = true },
//!   { op = "Mul", inputs = ["a", "u"], outputs = ["y"], commutative = true },
//! ]
//! constant = ["Wg", "Wu"]                    # must be initializers
//! dtypes = { Wg = ["float32", "float16", "bfloat16"] }   # where known at load
//! ranks = { Wg = 2, Wu = 2 }
//! same_shape = [["Wg", "Wu"]]                # one shape, known at load
//! concat = [{ output = "Wgu", inputs = ["Wg", "Wu"], axis = -1 }]   # new constants
//! transpose = [{ output = "WguT", input = "Wgu" }]   # more: ONNX Transpose (axes reversed)
//! replace = [
//!   { op = "MatMul", inputs = ["x", "Wgu"], outputs = ["gu"] },
//!   { domain = "ai.kiln", op = "SwiGlu", inputs = ["gu"], outputs = ["y"] },
//! ]
//! outputs = ["y"]                            # the values the rest of the graph may read
//! verify = { x = [3, 64], Wg = [64, 96], Wu = [64, 96] }    # shapes `kiln verify` uses
//! ```
//!
//! Names in `inputs`/`outputs` are pattern variables; `""` is an absent optional input or an
//! output left out. A variable no `match` node defines is a pattern input; the others are
//! defined once each (SSA). [`Fusion::validate`] refuses what can never match or cannot be
//! rewritten: cycles (a variable read before its node defines it), a pattern that is not
//! connected, a replacement that reads a variable the match does not bind, `outputs` that the
//! replacement does not define. Matching and rewriting are the host's (`kiln-host`
//! `fuse`); this module is the declaration only.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::DType;

/// Most elements of one `verify` input (16 Mi): verification inputs are small by design.
pub const MAX_VERIFY_ELEMENTS: usize = 1 << 24;

/// One `[[fusions]]` entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fusion {
    /// `[a-z0-9_-]`, 1..=64 characters, unique in the package.
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The subgraph to find, nodes in topological order.
    #[serde(rename = "match")]
    pub pattern: Vec<PatternNode>,
    /// What replaces it, in topological order.
    pub replace: Vec<PatternNode>,
    /// Variables defined by the match that nodes outside it may read; every other matched
    /// output must have no reader outside the match and must not be a graph output.
    pub outputs: Vec<String>,
    /// Pattern inputs that must be initializers (constant at load).
    #[serde(default)]
    pub constant: Vec<String>,
    /// Allowed dtypes per variable ([`DType::name`]). A constrained variable whose dtype is
    /// unknown at load rejects the candidate.
    #[serde(default)]
    pub dtypes: BTreeMap<String, Vec<String>>,
    /// Required rank per constant variable.
    #[serde(default)]
    pub ranks: BTreeMap<String, usize>,
    /// Groups of variables that must have one shape; a shape unknown at load rejects the
    /// candidate (SwiGlu(g, u) does not broadcast, `Mul` does).
    #[serde(default)]
    pub same_shape: Vec<Vec<String>>,
    /// New constants the replacement reads: constant variables concatenated along an axis.
    #[serde(default)]
    pub concat: Vec<ConstantConcat>,
    /// New constants the replacement reads: a constant variable or an earlier new constant
    /// (`concat` outputs first, then `transpose` outputs in order) with its axes reversed.
    /// Added in ABI 1 manifests of host 0.1 with the decode fusions (ABI.md §7.1).
    #[serde(default)]
    pub transpose: Vec<ConstantTranspose>,
    /// Shapes of the pattern inputs for `kiln verify` (the input domain of the declaration).
    #[serde(default)]
    pub verify: BTreeMap<String, Vec<usize>>,
    /// Constant pattern inputs that must hold one element (rank 0 or 1) of a float dtype equal to
    /// this number rounded to that dtype (manifest schema 15): the 1/√2, 1 and 0.5 of an exported GELU, which
    /// the replacement computes itself. `kiln verify` gives them these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub values: BTreeMap<String, f64>,
    /// Exact shapes of pattern variables, each dimension an integer or `"VAR.AXIS"` (a dimension
    /// of another variable, [`AttrConstraint`]) (manifest schema 15): `b = ["W.1"]`, a bias as
    /// long as W's columns. The variable's shape must be known at load; a `"VAR.AXIS"` the load
    /// does not know is not checked.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shapes: BTreeMap<String, Vec<AttrConstraint>>,
    /// The elements `kiln verify` gives constant pattern inputs whose random values would not
    /// be valid (a Reshape's target shape), as many as their `verify` shape holds (manifest
    /// schema 15). Not a match constraint.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub verify_values: BTreeMap<String, Vec<f64>>,
}

/// A node of a pattern or of its replacement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatternNode {
    /// `""` (ai.onnx) or another domain.
    #[serde(default)]
    pub domain: String,
    pub op: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    /// A match node with two inputs that may bind in either order (Add, Mul).
    #[serde(default)]
    pub commutative: bool,
    /// A replacement node takes every attribute of this match node (index into `match`).
    #[serde(default)]
    pub attributes_from: Option<usize>,
    /// On a match node, attributes it must carry (manifest schema 13), each an integer it must
    /// equal or a dimension of a pattern variable ([`AttrConstraint`]); `kiln verify` gives the
    /// unfused node these values. On a replacement node, integer attributes it gets (after
    /// those of `attributes_from`, replacing one of the same name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, AttrConstraint>,
}

/// What a match node's integer attribute must be (manifest schema 13; lists from schema 15).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AttrConstraint {
    /// This value (`bits = 4`).
    Int(i64),
    /// This list of integers (`perm = [0, 2, 1, 3]`; manifest schema 15).
    Ints(Vec<i64>),
    /// `"VAR.AXIS"`: dimension AXIS (negative counts from the last) of pattern variable VAR's
    /// shape (`N = "W.0"`). Checked where that dimension is known at load (a constant's always
    /// is), not where it is not. `kiln verify` takes it from the verify shapes. `"*"`: any value or none, an attribute the replacement does
    /// not depend on; verify leaves it out. `"$NAME"` (manifest schema 17): an attribute
    /// variable. On match nodes it takes any value or none, and every match node that names
    /// `$NAME` must carry the same value (or all none); on a replacement node it gives the node
    /// that value, or leaves the attribute out where the match had none (MatMulNBits'
    /// `accuracy_level` carried to the fused op that replaces it); verify leaves it out.
    Dim(String),
}

impl AttrConstraint {
    /// Whether this is `"*"`: any value.
    pub fn is_any(&self) -> bool {
        matches!(self, AttrConstraint::Dim(s) if s == "*")
    }

    /// The name of an attribute variable `"$NAME"` (manifest schema 17), or `None` for any
    /// other constraint. NAME is `[A-Za-z0-9_]+`; `"$"` alone or other characters are no
    /// variable (and [`Fusion::validate`] refuses them).
    pub fn attribute_var(&self) -> Option<&str> {
        let AttrConstraint::Dim(s) = self else { return None };
        let name = s.strip_prefix('$')?;
        (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(name)
    }

    /// The variable and axis of a [`AttrConstraint::Dim`], or `None` for an integer or a string
    /// that is not `VAR.AXIS`.
    pub fn dim(&self) -> Option<(&str, i64)> {
        let AttrConstraint::Dim(s) = self else { return None };
        let (var, axis) = s.rsplit_once('.')?;
        if var.is_empty() {
            return None;
        }
        Some((var, axis.parse().ok()?))
    }

    /// The value for a variable shape lookup `shape_of` (`None` where the dimension is unknown
    /// or out of range): the integer itself, or the dimension.
    /// A list ([`AttrConstraint::Ints`]) resolves to `None`: it is compared as a whole.
    pub fn resolve(&self, shape_of: impl Fn(&str) -> Option<Vec<Option<i64>>>) -> Option<i64> {
        match self {
            AttrConstraint::Int(v) => Some(*v),
            AttrConstraint::Ints(_) => None,
            AttrConstraint::Dim(_) => {
                let (var, axis) = self.dim()?;
                let shape = shape_of(var)?;
                let rank = shape.len() as i64;
                let a = if axis < 0 { axis + rank } else { axis };
                if a < 0 || a >= rank {
                    return None;
                }
                shape[a as usize]
            }
        }
    }
}

/// `output` = Concat(`inputs`, `axis`) of constant variables, computed once at load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConstantConcat {
    /// The new constant's variable.
    pub output: String,
    /// Constant pattern inputs, concatenated in this order.
    pub inputs: Vec<String>,
    /// Negative counts from the last axis, as ONNX Concat.
    pub axis: i64,
}

/// `output` = Transpose(`input`) with no `perm` (ONNX: the axes reversed; a matrix `[K, N]`
/// becomes `[N, K]`), computed once at load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConstantTranspose {
    /// The new constant's variable, read by `replace` nodes or a later `transpose`.
    pub output: String,
    /// A constant pattern input, or the output of a `concat` or an earlier `transpose`.
    pub input: String,
}

impl Fusion {
    /// Pattern inputs: variables `match` reads but does not define, in first-use order.
    pub fn pattern_inputs(&self) -> Vec<&str> {
        let defined: BTreeSet<&str> = self.defined();
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for n in &self.pattern {
            for v in n.inputs.iter().map(String::as_str).filter(|v| !v.is_empty()) {
                if !defined.contains(v) && seen.insert(v) {
                    out.push(v);
                }
            }
        }
        out
    }

    fn defined(&self) -> BTreeSet<&str> {
        self.pattern.iter().flat_map(|n| n.outputs.iter().map(String::as_str)).filter(|v| !v.is_empty()).collect()
    }

    /// Checks the declaration (see the module docs). The error names the fusion and the
    /// offending node or variable.
    pub fn validate(&self) -> Result<(), String> {
        let at = |msg: String| Err(format!("fusion {:?}: {msg}", self.name));
        let n = &self.name;
        if n.is_empty()
            || n.len() > 64
            || !n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        {
            return Err(format!("fusion name {n:?} must be 1 to 64 characters of a-z, 0-9, '-', '_'"));
        }
        if self.pattern.is_empty() {
            return at("`match` is empty: the pattern would match nothing".into());
        }
        if self.replace.is_empty() {
            return at("`replace` is empty".into());
        }
        // SSA and topological order; a variable read before its definition is a cycle.
        let defined = self.defined();
        let mut so_far: BTreeSet<&str> = BTreeSet::new();
        for (i, node) in self.pattern.iter().enumerate() {
            if node.op.is_empty() {
                return at(format!("match[{i}] has no op"));
            }
            if node.outputs.iter().all(String::is_empty) {
                return at(format!("match[{i}] ({}) defines no output", node.op));
            }
            if node.commutative && node.inputs.len() != 2 {
                return at(format!("match[{i}] ({}) is commutative but has {} inputs", node.op, node.inputs.len()));
            }
            if node.attributes_from.is_some() {
                return at(format!("match[{i}]: attributes_from belongs on replacement nodes"));
            }
            for (name, c) in &node.attributes {
                if name.is_empty() {
                    return at(format!("match[{i}] ({}): an attribute constraint has no name", node.op));
                }
                if let AttrConstraint::Dim(s) = c {
                    if c.is_any() || c.attribute_var().is_some() {
                        continue;
                    }
                    let Some((var, _)) = c.dim() else {
                        return at(format!(
                            "match[{i}] ({}): attributes.{name} = {s:?} is neither an integer nor \"VAR.AXIS\", \"*\" or \"$NAME\"",
                            node.op
                        ));
                    };
                    let known = self.pattern.iter().any(|n| n.inputs.iter().chain(&n.outputs).any(|v| v == var));
                    if !known {
                        return at(format!(
                            "match[{i}] ({}): attributes.{name} names {var:?}, which is not a pattern variable",
                            node.op
                        ));
                    }
                }
            }
            for v in node.inputs.iter().filter(|v| !v.is_empty()) {
                if defined.contains(v.as_str()) && !so_far.contains(v.as_str()) {
                    return at(format!(
                        "match[{i}] ({}) reads {v:?} before a later node defines it: the pattern has a cycle or is out of order",
                        node.op
                    ));
                }
            }
            for v in node.outputs.iter().filter(|v| !v.is_empty()) {
                if !so_far.insert(v) {
                    return at(format!("variable {v:?} is defined twice"));
                }
            }
        }
        // Connected: every node after the first shares a variable with an earlier one.
        let mut reach: BTreeSet<&str> = BTreeSet::new();
        fn vars(n: &PatternNode) -> Vec<&str> {
            n.inputs.iter().chain(&n.outputs).map(String::as_str).filter(|v| !v.is_empty()).collect()
        }
        let mut left: Vec<usize> = (0..self.pattern.len()).collect();
        reach.extend(vars(&self.pattern[0]));
        left.remove(0);
        while !left.is_empty() {
            let Some(pos) = left.iter().position(|&i| vars(&self.pattern[i]).iter().any(|v| reach.contains(v))) else {
                return at(format!(
                    "match[{}] ({}) shares no value with the rest: the pattern is not connected",
                    left[0], self.pattern[left[0]].op
                ));
            };
            reach.extend(vars(&self.pattern[left.remove(pos)]));
        }
        let inputs: BTreeSet<&str> = self.pattern_inputs().into_iter().collect();
        for v in &self.constant {
            if !inputs.contains(v.as_str()) {
                return at(format!("constant {v:?} is not a pattern input"));
            }
        }
        for (v, names) in &self.dtypes {
            if !inputs.contains(v.as_str()) && !defined.contains(v.as_str()) {
                return at(format!("dtypes: {v:?} is not a pattern variable"));
            }
            if let Some(d) = names.iter().find(|d| DType::from_name(d).is_none()) {
                return at(format!("dtypes.{v}: unknown dtype {d:?}"));
            }
        }
        for (v, x) in &self.values {
            if !self.constant.contains(v) {
                return at(format!("values: {v:?} is not a constant (values are checked on constants)"));
            }
            if !x.is_finite() {
                return at(format!("values.{v}: {x} is not a finite number"));
            }
        }
        for (v, dims) in &self.shapes {
            if !inputs.contains(v.as_str()) && !defined.contains(v.as_str()) {
                return at(format!("shapes: {v:?} is not a pattern variable"));
            }
            for d in dims {
                let ok = match d {
                    AttrConstraint::Int(n) => *n >= 0,
                    AttrConstraint::Dim(_) => {
                        d.dim().is_some_and(|(var, _)| inputs.contains(var) || defined.contains(var))
                    }
                    AttrConstraint::Ints(_) => false,
                };
                if !ok {
                    return at(format!(
                        "shapes.{v}: {d:?} is neither a dimension (an integer ≥ 0) nor \"VAR.AXIS\" of a pattern variable"
                    ));
                }
            }
        }
        for (v, xs) in &self.verify_values {
            if !self.constant.contains(v) {
                return at(format!("verify_values: {v:?} is not a constant"));
            }
            let n = self.verify.get(v).map(|s| s.iter().product::<usize>());
            if n.is_some_and(|n| n != xs.len()) {
                return at(format!(
                    "verify_values.{v}: {} values for a verify shape of {} elements",
                    xs.len(),
                    n.unwrap_or(0)
                ));
            }
        }
        for v in self.ranks.keys() {
            if !self.constant.contains(v) {
                return at(format!("ranks: {v:?} is not a constant (ranks are checked on constants)"));
            }
        }
        for group in &self.same_shape {
            if group.len() < 2 {
                return at("same_shape groups need at least two variables".into());
            }
            if let Some(v) = group.iter().find(|v| !inputs.contains(v.as_str()) && !defined.contains(v.as_str())) {
                return at(format!("same_shape: {v:?} is not a pattern variable"));
            }
        }
        let mut available: BTreeSet<&str> = inputs.clone();
        for c in &self.concat {
            if c.inputs.len() < 2 {
                return at(format!("concat {:?} needs at least two inputs", c.output));
            }
            if let Some(v) = c.inputs.iter().find(|v| !self.constant.contains(v)) {
                return at(format!("concat {:?}: input {v:?} is not a constant", c.output));
            }
            if inputs.contains(c.output.as_str()) || defined.contains(c.output.as_str()) || !available.insert(&c.output)
            {
                return at(format!("concat output {:?} is already a variable", c.output));
            }
        }
        let mut made: BTreeSet<&str> = self.concat.iter().map(|c| c.output.as_str()).collect();
        for t in &self.transpose {
            if !self.constant.contains(&t.input) && !made.contains(t.input.as_str()) {
                return at(format!(
                    "transpose {:?}: input {:?} is neither a constant nor an earlier concat or transpose output",
                    t.output, t.input
                ));
            }
            if inputs.contains(t.output.as_str()) || defined.contains(t.output.as_str()) || !available.insert(&t.output)
            {
                return at(format!("transpose output {:?} is already a variable", t.output));
            }
            made.insert(&t.output);
        }
        for v in &self.outputs {
            if !defined.contains(v.as_str()) {
                return at(format!("outputs: {v:?} is not defined by the match"));
            }
        }
        let mut replaced: BTreeSet<&str> = BTreeSet::new();
        for (i, node) in self.replace.iter().enumerate() {
            if node.op.is_empty() {
                return at(format!("replace[{i}] has no op"));
            }
            if node.commutative {
                return at(format!("replace[{i}]: commutative belongs on match nodes"));
            }
            let bound =
                |var: &str| self.pattern.iter().any(|p| p.attributes.values().any(|c| c.attribute_var() == Some(var)));
            if let Some((name, _)) = node.attributes.iter().find(|(_, c)| match c {
                AttrConstraint::Int(_) | AttrConstraint::Ints(_) => false,
                AttrConstraint::Dim(_) => !c.attribute_var().is_some_and(bound),
            }) {
                return at(format!(
                    "replace[{i}] ({}): attributes.{name} must be an integer, a list of integers or \"$NAME\" of an attribute variable a match node binds (a replacement node's attributes are values it gets; \"VAR.AXIS\" and \"*\" constrain match nodes)",
                    node.op
                ));
            }
            if let Some(a) = node.attributes_from.filter(|&a| a >= self.pattern.len()) {
                return at(format!(
                    "replace[{i}]: attributes_from = {a} but the match has {} nodes",
                    self.pattern.len()
                ));
            }
            for v in node.inputs.iter().filter(|v| !v.is_empty()) {
                if !available.contains(v.as_str()) && !replaced.contains(v.as_str()) {
                    return at(format!(
                        "replace[{i}] ({}) reads {v:?}, which is neither a pattern input, a concat or transpose output nor an earlier replacement output",
                        node.op
                    ));
                }
            }
            for v in node.outputs.iter().filter(|v| !v.is_empty()) {
                if available.contains(v.as_str()) || !replaced.insert(v) {
                    return at(format!("replace[{i}] ({}) redefines {v:?}", node.op));
                }
            }
        }
        for v in &self.outputs {
            if !replaced.contains(v.as_str()) {
                return at(format!("outputs: the replacement does not define {v:?}"));
            }
        }
        for (v, shape) in &self.verify {
            if !inputs.contains(v.as_str()) {
                return at(format!("verify: {v:?} is not a pattern input"));
            }
            let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            if shape.contains(&0) || shape.len() > 8 || elements.is_none_or(|n| n > MAX_VERIFY_ELEMENTS) {
                return at(format!(
                    "verify.{v}: shape {shape:?} must have at most 8 dimensions, none 0, and at most {MAX_VERIFY_ELEMENTS} elements"
                ));
            }
        }
        if !self.verify.is_empty() {
            if let Some(v) = inputs.iter().find(|v| !self.verify.contains_key(**v)) {
                return at(format!("verify: no shape for pattern input {v:?}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWIGLU: &str = r#"
name = "gate-up-swiglu"
match = [
  { op = "MatMul", inputs = ["x", "Wg"], outputs = ["g"] },
  { op = "MatMul", inputs = ["x", "Wu"], outputs = ["u"] },
  { op = "Sigmoid", inputs = ["g"], outputs = ["s"] },
  { op = "Mul", inputs = ["g", "s"], outputs = ["a"], commutative = true },
  { op = "Mul", inputs = ["a", "u"], outputs = ["y"], commutative = true },
]
constant = ["Wg", "Wu"]
dtypes = { Wg = ["float32", "float16"] }
ranks = { Wg = 2, Wu = 2 }
concat = [{ output = "Wgu", inputs = ["Wg", "Wu"], axis = -1 }]
transpose = [{ output = "WguT", input = "Wgu" }]
replace = [
  { op = "MatMul", inputs = ["x", "Wgu"], outputs = ["gu"] },
  { domain = "ai.kiln", op = "SwiGlu", inputs = ["gu"], outputs = ["y"] },
]
outputs = ["y"]
verify = { x = [3, 8], Wg = [8, 6], Wu = [8, 6] }
"#;

    fn parse(text: &str) -> Fusion {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_good_pattern_validates() {
        let f = parse(SWIGLU);
        f.validate().unwrap();
        assert_eq!(f.pattern_inputs(), vec!["x", "Wg", "Wu"]);
        let sigmoid = r#"{ op = "Sigmoid", inputs = ["g"], outputs = ["s"] }"#;
        let constrained = SWIGLU.replace(
            sigmoid,
            r#"{ op = "Sigmoid", inputs = ["g"], outputs = ["s"], attributes = { a = 4, b = "Wg.-1", c = "*" } }"#,
        );
        let f = parse(&constrained);
        f.validate().unwrap();
        let shapes = |v: &str| (v == "Wg").then(|| vec![Some(8), Some(6)]);
        let a = &f.pattern[2].attributes;
        assert_eq!((a["a"].resolve(shapes), a["b"].resolve(shapes), a["c"].resolve(shapes)), (Some(4), Some(6), None));
    }

    #[test]
    fn integer_lists_and_scalar_values_parse() {
        let sigmoid = r#"{ op = "Sigmoid", inputs = ["g"], outputs = ["s"] }"#;
        let text = SWIGLU
            .replace(
                sigmoid,
                r#"{ op = "Sigmoid", inputs = ["g"], outputs = ["s"], attributes = { perm = [0, 2, 1, 3] } }"#,
            )
            .replace("ranks = {", "values = { Wu = 0.5 }\nranks = {");
        let f = parse(&text);
        f.validate().unwrap();
        assert_eq!(f.pattern[2].attributes["perm"], AttrConstraint::Ints(vec![0, 2, 1, 3]));
        assert_eq!(f.pattern[2].attributes["perm"].resolve(|_| None), None);
        assert_eq!(f.values["Wu"], 0.5);
    }

    #[test]
    fn hostile_patterns_are_refused_with_the_reason() {
        let cases = [
            // A cycle: Sigmoid reads `a`, which a later node defines.
            (SWIGLU.replace(r#"inputs = ["g"], outputs = ["s"]"#, r#"inputs = ["a"], outputs = ["s"]"#), "cycle"),
            (
                SWIGLU.replace(r#"inputs = ["a", "u"], outputs = ["y"]"#, r#"inputs = ["p", "q"], outputs = ["y"]"#),
                "not connected",
            ),
            (
                SWIGLU.replace(
                    r#"outputs = ["y"]
verify"#,
                    r#"outputs = ["z"]
verify"#,
                ),
                "not defined by the match",
            ),
            (
                SWIGLU.replace(r#"inputs = ["gu"], outputs = ["y"]"#, r#"inputs = ["gx"], outputs = ["y"]"#),
                "neither a pattern input",
            ),
            (
                SWIGLU.replace(r#"inputs = ["gu"], outputs = ["y"]"#, r#"inputs = ["gu"], outputs = ["w"]"#),
                "does not define",
            ),
            (SWIGLU.replace(r#"constant = ["Wg", "Wu"]"#, r#"constant = ["Wg", "g"]"#), "not a pattern input"),
            (SWIGLU.replace(r#"outputs = ["u"]"#, r#"outputs = ["g"]"#), "defined twice"),
            (SWIGLU.replace("float16", "float17"), "unknown dtype"),
            (SWIGLU.replace(r#"outputs = ["gu"] }"#, r#"outputs = ["Wgu"] }"#), "redefines"),
            (SWIGLU.replace("x = [3, 8]", "x = [65536, 65536]"), "at most"),
            (SWIGLU.replace("ranks = {", "same_shape = [[\"Wg\", \"W\"]]\nranks = {"), "same_shape"),
            (SWIGLU.replace(", Wu = [8, 6]", ""), "no shape"),
            (SWIGLU.replace(r#"input = "Wgu" }"#, r#"input = "g" }"#), "neither a constant nor an earlier"),
            (SWIGLU.replace(r#"output = "WguT""#, r#"output = "Wgu""#), "transpose output \"Wgu\" is already"),
            (
                SWIGLU.replace(
                    r#"{ op = "Mul", inputs = ["g", "s"], outputs = ["a"], commutative = true }"#,
                    r#"{ op = "Mul", inputs = ["g", "s", "x"], outputs = ["a"], commutative = true }"#,
                ),
                "commutative",
            ),
        ];
        let sigmoid = r#"{ op = "Sigmoid", inputs = ["g"], outputs = ["s"] }"#;
        let with = |attrs: &str| SWIGLU.replace(sigmoid, &sigmoid.replace(" }", &format!(", attributes = {attrs} }}")));
        let cases = cases.into_iter().chain([
            (with(r#"{ k = "nope" }"#), "neither an integer nor"),
            (with(r#"{ k = "zz.0" }"#), "not a pattern variable"),
            (with(r#"{ "" = 1 }"#), "has no name"),
            (with(r#"{ k = "$" }"#), "neither an integer nor"),
            (with(r#"{ k = "$a-b" }"#), "neither an integer nor"),
            // A replacement's attribute variable must be one a match node binds.
            (
                SWIGLU.replace(
                    r#"outputs = ["y"] },
]"#,
                    r#"outputs = ["y"], attributes = { k = "$level" } },
]"#,
                ),
                "attribute variable a match node binds",
            ),
            (
                SWIGLU.replace(
                    r#"outputs = ["y"] },
]"#,
                    r#"outputs = ["y"], attributes = { k = "*" } },
]"#,
                ),
                "must be an integer",
            ),
            // Schema 15: `values` on constants only, finite.
            (SWIGLU.replace("ranks = {", "values = { x = 0.5 }\nranks = {"), "values: \"x\" is not a constant"),
            (SWIGLU.replace("ranks = {", "values = { Wg = inf }\nranks = {"), "not a finite number"),
        ]);
        for (text, needle) in cases {
            assert_ne!(text, SWIGLU, "case {needle:?} did not change the pattern");
            let err = parse(&text).validate().unwrap_err();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
        // Bound by a match node, the same variable is a valid replacement attribute.
        let bound = with(r#"{ level = "$level" }"#).replace(
            r#"outputs = ["y"] },
]"#,
            r#"outputs = ["y"], attributes = { accuracy_level = "$level" } },
]"#,
        );
        assert!(bound.contains("accuracy_level"));
        parse(&bound).validate().unwrap();
        let empty = Fusion { pattern: vec![], ..parse(SWIGLU) };
        assert!(empty.validate().unwrap_err().contains("match nothing"));
    }
}
