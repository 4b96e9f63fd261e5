//! onnxruntime's execution provider names, mapped to kiln's devices.

use kiln_host::ep::Device;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::{raise, Kind};

pub const CUDA: &str = "CUDAExecutionProvider";
pub const CPU: &str = "CPUExecutionProvider";

/// The providers this machine can run, best first: `CUDAExecutionProvider` when a CUDA GPU is
/// visible, then `CPUExecutionProvider` (as `onnxruntime.get_available_providers()`).
#[pyfunction]
pub fn get_available_providers() -> Vec<&'static str> {
    if kiln_host::cuda::device_count() > 0 {
        vec![CUDA, CPU]
    } else {
        vec![CPU]
    }
}

/// `"GPU"` when a CUDA GPU is visible, else `"CPU"` (as `onnxruntime.get_device()`).
#[pyfunction]
pub fn get_device() -> &'static str {
    if kiln_host::cuda::device_count() > 0 {
        "GPU"
    } else {
        "CPU"
    }
}

/// The device for `providers` (names, or `(name, options)` pairs, as onnxruntime takes them;
/// `provider_options` a list of option dicts beside the names): the first listed provider this
/// machine has (`device_id` from its options, default 0). `None`: the best available. Errors:
/// a name kiln does not know (onnxruntime's other providers included: no silent fallback), or
/// a list none of whose providers this machine has.
pub fn device(
    providers: Option<&Bound<'_, PyAny>>,
    provider_options: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Device, String)> {
    let Some(list) = providers.filter(|p| !p.is_none()) else {
        let best = get_available_providers()[0];
        return Ok((if best == CUDA { Device::Cuda(0) } else { Device::Cpu }, best.to_string()));
    };
    let list = list
        .cast::<PyList>()
        .map(|l| l.iter().collect::<Vec<_>>())
        .or_else(|_| list.cast::<PyTuple>().map(|t| t.iter().collect::<Vec<_>>()));
    let list = list.map_err(|_| raise(Kind::InvalidInput, "providers must be a list of provider names"))?;
    let options: Vec<Option<Bound<'_, PyAny>>> = match provider_options.filter(|o| !o.is_none()) {
        Some(o) => o.try_iter()?.map(|x| x.map(Some)).collect::<PyResult<_>>()?,
        None => Vec::new(),
    };
    if !options.is_empty() && options.len() != list.len() {
        return Err(raise(Kind::InvalidInput, "provider_options must have one entry per provider"));
    }
    let mut parsed = Vec::new();
    for (i, p) in list.iter().enumerate() {
        let (name, opts) = if let Ok(s) = p.cast::<PyString>() {
            (s.to_string(), options.get(i).cloned().flatten())
        } else if let Ok(t) = p.cast::<PyTuple>() {
            let name = t.get_item(0)?.extract::<String>()?;
            (name, t.get_item(1).ok())
        } else {
            return Err(raise(Kind::InvalidInput, format!("provider {p}: a name or a (name, options) pair")));
        };
        if name != CUDA && name != CPU {
            return Err(raise(
                Kind::Unsupported,
                format!("provider {name:?}: kiln runs {CUDA} and {CPU} only (no silent fallback)"),
            ));
        }
        let device_id = match opts.as_ref().and_then(|o| o.cast::<PyDict>().ok()) {
            Some(d) => match d.get_item("device_id")? {
                Some(v) => v
                    .str()?
                    .to_string()
                    .parse::<usize>()
                    .map_err(|_| raise(Kind::InvalidInput, format!("{name} device_id {v}: a GPU number")))?,
                None => 0,
            },
            None => 0,
        };
        parsed.push((name, device_id));
    }
    let gpus = kiln_host::cuda::device_count();
    for (name, id) in &parsed {
        match name.as_str() {
            CUDA if *id < gpus => return Ok((Device::Cuda(*id), name.clone())),
            CUDA if gpus > 0 => {
                return Err(raise(Kind::InvalidInput, format!("{CUDA} device_id {id}: this machine has {gpus} GPU(s)")))
            }
            CPU => return Ok((Device::Cpu, name.clone())),
            _ => {}
        }
    }
    Err(raise(
        Kind::Unsupported,
        format!(
            "none of the providers {:?} is available here ({} CUDA GPU(s) visible); add {CPU} to run on the CPU",
            parsed.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(),
            gpus
        ),
    ))
}
