//! Loading and executing models: malformed input is an error (never a panic), op logic lives
//! in the packages, intermediates and dtypes behave.

use std::path::Path;
use std::sync::Arc;

use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::sandbox::SandboxConfig;
use kiln_host::{model, packages, Error};
use kiln_tests::onnx::{self, attr_float, attr_int, attr_ints, attr_string, init_f32, init_i64, node, value};
use kiln_tests::{f32_tensor, f32_values};
use sha2::{Digest, Sha256};

fn runtime(extra: &[&Path]) -> Arc<Runtime> {
    let dirs: Vec<_> = extra.iter().map(|p| p.to_path_buf()).collect();
    let (reg, errors) = packages::registry(&dirs, &[]);
    assert!(errors.is_empty(), "{errors:?}");
    Runtime::new(reg, SandboxConfig::default()).expect("runtime")
}

/// y = Relu(x), x: float32 [n].
fn relu_model() -> onnx::ModelProto {
    onnx::model(
        vec![node("Relu", &["x"], &["y"], vec![])],
        vec![value("x", 1, &[-1])],
        vec![value("y", 1, &[-1])],
        vec![],
    )
}

fn run(
    rt: &Arc<Runtime>,
    bytes: &[u8],
    feeds: Vec<(String, kiln_host::Tensor)>,
) -> Result<Vec<(String, kiln_host::Tensor)>, Error> {
    let m = model::load_bytes(bytes, None)?;
    Session::new(rt.clone(), m, SessionOptions::default())?.run(feeds)
}

#[test]
fn a_small_graph_runs_and_matches_float64() {
    // z = Softmax(Relu(x · W + b)), checked against a float64 computation.
    let w = [0.5f32, -1.0, 2.0, 0.25, -0.5, 1.5];
    let b = [0.1f32, -0.2];
    let m = onnx::model(
        vec![
            node("MatMul", &["x", "W"], &["h"], vec![]),
            node("Add", &["h", "b"], &["a"], vec![]),
            node("Relu", &["a"], &["r"], vec![]),
            node("Softmax", &["r"], &["z"], vec![]),
        ],
        vec![value("x", 1, &[-1, 3])],
        vec![value("z", 1, &[-1, 2])],
        vec![init_f32("W", &[3, 2], &w), init_f32("b", &[2], &b)],
    );
    let x = [1.0f32, 2.0, 3.0, -1.0, 0.5, 4.0];
    let out = run(&runtime(&[]), &onnx::bytes(&m), vec![("x".into(), f32_tensor(&[2, 3], &x))]).unwrap();
    let z = f32_values(&out[0].1);
    for row in 0..2 {
        let mut a = [0f64; 2];
        for j in 0..2 {
            a[j] = (0..3).map(|k| x[row * 3 + k] as f64 * w[k * 2 + j] as f64).sum::<f64>() + b[j] as f64;
            a[j] = a[j].max(0.0);
        }
        let m = a[0].max(a[1]);
        let s: f64 = a.iter().map(|v| (v - m).exp()).sum();
        for j in 0..2 {
            let want = (a[j] - m).exp() / s;
            assert!((z[row * 2 + j] as f64 - want).abs() < 1e-6, "row {row}: {z:?} vs {want}");
        }
    }
}

