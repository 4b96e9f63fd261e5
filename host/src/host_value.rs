//! Values a session takes and gives on the host beside tensors: ONNX's sequences and optionals,
//! which If, Loop, SequenceMap and the sequence and optional ops carry (the executor runs them;
//! packages take tensors only). `tensorio` reads them from ONNX's `.pb` test data.

use crate::model::Kind;
use crate::{Error, Result, Tensor};

/// A graph value on the host: a tensor, a sequence of tensors, or an optional (absent, or a
/// tensor or sequence).
#[derive(Clone, Debug)]
pub enum HostValue {
    Tensor(Tensor),
    Sequence(Vec<Tensor>),
    Optional(Option<Box<HostValue>>),
}

impl HostValue {
    /// Its kind, as a model declares one (an absent optional: an optional tensor).
    pub fn kind(&self) -> Kind {
        match self {
            HostValue::Tensor(_) => Kind::Tensor,
            HostValue::Sequence(_) => Kind::Sequence,
            HostValue::Optional(v) => Kind::Optional(Box::new(v.as_deref().map_or(Kind::Tensor, HostValue::kind))),
        }
    }

    /// Whether it may feed a value declared `kind`: an absent optional fits either optional, and
    /// a present value fits an optional of its kind (as onnxruntime takes a Loop body's sequence
    /// where the loop carries an optional one).
    pub fn fits(&self, kind: &Kind) -> bool {
        match (self, kind) {
            (HostValue::Optional(None), Kind::Optional(_)) => true,
            (HostValue::Optional(Some(v)), Kind::Optional(k)) => v.fits(k),
            (v, Kind::Optional(k)) => v.fits(k),
            (v, k) => v.kind() == *k,
        }
    }

    /// The tensor. Errors: a sequence or optional, naming `what`.
    pub fn into_tensor(self, what: &str) -> Result<Tensor> {
        match self {
            HostValue::Tensor(t) => Ok(t),
            other => Err(Error::Input(format!("{what} is a {}, not a tensor", other.kind()))),
        }
    }

    /// The tensors of a sequence. Errors: a tensor or optional, naming `what`.
    pub fn into_sequence(self, what: &str) -> Result<Vec<Tensor>> {
        match self {
            HostValue::Sequence(s) => Ok(s),
            other => Err(Error::Input(format!("{what} is a {}, not a sequence", other.kind()))),
        }
    }
}

/// Compares `actual` with `expected` value by value (tensors with
/// [`crate::conformance::compare`]); `None` when they agree, else the first difference.
pub fn compare_values(actual: &HostValue, expected: &HostValue, rtol: f64, atol: f64) -> Option<String> {
    match (actual, expected) {
        (HostValue::Tensor(a), HostValue::Tensor(e)) => crate::conformance::compare(a, e, rtol, atol),
        (HostValue::Sequence(a), HostValue::Sequence(e)) => {
            if a.len() != e.len() {
                return Some(format!("a sequence of {}, expected {}", a.len(), e.len()));
            }
            a.iter().zip(e).enumerate().find_map(|(i, (a, e))| {
                crate::conformance::compare(a, e, rtol, atol).map(|m| format!("element {i}: {m}"))
            })
        }
        (HostValue::Optional(None), HostValue::Optional(None)) => None,
        (HostValue::Optional(Some(a)), HostValue::Optional(Some(e))) => compare_values(a, e, rtol, atol),
        (a, e) => Some(format!("a {}, expected a {}", describe(a), describe(e))),
    }
}

/// `tensor`, `sequence`, `empty optional`, `optional …`.
fn describe(v: &HostValue) -> String {
    match v {
        HostValue::Optional(None) => "empty optional".into(),
        v => v.kind().to_string(),
    }
}
