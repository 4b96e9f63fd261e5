//! `kiln.InferenceSession`: onnxruntime's session API over a kiln session.

use kiln_host::ep::{Feed, Fetch, Fetched, Runtime, Session, SessionOptions};
use kiln_host::model::{self, Dim};
use kiln_kernel_abi::DType;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::arrays::{to_numpy, to_tensor};
use crate::errors::{raise, IntoPy, Kind};
use crate::owner::Owner;

/// A graph input or output as onnxruntime describes it: `name`, `shape` (ints for known
/// dimensions, strings for symbolic ones, `None` for unknown ones) and `type`
/// (`"tensor(float)"`, …).
#[pyclass(module = "kiln", frozen)]
#[derive(Clone)]
pub struct NodeArg {
    #[pyo3(get)]
    name: String,
    dims: Option<Vec<Dim>>,
    #[pyo3(get, name = "type")]
    type_: String,
}

#[pymethods]
impl NodeArg {
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let dims = self.dims.as_deref().unwrap_or_default();
        let items: Vec<Bound<'py, PyAny>> = dims
            .iter()
            .map(|d| match d {
                Dim::Known(n) => Ok(n.into_pyobject(py)?.into_any()),
                Dim::Symbolic(s) => Ok(s.into_pyobject(py)?.into_any()),
                Dim::Unknown => Ok(py.None().into_bound(py)),
            })
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    fn __repr__(&self) -> String {
        let dims: Vec<String> = self
            .dims
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|d| match d {
                Dim::Known(n) => n.to_string(),
                Dim::Symbolic(s) => format!("'{s}'"),
                Dim::Unknown => "None".into(),
            })
            .collect();
        format!("NodeArg(name='{}', type='{}', shape=[{}])", self.name, self.type_, dims.join(", "))
    }
}

/// onnxruntime's type string of a tensor of `dtype`.
fn type_string(dtype: DType) -> String {
    let t = match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        DType::U16 => "uint16",
        DType::U32 => "uint32",
        DType::U64 => "uint64",
        DType::Bool => "bool",
        DType::String => "string",
        // onnxruntime's names of the rest are ONNX's in lower case, as kiln's.
        other => other.name(),
    };
    format!("tensor({t})")
}

fn node_args(m: &model::Model, ids: &[usize]) -> Vec<NodeArg> {
    ids.iter()
        .map(|&i| {
            let v = &m.graph.values[i];
            NodeArg {
                name: v.name.clone(),
                dims: v.ty.as_ref().and_then(|t| t.dims.clone()),
                type_: v.ty.as_ref().map_or_else(|| "tensor(undefined)".into(), |t| type_string(t.dtype)),
            }
        })
        .collect()
}

/// `kiln.InferenceSession(path_or_bytes, sess_options=None, providers=None,
/// provider_options=None)`: an ONNX model ready to run on the first of `providers` this machine
/// has (`CUDAExecutionProvider`, `CPUExecutionProvider`; default: the best available). The
/// built-in kernel packages and those in `KILN_PACKAGE_PATH` run its ops. `run` may be called
/// from several threads: calls on one session take turns (each runs alone), with the GIL
/// released while the model runs.
#[pyclass(module = "kiln")]
pub struct InferenceSession {
    session: Owner<Session>,
    inputs: Vec<NodeArg>,
    outputs: Vec<NodeArg>,
    provider: String,
}