/// Writes a package `kiln-unary` 9.9.9 providing Relu whose shim doubles its input instead.
/// The node call of the unnamed `Relu` (named `Relu#0` at load), one float32 [n] input and one
/// output puts the input handle at byte 58 of the call and the output handle at byte 86
/// (ABI.md §6.1).
fn doubling_relu_package(dir: &Path) {
    let wasm = wat::parse_str(
        r#"(module
  (import "kiln" "set_output" (func $set_output (param i32 i32 i32 i32) (result i32)))
  (import "kiln" "read" (func $read (param i32 i64 i32 i32) (result i32)))
  (import "kiln" "write" (func $write (param i32 i64 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "\04\00\00\00\00\00\00\00")
  (func (export "kiln_abi_version") (result i32) (i32.const 1))
  (func (export "kiln_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "kiln_infer") (param $p i32) (param $n i32) (result i32)
    (call $set_output (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 64)))
  (func (export "kiln_dispatch") (param $p i32) (param $n i32) (result i32) (i32.const 2))
  (func (export "kiln_cpu") (param $p i32) (param $n i32) (result i32) (local $i i32)
    (drop (call $read (i32.load (i32.add (local.get $p) (i32.const 58))) (i64.const 0) (i32.const 256) (i32.const 16)))
    (loop $l
      (f32.store (i32.add (i32.const 256) (local.get $i))
        (f32.mul (f32.load (i32.add (i32.const 256) (local.get $i))) (f32.const 2)))
      (local.set $i (i32.add (local.get $i) (i32.const 4)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 16))))
    (call $write (i32.load (i32.add (local.get $p) (i32.const 86))) (i64.const 0) (i32.const 256) (i32.const 16)))
)"#,
    )
    .unwrap();
    std::fs::write(dir.join("shim.wasm"), &wasm).unwrap();
    let manifest = format!(
        "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"kiln-unary\"\nversion = \"9.9.9\"\n\
         [[ops]]\nop_types = [\"Relu\"]\nsince_opset = 6\ndtypes = [\"float32\"]\nmax_rank = 1\n\
         [files]\n\"shim.wasm\" = \"{}\"\n",
        hex::encode(Sha256::digest(&wasm))
    );
    std::fs::write(dir.join("kernel.toml"), manifest).unwrap();
}

#[test]
fn op_logic_lives_in_the_packages_a_newer_shim_changes_the_result() {
    let x = || vec![("x".to_string(), f32_tensor(&[4], &[1.0, -2.0, 3.0, -4.0]))];
    let bytes = onnx::bytes(&relu_model());
    let builtin = run(&runtime(&[]), &bytes, x()).unwrap();
    assert_eq!(f32_values(&builtin[0].1), [1.0, 0.0, 3.0, 0.0]);
    let dir = tempfile::tempdir().unwrap();
    doubling_relu_package(dir.path());
    let rt = runtime(&[dir.path()]);
    let swapped = run(&rt, &bytes, x()).unwrap();
    assert_eq!(f32_values(&swapped[0].1), [2.0, -4.0, 6.0, -8.0], "kiln-unary 9.9.9 outranks the built-in");
    // Where the newer package does not apply (rank 2 > its max_rank 1), the built-in one runs.
    let m2 = onnx::model(
        vec![node("Relu", &["x"], &["y"], vec![])],
        vec![value("x", 1, &[1, 4])],
        vec![value("y", 1, &[1, 4])],
        vec![],
    );
    let out = run(&rt, &onnx::bytes(&m2), vec![("x".into(), f32_tensor(&[1, 4], &[1.0, -2.0, 3.0, -4.0]))]).unwrap();
    assert_eq!(f32_values(&out[0].1), [1.0, 0.0, 3.0, 0.0]);
}

/// A package published to a registry directory outranks the built-in one; a drop-in folder
/// outranks the registry; a yanked version is no longer chosen.
#[test]
fn registry_packages_rank_between_drop_ins_and_built_ins_and_yanked_ones_are_skipped() {
    let x = || vec![("x".to_string(), f32_tensor(&[4], &[1.0, -2.0, 3.0, -4.0]))];
    let bytes = onnx::bytes(&relu_model());
    let src = tempfile::tempdir().unwrap();
    doubling_relu_package(src.path());
    let reg_dir = tempfile::tempdir().unwrap();
    let reg = kiln_registry::RegistryDir::new(reg_dir.path());
    reg.publish("doubling.kpkg", &kiln_registry::archive::pack(src.path()).unwrap()).unwrap();
    let with = |dirs: &[std::path::PathBuf], regs: &[std::path::PathBuf]| {
        let (r, errors) = packages::registry(dirs, regs);
        assert!(errors.is_empty(), "{errors:?}");
        Runtime::new(r, SandboxConfig::default()).unwrap()
    };
    let regs = [reg_dir.path().to_path_buf()];
    let out = run(&with(&[], &regs), &bytes, x()).unwrap();
    assert_eq!(f32_values(&out[0].1), [2.0, -4.0, 6.0, -8.0], "the registry's kiln-unary 9.9.9 outranks the built-in");
    // A drop-in kiln-unary (the built-in's own files, as a folder) outranks the registry's.
    let builtin_unary = kiln_builtin_kernels::PACKAGES.iter().find(|p| p.dir == "unary").unwrap();
    let drop_in = tempfile::tempdir().unwrap();
    for (rel, data) in builtin_unary.files {
        let path = drop_in.path().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
    let out = run(&with(&[drop_in.path().to_path_buf()], &regs), &bytes, x()).unwrap();
    assert_eq!(f32_values(&out[0].1), [1.0, 0.0, 3.0, 0.0], "a drop-in folder outranks every registry");
    // Also when both hold the same name@version: the drop-in's copy (the built-in Relu, renamed
    // 9.9.9; kernel.toml is not among the hashed files) runs, not the registry's doubling one.
    let toml = std::fs::read_to_string(drop_in.path().join("kernel.toml")).unwrap();
    let builtin = format!("version = \"{}\"", kiln_tests::builtin_version("unary"));
    let toml = toml.replacen(&builtin, "version = \"9.9.9\"", 1);
    assert!(toml.contains("version = \"9.9.9\""));
    std::fs::write(drop_in.path().join("kernel.toml"), toml).unwrap();
    let out = run(&with(&[drop_in.path().to_path_buf()], &regs), &bytes, x()).unwrap();
    assert_eq!(f32_values(&out[0].1), [1.0, 0.0, 3.0, 0.0], "the drop-in's kiln-unary@9.9.9 wins over the registry's");
    // A requirement keeps the registry's 9.9.9 out: the built-in runs.
    let (mut r, _) = packages::registry(&[], &regs);
    r.require(&["kiln-unary@^1".parse().unwrap()]).unwrap();
    let out = run(&Runtime::new(r, SandboxConfig::default()).unwrap(), &bytes, x()).unwrap();
    assert_eq!(f32_values(&out[0].1), [1.0, 0.0, 3.0, 0.0], "kiln-unary@^1 excludes 9.9.9");
    let (mut r, _) = packages::registry(&[], &regs);
    let err = r.require(&["kiln-unary@^2".parse().unwrap()]).unwrap_err();
    assert!(
        err.contains("kiln-unary@^2: no package meets it")
            && err.contains("9.9.9")
            && err.contains(&kiln_tests::builtin_version("unary")),
        "{err}"
    );
    reg.yank("kiln-unary", &"9.9.9".parse().unwrap(), true).unwrap();
    let out = run(&with(&[], &regs), &bytes, x()).unwrap();
    assert_eq!(f32_values(&out[0].1), [1.0, 0.0, 3.0, 0.0], "a yanked version is not chosen");
}

#[test]
fn a_failing_package_fails_its_node_and_the_runtime_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    doubling_relu_package(dir.path());
    let rt = runtime(&[dir.path()]);
    // The doubling shim assumes a 4-element input: fed 2 elements, its read is out of bounds.
    let err = run(&rt, &onnx::bytes(&relu_model()), vec![("x".into(), f32_tensor(&[2], &[1.0, -1.0]))])
        .unwrap_err()
        .to_string();
    assert!(err.contains("kiln-unary@9.9.9") && err.contains("Relu") && err.contains("outside handle"), "{err}");
    let ok =
        run(&rt, &onnx::bytes(&relu_model()), vec![("x".into(), f32_tensor(&[4], &[1.0, 1.0, 1.0, 1.0]))]).unwrap();
    assert_eq!(f32_values(&ok[0].1), [2.0; 4]);
}

/// An int64 tensor.
fn i64_tensor(shape: &[usize], values: &[i64]) -> kiln_host::Tensor {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    kiln_host::Tensor::new(kiln_kernel_abi::DType::I64, shape.to_vec(), data.into()).unwrap()
}

fn load_err(m: &onnx::ModelProto) -> String {
    match model::load_bytes(&onnx::bytes(m), None) {
        Err(e) => e.to_string(),
        Ok(m) => match Session::new(runtime(&[]), m, SessionOptions::default()) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the model was accepted"),
        },
    }
}

#[test]
fn every_truncation_of_a_model_is_an_error_or_a_smaller_model_never_a_panic() {
    let bytes = onnx::bytes(&onnx::model(
        vec![node("MatMul", &["x", "W"], &["h"], vec![]), node("Relu", &["h"], &["y"], vec![])],
        vec![value("x", 1, &[1, 2])],
        vec![value("y", 1, &[1, 2])],
        vec![init_f32("W", &[2, 2], &[1.0, 2.0, 3.0, 4.0])],
    ));
    let rt = runtime(&[]);
    let mut errors = 0;
    for cut in 0..bytes.len() {
        let feeds = vec![("x".into(), f32_tensor(&[1, 2], &[1.0, 1.0]))];
        if run(&rt, &bytes[..cut], feeds).is_err() {
            errors += 1;
        }
    }
    // A cut inside the last value declaration leaves a valid model (an output without its
    // type); every other prefix misses something the model needs.
    assert!(errors >= bytes.len() - 8, "{errors} of {} prefixes failed", bytes.len());
    for junk in [&b"\xff\xff\xff\xff"[..], b"GIF89a....", b"\x0a\xff\xff\xff\xff\x0f"] {
        let e = model::load_bytes(junk, None).unwrap_err().to_string();
        assert!(e.contains("not a valid ONNX protobuf") || e.contains("no graph"), "{e}");
    }
}

