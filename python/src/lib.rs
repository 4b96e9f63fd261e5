//! kiln's Python module (`kiln._kiln`, re-exported by the `kiln` package): onnxruntime's
//! `InferenceSession` API over a kiln [`Session`](kiln_host::ep::Session), and
//! onnxruntime-genai's `Model` / `Tokenizer` / `GeneratorParams` / `Generator` API over a
//! kiln [`Generator`](kiln_host::genai::Generator), with numpy arrays in and out.
//!
//! Names and behaviour follow onnxruntime's Python API
//! (<https://onnxruntime.ai/docs/api/python/api_summary.html>) and onnxruntime-genai's
//! (<https://onnxruntime.ai/docs/genai/api/python.html>), so that their users' code runs
//! with `import kiln as ort` or `import kiln as og` where kiln implements what it uses. The GIL
//! is released while a model runs or generates.

mod arrays;
mod errors;
mod genai;
mod owner;
mod providers;
mod session;

use pyo3::prelude::*;

#[pymodule]
fn _kiln(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(providers::get_available_providers, m)?)?;
    m.add_function(wrap_pyfunction!(providers::get_device, m)?)?;
    m.add_class::<session::InferenceSession>()?;
    m.add_class::<session::NodeArg>()?;
    m.add_class::<genai::Model>()?;
    m.add_class::<genai::Tokenizer>()?;
    m.add_class::<genai::TokenizerStream>()?;
    m.add_class::<genai::GeneratorParams>()?;
    m.add_class::<genai::Generator>()?;
    Ok(())
}