#[pymethods]
impl InferenceSession {
    #[new]
    #[pyo3(signature = (path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs))]
    fn new(
        py: Python<'_>,
        path_or_bytes: &Bound<'_, PyAny>,
        sess_options: Option<&Bound<'_, PyAny>>,
        providers: Option<&Bound<'_, PyAny>>,
        provider_options: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<InferenceSession> {
        let _ = (sess_options, kwargs);
        let (device, provider) = crate::providers::device(providers, provider_options)?;
        let model = if let Ok(b) = path_or_bytes.cast::<PyBytes>() {
            model::load_bytes(b.as_bytes(), None).py_err()?
        } else {
            let path: std::path::PathBuf = path_or_bytes
                .extract()
                .map_err(|_| raise(Kind::InvalidInput, "path_or_bytes: a path to an .onnx file, or its bytes"))?;
            py.detach(|| model::load(&path)).py_err()?
        };
        let (inputs, outputs) = (node_args(&model, &model.graph.inputs), node_args(&model, &model.graph.outputs));
        let session = py.detach(move || {
            Owner::new("kiln-session", move || {
                Session::new(runtime()?, model, SessionOptions { device, ..SessionOptions::default() })
            })
        });
        Ok(InferenceSession { session: session.py_err()?, inputs, outputs, provider })
    }

    fn get_inputs(&self) -> Vec<NodeArg> {
        self.inputs
            .iter()
            .map(|a| NodeArg { name: a.name.clone(), dims: a.dims.clone(), type_: a.type_.clone() })
            .collect()
    }

    fn get_outputs(&self) -> Vec<NodeArg> {
        self.outputs
            .iter()
            .map(|a| NodeArg { name: a.name.clone(), dims: a.dims.clone(), type_: a.type_.clone() })
            .collect()
    }

    /// The provider the session runs on, as a one-element list.
    fn get_providers(&self) -> Vec<String> {
        vec![self.provider.clone()]
    }

    /// Runs the model: `input_feed` maps every input name to a numpy array; returns the arrays
    /// of `output_names` (all outputs when `None` or empty), in that order. Errors: `InvalidInput` for an
    /// unknown or missing name, a wrong dtype or shape; `Unsupported` for an op no package runs;
    /// `DeviceError` when the device fails.
    #[pyo3(signature = (output_names, input_feed, run_options=None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        output_names: Option<Vec<String>>,
        input_feed: &Bound<'py, PyDict>,
        run_options: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let _ = run_options;
        let mut feeds = Vec::with_capacity(input_feed.len());
        for (k, v) in input_feed.iter() {
            let name: String = k.extract().map_err(|_| raise(Kind::InvalidInput, "input_feed keys are input names"))?;
            let t = to_tensor(&format!("input {name:?}"), &v)?;
            feeds.push((name, t));
        }
        let all: Vec<String> = self.outputs.iter().map(|o| o.name.clone()).collect();
        // onnxruntime: None or an empty list is every output.
        let wanted = output_names.filter(|n| !n.is_empty()).unwrap_or_else(|| all.clone());
        if let Some(bad) = wanted.iter().find(|n| !all.contains(n)) {
            return Err(raise(
                Kind::InvalidInput,
                format!("output {bad:?} is not an output of the model (it has {all:?})"),
            ));
        }
        let want = wanted.clone();
        let ran = py.detach(|| {
            self.session.call(move |s: &mut Session| -> kiln_host::Result<Vec<(String, Fetched)>> {
                let fetches: Vec<(&str, Fetch<'_>)> = all
                    .iter()
                    .map(|n| (n.as_str(), if want.contains(n) { Fetch::Host } else { Fetch::Skip }))
                    .collect();
                let feeds = feeds.into_iter().map(|(n, t)| (n, Feed::Host(t))).collect();
                s.run_with(feeds, &fetches)
            })
        });
        let mut by_name: Vec<(String, kiln_host::Tensor)> = Vec::new();
        for (n, f) in ran.py_err()?.py_err()? {
            if let Fetched::Host(t) = f {
                by_name.push((n, t));
            }
        }
        wanted
            .iter()
            .map(|n| {
                let t = by_name
                    .iter()
                    .find(|(m, _)| m == n)
                    .map(|(_, t)| t)
                    .ok_or_else(|| raise(Kind::Device, format!("output {n:?} did not come back")))?;
                to_numpy(py, n, t)
            })
            .collect()
    }
}

/// The runtime of the built-in packages and `KILN_PACKAGE_PATH`'s folders, one per process (its
/// compiled shims are shared by every session).
pub fn runtime() -> kiln_host::Result<std::sync::Arc<Runtime>> {
    static RT: std::sync::OnceLock<std::sync::Arc<Runtime>> = std::sync::OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt.clone());
    }
    let dirs: Vec<std::path::PathBuf> =
        std::env::var_os("KILN_PACKAGE_PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    let (registry, errors) = kiln_host::packages::registry(&dirs, &[]);
    if let Some(e) = errors.into_iter().next() {
        return Err(kiln_host::Error::from(e));
    }
    let rt = Runtime::new(registry, kiln_host::cli::sandbox_config())?;
    Ok(RT.get_or_init(|| rt).clone())
}