#[test]
fn malformed_models_name_what_is_wrong() {
    let relu = || node("Relu", &["x"], &["y"], vec![]);
    let x = || value("x", 1, &[4]);
    let y = || value("y", 1, &[4]);
    let cases: Vec<(onnx::ModelProto, &str)> = vec![
        // A node reads a value nobody defines (a missing initializer).
        (
            onnx::model(vec![node("Add", &["x", "bias"], &["y"], vec![])], vec![x()], vec![y()], vec![]),
            "reads \"bias\", which no node produces",
        ),
        // A cycle.
        (
            onnx::model(
                vec![node("Relu", &["b"], &["a"], vec![]), node("Relu", &["a"], &["b"], vec![])],
                vec![],
                vec![value("a", 1, &[1])],
                vec![],
            ),
            "cycle through node",
        ),
        // A value defined twice.
        (onnx::model(vec![relu(), node("Neg", &["x"], &["y"], vec![])], vec![x()], vec![y()], vec![]), "defined twice"),
        // Initializer data that does not match its shape; negative and absurd dims.
        (
            onnx::model(vec![relu()], vec![], vec![y()], vec![init_f32("x", &[5], &[1.0, 2.0])]),
            "5 elements expected, float_data holds 2",
        ),
        (onnx::model(vec![relu()], vec![], vec![y()], vec![init_f32("x", &[-3], &[])]), "negative dimension -3"),
        (onnx::model(vec![relu()], vec![], vec![y()], vec![init_f32("x", &[1 << 40, 1 << 40], &[])]), "overflows"),
        (onnx::model(vec![relu()], vec![], vec![y()], vec![init_f32("x", &[1 << 31, 1 << 10], &[])]), "over the limit"),
        // A graph output nobody produces.
        (
            onnx::model(vec![relu()], vec![x()], vec![value("z", 1, &[4])], vec![]),
            "graph output \"z\" is never produced",
        ),
        // An attribute of the wrong type (Transpose's perm as FLOAT).
        (
            onnx::model(
                vec![node("Transpose", &["x"], &["y"], vec![attr_float("perm", 1.0)])],
                vec![value("x", 1, &[2, 2])],
                vec![y()],
                vec![],
            ),
            "perm",
        ),
        // An attribute inconsistent with the shapes.
        (
            onnx::model(
                vec![node("Transpose", &["x"], &["y"], vec![attr_ints("perm", &[0, 0])])],
                vec![value("x", 1, &[2, 2])],
                vec![y()],
                vec![],
            ),
            "Transpose",
        ),
        // An unknown element type.
        (onnx::model(vec![relu()], vec![value("x", 99, &[4])], vec![y()], vec![]), "element type 99"),
    ];
    for (m, needle) in cases {
        let e = load_err(&m);
        assert!(e.contains(needle), "{e:?} should mention {needle:?}");
    }
    // A domain the model does not import.
    let mut m = relu_model();
    m.graph.as_mut().unwrap().node[0].domain = "com.example".into();
    assert!(load_err(&m).contains("does not import"), "{}", load_err(&m));
    // No opset at all.
    let mut m = relu_model();
    m.opset_import.clear();
    assert!(load_err(&m).contains("imports no opset"));
}

#[test]
fn external_data_is_mapped_and_cannot_escape_the_model_folder() {
    let dir = tempfile::tempdir().unwrap();
    let w: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.path().join("w.bin"), [&[0u8; 8][..], &w].concat()).unwrap();
    let ext = |location: &str, offset: &str| {
        let mut t = onnx::TensorProto { name: "W".into(), data_type: 1, dims: vec![4], ..Default::default() };
        for (k, v) in [("location", location), ("offset", offset), ("length", "16")] {
            t.external_data.push(onnx::StringStringEntryProto { key: k.into(), value: v.into(), ..Default::default() });
        }
        t.data_location = protobuf::EnumOrUnknown::new(onnx::tensor_proto::DataLocation::EXTERNAL);
        onnx::model(
            vec![node("Add", &["x", "W"], &["y"], vec![])],
            vec![value("x", 1, &[4])],
            vec![value("y", 1, &[4])],
            vec![t],
        )
    };
    let path = dir.path().join("m.onnx");
    std::fs::write(&path, onnx::bytes(&ext("w.bin", "8"))).unwrap();
    let m = model::load(&path).unwrap();
    let out = Session::new(runtime(&[]), m, SessionOptions::default())
        .unwrap()
        .run(vec![("x".into(), f32_tensor(&[4], &[1.0; 4]))])
        .unwrap();
    assert_eq!(f32_values(&out[0].1), [2.0, 3.0, 4.0, 5.0]);
    for (loc, off, needle) in [
        ("../w.bin", "0", "inside the model's folder"),
        ("/etc/passwd", "0", "inside"),
        ("w.bin", "16", "past the end"),
        ("nope.bin", "0", "nope.bin"),
    ] {
        std::fs::write(&path, onnx::bytes(&ext(loc, off))).unwrap();
        let e = model::load(&path).unwrap_err().to_string();
        assert!(e.contains(needle), "{e:?} should mention {needle:?}");
    }
    // An empty location names the folder itself; "." and a directory name no file.
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    for (loc, reason) in [
        ("", "the location is empty; it must name a file inside the model's folder".to_string()),
        (".", "the location names the model's folder, not a file in it".to_string()),
        ("sub", format!("{} is not a regular file", dir.path().join("sub").display())),
    ] {
        std::fs::write(&path, onnx::bytes(&ext(loc, "0"))).unwrap();
        let e = model::load(&path).unwrap_err();
        assert!(matches!(e, Error::Model(_)), "{e:?}");
        assert_eq!(e.to_string(), format!("invalid model: initializer \"W\": external data {loc:?}: {reason}"));
    }
}

