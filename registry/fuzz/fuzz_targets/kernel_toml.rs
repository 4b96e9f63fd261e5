//! A package's `kernel.toml` from arbitrary bytes: parsed and validated (`Package::load_files`,
//! as a built-in or in-memory package is), and when it loads, added to an op registry and
//! linked. A package or an error, never a panic.

#![no_main]

use kiln_registry::{OpRegistry, Package, USER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Package::load_files("fuzz", &[("kernel.toml", data)]) {
        let mut reg = OpRegistry::new();
        reg.add(p, USER);
        reg.link();
    }
});
