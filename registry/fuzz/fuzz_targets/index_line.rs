//! A registry index file (`index/p`, one JSON line per version) from arbitrary bytes: its lines
//! or an error, and each line's signature verified or refused; never a panic.

#![no_main]

use std::path::Path;

use kiln_registry::{parse_index, signing};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(lines) = parse_index("p", Path::new("index/p"), data) {
        for l in &lines {
            let _ = signing::verify(l);
            let _ = l.provides("ai.onnx::Relu");
        }
    }
});
