//! Resolution speed (the package-format issue, item 12): an op registry of 1000 packages × 10
//! versions resolves the nodes of a 500-node model.
//!
//!     cargo bench -p kiln-registry --bench resolve
//!
//! Each synthetic package `pkg-N` (versions 1.0.0 … 1.9.0) claims five ops of its own domain
//! `com.pkgN` and one of 50 ai.onnx ops (`Op0` … `Op49`, 200 packages × 10 versions each), for
//! float32 and float16 up to rank 8. The model's 500 nodes are 250 ai.onnx ops (2,000 candidates
//! each, all valid: every node weighs every version) and 250 own-domain ops (10 candidates each).
//! Prints the median of 15 timed passes over the 500 nodes, and the time to build the registry
//! (parsing excluded).
use std::time::Instant;

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, OpRegistry, Package, BUILTIN};
use sha2::{Digest, Sha256};

fn package(n: usize, minor: usize) -> Package {
    let shim = format!("shim {n}.{minor}").into_bytes();
    let manifest = format!(
        "schema = 2\nabi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"pkg-{n}\"\nversion = \"1.{minor}.0\"\n\
         [[ops]]\ndomain = \"com.pkg{n}\"\nop_types = [\"A\", \"B\", \"C\", \"D\", \"E\"]\nsince_opset = 1\n\
         dtypes = [\"float32\", \"float16\"]\nmax_rank = 8\n\
         [[ops]]\nop_types = [\"Op{}\"]\nsince_opset = 1\ndtypes = [\"float32\", \"float16\"]\nmax_rank = 8\n\
         [files]\n\"shim.wasm\" = \"{}\"\n",
        n % 50,
        hex::encode(Sha256::digest(&shim))
    );
    Package::load_files(
        &format!("synthetic:{n}.{minor}"),
        &[("kernel.toml", manifest.as_bytes()), ("shim.wasm", &shim)],
    )
    .expect("a valid synthetic package")
}

fn main() {
    let packages: Vec<Package> = (0..1000).flat_map(|n| (0..10).map(move |m| package(n, m))).collect();
    let t = Instant::now();
    let mut reg = OpRegistry::new();
    for p in packages {
        reg.add(p, BUILTIN);
    }
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    let nodes: Vec<(String, String)> = (0..500)
        .map(|i| {
            if i % 2 == 0 {
                (String::new(), format!("Op{}", i % 50))
            } else {
                (format!("com.pkg{}", i * 7 % 1000), "C".into())
            }
        })
        .collect();
    let mut times = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        for (domain, op) in &nodes {
            let q = NodeQuery {
                domain,
                op_type: op,
                opset: 21,
                input_dtypes: vec![Some(DType::F32)],
                max_rank: Some(2),
                device: None,
            };
            let r = reg.resolve(&q).expect("resolves");
            assert_eq!(r.package.version().minor, 9, "the highest version wins");
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "resolve: 10000 packages (1000 × 10 versions), 500 nodes: median {:.2} ms over 15 passes (min {:.2}, max {:.2}); registry built in {:.1} ms",
        times[7], times[0], times[14], build_ms
    );
}
