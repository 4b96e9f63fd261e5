//! An ONNX model from arbitrary bytes, loaded, prepared with the built-in packages and run on
//! the CPU with zero-filled inputs of its declared shapes: a result or an error, never a panic,
//! an abort or a hang (libFuzzer's -timeout and -rss_limit_mb catch the last two).

#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::model::{self, Dim};
use kiln_host::sandbox::SandboxConfig;
use libfuzzer_sys::fuzz_target;

/// The built-in packages, their shims compiled once per process.
fn runtime() -> Arc<Runtime> {
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    RT.get_or_init(|| {
        let (reg, _errors) = kiln_host::packages::registry(&[], &[]);
        let config = SandboxConfig { call_timeout: Duration::from_secs(5), ..SandboxConfig::default() };
        Runtime::new(reg, config).expect("a runtime of the built-in packages")
    })
    .clone()
}

/// Largest input the target feeds, in bytes.
const MAX_FEED_BYTES: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = model::load_bytes(data, None) else { return };
    let mut feeds = Vec::new();
    for &id in &m.graph.inputs {
        let v = &m.graph.values[id];
        let Some(ty) = &v.ty else { return };
        let shape: Vec<usize> = match &ty.dims {
            Some(dims) => dims.iter().map(|d| if let Dim::Known(n) = d { *n } else { 1 }).collect(),
            None => vec![1],
        };
        let Ok(n) = kiln_host::tensor::byte_size(ty.dtype, &shape) else { return };
        if n > MAX_FEED_BYTES {
            return;
        }
        let Ok(t) = kiln_host::Tensor::new(ty.dtype, shape, vec![0u8; n as usize].into()) else { return };
        feeds.push((v.name.clone(), t));
    }
    let options = SessionOptions { max_tensor_bytes: 16 << 20, ..SessionOptions::default() };
    let Ok(mut s) = Session::new(runtime(), m, options) else { return };
    let _ = s.run(feeds);
});