/// `y = op(s)` for an int64 shape-like input `s` of `n` elements fed at run time, with
/// `extra` initializers (int64, by name) as further inputs.
fn value_driven(op: &str, n: i64, extra: &[(&str, &[i64])]) -> Vec<u8> {
    let mut inputs = vec!["s"];
    inputs.extend(extra.iter().map(|(name, _)| *name));
    let inits = extra
        .iter()
        .map(|(name, v)| onnx::TensorProto {
            name: name.to_string(),
            data_type: 7,
            dims: vec![v.len() as i64],
            int64_data: v.to_vec(),
            ..Default::default()
        })
        .collect();
    onnx::bytes(&onnx::model(
        vec![node(op, &inputs, &["y"], vec![])],
        vec![value("s", 7, &[n])],
        vec![onnx::ValueInfoProto { name: "y".into(), ..Default::default() }],
        inits,
    ))
}

fn int64(v: &[i64]) -> kiln_host::Tensor {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    kiln_host::Tensor::new(kiln_kernel_abi::DType::I64, vec![v.len()], bytes.into()).unwrap()
}

#[test]
fn a_huge_output_requested_by_a_value_is_an_error_naming_the_node() {
    let rt = runtime(&[]);
    let limit = 2u64 << 30;
    let over = |node: &str, what: &str, bytes: u64| {
        format!("invalid model: node {node:?}: output 0 would be {what} ({bytes} bytes), over the limit of {limit} bytes per tensor")
    };
    let cases: Vec<(Vec<u8>, Vec<i64>, String)> = vec![
        (
            value_driven("ConstantOfShape", 2, &[]),
            vec![1 << 15, 1 << 15],
            over("ConstantOfShape#0", "float32 [32768, 32768]", 1 << 32),
        ),
        (
            value_driven("Range", 1, &[("limit", &[1 << 30]), ("delta", &[1])]),
            vec![0],
            over("Range#0", "int64 [1073741824]", 1 << 33),
        ),
        (
            value_driven("Expand", 1, &[("shape", &[1 << 15, 1 << 15])]),
            vec![7],
            over("Expand#0", "int64 [32768, 32768]", 1 << 33),
        ),
    ];
    for (bytes, s, expected) in cases {
        let e = run(&rt, &bytes, vec![("s".into(), int64(&s))]).unwrap_err();
        assert!(matches!(e, Error::Model(_)), "{e:?}");
        assert_eq!(e.to_string(), expected);
    }
    // A shim may report 2^62 elements (the built-in ones refuse 2^32): their bytes overflow.
    let dir = tempfile::tempdir().unwrap();
    huge_relu_package(dir.path());
    let e = run(&runtime(&[dir.path()]), &onnx::bytes(&relu_model()), vec![("x".into(), f32_tensor(&[1], &[1.0]))])
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid model: node \"Relu#0\": output 0 would be float32 [2147483648, 2147483648], larger than memory can address"
    );
}

