//! kiln's errors as Python exceptions: `KilnError`, and under it `InvalidInput` (a bad model,
//! tensor, argument or folder: also a `ValueError`), `Unsupported` (an op, dtype or provider kiln
//! does not implement: also a `NotImplementedError`) and `DeviceError` (CUDA or a package's
//! shim failed: also a `RuntimeError`). Each carries kiln's message.

use pyo3::exceptions::{PyException, PyNotImplementedError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::PyTypeInfo;

pyo3::create_exception!(kiln, KilnError, PyException, "Every error kiln raises.");

/// The exception classes made at import (each with two bases, which `create_exception!` cannot
/// declare).
static CLASSES: std::sync::OnceLock<[Py<PyAny>; 3]> = std::sync::OnceLock::new();

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KilnError", py.get_type::<KilnError>())?;
    let make = |name: &str, other: Bound<'_, pyo3::types::PyType>, doc: &str| -> PyResult<Py<PyAny>> {
        let builtins = py.import("builtins")?;
        let bases = PyTuple::new(py, [py.get_type::<KilnError>().into_any(), other.into_any()])?;
        let ns = pyo3::types::PyDict::new(py);
        ns.set_item("__doc__", doc)?;
        ns.set_item("__module__", "kiln")?;
        let class = builtins.getattr("type")?.call1((name, bases, ns))?;
        m.add(name, &class)?;
        Ok(class.unbind())
    };
    let classes = [
        make("InvalidInput", PyValueError::type_object(py), "A bad model, tensor, argument or model folder.")?,
        make(
            "Unsupported",
            PyNotImplementedError::type_object(py),
            "An op, dtype or provider kiln does not implement.",
        )?,
        make("DeviceError", PyRuntimeError::type_object(py), "The device (CUDA) or a kernel package's shim failed.")?,
    ];
    let _ = CLASSES.set(classes);
    Ok(())
}

/// Which class an error is raised as.
#[derive(Clone, Copy)]
pub enum Kind {
    InvalidInput = 0,
    Unsupported = 1,
    Device = 2,
}

/// A Python exception of `kind` with `message`.
pub fn raise(kind: Kind, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match CLASSES.get() {
        Some(c) => match c[kind as usize].bind(py).call1((message.clone(),)) {
            Ok(e) => PyErr::from_value(e),
            Err(e) => e,
        },
        None => KilnError::new_err(message),
    })
}

/// kiln's error as the matching Python exception.
pub fn to_py(e: kiln_host::Error) -> PyErr {
    use kiln_host::Error;
    let kind = match &e {
        _ if e.is_unsupported() => Kind::Unsupported,
        Error::Device(_) | Error::OutOfMemory(_) | Error::Shim(_) => Kind::Device,
        _ => Kind::InvalidInput,
    };
    raise(kind, e.to_string())
}

/// `kiln_host::Result` into `PyResult`.
pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for kiln_host::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
