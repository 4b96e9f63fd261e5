//! The `kiln` binary end to end: the README's example, kernel listing, conformance on a few
//! node tests, and clear errors for bad arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The version of the built-in package in `kernels/<dir>` as its manifest states it, so that
/// tests which name a built-in package by version follow its version bumps.
fn builtin_version(dir: &str) -> String {
    let path = root().join("kernels").join(dir).join("kernel.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    kiln_kernel_abi::manifest::Manifest::parse(&text).unwrap().package.version.to_string()
}

/// ONNX's node tests, fetched into `.cache/` by scripts/fetch-onnx-node-tests.sh when missing.
fn node_tests() -> PathBuf {
    let dir = root().join(".cache/onnx-node-1.20.0/node");
    if !dir.is_dir() {
        let s = Command::new("bash").arg(root().join("scripts/fetch-onnx-node-tests.sh")).status().unwrap();
        assert!(s.success(), "could not fetch the ONNX node tests");
    }
    dir
}

/// `kiln args…` with `stdin` as its standard input.
fn kiln_with_stdin(args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kiln runs");
    child.stdin.take().expect("a piped stdin").write_all(stdin).expect("kiln reads its input");
    child.wait_with_output().expect("kiln ends")
}

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).current_dir(root()).output().expect("kiln runs")
}

/// `kiln run` of the README example on the CPU, with `extra` arguments.
fn run_example(extra: &[&str]) -> Output {
    let args = ["run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/x.npy", "--device", "cpu"];
    kiln(&[&args[..], extra].concat())
}

/// The tiny-llama fp32 CPU fixture folder and onnxruntime-genai's greedy run of "Once upon a
/// time" on it (`prompt_token_ids`, `generated_token_ids`).
fn tiny_llama_fp32() -> (PathBuf, serde_json::Value) {
    let fixtures =
        std::env::var_os("KILN_FIXTURES").map(PathBuf::from).unwrap_or_else(|| root().join("../shared/fixtures"));
    let dir = fixtures.join("llm/tiny-llama-v512-fp32-cpu");
    assert!(dir.is_dir(), "fixture {} is missing: set KILN_FIXTURES (see ../shared/fixtures/README.md)", dir.display());
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures.join("llm/references/tiny-llama-v512-fp32-cpu/genai_greedy.json")).unwrap(),
    )
    .unwrap();
    let run = reference["runs"].as_array().unwrap().iter().find(|r| r["prompt_id"] == "plain_once_upon").unwrap();
    (dir, run.clone())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn the_readme_example_runs_and_matches_onnxruntime() {
    let out = tempfile::tempdir().unwrap();
    let o = kiln(&[
        "run",
        "examples/mlp/model.onnx",
        "--input",
        "x=examples/mlp/x.npy",
        "--expect",
        "probs=examples/mlp/expected.npy",
        "--output-dir",
        out.path().to_str().unwrap(),
        "--report-json",
        out.path().join("report.json").to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("probs: float32 [3, 4]") && t.contains("probs: matches the expected output"), "{t}");
    assert!(t.contains("using the CPU (package CPU references)"), "auto says it picked the CPU: {t}");
    assert!(out.path().join("probs.npy").is_file());
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("report.json")).unwrap()).unwrap();
    // 7 nodes, each MatMul and its bias Add fused into one Linear (kiln-matmul's linear-bias).
    assert_eq!(report["nodes"], 5);
    assert_eq!(report["wasm_calls"]["cpu"], 5);
    assert_eq!(report["packages"][format!("kiln-matmul@{}", builtin_version("matmul"))], 2);
}