/// A package whose Relu infers a float32 [2^31, 2^31] output.
fn huge_relu_package(dir: &Path) {
    let wasm = wat::parse_str(
        r#"(module
  (import "kiln" "set_output" (func $set_output (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "\00\00\00\80\00\00\00\00\00\00\00\80\00\00\00\00")
  (func (export "kiln_abi_version") (result i32) (i32.const 1))
  (func (export "kiln_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "kiln_infer") (param $p i32) (param $n i32) (result i32)
    (call $set_output (i32.const 0) (i32.const 1) (i32.const 2) (i32.const 64)))
  (func (export "kiln_dispatch") (param $p i32) (param $n i32) (result i32) (i32.const 2))
  (func (export "kiln_cpu") (param $p i32) (param $n i32) (result i32) (i32.const 2))
)"#,
    )
    .unwrap();
    std::fs::write(dir.join("shim.wasm"), &wasm).unwrap();
    let manifest = format!(
        "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"huge\"\nversion = \"1.0.0\"\n\
         [[ops]]\nop_types = [\"Relu\"]\nsince_opset = 6\ndtypes = [\"float32\"]\nmax_rank = 2\n\
         [files]\n\"shim.wasm\" = \"{}\"\n",
        hex::encode(Sha256::digest(&wasm))
    );
    std::fs::write(dir.join("kernel.toml"), manifest).unwrap();
}

#[test]
fn wrong_inputs_are_errors() {
    let rt = runtime(&[]);
    let bytes = onnx::bytes(&relu_model());
    let int = kiln_host::Tensor::new(kiln_kernel_abi::DType::I64, vec![4], vec![0u8; 32].into()).unwrap();
    let cases = [
        (vec![], "input \"x\" was not given"),
        (vec![("x".to_string(), int)], "must be float32, not int64"),
        (vec![("nope".to_string(), f32_tensor(&[4], &[0.0; 4]))], "no input \"nope\""),
    ];
    for (feeds, needle) in cases {
        let e = run(&rt, &bytes, feeds).unwrap_err().to_string();
        assert!(e.contains(needle), "{e:?} should mention {needle:?}");
    }
}

#[test]
fn an_op_no_package_provides_names_node_op_and_candidates() {
    let m = onnx::model(
        vec![node("Bernoulli", &["x"], &["y"], vec![])],
        vec![value("x", 1, &[4])],
        vec![value("y", 1, &[4])],
        vec![],
    );
    let e = load_err(&m);
    assert!(
        e.contains("Bernoulli#0")
            && e.contains("ai.onnx::Bernoulli")
            && e.contains("float32")
            && e.contains("no installed package"),
        "{e}"
    );
    let m = onnx::model(
        vec![node("Sqrt", &["x"], &["y"], vec![])],
        vec![value("x", 7, &[4])],
        vec![value("y", 7, &[4])],
        vec![],
    );
    let e = load_err(&m);
    let unary =
        format!("kiln-unary@{} rejected: dtype int64 of input 0 is not in", kiln_tests::builtin_version("unary"));
    assert!(e.contains(&unary), "{e}");
}

/// I/O binding on the CPU: an output kept as a held tensor, fed back as an input without a
/// copy, written into in place; bad shapes and another session's handles are errors; a
/// dropped handle's buffer goes back to its session.
#[test]
fn held_tensors_feed_fetch_and_refuse_misuse() {
    use kiln_host::ep::{Feed, Fetch, Fetched};
    use kiln_kernel_abi::DType;
    let rt = runtime(&[]);
    let m = model::load_bytes(&onnx::bytes(&relu_model()), None).unwrap();
    let mut s = Session::new(rt.clone(), m.clone(), SessionOptions::default()).unwrap();
    let x = f32_tensor(&[4], &[-1.0, 2.0, -3.0, 4.0]);
    let out = s.run_with(vec![("x".into(), Feed::Host(x))], &[("y", Fetch::Device)]).unwrap();
    let Some((_, Fetched::Device(y))) = out.into_iter().next() else { panic!("y is not held") };
    assert_eq!(s.tensor_type(&y).unwrap(), (DType::F32, vec![4]));
    assert_eq!(f32_values(&s.read_tensor(&y).unwrap()), [0.0, 2.0, 0.0, 4.0]);
    // Relu(y) written into y itself.
    let out = s.run_with(vec![("x".into(), Feed::Device(&y))], &[("y", Fetch::Into(&y))]).unwrap();
    assert!(matches!(out[0].1, Fetched::Written));
    assert_eq!(f32_values(&s.read_slice(&y, 1, 3).unwrap()), [2.0, 0.0, 4.0]);
    assert!(s.read_slice(&y, 2, 3).is_err(), "a slice past the end");
    // Misuse.
    assert!(s.zeros(DType::F32, vec![1 << 40]).is_err(), "a tensor over the size limit");
    let mut other = Session::new(rt, m, SessionOptions::default()).unwrap();
    assert!(other.tensor_type(&y).is_err(), "another session's handle");
    let wrong = other.zeros(DType::F32, vec![3]).unwrap();
    let too_small = s.run_with(vec![("x".into(), Feed::Device(&y))], &[("y", Fetch::Into(&wrong))]);
    assert!(too_small.is_err(), "a bound tensor of another session");
    // Dropped handles give their buffers back to their own session.
    assert_eq!((s.held_tensors(), other.held_tensors()), (1, 1));
    drop((y, wrong));
    s.reclaim();
    assert_eq!((s.held_tensors(), other.held_tensors()), (0, 1), "only s reclaimed so far");
    let z = other.zeros(DType::F32, vec![2]).unwrap();
    assert_eq!(other.held_tensors(), 1, "an allocation reclaims first: only the new tensor is held");
    assert_eq!(other.tensor_type(&z).unwrap(), (DType::F32, vec![2]));
}

/// `Fetch::Skip`: a skipped output is not returned, the node that only it needs does not run,
/// and an input only that node reads need not be fed.
#[test]
fn a_skipped_output_is_not_computed_and_its_inputs_need_not_be_fed() {
    use kiln_host::ep::{Feed, Fetch};
    let m = onnx::model(
        vec![node("Relu", &["x"], &["y"], vec![]), node("Neg", &["z"], &["w"], vec![])],
        vec![value("x", 1, &[3]), value("z", 1, &[3])],
        vec![value("y", 1, &[3]), value("w", 1, &[3])],
        vec![],
    );
    let model = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let mut s = Session::new(runtime(&[]), model, SessionOptions::default()).unwrap();
    let x = f32_tensor(&[3], &[-1.0, 2.0, -3.0]);
    let mut out = s.run_with(vec![("x".into(), Feed::Host(x.clone()))], &[("w", Fetch::Skip)]).unwrap();
    assert_eq!(out.len(), 1);
    let (name, y) = out.remove(0);
    assert_eq!(name, "y");
    assert_eq!(f32_values(&y.into_host().unwrap()), vec![0.0, 2.0, 0.0]);
    assert_eq!(s.report.nodes, 1, "only Relu ran");
    // Without the skip, z is needed.
    let err = s.run_with(vec![("x".into(), Feed::Host(x))], &[]).unwrap_err().to_string();
    assert!(err.contains("\"z\" was not given"), "{err}");
}

#[test]
fn one_error_names_every_op_no_package_runs() {
    // RandomUniformLike twice, Bernoulli once, then a supported Relu: the error gives the first
    // RandomUniformLike's full detail and names Bernoulli (with its first node) as missing too.
    let m = onnx::model(
        vec![
            node("RandomUniformLike", &["x"], &["c1"], vec![]),
            node("Bernoulli", &["c1"], &["p"], vec![]),
            node("RandomUniformLike", &["p"], &["c2"], vec![]),
            node("Relu", &["c2"], &["y"], vec![]),
        ],
        vec![value("x", 1, &[1, 1, 8, 8])],
        vec![value("y", 1, &[-1, -1, -1, -1])],
        vec![],
    );
    let bytes = onnx::bytes(&m);
    // `kiln inspect` lists both, with their counts, and the Relu's package.
    let (reg, _) = packages::registry(&[], &[]);
    let ins = kiln_host::cli::inspect::inspect(
        model::load_bytes(&bytes, None).unwrap(),
        &reg,
        kiln_host::ep::Device::Cpu,
        None,
        true,
    );
    assert_eq!(ins.unsupported_ops, 2);
    let row = |op: &str| ins.ops.iter().find(|r| r.op == op).unwrap();
    assert_eq!(
        (row("ai.onnx::RandomUniformLike").nodes, row("ai.onnx::RandomUniformLike").package.as_deref()),
        (2, None)
    );
    assert!(row("ai.onnx::Bernoulli").reason.as_deref().unwrap().contains("no kernel package runs ai.onnx::Bernoulli"));
    assert_eq!(row("ai.onnx::Relu").package, Some(format!("kiln-unary@{}", kiln_tests::builtin_version("unary"))));
    assert_eq!(ins.inputs[0].shape, "1 × 1 × 8 × 8");
    let err = Session::new(runtime(&[]), model::load_bytes(&bytes, None).unwrap(), SessionOptions::default())
        .err()
        .expect("no package runs RandomUniformLike");
    assert!(err.is_unsupported(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("node \"RandomUniformLike#0\": no kernel package runs ai.onnx::RandomUniformLike"),
        "{msg}"
    );
    assert!(
        msg.contains(
            "no package runs these ops of the model either: ai.onnx::Bernoulli (1 node, first \"Bernoulli#1\")"
        ),
        "{msg}"
    );
    assert!(!msg.contains("Relu"), "Relu has a package: {msg}");
}

/// kiln-pool and kiln-loss refuse malformed nodes with the reason, never a panic: a stride
/// past what the shim's 32-bit sizes hold, padding as large as the window (onnxruntime's rule),
/// and a target that only fits 32 bits when cut short.
#[test]
fn malformed_pooling_and_loss_nodes_are_clear_errors() {
    let pool = |attrs| {
        onnx::model(
            vec![node("MaxPool", &["x"], &["y"], attrs)],
            vec![value("x", 1, &[1, 1, 4, 4])],
            vec![value("y", 1, &[-1, -1, -1, -1])],
            vec![],
        )
    };
    let e = load_err(&pool(vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("strides", &[1 << 32, 1])]));
    assert!(e.contains("MaxPool: strides entries must be in 1..=2147483647, not 4294967296"), "{e}");
    let e = load_err(&pool(vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("pads", &[2, 0, 0, 0])]));
    assert!(e.contains("MaxPool: pads [2, 0, 0, 0] must be smaller than kernel_shape [2, 2] (axis 0)"), "{e}");
    // A target of 2^32 + 1 over 3 classes: out of range, not class 1.
    let m = onnx::model(
        vec![node("NegativeLogLikelihoodLoss", &["x", "t"], &["y"], vec![])],
        vec![value("x", 1, &[1, 3]), value("t", 7, &[1])],
        vec![value("y", 1, &[])],
        vec![],
    );
    let rt = runtime(&[]);
    let err = run(
        &rt,
        &onnx::bytes(&m),
        vec![("x".into(), f32_tensor(&[1, 3], &[0.1, 0.2, 0.7])), ("t".into(), i64_tensor(&[1], &[(1i64 << 32) + 1]))],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("NegativeLogLikelihoodLoss: target 4294967297 is out of range for 3 classes"), "{err}");
}

/// The vision, quantization, normalization and attention ops added for general ONNX models refuse
/// malformed nodes with the reason, never a panic (each case once made a shim divide by zero or
/// read past a buffer), and the edge cases that have a value compute it.
#[test]
fn malformed_vision_quantization_and_attention_nodes_are_clear_errors() {
    let one = |op: &str, ins: &[&str], attrs, inputs, inits| {
        onnx::model(vec![node(op, ins, &["y"], attrs)], inputs, vec![value("y", 1, &[-1, -1, -1, -1])], inits)
    };
    // blocksize² past the shim's 32-bit sizes.
    let m = one("DepthToSpace", &["x"], vec![attr_int("blocksize", 65536)], vec![value("x", 1, &[1, 4, 2, 2])], vec![]);
    let e = load_err(&m);
    assert!(e.contains("DepthToSpace: blocksize 65536 makes [1, 4, 2, 2] too large"), "{e}");
    // num_groups of 2^32 is not 0 groups.
    let m = one(
        "GroupNormalization",
        &["x", "s", "b"],
        vec![attr_int("num_groups", 1 << 32)],
        vec![value("x", 1, &[1, 4, 2, 2])],
        vec![init_f32("s", &[4], &[1.0; 4]), init_f32("b", &[4], &[0.0; 4])],
    );
    let e = load_err(&m);
    assert!(e.contains("GroupNormalization: num_groups 4294967296 must be positive and divide the 4 channels"), "{e}");
    // Nothing to sample from.
    let m = one(
        "GridSample",
        &["x", "g"],
        vec![attr_string("padding_mode", "border")],
        vec![value("x", 1, &[1, 1, 0, 2]), value("g", 1, &[1, 1, 1, 2])],
        vec![],
    );
    let e = load_err(&m);
    assert!(e.contains("GridSample: X [1, 1, 0, 2] has an empty spatial axis to sample from"), "{e}");
    // A zero point of another type than x.
    let m = onnx::model(
        vec![node("DequantizeLinear", &["x", "s", "z"], &["y"], vec![])],
        vec![value("x", 6, &[4]), value("s", 1, &[]), value("z", 3, &[])],
        vec![value("y", 1, &[-1])],
        vec![],
    );
    let e = load_err(&m);
    assert!(e.contains("DequantizeLinear: x_zero_point is int8 but x is int32"), "{e}");
    // Attention (opset 23) with no KV head, and with no key at all (Y is zero, as the reference's
    // empty matmul gives).
    let attention = |k: &[i64]| {
        let mut m = onnx::model(
            vec![node("Attention", &["q", "k", "v"], &["y"], vec![])],
            vec![value("q", 1, &[1, 2, 3, 4]), value("k", 1, k), value("v", 1, k)],
            vec![value("y", 1, &[-1, -1, -1, -1])],
            vec![],
        );
        m.opset_import[0].version = 23;
        m
    };
    let e = load_err(&attention(&[1, 0, 3, 4]));
    assert!(e.contains("Attention: 2 query heads are not a multiple of 0 KV heads"), "{e}");
    let rt = runtime(&[]);
    let q = f32_tensor(&[1, 2, 3, 4], &[0.5; 24]);
    let kv = f32_tensor(&[1, 1, 0, 4], &[]);
    let feeds = vec![("q".into(), q), ("k".into(), kv.clone()), ("v".into(), kv)];
    let out = run(&rt, &onnx::bytes(&attention(&[1, 1, 0, 4])), feeds).unwrap();
    assert_eq!(out[0].1.shape, vec![1, 2, 3, 4]);
    assert_eq!(f32_values(&out[0].1), vec![0.0; 24]);
    // A packed ReshapedAttention whose Reshape targets do not split a 6-column block into heads
    // of its width ([2, 8, 1, 3] has a block's 48 elements but rows of 3): refused at load, not
    // read at the wrong stride.
    let packed = |sq: &[i64]| {
        let mut n = node(
            "ReshapedAttention",
            &["qkv", "", "", "", "c", "sq", "sq", "sq", "so"],
            &["y"],
            vec![attr_int("packed", 1)],
        );
        n.domain = "ai.kiln".into();
        let mut m = onnx::model(
            vec![n],
            vec![value("qkv", 1, &[2, 4, 18])],
            vec![value("y", 1, &[-1, -1, -1])],
            vec![init_f32("c", &[], &[2.0]), init_i64("sq", &[4], sq), init_i64("so", &[3], &[2, 4, -1])],
        );
        m.opset_import.push(onnx::OperatorSetIdProto { domain: "ai.kiln".into(), version: 1, ..Default::default() });
        m
    };
    let e = load_err(&packed(&[2, 8, 1, 3]));
    assert!(
        e.contains("ReshapedAttention: packed Q, K, V blocks of 6 columns are not split into heads: Q's target gives 1 heads of 3"),
        "{e}"
    );
    // The same with targets that split each block into 2 heads of 3 runs.
    let rt = runtime(&[]);
    let qkv = f32_tensor(&[2, 4, 18], &(0..144).map(|i| (i % 7) as f32 * 0.1).collect::<Vec<_>>());
    let out = run(&rt, &onnx::bytes(&packed(&[2, 4, 2, 3])), vec![("qkv".into(), qkv)]).unwrap();
    assert_eq!(out[0].1.shape, vec![2, 4, 6]);
    // ReverseSequence with a length past the time axis: the CPU reference's message (the GPU
    // kernel reports the same through its status record).
    let m = onnx::model(
        vec![node("ReverseSequence", &["x", "l"], &["y"], vec![])],
        vec![value("x", 1, &[3, 2]), value("l", 7, &[2])],
        vec![value("y", 1, &[-1, -1])],
        vec![],
    );
    let feeds = vec![("x".into(), f32_tensor(&[3, 2], &[0.0; 6])), ("l".into(), i64_tensor(&[2], &[3, 4]))];
    let e = run(&rt, &onnx::bytes(&m), feeds).unwrap_err().to_string();
    assert!(e.contains("ReverseSequence: sequence_lens[1] = 4 is out of range for 3 time steps"), "{e}");
    // InstanceNormalization over no channel: an empty output.
    let m = onnx::model(
        vec![node("InstanceNormalization", &["x", "s", "b"], &["y"], vec![])],
        vec![value("x", 1, &[1, 0, 4]), value("s", 1, &[0]), value("b", 1, &[0])],
        vec![value("y", 1, &[-1, -1, -1])],
        vec![],
    );
    let empty = f32_tensor(&[0], &[]);
    let feeds = vec![("x".into(), f32_tensor(&[1, 0, 4], &[])), ("s".into(), empty.clone()), ("b".into(), empty)];
    let out = run(&rt, &onnx::bytes(&m), feeds).unwrap();
    assert_eq!(out[0].1.shape, vec![1, 0, 4]);
}

/// The index ops (kiln-tensor's GatherElements, ScatterND, OneHot, Pad; kiln-reduce's TopK)
/// refuse out-of-range indices and bad geometry with the CPU reference's messages, and a
/// scatter's repeated indices combine in order.
#[test]
fn index_ops_refuse_bad_indices_and_combine_repeats_in_order() {
    let rt = runtime(&[]);
    let feeds = |f: Vec<(&str, kiln_host::Tensor)>| f.into_iter().map(|(n, t)| (n.to_string(), t)).collect::<Vec<_>>();
    let ok = |m: &onnx::ModelProto, f| run(&rt, &onnx::bytes(m), feeds(f)).unwrap();
    let err = |m: &onnx::ModelProto, f| run(&rt, &onnx::bytes(m), feeds(f)).unwrap_err().to_string();
    // GatherElements: an index of 3 along an axis of 3.
    let m = onnx::model(
        vec![node("GatherElements", &["x", "i"], &["y"], vec![attr_int("axis", 1)])],
        vec![value("x", 1, &[2, 3]), value("i", 7, &[2, 1])],
        vec![value("y", 1, &[-1, -1])],
        vec![],
    );
    let x = f32_tensor(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let e = err(&m, vec![("x", x.clone()), ("i", i64_tensor(&[2, 1], &[0, 3]))]);
    assert!(e.contains("GatherElements: index 3 is out of range for dimension 3 of axis 1"), "{e}");
    let out = ok(&m, vec![("x", x), ("i", i64_tensor(&[2, 1], &[-1, 1]))]);
    assert_eq!(f32_values(&out[0].1), vec![3., 5.]);
    // ScatterND with reduction add and a repeated index: both updates land, in order.
    let m = onnx::model(
        vec![node("ScatterND", &["x", "i", "u"], &["y"], vec![attr_string("reduction", "add")])],
        vec![value("x", 1, &[4]), value("i", 7, &[3, 1]), value("u", 1, &[3])],
        vec![value("y", 1, &[-1])],
        vec![],
    );
    let scatter = |i: &[i64]| {
        vec![
            ("x", f32_tensor(&[4], &[1., 1., 1., 1.])),
            ("i", i64_tensor(&[3, 1], i)),
            ("u", f32_tensor(&[3], &[0.5, 0.25, 2.])),
        ]
    };
    assert_eq!(f32_values(&ok(&m, scatter(&[2, -2, 0]))[0].1), vec![3., 1., 1.75, 1.]);
    let e = err(&m, scatter(&[2, -5, 0]));
    assert!(e.contains("ScatterND: index -5 is out of range for dimension 4 of data axis 0"), "{e}");
    // TopK: k larger than the axis; ties keep index order (the two 5s, the first one first);
    // NaN ranks above every number (numpy, torch).
    let m = onnx::model(
        vec![node("TopK", &["x", "k"], &["v", "i"], vec![])],
        vec![value("x", 1, &[-1]), value("k", 7, &[1])],
        vec![value("v", 1, &[-1]), value("i", 7, &[-1])],
        vec![],
    );
    let topk = |x: &[f32], k: i64| vec![("x", f32_tensor(&[x.len()], x)), ("k", i64_tensor(&[1], &[k]))];
    let e = err(&m, topk(&[1., 5., 2., 5., 0.], 6));
    assert!(e.contains("TopK: k = 6 is out of range for axis 0 of 5 elements"), "{e}");
    let out = ok(&m, topk(&[1., 5., 2., 5., 0.], 3));
    assert_eq!(f32_values(&out[0].1), vec![5., 5., 2.]);
    assert_eq!(i64_values(&out[1].1), vec![1, 3, 2]);
    let out = ok(&m, topk(&[1., f32::NAN, 2.], 2));
    assert!(f32_values(&out[0].1)[0].is_nan() && f32_values(&out[0].1)[1] == 2.);
    assert_eq!(i64_values(&out[1].1), vec![1, 2]);
    // Pad: pads that crop more than the axis holds; reflect beyond one period; an axis cropped at
    // one end and padded at the other wraps its kept window (ONNX's reference crops first), and a
    // window cropped away cannot be reflected.
    let pad = |mode| {
        onnx::model(
            vec![node("Pad", &["x", "p"], &["y"], vec![attr_string("mode", mode)])],
            vec![value("x", 1, &[-1]), value("p", 7, &[2])],
            vec![value("y", 1, &[-1])],
            vec![],
        )
    };
    let pads = |x: &[f32], p: [i64; 2]| vec![("x", f32_tensor(&[x.len()], x)), ("p", i64_tensor(&[2], &p))];
    let e = err(&pad("reflect"), pads(&[1., 2., 3.], [-2, -2]));
    assert!(e.contains("Pad: pads -2 and -2 leave axis 0 of 3 elements with -1"), "{e}");
    let out = ok(&pad("reflect"), pads(&[1., 2., 3.], [5, 1]));
    assert_eq!(f32_values(&out[0].1), vec![2., 1., 2., 3., 2., 1., 2., 3., 2.]);
    let out = ok(&pad("wrap"), pads(&[0., 1., 2., 3., 4.], [-1, 1]));
    assert_eq!(f32_values(&out[0].1), vec![1., 2., 3., 4., 1.]);
    let e = err(&pad("reflect"), pads(&[1., 2., 3.], [-3, 2]));
    assert!(e.contains("cannot pad axis 0: pads -3 and 2 leave none of it"), "{e}");
}

/// The elements of an int64 tensor.
fn i64_values(t: &kiln_host::Tensor) -> Vec<i64> {
    assert_eq!(t.dtype, kiln_kernel_abi::DType::I64);
    t.data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// tests/real-models (torchvision's MobileNetV3-Small at 64 × 64, a 2-layer BERT encoder;
/// scripts/make-real-models.py) match onnxruntime on the CPU: max|Δ| ≤ 1e-3·max|ref|, the same
/// top-5 classes.
#[test]
fn small_real_models_match_onnxruntime_on_the_cpu() {
    let checked =
        kiln_tests::check_real_models(&kiln_tests::root().join("tests/real-models"), &SessionOptions::default());
    assert_eq!(checked.len(), 2, "{checked:?}");
    println!("{checked:?}");
}

/// The full-size models of scripts/make-big-models.py (resnet50, mobilenet_v3_large,
/// efficientnet_b0, vit_b_16, BERT-base; about 900 MB, so not in the repository) on the CPU,
/// from the folder `KILN_BIG_MODELS` names: max|Δ| ≤ 1e-3·max|ref|, the same top-5 classes.
#[test]
#[ignore = "needs KILN_BIG_MODELS (scripts/make-big-models.py)"]
fn big_real_models_match_onnxruntime_on_the_cpu() {
    let dir = std::env::var_os("KILN_BIG_MODELS").expect("set KILN_BIG_MODELS to scripts/make-big-models.py's folder");
    println!("{:?}", kiln_tests::check_real_models(Path::new(&dir), &SessionOptions::default()));
}

/// DFT's inverse on ONNX 1.20's `test_dft_inverse` input (whose expected output, a float32 FFT,
/// the conformance runner does not use) against the exact transform in f64: within 1e-5, where
/// that test's data is off by up to 1.5e-6 around values of 54 and 1.9e-7 where the exact value is
/// 0.
#[test]
fn inverse_dft_matches_the_exact_transform() {
    let dir = kiln_tests::onnx_node_tests().join("test_dft_inverse");
    let (x, _) = kiln_host::tensorio::read_tensor_file(&dir.join("test_data_set_0/input_0.pb")).unwrap();
    let (axis, _) = kiln_host::tensorio::read_tensor_file(&dir.join("test_data_set_0/input_1.pb")).unwrap();
    let m = model::load(&dir.join("model.onnx")).unwrap();
    let mut s = Session::new(runtime(&[]), m, SessionOptions::default()).unwrap();
    let out = s.run(vec![("x".into(), x.clone()), ("axis".into(), axis)]).unwrap();
    let (got, xs) = (f32_values(&out[0].1), f32_values(&x));
    // x [1, 10, 10, 2], transformed along axis 1 (n = 10), inverse: (1/n) Σ x[m]·e^(+2πi·k·m/n).
    let n = 10;
    let mut worst = 0f64;
    for k in 0..n {
        for i in 0..10 {
            let (mut re, mut im) = (0f64, 0f64);
            for m in 0..n {
                let (xr, xi) = (xs[(m * 10 + i) * 2] as f64, xs[(m * 10 + i) * 2 + 1] as f64);
                let a = 2.0 * std::f64::consts::PI * ((k * m) % n) as f64 / n as f64;
                re += xr * a.cos() - xi * a.sin();
                im += xr * a.sin() + xi * a.cos();
            }
            let at = (k * 10 + i) * 2;
            worst = worst.max((got[at] as f64 - re / n as f64).abs()).max((got[at + 1] as f64 - im / n as f64).abs());
        }
    }
    assert!(worst < 1e-5, "max |kiln − exact| = {worst}");
}

/// String tensors move through the order-keeping shape ops (kiln-tensor's Reshape, Identity,
/// Unsqueeze, Flatten) and into kiln-string's ops; a string op that no package runs for strings
/// (Transpose) is refused by name.
#[test]
fn string_tensors_flow_through_shape_ops_and_string_ops() {
    const STRING: i32 = 8;
    let shape = onnx::TensorProto {
        name: "shape".into(),
        data_type: 7,
        dims: vec![2],
        int64_data: vec![3, 2],
        ..Default::default()
    };
    let m = onnx::model(
        vec![
            node("Reshape", &["x", "shape"], &["r"], vec![]),
            node("Identity", &["r"], &["i"], vec![]),
            node("StringConcat", &["i", "i"], &["c"], vec![]),
            node("Unsqueeze", &["c", "axes"], &["u"], vec![]),
            node("Flatten", &["u"], &["y"], vec![attr_int("axis", 2)]),
        ],
        vec![value("x", STRING, &[2, 3])],
        vec![value("y", STRING, &[])],
        vec![
            shape,
            onnx::TensorProto {
                name: "axes".into(),
                data_type: 7,
                dims: vec![1],
                int64_data: vec![0],
                ..Default::default()
            },
        ],
    );
    let mut m = m;
    m.opset_import[0].version = 21;
    m.graph.as_mut().unwrap().output[0].type_.as_mut().unwrap().mut_tensor_type().shape.clear();
    let loaded = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let mut s = Session::new(kiln_tests::builtin_runtime(), loaded, SessionOptions::default()).unwrap();
    let x = kiln_host::Tensor::from_strings(vec![2, 3], &["a", "b", "c", "d", "e", "的"]).unwrap();
    let y = s.run(vec![("x".into(), x)]).unwrap().remove(0).1;
    assert_eq!(y.shape, vec![3, 2], "Flatten at axis 2 of [1, 3, 2]");
    let want = ["aa", "bb", "cc", "dd", "ee", "的的"];
    assert_eq!(y.strings().unwrap(), want.iter().map(|w| w.as_bytes()).collect::<Vec<_>>());
    // Transpose of strings: no package claims it.
    let t = onnx::model(
        vec![node("Transpose", &["x"], &["y"], vec![])],
        vec![value("x", STRING, &[2, 3])],
        vec![value("y", STRING, &[3, 2])],
        vec![],
    );
    let err = model::load_bytes(&onnx::bytes(&t), None)
        .and_then(|m| Session::new(kiln_tests::builtin_runtime(), m, SessionOptions::default()))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("Transpose") && err.contains("string"), "{err}");
}