/// A flag's value out of its range is invalid input (exit 3, README's exit codes), whichever
/// flag it is; a value that is not a number at all is clap's usage error (exit 2).
#[test]
fn flag_values_out_of_range_are_invalid_input() {
    for (flag, value, why) in [
        ("--runs", "0", "--runs must be at least 1"),
        ("--cpu-tiles", "0", "--cpu-tiles must be in 1..=1024, got 0"),
        ("--cpu-tiles", "1025", "--cpu-tiles must be in 1..=1024, got 1025"),
    ] {
        let o = run_example(&[flag, value]);
        assert_eq!(o.status.code(), Some(3), "{flag} {value}: {}", text(&o));
        assert!(text(&o).contains(why), "{flag} {value}: {}", text(&o));
    }
    let o = run_example(&["--cpu-tiles", "many"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn a_wrong_expectation_exits_with_the_mismatch_code() {
    let out = tempfile::tempdir().unwrap();
    let o = kiln(&[
        "run",
        "examples/mlp/model.onnx",
        "--input",
        "x=examples/mlp/x.npy",
        "--expect",
        "probs=examples/mlp/x.npy",
        "--output-dir",
        out.path().to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert_eq!(o.status.code(), Some(5), "a mismatch: {}", text(&o));
    assert!(text(&o).contains("MISMATCH"));
}

#[test]
fn kernels_list_shows_every_builtin_package() {
    let o = kiln(&["kernels", "list"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for dir in [
        "unary",
        "binary",
        "cast",
        "matmul",
        "reduce",
        "normalization",
        "tensor",
        "pool",
        "loss",
        "image",
        "conv",
        "rnn",
        "string",
        "cuda-std",
    ] {
        let p = format!("kiln-{dir} {}", builtin_version(dir));
        assert!(t.contains(&p), "{p} missing from:\n{t}");
    }
    assert!(t.contains("LayerNormalization") && t.contains("bfloat16"));
    assert!(t.contains("headers: kiln-cuda-std/vec.cuh") && t.contains("depends on: kiln-cuda-std ^1.5"), "{t}");
}

#[test]
fn conformance_prints_a_table_and_the_summary_line() {
    let dir = node_tests();
    let json = tempfile::NamedTempFile::new().unwrap();
    let o = kiln(&[
        "conformance",
        dir.to_str().unwrap(),
        "--filter",
        "test_softmax",
        "--device",
        "cpu",
        "--json",
        json.path().to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("Softmax") && t.contains("conformance: ") && t.contains(" passed, 0 failed, "), "{t}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    assert!(doc["passed"].as_u64().unwrap() >= 7, "{doc}");
    // One test folder runs that test; a filter that matches no name says so.
    let one = dir.join("test_softmax_axis_0");
    let o = kiln(&["conformance", one.to_str().unwrap(), "--device", "cpu"]);
    assert!(o.status.success() && text(&o).contains("conformance: 1 passed, 0 failed, 0 unsupported"), "{}", text(&o));
    let o = kiln(&["conformance", dir.to_str().unwrap(), "--filter", "Softmax", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("no test folder's name contains \"Softmax\""), "{}", text(&o));
}

#[test]
fn bad_arguments_are_clear_errors() {
    let cases: [(&[&str], &str); 11] = [
        (&["run", "nope.onnx"], "nope.onnx: No such file"),
        (&["run", "examples/mlp"], "examples/mlp is a folder; give its model file: `kiln run examples/mlp/model.onnx`"),
        (&["generate", "examples/mlp", "--prompt", "hi"], "examples/mlp is not an onnxruntime-genai model folder"),
        (&["conformance", "examples/mlp/model.onnx"], "is a file: give a folder of node tests"),
        (&["run", "examples/mlp/model.onnx", "--device-memory-limit", "0"], "0 is not in 1..=17592186044415"),
        (&["generate", "x", "--device-memory-limit", "99999999999999999999"], "--device-memory-limit"),
        (&["run", "examples/mlp/model.onnx", "--input", "x"], "expected NAME=FILE"),
        (&["run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/model.onnx"], "must end in .npy or .pb"),
        (&["run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/x.npy", "--device", "cuda"], "no CUDA driver"),
        (&["run", "examples/mlp/model.onnx"], "input \"x\" was not given"),
        (&["run", "examples/mlp/x.npy", "--input", "x=examples/mlp/x.npy"], "not a valid ONNX protobuf"),
    ];
    // A usage error is 2, an invalid input 3 (README, "Exit codes").
    let o = kiln(&["run", "--no-such-flag"]);
    assert_eq!(o.status.code(), Some(2), "usage: {}", text(&o));
    let o = kiln(&["run", "examples/mlp/model.onnx", "--expect", "=probs.npy"]);
    assert_eq!(o.status.code(), Some(2), "a malformed NAME=FILE is usage: {}", text(&o));
    let o = kiln(&["run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/model.onnx"]);
    assert_eq!(o.status.code(), Some(3), "a well-formed but wrong file is invalid input: {}", text(&o));
    for (args, needle) in cases {
        let o = kiln(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(text(&o).contains(needle), "{args:?}: {:?} should mention {needle:?}", text(&o));
    }
}

#[test]
fn a_broken_drop_in_package_is_listed_and_fails_a_run_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("broken");
    std::fs::create_dir(&pkg).unwrap();
    std::fs::write(pkg.join("kernel.toml"), "abi = 1\nname = 3\n").unwrap();
    let o = kiln(&["kernels", "list", "--packages", dir.path().to_str().unwrap()]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("BROKEN") && t.contains("broken") && t.contains("kiln-unary"), "{t}");
    let out = tempfile::tempdir().unwrap();
    let o = kiln(&[
        "run",
        "examples/mlp/model.onnx",
        "--input",
        "x=examples/mlp/x.npy",
        "--packages",
        dir.path().to_str().unwrap(),
        "--output-dir",
        out.path().to_str().unwrap(),
    ]);
    // A run never falls back silently from a package the user added: invalid input (3),
    // naming the package folder and the reason.
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("1 package(s) could not be loaded") && t.contains("broken"), "{t}");
    assert!(!out.path().join("probs.npy").exists(), "nothing ran");
}

#[test]
fn generate_streams_text_and_writes_json_like_genai() {
    let (dir, run) = tiny_llama_fp32();
    let json = tempfile::NamedTempFile::new().unwrap();
    let o = kiln(&[
        "generate",
        dir.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "32",
        "--greedy",
        "--json",
        json.path().to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("time to first token") && t.contains("decode"), "{t}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    // One schema for any number of prompts: a list of rows.
    assert_eq!(doc["rows"].as_array().map(Vec::len), Some(1), "{doc}");
    assert_eq!(doc["rows"][0]["prompt_ids"], run["prompt_token_ids"]);
    assert_eq!(doc["rows"][0]["generated_ids"], run["generated_token_ids"]);
    assert!(doc["timings"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    // `--json -`: the JSON alone on stdout (the text goes to stderr), two prompts, same schema.
    let o = kiln(&[
        "generate",
        dir.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "8",
        "--greedy",
        "--json",
        "-",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON document");
    assert_eq!(doc["rows"].as_array().map(Vec::len), Some(2), "{doc}");
    assert_eq!(
        doc["rows"][0]["generated_ids"].as_array().unwrap()[..8],
        run["generated_token_ids"].as_array().unwrap()[..8]
    );
    // A batch prints each row labelled, prompt and answer apart.
    let t = String::from_utf8_lossy(&o.stderr);
    assert!(t.contains("[0] prompt: Once upon a time\n[0] output: ") && t.contains("[1] prompt: The cat\n"), "{t}");
    // Bad arguments.
    let o = kiln(&["generate", dir.to_str().unwrap(), "--prompt", "x", "--top-p", "2"]);
    assert!(!o.status.success() && text(&o).contains("--top-p"), "{}", text(&o));
    // A length over the model's context (2048) fails before the session is built.
    let o = kiln(&["generate", dir.to_str().unwrap(), "--prompt", "x", "--max-length", "6000"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("--max-length") && t.contains("6000") && t.contains("context_length 2048"), "{t}");
    let o = kiln(&["generate", "nope", "--prompt", "x"]);
    assert!(!o.status.success() && text(&o).contains("not a folder"), "{}", text(&o));
}

#[test]
fn verify_checks_a_package_on_the_cpu_and_names_unknown_packages() {
    // verify reads the node tests from the default folder under the repository root.
    node_tests();
    let json = tempfile::NamedTempFile::new().unwrap();
    let o = kiln(&["verify", "kiln-unary", "--device", "cpu", "--seeds", "1", "--json", json.path().to_str().unwrap()]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("verify kiln-unary: ") && t.contains(" passed, 0 failed, 0 unsupported"), "{t}");
    assert!(t.contains("Sigmoid") && t.contains("float16") && t.contains("max rel err"), "{t}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    assert!(doc["passed"].as_u64().unwrap() > 100 && doc["failed"] == 0, "{doc}");
    assert!(doc["random"].as_array().unwrap().iter().any(|c| c["dtype"] == "bfloat16"), "{doc}");

    let o = kiln(&["verify", "nope", "--device", "cpu"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("no package named \"nope\"") && t.contains("kiln-unary"), "{t}");
}

/// kiln-tensor claims Dropout at opset 22 for float32 and declines `training_mode` (schema 9):
/// ONNX's four training-mode tests are unsupported, not broken claims.
#[test]
fn verify_counts_a_declared_refusal_unsupported() {
    node_tests();
    let o = kiln(&["verify", "kiln-tensor", "--device", "cpu", "--seeds", "1"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("verify kiln-tensor: ") && t.contains(" passed, 0 failed, 4 unsupported"), "{t}");
}

/// A package that claims an (op, opset, dtype) in its manifest but answers UNSUPPORTED for it
/// fails `kiln verify` (the claim is what resolution trusts), naming the claim and the answer.
#[test]
fn verify_fails_a_package_that_answers_unsupported_for_what_it_claims() {
    use sha2::Digest;
    node_tests();
    let dir = tempfile::tempdir().unwrap();
    // Every call of this shim answers UNSUPPORTED (status 2, ABI.md §3).
    let wasm = wat::parse_str(
        r#"(module
  (memory (export "memory") 1)
  (func (export "kiln_abi_version") (result i32) (i32.const 1))
  (func (export "kiln_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "kiln_infer") (param i32 i32) (result i32) (i32.const 2))
  (func (export "kiln_dispatch") (param i32 i32) (result i32) (i32.const 2))
  (func (export "kiln_cpu") (param i32 i32) (result i32) (i32.const 2)))"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("shim.wasm"), &wasm).unwrap();
    std::fs::write(
        dir.path().join("kernel.toml"),
        format!(
            "schema = 2\nabi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"claims-relu\"\nversion = \"1.0.0\"\n\
             [[ops]]\nop_types = [\"Relu\"]\nsince_opset = 6\ndtypes = [\"float32\"]\nmax_rank = 8\n\
             [files]\n\"shim.wasm\" = \"{}\"\n",
            hex::encode(sha2::Sha256::digest(&wasm))
        ),
    )
    .unwrap();
    let o = kiln(&["verify", dir.path().to_str().unwrap(), "--device", "cpu", "--seeds", "1"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(5), "a check failed: {t}");
    assert!(t.contains("kernel.toml claims Relu at opset 14 for float32, but the package answered"), "{t}");
    // The node test and its random cases (float32 twice: the test's shapes and doubled dims).
    assert!(t.contains("verify claims-relu: 0 passed, 3 failed, 0 unsupported"), "{t}");
}

/// Shared device code through a registry (manifest schema 4): a header-only package builds with
/// no shim and publishes; a package that declares it in `[dependencies]` publishes with them on
/// its index line, `kiln lock` pins both, a run finds the dependency in the registry, and
/// without it the node names the missing dependency.
#[test]
fn a_header_package_is_a_dependency_that_runs_resolve() {
    let t = tempfile::tempdir().unwrap();
    let at = t.path().to_str().unwrap();
    let std_dir = t.path().join("my-std");
    std::fs::create_dir_all(std_dir.join("include")).unwrap();
    std::fs::write(
        std_dir.join("kernel.toml"),
        "schema = 4\nabi = 1\nheaders = [\"include/twice.cuh\"]\n[package]\nname = \"my-std\"\nversion = \"1.2.0\"\n",
    )
    .unwrap();
    std::fs::write(
        std_dir.join("include/twice.cuh"),
        "#pragma once\n__device__ __forceinline__ float my_twice(float x) { return 2.f * x; }\n",
    )
    .unwrap();
    let std_kpkg = t.path().join("my-std.kpkg");
    let o = kiln(&["package", "build", std_dir.to_str().unwrap(), "-o", std_kpkg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let manifest = std::fs::read_to_string(std_dir.join("kernel.toml")).unwrap();
    assert!(manifest.contains("\"include/twice.cuh\" = ") && !manifest.contains("shim"), "{manifest}");
    let reg = t.path().join("reg");
    let r = reg.to_str().unwrap();
    let o = kiln(&["publish", std_kpkg.to_str().unwrap(), "--registry", r]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kiln(&["kernels", "list", "--registry", r, "--allow-unsigned"]);
    assert!(text(&o).contains("my-std 1.2.0") && text(&o).contains("headers: my-std/twice.cuh"), "{}", text(&o));

    let o = kiln(&["package", "new", "my-twice", "--dir", at]);
    assert!(o.status.success(), "{}", text(&o));
    let dir = t.path().join("my-twice");
    let toml = std::fs::read_to_string(dir.join("kernel.toml")).unwrap();
    let toml = toml + "\n[dependencies]\nmy-std = \"^1.0\"\n";
    std::fs::write(dir.join("kernel.toml"), toml).unwrap();
    let cu = std::fs::read_to_string(dir.join("cuda/kernel.cu")).unwrap();
    std::fs::write(
        dir.join("cuda/kernel.cu"),
        cu.replacen("#include \"kiln.cuh\"", "#include \"kiln.cuh\"\n#include \"my-std/twice.cuh\"", 1),
    )
    .unwrap();
    let kpkg = t.path().join("my-twice.kpkg");
    let o = kiln(&["package", "build", dir.to_str().unwrap(), "-o", kpkg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kiln(&["publish", kpkg.to_str().unwrap(), "--registry", r]);
    assert!(o.status.success(), "{}", text(&o));
    let index = std::fs::read_to_string(reg.join("index/my-twice")).unwrap();
    assert!(index.contains("\"deps\":{\"my-std\":\"^1.0\"}"), "{index}");

    let case = dir.join("tests/test_twice");
    let m = case.join("model.onnx");
    let m = m.to_str().unwrap();
    let lock = t.path().join("twice.lock");
    let o = kiln(&["lock", m, "--registry", r, "--allow-unsigned", "--device", "cpu", "-o", lock.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let pinned = std::fs::read_to_string(&lock).unwrap();
    assert!(pinned.contains("name = \"my-twice\"") && pinned.contains("name = \"my-std\""), "{pinned}");
    let input = format!("x={}", case.join("test_data_set_0/input_0.pb").display());
    let expect = format!("y={}", case.join("test_data_set_0/output_0.pb").display());
    let out_dir = t.path().join("out");
    let run = |source: &[&str]| {
        let args = ["run", m, "--input", &input, "--expect", &expect, "--device", "cpu", "--output-dir"];
        kiln(&[&args[..], &[out_dir.to_str().unwrap()], source].concat())
    };
    let o = run(&["--registry", r, "--allow-unsigned", "--lock", lock.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&["--packages", dir.to_str().unwrap()]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("my-twice@0.1.0 depends on my-std ^1.0, which no package source has"), "{}", text(&o));
    let o = kiln(&["verify", dir.to_str().unwrap(), "--device", "cpu"]);
    assert!(!o.status.success() && text(&o).contains("package my-twice@0.1.0 is left out: "), "{}", text(&o));
    let o = kiln(&["kernels", "why", "ai.example::Twice", "--packages", dir.to_str().unwrap()]);
    assert!(text(&o).contains("drop-in folder") && text(&o).contains("depends on my-std"), "{}", text(&o));
}

/// `kiln package build` with NVRTC (a CUDA toolkit, or `pip install nvidia-cuda-nvrtc` with its
/// lib folder on `LD_LIBRARY_PATH`; no GPU) instantiates the scaffold's template kernel by its
/// name expression (schema 6) and finds its lowered symbol in the CUBIN, for float32 and for a
/// float16 instantiation added to the manifest, then again from the NVRTC cache (the CUBIN and
/// its lowered names); an expression that names no template of the
/// source fails the build, naming the template, before anything is packed.
#[test]
#[ignore = "needs NVRTC (libnvrtc)"]
fn package_build_lowers_name_expressions_and_refuses_one_the_source_lacks() {
    let t = tempfile::tempdir().unwrap();
    let at = t.path().to_str().unwrap();
    assert!(kiln(&["package", "new", "my-twice", "--dir", at]).status.success());
    let dir = t.path().join("my-twice");
    let d = dir.to_str().unwrap();
    let manifest = dir.join("kernel.toml");
    // Adds kernel `k` to the manifest, with a signature entry of its own when `pattern` is given.
    let with = |k: &str, pattern: Option<&str>| {
        let m = std::fs::read_to_string(&manifest).unwrap();
        let m = m.replace("kernels = [\"", &format!("kernels = [\"{k}\", \""));
        let m = match pattern {
            Some(p) => m.replace("[\"my_twice_twice<*>\"]", &format!("[\"my_twice_twice<*>\", \"{p}\"]")),
            None => m,
        };
        std::fs::write(&manifest, m).unwrap();
    };
    let o = kiln(&["package", "build", d, "--arch", "sm_90"]);
    assert!(o.status.success() && text(&o).contains("every listed kernel is defined"), "{}", text(&o));
    with("my_twice_twice<kiln_tag_f16>", None);
    let o = kiln(&["package", "build", d, "--arch", "sm_90"]);
    assert!(o.status.success() && text(&o).contains("every listed kernel is defined"), "{}", text(&o));
    // Again: the CUBIN and its lowered names come from the NVRTC cache, and still name every kernel.
    let o = kiln(&["-vv", "package", "build", d, "--arch", "sm_90"]);
    let out = text(&o);
    assert!(
        o.status.success() && out.contains("NVRTC: from the cache") && out.contains("every listed kernel is defined"),
        "{out}"
    );
    with("my_twice_thrice<kiln_tag_f32>", Some("my_twice_thrice<*>"));
    let o = kiln(&["package", "build", d, "--arch", "sm_90"]);
    assert!(!o.status.success() && text(&o).contains("\"my_twice_thrice\" is undefined"), "{}", text(&o));
}

/// `kiln package new` scaffolds a package that builds and passes its own test: `package build`
/// compiles its shim for wasm32 with cargo, fills `[files]` and writes the archive; `verify`
/// passes its node test and random cases on the CPU, and `conformance --check-dispatch` checks
/// its GPU launch against the kernel's declared signature. Bad names and existing folders are
/// refused.
#[test]
fn a_new_package_builds_and_passes_its_own_test() {
    let t = tempfile::tempdir().unwrap();
    let at = t.path().to_str().unwrap();
    let o = kiln(&["package", "new", "my-twice", "--dir", at]);
    assert!(o.status.success(), "{}", text(&o));
    let dir = t.path().join("my-twice");
    let d = dir.to_str().unwrap();
    let kpkg = t.path().join("my-twice.kpkg");
    let o = kiln(&["package", "build", d, "-o", kpkg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("my-twice@0.1.0"), "{}", text(&o));
    let manifest = std::fs::read_to_string(dir.join("kernel.toml")).unwrap();
    assert!(
        manifest.contains("[files]")
            && manifest.contains("\"shim.wasm\" = ")
            && manifest.contains("\"cuda/kernel.cu\" = ")
    );
    let tests = dir.join("tests");
    let o = kiln(&["verify", d, "--node-tests", tests.to_str().unwrap(), "--device", "cpu", "--seeds", "1"]);
    assert!(
        o.status.success() && text(&o).contains("verify my-twice: 3 passed, 0 failed, 0 unsupported"),
        "{}",
        text(&o)
    );
    let o = kiln(&["conformance", tests.to_str().unwrap(), "--packages", d, "--check-dispatch", "--device", "cpu"]);
    assert!(o.status.success() && text(&o).contains("conformance: 1 passed, 0 failed"), "{}", text(&o));
    // The archive publishes; a lock pins it; once yanked, only a run with that lock uses it.
    let reg = t.path().join("reg");
    let r = reg.to_str().unwrap();
    let o = kiln(&["publish", kpkg.to_str().unwrap(), "--registry", r]);
    assert!(o.status.success(), "{}", text(&o));
    let case = tests.join("test_twice");
    let model = case.join("model.onnx");
    let m = model.to_str().unwrap();
    let lock = t.path().join("twice.lock");
    let o = kiln(&["lock", m, "--registry", r, "--allow-unsigned", "--device", "cpu", "-o", lock.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kiln(&["yank", "my-twice@0.1.0", "--registry", r]);
    assert!(o.status.success(), "{}", text(&o));
    let input = format!("x={}", case.join("test_data_set_0/input_0.pb").display());
    let expect = format!("y={}", case.join("test_data_set_0/output_0.pb").display());
    let out_dir = t.path().join("out");
    let run = |extra: &[&str]| {
        let args =
            ["run", m, "--input", &input, "--expect", &expect, "--registry", r, "--allow-unsigned", "--device", "cpu"];
        kiln(&[&args[..], &["--output-dir", out_dir.to_str().unwrap()], extra].concat())
    };
    let o = run(&[]);
    assert!(!o.status.success() && text(&o).contains("no kernel package runs ai.example::Twice"), "{}", text(&o));
    let o = run(&["--lock", lock.to_str().unwrap(), "--report"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("my-twice@0.1.0 (unsigned)"), "the report says so: {}", text(&o));
    assert!(
        text(&o).contains("my-twice@0.1.0 is yanked in") && text(&o).contains("used because the lock pins it"),
        "{}",
        text(&o)
    );
    assert!(
        text(&o).contains("note: using my-twice@0.1.0 (unsigned;") && text(&o).contains("(--allow-unsigned)"),
        "{}",
        text(&o)
    );

    let o = kiln(&["package", "new", "my-twice", "--dir", at]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("exists"), "{}", text(&o));
    for bad in ["My Twice", "1abc", "-x"] {
        let o = kiln(&["package", "new", "--dir", at, "--", bad]);
        assert_eq!(o.status.code(), Some(3), "{bad}: {}", text(&o));
        assert!(text(&o).contains(&format!("package name {bad:?}")), "{}", text(&o));
    }
    let o = kiln(&["package", "new", "x", "--op", "ai.example::", "--dir", at]);
    assert!(text(&o).contains("expected DOMAIN::OP"), "{}", text(&o));
    let o = kiln(&["package", "build", at]);
    assert!(text(&o).contains("has kernel.toml and a shim crate in shim/"), "{}", text(&o));
    let before = std::fs::read_to_string(dir.join("kernel.toml")).unwrap();
    let o = kiln(&["package", "build", d, "-o", "/nonexistent/x.kpkg"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("-o: folder /nonexistent does not exist"), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(dir.join("kernel.toml")).unwrap(), before, "nothing rewritten");
}

/// The third-party example end to end on the CPU (examples/third-party): its package
/// (com.example::BiasGelu) is built with `kiln package build` (in a copy, so the checkout stays
/// clean), published to a temporary registry, and the example model that uses it runs from that
/// registry and matches numpy's float64 reference (`make_model.py`).
#[test]
fn the_third_party_example_builds_publishes_and_runs() {
    let t = tempfile::tempdir().unwrap();
    let src = root().join("examples/third-party");
    let pkg = t.path().join("bias-gelu");
    for rel in ["kernel.toml", "cuda/bias_gelu.cu", "shim/Cargo.toml", "shim/src/lib.rs"] {
        std::fs::create_dir_all(pkg.join(rel).parent().unwrap()).unwrap();
        std::fs::copy(src.join("bias-gelu").join(rel), pkg.join(rel)).unwrap();
    }
    // The copy's shim depends on this checkout's kernel-abi.
    let cargo = std::fs::read_to_string(pkg.join("shim/Cargo.toml")).unwrap();
    let abi = root().join("kernel-abi");
    std::fs::write(
        pkg.join("shim/Cargo.toml"),
        cargo.replace("\"../../../../kernel-abi\"", &format!("{:?}", abi.display().to_string())),
    )
    .unwrap();
    let kpkg = t.path().join("bias-gelu.kpkg");
    let o = kiln(&["package", "build", pkg.to_str().unwrap(), "-o", kpkg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    // Signed by its publisher's key, which the run trusts.
    let key_file = t.path().join("publisher.key");
    let o = kiln(&["key", "new", "-o", key_file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let public = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(public.starts_with("ed25519:") && public.len() == 8 + 64, "{public}");
    let reg = t.path().join("reg");
    let o = kiln(&[
        "publish",
        kpkg.to_str().unwrap(),
        "--registry",
        reg.to_str().unwrap(),
        "--sign",
        key_file.to_str().unwrap(),
    ]);
    assert!(o.status.success() && text(&o).contains(&format!("signed by {public}")), "{}", text(&o));
    let path = |f: &str| src.join(f).display().to_string();
    let out = t.path().join("out");
    let o = kiln(&[
        "run",
        &path("model.onnx"),
        "--input",
        &format!("x={}", path("x.npy")),
        "--expect",
        &format!("y={}", path("expected.npy")),
        "--registry",
        reg.to_str().unwrap(),
        "--trust",
        &public,
        "--device",
        "cpu",
        "--output-dir",
        out.to_str().unwrap(),
        "--report",
    ]);
    let t_ = text(&o);
    assert!(o.status.success() && t_.contains("y: matches the expected output"), "{t_}");
    assert!(t_.contains("bias-gelu@1.0.0"), "the registry's package ran BiasGelu: {t_}");
    // Without the registry, nothing provides the op.
    let o = kiln(&["run", &path("model.onnx"), "--input", &format!("x={}", path("x.npy")), "--device", "cpu"]);
    assert!(text(&o).contains("no kernel package runs com.example::BiasGelu"), "{}", text(&o));
}

/// Registry packages run only when a trusted key signed them: unsigned or signed by another key,
/// they are left out with the reason (and `--allow-unsigned` takes them, saying so); a
/// signature that does not verify is refused even then; `trust = [...]` in the `kiln.toml` beside
/// a model trusts a key as `--trust` does.
#[test]
fn registry_packages_need_a_trusted_signature() {
    let t = tempfile::tempdir().unwrap();
    let (reg, p) = (t.path().join("reg"), t.path().join("p"));
    let r = reg.to_str().unwrap();
    let key = |name: &str| {
        let f = t.path().join(name);
        let o = kiln(&["key", "new", "-o", f.to_str().unwrap()]);
        assert!(o.status.success(), "{}", text(&o));
        (f, String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let (signer, public) = key("a.key");
    let (_, other) = key("b.key");
    let publish = |version: &str, sign: Option<&std::path::Path>| {
        tiny_package(&p.join(version), version, a_shim());
        let kpkg = t.path().join(format!("p-{version}.kpkg"));
        let o = kiln(&["package", "pack", p.join(version).to_str().unwrap(), "-o", kpkg.to_str().unwrap()]);
        assert!(o.status.success(), "{}", text(&o));
        let mut args = vec!["publish", kpkg.to_str().unwrap(), "--registry", r];
        if let Some(s) = sign {
            args.extend(["--sign", s.to_str().unwrap()]);
        }
        let o = kiln(&args);
        assert!(o.status.success(), "{}", text(&o));
    };
    publish("1.0.0", Some(&signer));
    publish("0.9.0", None);
    let why = |extra: &[&str]| kiln(&[&["kernels", "why", "ai.example::Twice", "--registry", r][..], extra].concat());
    // No trust: both left out, each with its reason, which the verdicts name too.
    let o = why(&[]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("left out: signed by") && text(&o).contains("left out: unsigned;"), "{}", text(&o));
    // The public key of a key file, again.
    let k = kiln(&["key", "public", signer.to_str().unwrap()]);
    assert!(k.status.success() && String::from_utf8_lossy(&k.stdout).trim() == public, "{}", text(&k));
    assert!(
        text(&o).contains(&format!("left out: p@1.0.0 (signed by {public}, which is not trusted;")),
        "{}",
        text(&o)
    );
    assert!(text(&o).contains("left out: p@0.9.0 (unsigned;"), "{}", text(&o));
    // Trusting another key changes nothing; trusting the signer chooses the signed version only.
    assert_eq!(why(&["--trust", &other]).status.code(), Some(4));
    let o = why(&["--trust", &public]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).lines().any(|l| l.contains("chosen") && l.contains("p@1.0.0")), "{}", text(&o));
    assert!(text(&o).contains("left out: p@0.9.0 (unsigned;"), "{}", text(&o));
    let o = why(&["--allow-unsigned"]);
    assert!(o.status.success() && text(&o).contains("note: using p@0.9.0 (unsigned;"), "{}", text(&o));
    // `kernels list` marks what runs leave out.
    let o = kiln(&["kernels", "list", "--registry", r, "--trust", &public]);
    assert!(text(&o).contains("[unsigned: left out by runs; --trust KEY or --allow-unsigned]"), "{}", text(&o));
    assert!(!text(&o).contains(&format!("[signed by {public}")), "{}", text(&o));
    let o = why(&["--trust", "ed25519:1234"]);
    assert_eq!(o.status.code(), Some(2), "a malformed key is a usage error: {}", text(&o));
    // A signature that does not verify (the index line names another key) is refused, trusted or not.
    let index = reg.join("index/p");
    let lines = std::fs::read_to_string(&index).unwrap();
    std::fs::write(&index, lines.replace(&public[8..], &other[8..])).unwrap();
    let o = why(&["--trust", &other, "--allow-unsigned"]);
    assert!(text(&o).contains("does not verify"), "{}", text(&o));
    assert!(!text(&o).lines().any(|l| l.contains("chosen") && l.contains("p@1.0.0")), "{}", text(&o));
    std::fs::write(&index, lines).unwrap();
    // `trust = [...]` beside a model, for the commands that run one.
    let model_dir = t.path().join("m");
    std::fs::create_dir_all(&model_dir).unwrap();
    let model = model_dir.join("model.onnx");
    std::fs::copy(root().join("examples/mlp/model.onnx"), &model).unwrap();
    std::fs::write(model_dir.join("kiln.toml"), format!("trust = [\"{public}\"]\n")).unwrap();
    let o = kiln(&["inspect", model.to_str().unwrap(), "--registry", r, "--device", "cpu"]);
    assert!(o.status.success() && !text(&o).contains("left out: p@1.0.0"), "{}", text(&o));
    assert!(text(&o).contains("left out: p@0.9.0"), "{}", text(&o));
    std::fs::write(model_dir.join("kiln.toml"), "trust = [\"nope\"]\n").unwrap();
    let o = kiln(&["inspect", model.to_str().unwrap(), "--registry", r, "--device", "cpu"]);
    assert!(text(&o).contains("trust: \"nope\" is not a public key"), "{}", text(&o));
}

/// A `kiln.toml` beside a model holds its package requirements (`[kernels] NAME = "REQ"`), as
/// `--kernels NAME@REQ` does, and errors name the file; `--locked` uses the `kiln.lock` beside
/// the model and is an error without one.
#[test]
fn requirements_and_the_lock_beside_a_model_apply_to_its_runs() {
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("model.onnx");
    std::fs::copy(root().join("examples/mlp/model.onnx"), &model).unwrap();
    let m = model.to_str().unwrap();
    let x = format!("x={}", root().join("examples/mlp/x.npy").display());
    let out = t.path().join("out");
    let run = |extra: &[&str]| {
        let args = ["run", m, "--input", &x, "--device", "cpu", "--output-dir", out.to_str().unwrap()];
        kiln(&[&args[..], extra].concat())
    };
    let toml = t.path().join("kiln.toml");
    std::fs::write(&toml, "[kernels]\nkiln-matmul = \"^2\"\n").unwrap();
    let o = run(&[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "{} kiln-matmul@^2: no package meets it; there are {}",
            toml.display(),
            builtin_version("matmul")
        )),
        "{}",
        text(&o)
    );
    std::fs::write(&toml, "[kernels]\nkiln-matmul = \"^1.2\"\nkiln-unary = \"1\"\n").unwrap();
    let o = run(&[]);
    assert!(o.status.success(), "{}", text(&o));
    for (bad, why) in [
        ("[kernel]\nx = \"1\"\n", "unknown table or key \"kernel\""),
        ("[kernels]\nkiln-matmul = 1\n", "kernels.kiln-matmul must be a version requirement string"),
        ("[kernels]\nkiln-matmul = \"^x\"\n", "kernels.kiln-matmul"),
    ] {
        std::fs::write(&toml, bad).unwrap();
        let o = run(&[]);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        assert!(text(&o).contains(&toml.display().to_string()) && text(&o).contains(why), "{why}: {}", text(&o));
    }
    std::fs::remove_file(&toml).unwrap();
    let o = run(&["--locked"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("--locked: no kiln.lock beside the model"), "{}", text(&o));
    let o = kiln(&["lock", m, "--device", "cpu", "--locked"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("--lock and --locked read one: drop them"), "{}", text(&o));
    let o = kiln(&["lock", m, "--device", "cpu"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&["--locked"]);
    assert!(o.status.success(), "{}", text(&o));
}

/// `--json -` writes the document to stdout and the human-readable table to stderr; a JSON
/// path in a missing folder fails before any test runs, naming the flag; `devices --json` is
/// JSON on a machine without a driver too.
#[test]
fn json_goes_to_stdout_with_a_dash_and_bad_paths_fail_first() {
    let dir = node_tests();
    let o = kiln(&["conformance", dir.to_str().unwrap(), "--filter", "test_softmax", "--device", "cpu", "--json", "-"]);
    assert!(o.status.success(), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON document");
    assert!(doc["passed"].as_u64().unwrap() >= 7, "{doc}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("conformance: "), "{}", text(&o));
    let missing = tempfile::tempdir().unwrap().path().join("gone/results.json");
    let started = std::time::Instant::now();
    let o = kiln(&["conformance", dir.to_str().unwrap(), "--device", "cpu", "--json", missing.to_str().unwrap()]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("--json") && t.contains("does not exist") && !t.contains("conformance: "), "{t}");
    assert!(started.elapsed().as_secs() < 20, "the path is checked before the 1,600 tests run");
    let o = kiln(&["devices", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("devices --json is JSON");
    assert!(doc.is_array(), "{doc}");
}

/// `kiln … | head`: a reader that goes away ends kiln quietly (SIGPIPE), with no panic and no
/// backtrace.
#[test]
#[cfg(unix)]
fn a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let dir = node_tests();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["conformance", dir.to_str().unwrap(), "--filter", "test_add", "--device", "cpu"])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kiln runs");
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
    assert_eq!(o.status.signal(), Some(13), "ended by SIGPIPE: {:?} {err}", o.status);
}

/// Sampling is explicit: `--temperature 0` is greedy (the reference's greedy tokens); a
/// sampled run prints its seed, a random one unless given, and `--seed` repeats it; sampling
/// flags without `--temperature` say what they imply; a bad value names its flag.
#[test]
fn sampling_flags_say_what_they_do() {
    let (dir, run) = tiny_llama_fp32();
    let gen = |extra: &[&str]| {
        let mut args =
            vec!["generate", dir.to_str().unwrap(), "--prompt", "Once upon a time", "--max-new-tokens", "16"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--json", "-"]);
        let o = kiln(&args);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
        (doc, String::from_utf8_lossy(&o.stderr).to_string())
    };
    let (doc, err) = gen(&["--temperature", "0"]);
    assert_eq!(doc["sampling"]["do_sample"], false, "{doc}");
    assert!(doc["sampling"]["seed"].is_null(), "a greedy run draws nothing, so it has no seed: {doc}");
    assert_eq!(
        doc["rows"][0]["generated_ids"].as_array().unwrap()[..],
        run["generated_token_ids"].as_array().unwrap()[..16]
    );
    assert!(!err.contains("seed"), "greedy prints no seed: {err}");
    // Two sampled runs without --seed: random seeds, both printed; --seed repeats a run.
    let (a, err_a) = gen(&["--temperature", "1.5"]);
    let (b, _) = gen(&["--temperature", "1.5"]);
    let seed = a["sampling"]["seed"].as_u64().unwrap();
    assert_ne!(seed, b["sampling"]["seed"].as_u64().unwrap(), "seeds are random unless given");
    assert!(err_a.contains(&format!("seed {seed}")), "{err_a}");
    let (again, _) = gen(&["--temperature", "1.5", "--seed", &seed.to_string()]);
    assert_eq!(again["rows"][0]["generated_ids"], a["rows"][0]["generated_ids"]);
    let (_, err) = gen(&["--top-k", "5"]);
    assert!(err.contains("--top-k without --temperature") && err.contains("sampling"), "{err}");
    for (flag, value) in [("--temperature", "-1"), ("--repetition-penalty", "0"), ("--top-p", "0")] {
        let o = kiln(&["generate", dir.to_str().unwrap(), "--prompt", "x", flag, value]);
        assert_eq!(o.status.code(), Some(3), "invalid input: {}", text(&o));
        assert!(text(&o).contains(&format!("{flag} must be")), "{flag}: {}", text(&o));
    }
}

/// A fed tensor of the wrong shape names the declared shape as people write it (`[N, 4]`), not
/// as Rust debug-prints it.
#[test]
fn shapes_print_readably() {
    let dir = tempfile::tempdir().unwrap();
    let x = dir.path().join("x.npy");
    let data: Vec<u8> = (0..15).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let t = kiln_host::Tensor::new(kiln_kernel_abi::DType::F32, vec![3, 5], data.into()).unwrap();
    kiln_host::tensorio::write_npy(&x, &t).unwrap();
    let o = kiln(&["run", "examples/mlp/model.onnx", "--input", &format!("x={}", x.display())]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("has shape [3, 5]; the model declares ["), "{t}");
    assert!(!t.contains("Known(") && !t.contains("Symbolic("), "{t}");
}

/// Commands that only run on a GPU say so without pointing at a `--device` flag they lack.
#[test]
fn gpu_only_commands_name_no_missing_flag() {
    for (args, command) in [(&["kernels", "warm"][..], "kernels warm"), (&["bench", "ops"][..], "bench ops")] {
        let o = kiln(args);
        let t = text(&o);
        if kiln_host::cuda::device_count() > 0 {
            assert!(o.status.success(), "{args:?} on a GPU: {t}");
            continue;
        }
        assert_eq!(o.status.code(), Some(1), "{t}");
        assert!(t.contains(&format!("kiln {command} needs a CUDA GPU")) && !t.contains("--device"), "{t}");
    }
}

/// `kiln inspect`: a model folder's inputs with readable shapes, each op with its package
/// and the fusions that apply (exit 0); a model with an op no package runs names it with the
/// reason and exits with the unsupported code.
#[test]
fn inspect_shows_shapes_packages_fusions_and_what_is_missing() {
    let (dir, _) = tiny_llama_fp32();
    let o = kiln(&["inspect", dir.to_str().unwrap(), "--device", "cpu", "--json", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let input = doc["inputs"].as_array().unwrap().iter().find(|i| i["name"] == "input_ids").unwrap();
    assert_eq!(input["shape"], "batch_size × sequence_length");
    assert_eq!(input["dtype"], "int64");
    let ops = doc["ops"].as_array().unwrap();
    let op = |name: &str| ops.iter().find(|r| r["op"] == name).cloned();
    let attention = format!("kiln-attention@{}", builtin_version("attention"));
    assert_eq!(op("com.microsoft::GroupQueryAttention").unwrap()["package"], attention.as_str());
    // Fused: each layer's norms and projections become kiln-matmul's linear layers (the MLP
    // half one RmsNormLinear, the SwiGLU its epilogue, and one Linear; with QKV's, O's and the
    // final norm's: 5 and 4).
    assert_eq!(
        (op("ai.kiln::RmsNormLinear").unwrap()["nodes"].clone(), op("ai.kiln::Linear").unwrap()["nodes"].clone()),
        (5.into(), 4.into())
    );
    assert!(op("ai.kiln::SwiGluLinear").is_none());
    let matmul = format!("kiln-matmul@{}", builtin_version("matmul"));
    assert_eq!(op("ai.kiln::Linear").unwrap()["package"], matmul.as_str());
    assert!(op("ai.onnx::Sigmoid").is_none() && op("ai.onnx::MatMul").is_none());
    assert_eq!(doc["fusions"]["applied"].as_array().unwrap().len(), 7);
    assert_eq!(doc["unsupported_ops"], 0);
    let t = String::from_utf8_lossy(&o.stderr);
    assert!(t.contains("every node has a package on this device"), "{t}");
    // Unfused, the graph's own ops show.
    let o = kiln(&["inspect", dir.to_str().unwrap(), "--device", "cpu", "--no-fuse", "--json", "-"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(doc["ops"].as_array().unwrap().iter().any(|r| r["op"] == "ai.onnx::Sigmoid" && r["nodes"] == 2), "{doc}");

    let bernoulli = node_tests().join("test_bernoulli/model.onnx");
    let o = kiln(&["inspect", bernoulli.to_str().unwrap(), "--device", "cpu"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(4), "unsupported: {t}");
    assert!(
        t.contains("ai.onnx::Bernoulli")
            && t.contains("UNSUPPORTED")
            && t.contains("no kernel package runs ai.onnx::Bernoulli"),
        "{t}"
    );
    assert!(t.contains("x  ") && t.contains("float64   10"), "readable input shape: {t}");
}

/// `kiln chat`: each stdin line is a turn; a greedy first answer is what `generate --chat`
/// gives for the same message; `/reset` starts over (the same answer again); a conversation
/// over `--max-length` drops its oldest turn and says so; `/exit` ends with 0.
#[test]
fn chat_answers_turn_by_turn_resets_and_keeps_within_the_context() {
    let (dir, _) = tiny_llama_fp32();
    let d = dir.to_str().unwrap();
    let chat = |stdin: &str, extra: &[&str]| {
        let mut args = vec!["chat", d, "--max-new-tokens", "8", "--greedy"];
        args.extend_from_slice(extra);
        kiln_with_stdin(&args, stdin.as_bytes())
    };
    let g = kiln(&["generate", d, "--chat", "--prompt", "Hello", "--max-new-tokens", "8", "--greedy"]);
    assert!(g.status.success(), "{}", text(&g));
    let answer = String::from_utf8_lossy(&g.stdout).trim_end().to_string();
    assert!(!answer.is_empty());

    let o = chat("Hello\n/reset\nHello\n/exit\nnot read\n", &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let answers: Vec<&str> = out.lines().collect();
    assert_eq!(answers, vec![answer.as_str(), answer.as_str()], "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("kiln: history cleared"), "{}", text(&o));

    let o = chat("Hi\nHey\nYo\n", &["--max-length", "70", "--system", "Be brief."]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 3, "{}", text(&o));
    assert!(text(&o).contains("kiln: dropped the oldest 2 message(s) to stay within 70 tokens"), "{}", text(&o));

    // A turn that cannot fit is refused and the chat goes on.
    let long = "word ".repeat(40);
    let o = chat(&format!("{long}\nHi\n"), &["--max-length", "70"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("kiln: turn skipped: with the system prompt it takes"), "{}", text(&o));
    assert!(text(&o).contains("a prompt may take at most 62 (--max-length less --max-new-tokens)"), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 1, "{}", text(&o));
    // Unknown commands are not sent to the model.
    let o = chat("/help\n/exit\n", &[]);
    assert!(text(&o).contains("unknown command /help") && o.stdout.is_empty(), "{}", text(&o));
}

/// `--prompt-file`: a file's text (or stdin's, with `-`) is a prompt, the same as `--prompt`.
#[test]
fn prompts_come_from_files_and_stdin_too() {
    let (dir, _) = tiny_llama_fp32();
    let d = dir.to_str().unwrap();
    let base = ["generate", d, "--max-new-tokens", "6", "--greedy", "--json", "-"];
    let ids = |o: &Output, row: usize| {
        assert!(o.status.success(), "{}", text(o));
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        doc["rows"][row]["generated_ids"].clone()
    };
    let mut args = base.to_vec();
    args.extend(["--prompt", "Once upon a time"]);
    let want = ids(&kiln(&args), 0);
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), "Once upon a time\n").unwrap();
    let mut args = base.to_vec();
    args.extend(["--prompt", "The cat", "--prompt-file", f.path().to_str().unwrap()]);
    assert_eq!(ids(&kiln(&args), 1), want, "the file's prompt follows the --prompt ones");
    let args: Vec<&str> = base.iter().chain(&["--prompt-file", "-"]).copied().collect();
    assert_eq!(ids(&kiln_with_stdin(&args, b"Once upon a time\n"), 0), want);
    let o = kiln(&["generate", d, "--prompt-file", "/nonexistent/p.txt"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("--prompt-file /nonexistent/p.txt"), "{}", text(&o));
}

/// `kiln bench run`: random inputs of the declared shape (`--shape` for named dimensions),
/// percentiles in the JSON; a named dimension without `--shape` and a wrong `--shape` are clear
/// errors.
#[test]
fn bench_run_times_a_model_on_random_inputs() {
    let o = kiln(&["bench", "run", "examples/mlp/model.onnx", "--shape", "x=4x8", "--runs", "7", "--json", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["runs"], 7);
    assert_eq!(doc["inputs"]["x"], serde_json::json!([4, 8]));
    let (p50, p90, p99, min) = (
        doc["p50_ms"].as_f64().unwrap(),
        doc["p90_ms"].as_f64().unwrap(),
        doc["p99_ms"].as_f64().unwrap(),
        doc["min_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < min && min <= p50 && p50 <= p90 && p90 <= p99, "{doc}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("latency ms: p50"), "{}", text(&o));
    // Integer inputs are drawn as valid indices: BERT's token types index a 2-row table.
    let bert = "tests/real-models/bert_2_layers/model.onnx";
    let o = kiln(&["bench", "run", bert, "--runs", "2", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(0), "{bert}: {}", text(&o));
    assert!(text(&o).contains("token_type_ids int64 2×16"), "{}", text(&o));
    for (args, want) in [
        (vec!["bench", "run", "examples/mlp/model.onnx"], "give its shape with --shape x=DIMS"),
        (
            vec!["bench", "run", "examples/mlp/model.onnx", "--shape", "x=4x8x2"],
            "3 dimensions, but the input is declared [batch, 8]",
        ),
        (
            vec!["bench", "run", "examples/mlp/model.onnx", "--shape", "y=4"],
            "the model has no input \"y\"; its inputs: x",
        ),
        (vec!["bench", "run", "examples/mlp/model.onnx", "--shape", "x=4xb"], "expected NAME=DIMS"),
    ] {
        let o = kiln(&args);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        assert!(text(&o).contains(want), "{}", text(&o));
    }
}

/// `-v` logs what kiln does (model load, fusion, preparation); `-q` leaves only results and
/// errors on the terminal.
#[test]
fn verbose_and_quiet_change_what_goes_to_stderr() {
    let run = ["run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/x.npy", "--device", "cpu"];
    let o = kiln(&[&["-v"], &run[..]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("INFO") && err.contains("model loaded") && err.contains("session prepared"), "{err}");
    assert!(!err.contains('\u{1b}'), "no colour codes into a pipe: {err:?}");
    let o = kiln(&[&run[..], &["-q"]].concat());
    assert!(o.status.success(), "{}", text(&o));
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("probs: float32 [3, 4]"), "{}", text(&o));
    let o = kiln(&["-q", "-v", "devices"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// `--pdl on` asks for programmatic dependent launch, which needs a GPU: on the CPU it is
/// invalid input with the reason; `--pdl off` and the default run.
#[test]
fn pdl_on_without_a_gpu_is_invalid_input() {
    let o = run_example(&["--pdl", "on"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    assert!(t.contains("--pdl on needs a CUDA GPU"), "{t}");
    for mode in ["off", "auto"] {
        let o = run_example(&["--pdl", mode]);
        assert!(o.status.success(), "--pdl {mode}: {}", text(&o));
    }
}

/// A real shim module (kiln-unary's): `pack` and `publish` compile and validate the shim.
fn a_shim() -> &'static [u8] {
    let unary = kiln_builtin_kernels::PACKAGES.iter().find(|p| p.dir == "unary").expect("kiln-unary is built in");
    unary.files.iter().find(|(rel, _)| *rel == "shim.wasm").expect("a shim").1
}

/// A package folder `p` at `version` providing `ai.example::Twice` with shim bytes `shim`.
fn tiny_package(dir: &std::path::Path, version: &str, shim: &[u8]) {
    use sha2::Digest;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("shim.wasm"), shim).unwrap();
    let hash = hex::encode(sha2::Sha256::digest(shim));
    let manifest = format!(
        "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"p\"\nversion = \"{version}\"\n[[ops]]\ndomain = \"ai.example\"\n\
         op_types = [\"Twice\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 4\n[files]\n\"shim.wasm\" = \"{hash}\"\n"
    );
    std::fs::write(dir.join("kernel.toml"), manifest).unwrap();
}

/// `kiln package pack`, `publish`, `search`, `yank` end to end; a republished version and a
/// tampered archive are refused with their reasons.
#[test]
fn pack_publish_search_and_yank() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("registry");
    let reg_s = reg.to_str().unwrap();
    tiny_package(&t.path().join("src"), "1.0.0", a_shim());
    let out = t.path().join("p.kpkg");
    let o = kiln(&["package", "pack", t.path().join("src").to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kiln(&["publish", out.to_str().unwrap(), "--registry", reg_s]);
    assert!(o.status.success() && text(&o).contains("published p@1.0.0"), "{}", text(&o));
    let o = kiln(&["publish", out.to_str().unwrap(), "--registry", reg_s]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("p@1.0.0 is already published"), "{}", text(&o));
    let o = kiln(&["search", "ai.example::Twice", "--registry", reg_s, "--json", "-"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert_eq!(doc[0]["index"]["vers"], "1.0.0");
    assert_eq!(doc[0]["index"]["yanked"], false);
    let o = kiln(&["yank", "p@1.0.0", "--registry", reg_s]);
    assert!(o.status.success(), "{}", text(&o));
    let o = kiln(&["search", "Twice", "--registry", reg_s]);
    assert!(text(&o).contains("p@1.0.0") && text(&o).contains("[yanked]"), "{}", text(&o));
    let o = kiln(&["yank", "p@2.0.0", "--registry", reg_s]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    // A tampered archive is named when a run loads the registry.
    kiln(&["yank", "p@1.0.0", "--undo", "--registry", reg_s]);
    let archive = reg.join("packages/p/p-1.0.0.kpkg");
    let mut bytes = std::fs::read(&archive).unwrap();
    let n = bytes.len() / 3;
    bytes[n] ^= 0xff;
    std::fs::write(&archive, bytes).unwrap();
    let o = kiln(&["kernels", "list", "--registry", reg_s]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("p-1.0.0.kpkg") && text(&o).contains("sha256"), "{}", text(&o));
    // A run skips it with a warning naming it; the other packages load and the model runs.
    let o = run_example(&["--registry", reg_s]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("warning: package skipped: registry") && text(&o).contains("p-1.0.0.kpkg"),
        "{}",
        text(&o)
    );
    let o = kiln(&["yank", "../../x@1.0.0", "--registry", reg_s]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("is not a package name"), "{}", text(&o));
    // The archive never overwrites the package's own files; an invalid shim is refused.
    let src = t.path().join("src");
    let o = kiln(&["package", "pack", src.to_str().unwrap(), "-o", src.join("shim.wasm").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("must not be written inside the package folder"), "{}", text(&o));
    tiny_package(&t.path().join("bad"), "1.0.0", b"not wasm at all");
    let o = kiln(&[
        "package",
        "pack",
        t.path().join("bad").to_str().unwrap(),
        "-o",
        t.path().join("bad.kpkg").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("not a valid WebAssembly module"), "{}", text(&o));
    // A registry folder that does not exist is an error for a run, not a skipped package.
    let o = run_example(&["--registry", "/nonexistent/registry"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("no such registry directory"), "{}", text(&o));
    // No registry given.
    let o = kiln(&["publish", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3));
    assert!(text(&o).contains("--registry DIR or KILN_REGISTRY"), "{}", text(&o));
}

/// 8 processes publish 50 versions each of one package into one registry at once while a ninth
/// publisher is SIGKILLed in the middle of writing its archive: exactly the 400 versions are
/// published, every index line parses and every archive verifies.
#[test]
#[cfg(unix)]
fn concurrent_publishers_and_a_killed_one_lose_nothing() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("registry");
    let (workers, each) = (8usize, 50usize);
    for w in 0..workers {
        for i in 0..each {
            let src = t.path().join(format!("src-{w}-{i}"));
            tiny_package(&src, &format!("1.{w}.{i}"), a_shim());
            let bytes = kiln_registry::archive::pack(&src).unwrap();
            std::fs::write(t.path().join(format!("a-{w}-{i}.kpkg")), bytes).unwrap();
        }
    }
    // The victim: a 48 MiB archive (a real shim and a large data file), so that writing and
    // syncing it takes a while.
    let big = t.path().join("src-big");
    tiny_package(&big, "9.9.9", a_shim());
    let blob: Vec<u8> = (0..48u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    std::fs::write(big.join("blob.bin"), &blob).unwrap();
    let toml = std::fs::read_to_string(big.join("kernel.toml")).unwrap();
    let blob_hash = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&blob))
    };
    std::fs::write(big.join("kernel.toml"), format!("{toml}\"blob.bin\" = \"{blob_hash}\"\n")).unwrap();
    std::fs::write(t.path().join("big.kpkg"), kiln_registry::archive::pack(&big).unwrap()).unwrap();
    let bin = env!("CARGO_BIN_EXE_kiln");
    let reg_s = reg.to_str().unwrap().to_string();
    let mut children: Vec<std::process::Child> = (0..workers)
        .map(|w| {
            let script = format!(
                "for i in $(seq 0 {}); do \"$0\" publish {}/a-{w}-$i.kpkg --registry \"$1\" >/dev/null || exit 1; done",
                each - 1,
                t.path().display()
            );
            Command::new("sh").args(["-c", &script, bin, &reg_s]).spawn().unwrap()
        })
        .collect();
    let mut victim = Command::new(bin)
        .args(["publish", t.path().join("big.kpkg").to_str().unwrap(), "--registry", &reg_s])
        .spawn()
        .unwrap();
    // Kill it once its temporary archive exists: it is then mid-write (or mid-fsync).
    let pkg_dir = reg.join("packages/p");
    let started = std::time::Instant::now();
    let mut killed_mid_write = false;
    while started.elapsed() < std::time::Duration::from_secs(60) {
        let mid = std::fs::read_dir(&pkg_dir)
            .map(|rd| rd.filter_map(|e| e.ok()).any(|e| e.file_name().to_string_lossy().starts_with(".p-9.9.9.kpkg.")))
            .unwrap_or(false);
        if mid {
            victim.kill().unwrap();
            killed_mid_write = true;
            break;
        }
        if victim.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let _ = victim.kill();
    let _ = victim.wait();
    for c in &mut children {
        assert!(c.wait().unwrap().success(), "a publisher failed");
    }
    let dir = kiln_registry::RegistryDir::new(&reg);
    let lines = dir.versions("p").unwrap();
    assert!(killed_mid_write, "the victim was never seen mid-write, so the crash was not tested");
    let published: std::collections::BTreeSet<String> = lines.iter().map(|l| l.vers.to_string()).collect();
    assert!(!published.contains("9.9.9"), "the killed publisher's version must not be published");
    assert_eq!(lines.len(), workers * each);
    assert_eq!(published.len(), lines.len(), "no version twice");
    for l in &lines {
        dir.load(l).unwrap_or_else(|e| panic!("{}: {e}", l.id()));
    }
}

/// `kiln kernels why`: a drop-in folder's version outranks a higher version in a registry, and a
/// dtype no candidate lists rejects them all with the reason (unsupported, exit 4).
#[test]
fn kernels_why_names_the_chosen_package_and_why_the_others_lose() {
    let t = tempfile::tempdir().unwrap();
    let reg = t.path().join("registry");
    tiny_package(&t.path().join("v1"), "1.0.0", a_shim());
    let archive = t.path().join("p.kpkg");
    assert!(kiln(&["package", "pack", t.path().join("v1").to_str().unwrap(), "-o", archive.to_str().unwrap()])
        .status
        .success());
    assert!(kiln(&["publish", archive.to_str().unwrap(), "--registry", reg.to_str().unwrap()]).status.success());
    let drop_in = t.path().join("drop-in");
    tiny_package(&drop_in, "0.5.0", a_shim());
    let base = [
        "kernels",
        "why",
        "ai.example::Twice",
        "--registry",
        reg.to_str().unwrap(),
        "--allow-unsigned",
        "--packages",
        drop_in.to_str().unwrap(),
    ];
    let o = kiln(&base);
    let t1 = text(&o);
    assert!(o.status.success(), "{t1}");
    let chosen = t1.lines().find(|l| l.contains("chosen")).expect("a chosen line");
    assert!(chosen.contains("p@0.5.0") && chosen.contains("drop-in folder"), "{t1}");
    let outranked = t1.lines().find(|l| l.contains("outranked")).expect("an outranked line");
    assert!(outranked.contains("p@1.0.0") && outranked.contains("registry 1"), "{t1}");
    let o = kiln(&[&base[..], &["--dtype", "float64"]].concat());
    let t2 = text(&o);
    assert_eq!(o.status.code(), Some(4), "unsupported: {t2}");
    assert_eq!(t2.matches("rejected").count(), 2, "{t2}");
    assert!(t2.contains("dtype float64 of input 0 is not in [float32]"), "{t2}");
    // Without its domain the op is looked up in ai.onnx, and the domains that have it are named.
    let o = kiln(&["kernels", "why", "Twice", "--packages", drop_in.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("packages declare ai.example::Twice"), "{}", text(&o));
}

/// `--kernels NAME@REQ`: a requirement no package meets stops the run before any work, listing
/// the versions there are; one that the built-in meets runs.
#[test]
fn a_kernel_requirement_no_package_meets_is_invalid_input() {
    let o = run_example(&["--kernels", "kiln-matmul@^2"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "invalid input: {t}");
    let want = format!(
        "--kernels kiln-matmul@^2: no package meets it; there are {} (builtin:matmul)",
        builtin_version("matmul")
    );
    assert!(t.contains(&want), "{t}");
    let o = run_example(&["--kernels", "kiln-matmul@^1.1"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run_example(&["--kernels", "kiln-matmul@~~1"]);
    assert_eq!(o.status.code(), Some(2), "a malformed requirement is a usage error: {}", text(&o));
}

/// `kiln lock` pins the packages a model resolves to; `--lock` runs with exactly those, and a
/// pinned version that is not available, or a package whose files changed, stops the run naming
/// it.
#[test]
fn a_lock_pins_the_packages_a_model_uses() {
    let t = tempfile::tempdir().unwrap();
    let lock = t.path().join("kiln.lock");
    let o = kiln(&["lock", "examples/mlp/model.onnx", "--device", "cpu", "-o", lock.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let text_lock = std::fs::read_to_string(&lock).unwrap();
    let matmul_version = builtin_version("matmul");
    let matmul = format!("name = \"kiln-matmul\"\nversion = \"{matmul_version}\"");
    assert!(text_lock.contains(&matmul), "{text_lock}");
    assert!(!text_lock.contains("kiln-attention"), "only the packages the model uses: {text_lock}");
    let o = run_example(&["--lock", lock.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    // A version that is not available.
    std::fs::write(&lock, text_lock.replace(&matmul, "name = \"kiln-matmul\"\nversion = \"1.0.9\"")).unwrap();
    let o = run_example(&["--lock", lock.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        text(&o).contains("the lock pins kiln-matmul@1.0.9")
            && text(&o).contains(&format!("there are {matmul_version}")),
        "{}",
        text(&o)
    );
    // Another package under the pinned name and version.
    let digest_line = text_lock.lines().find(|l| l.starts_with("digest")).unwrap().to_string();
    std::fs::write(&lock, text_lock.replacen(&digest_line, &format!("digest = \"{}\"", "0".repeat(64)), 1)).unwrap();
    let o = run_example(&["--lock", lock.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("is not the package the lock pins"), "{}", text(&o));
    // A model folder's lock covers the ops decoding adds (device-step sampling) too: generate
    // runs with it.
    let (dir, _) = tiny_llama_fp32();
    let folder_lock = t.path().join("llm.lock");
    let o = kiln(&["lock", dir.to_str().unwrap(), "--device", "cpu", "-o", folder_lock.to_str().unwrap()]);
    assert!(o.status.success() && text(&o).contains("kiln-sampling"), "{}", text(&o));
    let o = kiln(&[
        "generate",
        dir.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--lock",
        folder_lock.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

/// `kernels why --model M --node NAME`: a node a fusion absorbs is followed into the nodes that
/// replace it, each explained with the model's opset and dtypes; `--no-fuse` explains the node
/// itself; a name the model does not have is invalid input that names it.
#[test]
fn kernels_why_explains_a_node_of_a_model_through_its_fusion() {
    let (dir, _) = tiny_llama_fp32();
    let m = dir.to_str().unwrap();
    let node = "/model/layers.0/mlp/act_fn/Sigmoid";
    let o = kiln(&["kernels", "why", "--model", m, "--node", node, "--device", "cpu"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains(&format!("node \"{node}\" (ai.onnx::Sigmoid) is fused by skip-rmsnorm-mlp (kiln-matmul@")),
        "{t}"
    );
    assert!(t.contains("ai.kiln::RmsNormLinear at opset 1, float32, on cpu:"), "{t}");
    assert!(t.contains("ai.kiln::Linear at opset 1") && t.matches("chosen     kiln-matmul@").count() == 2, "{t}");
    let o = kiln(&["kernels", "why", "--model", m, "--node", node, "--device", "cpu", "--no-fuse"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("ai.onnx::Sigmoid at opset") && t.contains("chosen     kiln-unary@"), "{t}");
    assert!(!t.contains("fused by"), "{t}");
    let o = kiln(&["kernels", "why", "--model", m, "--node", "no/such/node", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("has no node named \"no/such/node\""), "{}", text(&o));
    // A replacement's own name is explained as it is; a near miss names the nodes like it.
    let fused = "/model/layers.0/mlp/down_proj/MatMul/skip-rmsnorm-mlp#1";
    let o = kiln(&["kernels", "why", "--model", m, "--node", fused, "--device", "cpu"]);
    assert!(o.status.success() && text(&o).contains("ai.kiln::Linear at opset 1"), "{}", text(&o));
    let o = kiln(&["kernels", "why", "--model", m, "--node", "/model/layers.0/mlp/act_fn/Sigmoidx", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("nodes with a similar name: [\"/model/layers.0/mlp/act_fn/Sigmoid\""), "{}", text(&o));
    let o = kiln(&["kernels", "why", "--node", node]);
    assert_eq!(o.status.code(), Some(2), "--node without --model is a usage error: {}", text(&o));
}

/// Progress bars go to a terminal only: with stderr piped (a log, CI), `conformance`, `verify`
/// and `run` write no bar, and their results are as before.
#[test]
fn progress_bars_stay_off_a_piped_stderr() {
    let o = kiln(&["conformance", "tests/contrib-node-tests", "--filter", "rotary_embedding", "--device", "cpu"]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("conformance: 2 passed, 0 failed"), "{out}");
    assert!(!err.contains("conformance [") && !err.contains('\u{1b}'), "a bar on a piped stderr: {err:?}");
    let o = run_example(&["--output-dir", tempfile::tempdir().unwrap().path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("loading the model") && !err.contains('\u{1b}'), "{err:?}");
}

/// `kiln run --runs N` runs the model N times on the same inputs and writes the last run's
/// outputs (onnxruntime's, within ONNX's tolerances); `--runs 0` is invalid input that names
/// the flag.
#[test]
fn run_repeats_the_model_and_refuses_zero_runs() {
    let out = tempfile::tempdir().unwrap();
    let o = run_example(&[
        "--runs",
        "4",
        "--expect",
        "probs=examples/mlp/expected.npy",
        "--output-dir",
        out.path().to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("probs: matches the expected output") && t.contains("4 runs in "), "{t}");
    assert!(out.path().join("probs.npy").is_file(), "{t}");
    let o = run_example(&["--runs", "0", "--output-dir", out.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("--runs must be at least 1"), "{}", text(&o));
}
