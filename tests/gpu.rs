//! GPU tests (the H200 machine: `.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst
//! --workspace-remap . --run-ignored all`). Each needs a CUDA GPU and says so when ignored.

use kiln_host::conformance::{run_test, summary, test_dirs, Outcome};
use kiln_host::ep::{Device, Runtime, Session, SessionOptions};
use kiln_host::genai::sampling::argmax;
use kiln_host::{model, tensorio};

fn runtime() -> std::sync::Arc<Runtime> {
    kiln_tests::builtin_runtime()
}

/// The bundled example: its model, input and onnxruntime's output.
fn example() -> (model::Model, kiln_host::Tensor, kiln_host::Tensor) {
    let root = kiln_tests::root();
    let m = model::load(&root.join("examples/mlp/model.onnx")).unwrap();
    let x = tensorio::read_tensor_file(&root.join("examples/mlp/x.npy")).unwrap().0;
    let want = tensorio::read_tensor_file(&root.join("examples/mlp/expected.npy")).unwrap().0;
    (m, x, want)
}

fn cuda() -> SessionOptions {
    assert!(kiln_host::cuda::device_count() > 0, "no CUDA GPU visible");
    SessionOptions { device: Device::Cuda(0), ..SessionOptions::default() }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_example_runs_on_the_gpu_and_matches_onnxruntime() {
    let (m, x, want) = example();
    let mut s = Session::new(runtime(), m, cuda()).unwrap();
    for _ in 0..3 {
        let out = s.run(vec![("x".into(), x.clone())]).unwrap();
        assert_eq!(kiln_host::conformance::compare(&out[0].1, &want, 1e-3, 1e-5), None);
    }
    assert!(s.report.plan_hits > 0, "later runs reuse the launch plans: {:?}", s.report);
}

/// The third-party example's package as `scripts/stage-gpu.sh` archived it (the GPU machine has
/// no cargo to build its shim).
fn bias_gelu_package() -> kiln_registry::Package {
    let kpkg = kiln_tests::root().join(".gpu/bias-gelu.kpkg");
    let bytes = std::fs::read(&kpkg)
        .unwrap_or_else(|e| panic!("{}: {e}: scripts/stage-gpu.sh builds the example's package", kpkg.display()));
    kiln_registry::archive::unpack(&kpkg.display().to_string(), &bytes).unwrap()
}

/// The third-party example (examples/third-party) on CUDA: its package, built and archived by
/// `scripts/stage-gpu.sh` into `.gpu/bias-gelu.kpkg` (the GPU machine has no cargo), runs
/// com.example::BiasGelu with its own CUDA kernel, and the model matches numpy's float64
/// reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_third_party_example_runs_its_cuda_kernel() {
    let root = kiln_tests::root();
    let pkg = bias_gelu_package();
    let (mut reg, errors) = kiln_host::packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    reg.add(pkg, kiln_registry::USER);
    let rt = Runtime::new(reg, kiln_host::sandbox::SandboxConfig::default()).unwrap();
    let dir = root.join("examples/third-party");
    let m = model::load(&dir.join("model.onnx")).unwrap();
    let x = tensorio::read_tensor_file(&dir.join("x.npy")).unwrap().0;
    let want = tensorio::read_tensor_file(&dir.join("expected.npy")).unwrap().0;
    let mut s = Session::new(rt, m, cuda()).unwrap();
    let out = s.run(vec![("x".into(), x)]).unwrap();
    assert_eq!(kiln_host::conformance::compare(&out[0].1, &want, 1e-4, 1e-5), None);
    assert_eq!(s.report.packages.get("bias-gelu@1.0.0"), Some(&1), "{:?}", s.report.packages);
    assert!(s.report.wasm_calls.dispatch > 0, "BiasGelu ran its CUDA kernel: {:?}", s.report.wasm_calls);
}

/// A package whose kernel, as compiled, takes other parameters than its kernel.toml signature
/// declares (one more; one of another size) fails its node when the kernel is loaded, before its
/// first launch, naming the node, the package, the kernel and the mismatch; the process goes
/// on, and the package as built runs in a new session.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_kernel_compiled_unlike_its_signature_fails_its_node_before_any_launch() {
    let dir = kiln_tests::root().join("examples/third-party");
    let x = tensorio::read_tensor_file(&dir.join("x.npy")).unwrap().0;
    let session = |edit: &dyn Fn(&str) -> String| {
        let mut pkg = bias_gelu_package();
        let src = pkg.cuda_sources.get_mut("cuda/bias_gelu.cu").unwrap();
        *src = edit(src);
        let (mut reg, _) = kiln_host::packages::registry(&[], &[]);
        reg.add(pkg, kiln_registry::USER);
        let rt = Runtime::new(reg, kiln_host::sandbox::SandboxConfig::default()).unwrap();
        Session::new(rt, model::load(&dir.join("model.onnx")).unwrap(), cuda()).unwrap()
    };
    let sig = "kiln_u64 n, kiln_u64 c)";
    for (edit, want) in [
        (
            "kiln_u64 n, kiln_u64 c, unsigned extra)",
            "takes 6 parameters as compiled, but its kernel.toml signature declares 5",
        ),
        (
            "kiln_u64 n, unsigned c)",
            "parameter 4 is 4 bytes as compiled, but its kernel.toml signature declares u64 (8 bytes)",
        ),
    ] {
        let mut s = session(&|src: &str| {
            assert!(src.contains(sig), "the example kernel's parameters changed: update this test");
            src.replace(sig, edit)
        });
        let err = s.run(vec![("x".into(), x.clone())]).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, kiln_host::Error::Input(_)), "{msg}");
        assert!(
            msg.contains("(BiasGelu): package bias-gelu@1.0.0: kernel bias_gelu_f32") && msg.contains(want),
            "{msg}"
        );
        println!("{msg}");
    }
    let mut s = session(&|src: &str| src.to_string());
    let want = tensorio::read_tensor_file(&dir.join("expected.npy")).unwrap().0;
    let out = s.run(vec![("x".into(), x)]).unwrap();
    assert_eq!(kiln_host::conformance::compare(&out[0].1, &want, 1e-4, 1e-5), None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn onnx_node_tests_that_pass_on_the_cpu_pass_on_the_gpu() {
    let dir = kiln_tests::onnx_node_tests();
    let rt = runtime();
    let dirs = test_dirs(&dir, None).unwrap();
    let cpu: Vec<_> = dirs.iter().map(|d| run_test(&rt, d, &SessionOptions::default())).collect();
    // Every node on the GPU kernels (no shape arithmetic on the host).
    let gpu_options = SessionOptions { small_integer_nodes_on_host: false, ..cuda() };
    let gpu: Vec<_> = dirs.iter().map(|d| run_test(&rt, d, &gpu_options)).collect();
    // kiln's node tests of onnxruntime's contrib ops and of ONNX's ops beyond ONNX's own tests
    // (expected outputs from onnxruntime): all of them pass on the GPU.
    let mut contrib = test_dirs(&kiln_tests::root().join("tests/contrib-node-tests"), None).unwrap();
    contrib.extend(test_dirs(&kiln_tests::root().join("tests/onnx-node-tests"), None).unwrap());
    let contrib: Vec<_> = contrib.iter().map(|d| run_test(&rt, d, &gpu_options)).collect();
    println!("{}", summary(&contrib));
    let contrib_failed: Vec<_> = contrib.iter().filter(|r| r.outcome != Outcome::Passed).collect();
    assert!(contrib_failed.is_empty(), "kiln's own node tests on the GPU: {contrib_failed:#?}");
    println!("{}", summary(&gpu));
    let regressions: Vec<_> = cpu
        .iter()
        .zip(&gpu)
        .filter(|(c, g)| c.outcome == Outcome::Passed && g.outcome != Outcome::Passed)
        .map(|(_, g)| format!("{}: {:?}", g.name, g.outcome))
        .collect();
    let failed = gpu.iter().filter(|r| matches!(r.outcome, Outcome::Failed(_))).count();
    assert_eq!(failed, 0, "{failed} node tests failed on the GPU");
    assert!(
        regressions.is_empty(),
        "{} tests pass on the CPU but not on the GPU:\n{}",
        regressions.len(),
        regressions.join("\n")
    );
}

/// The f16 tiny-llama built for CUDA, teacher-forced through a prefill and 8 decode steps
/// against onnxruntime's f16 references: max |Δlogit| ≤ 0.15 and the reference argmax within
/// kiln's top 2 (fixtures/README.md).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_llama_fp16_on_the_gpu_matches_onnxruntime_within_f16_tolerances() {
    use kiln_host::genai::{Generator, ModelFolder};
    let folder = "tiny-llama-v512-fp16-cuda";
    let mf = ModelFolder::open(&kiln_tests::fixture(&format!("llm/{folder}"))).unwrap();
    let mut g = Generator::new(runtime(), mf, cuda()).unwrap();
    kiln_tests::teacher_forced(&mut g, &kiln_tests::fixture(&format!("llm/references/{folder}")), |s| {
        let max_diff = s.kiln.iter().zip(s.reference).map(|(a, b)| (a - *b as f64).abs()).fold(0.0, f64::max);
        assert!(max_diff <= 0.15, "{} step {}: max |Δlogit| {max_diff}", s.prompt, s.step);
        let above = s.kiln.iter().filter(|v| **v > s.kiln[s.reference_argmax]).count();
        assert!(above <= 1, "{} step {}: the reference argmax is not in kiln's top 2", s.prompt, s.step);
    });
}

/// The SmolLM2-architecture models that `fixtures/device/make-smollm2-arch.sh` builds on the
/// GPU machine (`KILN_DEVICE_MODELS`, default `/tmp/kiln-models`), with its onnxruntime fp32
/// references: the four-prompt batch (right-padded) teacher-forced through a prefill and 16
/// decode steps in one batch. `check(row, step, kiln logits, reference logits, reference step)`.
/// `reference` names the JSON in the references folder (`smollm2-arch-ref.json`, or
/// `FOLDER-ref.json` from `make-smollm2-arch.sh --ref-only`).
fn smollm2_arch_teacher_forced(
    folder: &str,
    reference: &str,
    mut check: impl FnMut(usize, usize, &[f32], &[f32], &serde_json::Value),
) {
    use kiln_host::genai::{Generator, ModelFolder};
    let root = device_models_root();
    let refs = root.join("reference");
    let json_path = refs.join(reference);
    assert!(
        json_path.is_file(),
        "{} is missing: build the models first (bash .gpu/device-fixtures/make-smollm2-arch.sh {}; `gpu-check.sh int4` makes the int4 folder and its reference)",
        json_path.display(),
        root.display()
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    let batch = &doc["batch4"];
    let bin = std::fs::read(refs.join(batch["logits_file"].as_str().unwrap())).unwrap();
    let reference: Vec<f32> = bin.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let shape: Vec<usize> =
        batch["logits_shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let (rows, steps, vocab) = (shape[0], shape[1], shape[2]);
    let ids =
        |v: &serde_json::Value| -> Vec<i64> { v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect() };
    let prompts: Vec<Vec<i64>> = batch["rows"].as_array().unwrap().iter().map(|r| ids(&r["prompt_ids"])).collect();
    let generated: Vec<Vec<i64>> = batch["rows"].as_array().unwrap().iter().map(|r| ids(&r["generated_ids"])).collect();
    let mf = ModelFolder::open(&root.join(folder)).unwrap();
    let mut g = Generator::new(runtime(), mf, cuda()).unwrap();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let (mut kv, mut logits) = g.prefill(&prompts, longest + steps).unwrap();
    for step in 0..steps {
        for r in 0..rows {
            let at = (r * steps + step) * vocab;
            check(r, step, &logits[r], &reference[at..at + vocab], &batch["rows"][r]["steps"][step]);
        }
        if step + 1 < steps {
            let next: Vec<i64> = generated.iter().map(|g| g[step]).collect();
            logits = g.decode(&mut kv, &next).unwrap();
        }
    }
    g.free(kv);
}

/// The largest |a − b|; NaN meets NaN and an infinity the same infinity (0), and either
/// against anything else counts as infinite.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) if x == y => 0.0,
            (false, false) => (x - y).abs(), // inf − finite is inf; inf − (−inf) too
            _ => f32::INFINITY,
        })
        .fold(0.0, f32::max)
}

/// Float16 results against a float16 reference: the largest excess of |got − want| over
/// 1e-3·|want| + `abs`, ≤ 0 when every element is within one float16 rounding of the reference
/// (an ulp is at most 2⁻¹⁰ of the value; an `abs` of 1e-5 covers values near 0); NaN must meet NaN. A reference computed in
/// float64 and a kernel in float32 may round a value to neighbouring float16s, but a dropped or
/// extra key moves an attention output by far more.
fn f16_excess(got: &[f32], want: &[f32], abs: f32) -> f32 {
    got.iter()
        .zip(want)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => f32::MIN,
            (false, false) if (x.is_infinite() || y.is_infinite()) && x == y => f32::MIN,
            (false, false) if x.is_infinite() || y.is_infinite() => f32::INFINITY, // against another value
            (false, false) => (x - y).abs() - (1e-3 * y.abs() + abs),
            _ => f32::INFINITY, // NaN on one side only
        })
        .fold(f32::MIN, f32::max)
}

/// Whether an attention result `got` matches `want`: float32 within `f32_tol`, float16 within one
/// rounding with `f16_abs` near 0 (`f16_excess`). Errors: the measured difference, for the
/// caller's message.
fn attention_close(
    got: &kiln_host::Tensor,
    want: &kiln_host::Tensor,
    f32_tol: f32,
    f16_abs: f32,
) -> Result<(), String> {
    let (a, b) = (got.to_f32().expect("a float result"), want.to_f32().expect("a float reference"));
    if got.dtype == kiln_kernel_abi::DType::F16 {
        let e = f16_excess(&a, &b, f16_abs);
        return if e <= 0.0 { Ok(()) } else { Err(format!("|Δ| past 1e-3·|ref| + {f16_abs} by {e}")) };
    }
    let d = max_abs_diff(&a, &b);
    if d <= f32_tol {
        Ok(())
    } else {
        Err(format!("max |Δ| {d}"))
    }
}

/// The f16 SmolLM2-architecture folder against the fp32 references, with the tolerances of
/// fixtures/device/README.md: |Δlogit| ≤ 3; the same argmax where the fp32 top-2 margin is
/// ≥ 1, elsewhere kiln's argmax within the reference top 5.
#[test]
#[ignore = "needs a CUDA GPU"]
fn smollm2_arch_fp16_on_the_gpu_matches_the_fp32_reference_within_f16_tolerances() {
    let mut worst = 0f32;
    smollm2_arch_teacher_forced("smollm2-arch-fp16-cuda", "smollm2-arch-ref.json", |row, step, kiln, reference, r| {
        check_f16_rules(row, step, kiln, reference, r, &mut worst);
    });
    println!("smollm2-arch fp16: max |Δlogit| {worst}");
}

/// fixtures/device/README.md's rules for a 16-bit SmolLM2-architecture folder against a float32
/// (or onnxruntime-CPU) reference: |Δlogit| ≤ 3; the same argmax where the reference's top-2
/// margin is ≥ 1, elsewhere kiln's argmax within the reference top 5. `worst` takes the largest
/// |Δlogit|.
fn check_f16_rules(row: usize, step: usize, kiln: &[f32], reference: &[f32], r: &serde_json::Value, worst: &mut f32) {
    let d = max_abs_diff(kiln, reference);
    *worst = worst.max(d);
    assert!(d <= 3.0, "row {row} step {step}: max |Δlogit| {d}");
    let a = argmax(kiln) as i64;
    let top5: Vec<i64> = r["top5_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    if r["margin_top1_top2"].as_f64().unwrap() >= 1.0 {
        assert_eq!(a, r["argmax"].as_i64().unwrap(), "row {row} step {step}: argmax");
    } else {
        assert!(top5.contains(&a), "row {row} step {step}: argmax {a} not in the reference top 5 {top5:?}");
    }
}

/// The int4 SmolLM2-architecture folder (MatMulNBits weights with fp16 activations:
/// `make-smollm2-arch.sh --extra-builds int4-cuda`, made by `gpu-check.sh int4`) on the GPU,
/// fused (kiln-matmul's `*-nbits` fusions, the 4-bit GEMV at decode), teacher-forced against
/// onnxruntime's CPU run of that same graph (`--ref-only`), with the f16 rules.
#[test]
#[ignore = "needs a CUDA GPU"]
fn smollm2_arch_int4_on_the_gpu_matches_onnxruntime_on_its_graph() {
    let mut worst = 0f32;
    smollm2_arch_teacher_forced(
        "smollm2-arch-int4-cuda",
        "smollm2-arch-int4-cuda-ref.json",
        |row, step, kiln, reference, r| check_f16_rules(row, step, kiln, reference, r, &mut worst),
    );
    println!("smollm2-arch int4: max |Δlogit| {worst}");
}

/// The fp32 SmolLM2-architecture folder on the GPU against the same references: |Δlogit| ≤
/// 1e-2 (logits up to about 20; the README holds fp32 to about 2e-3) and the same argmax at
/// every step of every row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn smollm2_arch_fp32_on_the_gpu_matches_the_fp32_reference() {
    let mut worst = 0f32;
    smollm2_arch_teacher_forced("smollm2-arch-fp32-cpu", "smollm2-arch-ref.json", |row, step, kiln, reference, r| {
        let d = max_abs_diff(kiln, reference);
        worst = worst.max(d);
        assert!(d <= 1e-2, "row {row} step {step}: max |Δlogit| {d}");
        assert_eq!(argmax(kiln) as i64, r["argmax"].as_i64().unwrap(), "row {row} step {step}: argmax");
    });
    println!("smollm2-arch fp32: max |Δlogit| {worst}");
}

/// A generator of `folder` on the GPU with CUDA graphs `graphs`.
fn gpu_generator(folder: &std::path::Path, graphs: kiln_host::ep::GraphMode) -> kiln_host::genai::Generator {
    use kiln_host::genai::{Generator, ModelFolder};
    let mf = ModelFolder::open(folder).unwrap();
    let g = Generator::new(runtime(), mf, SessionOptions { graphs, ..cuda() }).unwrap();
    assert!(g.samples_on_device(), "{}: greedy steps should sample on the device", folder.display());
    g
}

/// `rows` prompts of different lengths (3 + 4·row tokens, ids spread over the vocabulary).
fn prompts(rows: usize, vocab: usize) -> Vec<Vec<i64>> {
    (0..rows).map(|r| (0..3 + 4 * r).map(|i| ((i * 7919 + r * 104_729 + 11) % vocab) as i64).collect()).collect()
}

/// Greedy generation of `new` tokens per row, EOS ignored.
fn greedy(g: &mut kiln_host::genai::Generator, prompts: &[Vec<i64>], new: usize) -> kiln_host::genai::Generation {
    use kiln_host::genai::{GenerateOptions, SamplingParams};
    let opts = GenerateOptions {
        max_new_tokens: new,
        max_length: None,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        stop: None,
    };
    g.generate(prompts, &opts, &mut |_, _| {}).unwrap()
}

/// Graph decode gives exactly the tokens of eager decode (the same execution plan, run
/// without capture) at the same bucket: batch 1, 3 (padded to 4) and 8, 512 steps each, over a
/// paged KV cache (kiln-attention takes paged caches), whose rows map as they grow; eager
/// decode over the pool's row-major cache gives the same tokens. A second generation of each
/// shape replays the graph at every step, with no fallback.
fn graph_decode_matches_eager(folder: &std::path::Path) {
    use kiln_host::ep::GraphMode;
    let mut eager = gpu_generator(folder, GraphMode::Off);
    let mut graph = gpu_generator(folder, GraphMode::On);
    let mut row_major = gpu_generator(folder, GraphMode::Off);
    assert!(graph.set_paged_kv(true) && !row_major.set_paged_kv(false), "paged caches, and row-major ones");
    let vocab = eager.folder.config.model.vocab_size;
    for rows in [1usize, 3, 8] {
        let p = prompts(rows, vocab);
        let want = greedy(&mut eager, &p, 513);
        let got = greedy(&mut graph, &p, 513);
        let plain = greedy(&mut row_major, &p, 513);
        for (a, b) in want.rows.iter().zip(&plain.rows) {
            assert_eq!(a.generated_ids, b.generated_ids, "{}: batch {rows}: paged vs row-major", folder.display());
        }
        assert_eq!(got.timings.bucket, kiln_host::genai::bucket(rows));
        assert!(got.timings.device_sampling);
        for (r, (a, b)) in want.rows.iter().zip(&got.rows).enumerate() {
            assert_eq!(a.generated_ids.len(), 513);
            assert_eq!(
                a.generated_ids,
                b.generated_ids,
                "{}: batch {rows} row {r}: graph vs eager tokens",
                folder.display()
            );
        }
        let before = graph.session.report.graphs.clone();
        let again = greedy(&mut graph, &p, 513);
        let after = &graph.session.report.graphs;
        assert_eq!(again.rows[0].generated_ids, got.rows[0].generated_ids, "the same prompt twice");
        assert_eq!(after.replays - before.replays, again.timings.decode_steps as u64, "one replay per step: {after:?}");
        assert_eq!(after.fallbacks, before.fallbacks, "no fallback: {after:?}");
        assert_eq!(after.recaptures, before.recaptures, "same buffers, no re-capture");
        // The graph's kernel nodes (kiln's and cuBLASLt's kernels) are most of its nodes, and a
        // kernel per plan launch at least.
        assert!(after.graph_kernels > 0 && after.graph_kernels <= after.graph_nodes, "{after:?}");
        assert!(after.graph_kernels + after.graph_memsets + after.graph_memcpys <= after.graph_nodes, "{after:?}");
        println!(
            "{}: batch {rows}: {} steps replayed; graph {} nodes, {} kernels, {} memsets, {} memcpys",
            folder.display(),
            again.timings.decode_steps,
            after.graph_nodes,
            after.graph_kernels,
            after.graph_memsets,
            after.graph_memcpys
        );
    }
}

/// Sessions on one device share its module cache, pool and stream (one `cuda::Device` per
/// device per process): a second session of a model loads no kernel, a block the first session
/// frees is the second's pool hit, and two threads, each with its own session capturing and
/// replaying decode graphs at the same time on the shared stream, get exactly the tokens each
/// prompt gets alone, with a replay per step and no fallback (a capture never takes in the
/// other thread's launches).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sessions_share_the_device_and_two_threads_capture_apart() {
    use kiln_host::ep::GraphMode;
    use kiln_kernel_abi::DType;
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda");
    let mut first = gpu_generator(&folder, GraphMode::On);
    let vocab = first.folder.config.model.vocab_size;
    let work: Vec<Vec<Vec<i64>>> = vec![prompts(1, vocab), prompts(4, vocab)[1..].to_vec()];
    let alone: Vec<Vec<Vec<i64>>> =
        work.iter().map(|p| greedy(&mut first, p, 300).rows.into_iter().map(|r| r.generated_ids).collect()).collect();
    let (compiles, hits) = first.session.kernel_loads().unwrap();
    assert!(compiles + hits > 0, "the first session loads the kernels");

    let mut second = gpu_generator(&folder, GraphMode::On);
    let again: Vec<Vec<i64>> = greedy(&mut second, &work[0], 300).rows.into_iter().map(|r| r.generated_ids).collect();
    assert_eq!(again, alone[0], "the second session's tokens");
    assert_eq!(second.session.kernel_loads(), Some((0, 0)), "the second session's kernels come from the device");
    let t = first.session.zeros(DType::F32, vec![3 << 18]).unwrap();
    drop(t);
    first.session.reclaim();
    let hits = second.session.gpu_stats().unwrap().0.pool_hits;
    let u = second.session.zeros(DType::F32, vec![3 << 18]).unwrap();
    assert_eq!(second.session.gpu_stats().unwrap().0.pool_hits, hits + 1, "the first session's block, reused");
    drop(u);
    drop(second);

    let threads: Vec<_> = work
        .into_iter()
        .zip(alone)
        .map(|(p, want)| {
            let folder = folder.clone();
            std::thread::spawn(move || {
                let mut g = gpu_generator(&folder, GraphMode::On);
                for round in 0..4 {
                    let before = g.session.report.graphs.clone();
                    let got = greedy(&mut g, &p, 300);
                    let ids: Vec<Vec<i64>> = got.rows.iter().map(|r| r.generated_ids.clone()).collect();
                    assert_eq!(ids, want, "round {round}: the tokens of these prompts alone");
                    let after = &g.session.report.graphs;
                    assert_eq!(after.fallbacks, before.fallbacks, "no fallback: {after:?}");
                    if round > 0 {
                        assert_eq!(after.replays - before.replays, got.timings.decode_steps as u64, "{after:?}");
                    }
                }
                g.session.report.graphs.replays
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().expect("a decode thread panicked") > 0);
    }
    drop(first);
}

/// Where `make-smollm2-arch.sh` put its folders (`KILN_DEVICE_MODELS`, default `/tmp/kiln-models`).
fn device_models_root() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("KILN_DEVICE_MODELS").unwrap_or_else(|_| "/tmp/kiln-models".into()))
}

/// [`device_models_root`], which must hold the SmolLM2-architecture fp16 folder.
fn device_models() -> std::path::PathBuf {
    let root = device_models_root();
    assert!(
        root.join("smollm2-arch-fp16-cuda/genai_config.json").is_file(),
        "{} has no SmolLM2-architecture folders: build them first (bash .gpu/device-fixtures/make-smollm2-arch.sh {})",
        root.display(),
        root.display()
    );
    root
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_decode_gives_the_eager_tokens_tiny_llama_fp16() {
    graph_decode_matches_eager(&kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_decode_gives_the_eager_tokens_smollm2_arch_fp16() {
    graph_decode_matches_eager(&device_models().join("smollm2-arch-fp16-cuda"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_decode_gives_the_eager_tokens_smollm2_arch_fp32() {
    graph_decode_matches_eager(&device_models().join("smollm2-arch-fp32-cpu"));
}

/// Device greedy sampling (ArgMax on the device, graphs on) picks the tokens the host's
/// argmax picks from the same logits: batch 1 teacher-free, 64 steps, against the host-sampled
/// decode path (`Generator::decode`, logits downloaded, `sampling::argmax`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_argmax_picks_the_host_argmax_tokens() {
    use kiln_host::ep::GraphMode;
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda");
    let mut g = gpu_generator(&folder, GraphMode::On);
    let p = prompts(1, g.folder.config.model.vocab_size);
    let device = greedy(&mut g, &p, 65).rows.remove(0).generated_ids;
    let (mut kv, logits) = g.prefill(&p, p[0].len() + 65).unwrap();
    let mut host = vec![argmax(&logits[0]) as i64];
    while host.len() < 65 {
        let l = g.decode(&mut kv, &[*host.last().unwrap()]).unwrap();
        host.push(argmax(&l[0]) as i64);
    }
    g.free(kv);
    assert_eq!(device, host, "device ArgMax vs host argmax");
}

/// Device sampling (the Sample node inside the captured step, graphs on) gives the host
/// sampler's tokens for the same seed from the same GPU logits: temperature with top-k, top-p
/// and a repetition penalty; greedy with a penalty; and more candidates than the kernel sorts on
/// chip (1,024), where it selects by mass instead: every token (top-k 0), top-p 0.95 over every
/// token at temperature 1.5, and top-k 2,000. Batch 1 and 4 (its own bucket), 96 tokens, on
/// tiny-llama fp16 (vocabulary 512) and the SmolLM2-architecture fp16 folder (vocabulary 49152,
/// where greedy decoding of random weights repeats no token, so the penalty changes nothing).
/// A second generation replays the graph at every step and draws the same tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_sampling_gives_the_host_samplers_tokens() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::{GenerateOptions, SamplingParams};
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.8, top_k: 50, top_p: 0.9, repetition_penalty: 1.2, seed: 11 };
    let penalized = SamplingParams { repetition_penalty: 1.3, ..SamplingParams::default() };
    let every = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, seed: 5, ..sampled };
    let nucleus = SamplingParams { temperature: 1.5, top_k: 0, top_p: 0.95, seed: 7, ..sampled };
    let wide = SamplingParams { top_k: 2000, top_p: 1.0, seed: 13, ..sampled };
    for folder in [kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"), device_models().join("smollm2-arch-fp16-cuda")]
    {
        let mut g = gpu_generator(&folder, GraphMode::On);
        let vocab = g.folder.config.model.vocab_size;
        for rows in [1usize, 4] {
            let p = prompts(rows, vocab);
            let greedy_tokens: Vec<Vec<i64>> =
                greedy(&mut g, &p, 96).rows.into_iter().map(|r| r.generated_ids).collect();
            for params in [&sampled, &penalized, &every, &nucleus, &wide] {
                let opts = GenerateOptions {
                    max_new_tokens: 96,
                    max_length: None,
                    sampling: params.clone(),
                    ignore_eos: true,
                    stop: None,
                };
                let out = g.generate(&p, &opts, &mut |_, _| {}).unwrap();
                assert!(out.timings.device_sampling && out.timings.bucket == rows);
                // Again, on the captured graph: every step one replay, the same draws.
                let before = g.session.report.graphs.clone();
                let again = g.generate(&p, &opts, &mut |_, _| {}).unwrap();
                let after = &g.session.report.graphs;
                assert_eq!(after.fallbacks, before.fallbacks, "no fallback: {after:?}");
                assert_eq!(after.replays - before.replays, again.timings.decode_steps as u64, "{after:?}");
                let device: Vec<Vec<i64>> = out.rows.into_iter().map(|r| r.generated_ids).collect();
                let device_again: Vec<Vec<i64>> = again.rows.into_iter().map(|r| r.generated_ids).collect();
                assert_eq!(device, device_again, "the same seed twice");
                let host = kiln_tests::host_sampled(&mut g, &p, params, 96);
                assert_eq!(device, host, "{}: batch {rows} {params:?}: device vs host sampler", folder.display());
                // Sampling leaves the greedy path; a penalty does wherever greedy repeats a token.
                let repeats = p.iter().zip(&greedy_tokens).any(|(prompt, gen)| {
                    let mut seen: Vec<i64> = prompt.iter().chain(gen).copied().collect();
                    seen.sort_unstable();
                    seen.windows(2).any(|w| w[0] == w[1])
                });
                if params.do_sample || repeats {
                    assert_ne!(device, greedy_tokens, "{params:?}: not the greedy tokens");
                }
            }
        }
    }
}

/// New buffers at new addresses (same shapes) make the next step re-capture, through
/// `cuGraphExecUpdate` since the topology is the same; the reason is counted and the tokens
/// stay the same.
#[test]
#[ignore = "needs a CUDA GPU"]
fn new_buffers_re_capture_by_graph_update() {
    use kiln_host::ep::GraphMode;
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda");
    let mut g = gpu_generator(&folder, GraphMode::On);
    let p = prompts(2, g.folder.config.model.vocab_size);
    let first = greedy(&mut g, &p, 40);
    g.release_buffers();
    // Hold a block and a paged cache's addresses of the generation's shape, so that the new
    // buffers cannot all land where the old ones were.
    let kv_dtype = g.folder.kv_dtype;
    let d = &g.folder.config.model.decoder;
    let (kv_heads, head_size, limit) = (d.num_key_value_heads, d.head_size, p[1].len() + 40);
    let pages =
        kiln_host::ep::KvPages { tensors: 2 * d.num_hidden_layers, rows: 2, kv_heads, positions: limit, head_size };
    let hold = (
        g.session.zeros(kv_dtype, vec![2, kv_heads, limit, head_size]).unwrap(),
        g.session.reserve_pages(kv_dtype, pages).unwrap(),
    );
    let before = g.session.report.graphs.clone();
    let second = greedy(&mut g, &p, 40);
    drop(hold);
    let after = &g.session.report.graphs;
    for (a, b) in first.rows.iter().zip(&second.rows) {
        assert_eq!(a.generated_ids, b.generated_ids);
    }
    assert!(after.recaptures > before.recaptures, "a re-capture: {after:?}");
    assert!(after.updates > before.updates, "by cuGraphExecUpdate: {after:?}");
    assert_eq!(after.fallbacks, before.fallbacks, "{after:?}");
}

/// The example model through execution plans: fed from a held tensor, its output bound to
/// another, it is captured and replayed with onnxruntime's result; fresh tensors on every run
/// re-capture until the budget runs out, and then it runs eagerly with that reason reported.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_example_replays_as_a_graph_and_a_moving_binding_exhausts_the_budget() {
    use kiln_host::ep::{Feed, Fetch, GraphMode};
    let (m, x, want) = example();
    let mut s = Session::new(runtime(), m, SessionOptions { graphs: GraphMode::Auto, ..cuda() }).unwrap();
    let out_name = s.model().graph.values[s.output_ids()[0]].name.clone();
    let xin = s.zeros(x.dtype, x.shape.clone()).unwrap();
    s.write_tensor(&xin, &x).unwrap();
    let y = s.zeros(want.dtype, want.shape.clone()).unwrap();
    for _ in 0..4 {
        s.run_with(vec![("x".into(), Feed::Device(&xin))], &[(out_name.as_str(), Fetch::Into(&y))]).unwrap();
        let got = s.read_tensor(&y).unwrap();
        assert_eq!(kiln_host::conformance::compare(&got, &want, 1e-3, 1e-5), None);
    }
    let st = s.report.graphs.clone();
    assert_eq!((st.plans_built, st.first_runs, st.captures, st.replays), (1, 1, 1, 3), "{st:?}");
    // A new output tensor on every run: bindings change each time.
    let mut keep = Vec::new();
    for _ in 0..8 {
        let y2 = s.zeros(want.dtype, want.shape.clone()).unwrap();
        s.run_with(vec![("x".into(), Feed::Device(&xin))], &[(out_name.as_str(), Fetch::Into(&y2))]).unwrap();
        assert_eq!(kiln_host::conformance::compare(&s.read_tensor(&y2).unwrap(), &want, 1e-3, 1e-5), None);
        keep.push(y2);
    }
    let st = &s.report.graphs;
    assert!(st.fallbacks.get("re-capture budget exhausted").is_some_and(|n| *n > 0), "{st:?}");
    assert!(st.last_fallback.as_deref().is_some_and(|r| r.contains("in a row")), "{st:?}");
}

/// GroupQueryAttention decode over a long shared buffer (split over the keys in chunks, then
/// merged) against the package's CPU reference on the same float32 inputs: rows of 3000,
/// 700 and 1 valid positions in a 3072-position buffer, rotary on, with and without a local
/// window; 2 query heads per KV head (the kernel by KV head, rows in registers, 12 splits that
/// its last block per KV head merges), 32 query heads over 8 KV heads (73,728 cache positions
/// in all: the kernel by KV head over shared-memory tiles, 24 splits, here with every row
/// written first since present and past are separate buffers) and 9 (one block per query head,
/// then `kiln_gqa_merge`); and 2 over 1 in a 40,960-position buffer (320 splits: more than
/// the decode kernels fold, so `kiln_gqa_merge` follows them); and rows of 1000, 700 and 1 in a
/// 1024-position buffer (`kiln_gqa_decode_cluster_rows`: 8 blocks of up to 128 keys merged
/// through a cluster, each block's rows copied into shared memory), with 2 and 8 query heads per
/// KV head. max |Δ| ≤ 1e-4 on the output and the present K/V.
#[test]
#[ignore = "needs a CUDA GPU"]
fn long_context_decode_attention_matches_the_cpu_reference() {
    long_context_decode_attention(4, 2, 3072, &[3000, 700, 1]);
    long_context_decode_attention(32, 8, 3072, &[3000, 700, 1]);
    long_context_decode_attention(18, 2, 3072, &[3000, 700, 1]);
    long_context_decode_attention(2, 1, 40_960, &[3000, 700, 1]);
    long_context_decode_attention(4, 2, 1024, &[1000, 700, 1]);
    long_context_decode_attention(16, 2, 1024, &[1000, 700, 1]);
}

/// Decode attention over float16 caches of 4,096 positions at one and two batch rows
/// (`kiln_gqa_decode_cluster16_rows`: 16 blocks of up to 256 keys merged through a non-portable
/// cluster of 16, which the host allows at load; its rows have no float32 instantiation; here its
/// `_hg` form, head size 64 compiled in), with 3 query heads per KV head as SmolLM2's and 8, with
/// and without a local window, against the package's CPU reference on the same float16 inputs:
/// every element within one float16 rounding (`f16_excess`: the reference sums in float64, the
/// kernel in float32, both round once).
#[test]
#[ignore = "needs a CUDA GPU"]
fn long_context_f16_decode_attention_over_a_cluster_of_16_matches_the_cpu_reference() {
    long_context_decode_attention_as(9, 3, 4096, &[4000], true);
    long_context_decode_attention_as(9, 3, 4096, &[4095, 2100], true);
    long_context_decode_attention_as(16, 2, 4096, &[3000, 1], true);
}

/// Decode attention in float16 at the head sizes and groups that the cluster kernels are compiled
/// for (the shim's HG_HEADS, HG_GROUPS, HG_PLAIN_GROUPS: `kiln_gqa_decode_cluster_plain_hg`,
/// `kiln_gqa_decode_cluster_rows_hg`, `kiln_gqa_decode_cluster16_rows_hg`) and at head size 32,
/// which keeps the runtime forms: 1 to 8 query heads per KV head over 2 KV heads, two batch rows,
/// with and without a local window (with one, the plain kernels' option-bearing forms), against
/// the package's CPU reference on the same float16 inputs (every element within one float16
/// rounding). The shim's choices, by cache (present) size:
/// - 384 positions, rows of 300 and 17: the plain cluster kernel, its `_hg` form at groups 1, 2, 3,
///   5 and 8, the runtime form at 4, 6 and 7;
/// - 1,024 (rows of 1,000 and 513): the cluster rows kernel, its `_hg` form at head sizes 64 and
///   128 (128-wide rows fill its 64 KiB exactly);
/// - 2,048 (rows of 2,000 and 1,100): at head size 128 the rows no longer fit, and the plain
///   cluster kernel loops over chunks of keys; at 32 and 64 the cluster rows kernel;
/// - 4,096 (rows of 4,000 and 2,100): 16 blocks of rows at head sizes 32 and 64 (`_hg` at 64), and
///   `kiln_gqa_decode`'s folded splits at 128.
///
/// The float16 kernels only: the GPU tests have no bfloat16 attention case.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_at_compiled_head_sizes_and_groups_matches_the_cpu_reference() {
    let caches = [(384, vec![300, 17]), (1024, vec![1000, 513]), (2048, vec![2000, 1100]), (4096, vec![4000, 2100])];
    for h in [32, 64, 128] {
        for group in 1..=8 {
            for (past, lens) in &caches {
                let total = (lens[0] as usize + 72).min(*past);
                for window in [-1i64, 200] {
                    let model = gqa_model(h, 2 * group, 2, window, lens, (1, total), true, *past, total);
                    let what = format!("head size {h}, group {group}, {past} positions, window {window}");
                    gqa_gpu_matches_cpu(model, true, &what);
                }
            }
        }
    }
}

fn long_context_decode_attention(n: usize, nk: usize, past: usize, lens: &[i32]) {
    long_context_decode_attention_as(n, nk, past, lens, false)
}

fn long_context_decode_attention_as(n: usize, nk: usize, past: usize, lens: &[i32], f16: bool) {
    // total_sequence_length (and the rotary cache's rows): the longest row's positions and a
    // few more, within the buffer.
    let total = (*lens.iter().max().expect("rows") as usize + 72).min(past);
    for window in [-1i64, 1000] {
        let model = gqa_model(64, n, nk, window, lens, (1, total), true, past, total);
        gqa_gpu_matches_cpu(model, f16, &format!("{n} heads, {nk} KV heads, {past} positions, window {window}"));
    }
}

/// Runs a `gqa_model` (rounded to float16 with `f16`) on the CPU, the package's reference, and on
/// the GPU, and checks every output: the same dtype and shape, and `attention_close` (float32
/// within 1e-4, float16 within one rounding). `what` names the case in a failure.
fn gqa_gpu_matches_cpu(model: (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>), f16: bool, what: &str) {
    gpu_matches_cpu_within(model, f16, what, 1e-5)
}

/// [`gqa_gpu_matches_cpu`] with float16 elements allowed `f16_abs` besides their 1e-3·|ref|.
fn gpu_matches_cpu_within(
    model: (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>),
    f16: bool,
    what: &str,
    f16_abs: f32,
) {
    let (m, feeds) = if f16 { gqa_in_f16(model) } else { model };
    let load = || model::load_bytes(&kiln_tests::onnx::bytes(&m), None).unwrap();
    let want = Session::new(runtime(), load(), SessionOptions::default()).unwrap().run(feeds.clone()).unwrap();
    let gpu_options = SessionOptions { small_integer_nodes_on_host: false, ..cuda() };
    let got = Session::new(runtime(), load(), gpu_options).unwrap().run(feeds).unwrap();
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{what}: {name}");
        if let Err(e) = attention_close(a, b, 1e-4, f16_abs) {
            panic!("{what}, f16 {f16}: {name}: {e}");
        }
    }
}

/// `gqa_model`'s model and feeds with every float32 input rounded to float16 and declared so.
fn gqa_in_f16(
    (mut m, feeds): (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>),
) -> (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>) {
    use kiln_kernel_abi::DType;
    use kiln_tests::onnx::type_proto;
    for v in &mut m.graph.mut_or_insert_default().input {
        if let Some(type_proto::Value::TensorType(t)) = v.type_.mut_or_insert_default().value.as_mut() {
            if t.elem_type == 1 {
                t.elem_type = 10;
            }
        }
    }
    let feeds = feeds
        .into_iter()
        .map(|(name, t)| {
            if t.dtype != DType::F32 {
                return (name, t);
            }
            let bytes: Vec<u8> =
                kiln_tests::f32_values(&t).iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect();
            (name, kiln_host::Tensor::new(DType::F16, t.shape.clone(), bytes.into()).unwrap())
        })
        .collect();
    (m, feeds)
}

/// GroupQueryAttention over a paged KV cache (ABI.md §6.1.1: the past copied into pages of a
/// `Session::reserve_pages` cache from row-major tensors, past and present bound in place to its
/// views) gives the CPU reference's output on the row-major caches: decode over rows of 3000,
/// 700 and 1 positions of a 3072-position cache (2 query heads per KV head: the kernel with rows
/// in registers; 32 over 8: 73,728 positions in all, shared-memory tiles), of 1000, 700 and 1 of a
/// 1024-position cache (even shares over a cluster of 8 blocks) and a prompt of 37
/// tokens over 263 (kiln_gqa_kv appends them, kiln_gqa_prefill reads them back), with and
/// without a local window. After a decode step, a second one attends to the rows the first
/// appended in place, against the CPU's next step over the first one's present. max |Δ| ≤ 1e-4.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_over_a_paged_kv_cache_matches_the_cpu_reference() {
    use kiln_host::ep::{Fetch, Fetched, KvPages};
    for (n, nk, lens, seq_total, past) in [
        (4, 2, vec![3000, 700, 1], (1, 3072), 3072),
        (32, 8, vec![3000, 700, 1], (1, 3072), 3072),
        (4, 2, vec![1000, 700, 1], (1, 1024), 1024),
        (4, 2, vec![300], (37, 300), 512),
    ] {
        for window in [-1i64, 1000] {
            let what = format!("{n} heads over {nk}, rows {lens:?}, S {}, window {window}", seq_total.0);
            let (m, mut feeds) = gqa_model(64, n, nk, window, &lens, seq_total, true, past, 3072);
            let load = || model::load_bytes(&kiln_tests::onnx::bytes(&m), None).unwrap();
            let mut cpu = Session::new(runtime(), load(), SessionOptions::default()).unwrap();
            let mut gpu = Session::new(runtime(), load(), cuda()).unwrap();
            let b = lens.len();
            let shape = KvPages { tensors: 2, rows: b, kv_heads: nk, positions: past, head_size: 64 };
            let pages = gpu.reserve_pages(kiln_kernel_abi::DType::F32, shape).unwrap();
            gpu.map_pages(&pages, b, past, false).unwrap();
            for (i, name) in ["past_key", "past_value"].iter().enumerate() {
                let t = &feeds.iter().find(|(nm, _)| nm == name).unwrap().1;
                let held = gpu.zeros(t.dtype, t.shape.clone()).unwrap();
                gpu.write_tensor(&held, t).unwrap();
                for r in 0..b {
                    gpu.copy_into_pages((&held, r), (&pages, i, r), past).unwrap();
                }
            }
            let views = [gpu.page_view(&pages, 0, b).unwrap(), gpu.page_view(&pages, 1, b).unwrap()];
            let err = gpu.read_tensor(&views[0]).unwrap_err().to_string();
            assert!(err.contains("paged tensor"), "a host read of a paged view: {err}");
            // A present bound to a paged tensor that is not its past (another cache) is refused.
            let other = gpu.reserve_pages(kiln_kernel_abi::DType::F32, shape).unwrap();
            let stray = gpu.page_view(&other, 0, b).unwrap();
            let run = on_pages(&feeds, &views);
            let fetches = [("present_key", Fetch::Into(&stray)), ("present_value", Fetch::Into(&views[1]))];
            let err = gpu.run_with(run, &fetches).unwrap_err().to_string();
            assert!(err.contains("written only in place"), "{what}: {err}");
            drop((stray, other));
            // A decode step's appended row is read by the next step; a prompt's by itself.
            let steps = if seq_total.0 == 1 { 2 } else { 1 };
            for step in 0..steps {
                let want = cpu.run(feeds.clone()).unwrap();
                let run = on_pages(&feeds, &views);
                let fetches = [
                    ("output", Fetch::Host),
                    ("present_key", Fetch::Into(&views[0])),
                    ("present_value", Fetch::Into(&views[1])),
                ];
                let got = gpu.run_with(run, &fetches).unwrap();
                let Fetched::Host(out) = &got[0].1 else { panic!("{what}: no host output") };
                let d = max_abs_diff(&kiln_tests::f32_values(out), &kiln_tests::f32_values(&want[0].1));
                assert!(d <= 1e-4, "{what}, step {step}: output max |Δ| {d}");
                // The next step: one more token per row (a decode step after a prompt), over the
                // CPU's present as its past.
                let grown: Vec<i32> = lens.iter().map(|&l| (l + 1).min(past as i32)).collect();
                let next = gqa_model(64, n, nk, window, &grown, (1, past), true, past, 3072).1;
                feeds = next
                    .into_iter()
                    .map(|(nm, t)| match nm.as_str() {
                        "past_key" => (nm, want[1].1.clone()),
                        "past_value" => (nm, want[2].1.clone()),
                        _ => (nm, t),
                    })
                    .collect();
            }
        }
    }
}

/// `feeds` with the past key and value fed from paged views `views`, the rest from the host.
fn on_pages<'a>(
    feeds: &[(String, kiln_host::Tensor)],
    views: &'a [kiln_host::ep::DeviceTensor; 2],
) -> Vec<(String, kiln_host::ep::Feed<'a>)> {
    use kiln_host::ep::Feed;
    (feeds.iter())
        .map(|(nm, t)| match nm.as_str() {
            "past_key" => (nm.clone(), Feed::Device(&views[0])),
            "past_value" => (nm.clone(), Feed::Device(&views[1])),
            _ => (nm.clone(), Feed::Host(t.clone())),
        })
        .collect()
}

/// A paged KV cache (`Session::reserve_pages`, 32 cache tensors of 2 float16 heads of 64: 512
/// KiB per page of 64 positions, 8 MiB per row of 1,000 positions, four 2 MiB granules of the
/// H200) maps each row's region as its positions grow, in chunks of the granularity: rows join
/// and grow apart, a trim unmaps the rows past the kept ones and each kept row's positions past
/// its need, the views' addresses never move, a host read of a view and a copy into positions a
/// row has not mapped are refused, and dropped, everything is unmapped and unreserved.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_paged_kv_cache_maps_each_row_as_its_positions_grow() {
    use kiln_host::ep::{KvPages, PageGeometry};
    use kiln_kernel_abi::DType;
    let options = SessionOptions { vmm_chunk_bytes: 0, ..cuda() };
    let mut s = Session::new(runtime(), example().0, options).unwrap();
    s.reclaim();
    let gran = kiln_host::cuda::granularity(0).unwrap();
    let shape = KvPages { tensors: 32, rows: 3, kv_heads: 2, positions: 1000, head_size: 64 };
    let g = PageGeometry::new(shape, 2, gran).unwrap();
    assert_eq!((g.page_stride * 2, g.row_bytes()), (512 << 10, 8 << 20), "512 KiB pages, 8 MiB rows");
    let base = s.gpu_stats().unwrap().0;
    let pages = s.reserve_pages(DType::F16, shape).unwrap();
    let view = s.page_view(&pages, 5, 3).unwrap();
    let at = s.device_address(&view).unwrap();
    let delta = |s: &Session| {
        let m = s.gpu_stats().unwrap().0;
        (
            m.vmm_reserved_bytes - base.vmm_reserved_bytes,
            m.vmm_mapped_bytes - base.vmm_mapped_bytes,
            m.vmm_maps - base.vmm_maps,
            m.vmm_unmaps - base.vmm_unmaps,
        )
    };
    assert_eq!(delta(&s), (3 * (8 << 20), 0, 0, 0), "reserved, nothing mapped");
    s.map_pages(&pages, 2, 1, false).unwrap();
    assert_eq!((delta(&s).1, delta(&s).2), (2 * gran, 2), "rows 0 and 1: a granule each");
    s.map_pages(&pages, 2, 64, false).unwrap();
    assert_eq!(delta(&s).2, 2, "a page is within the granule: nothing new");
    s.map_pages(&pages, 2, 300, false).unwrap();
    assert_eq!((delta(&s).1, delta(&s).2), (4 * gran, 4), "5 pages (2.5 MiB): a second granule per row");
    s.map_pages(&pages, 3, 300, false).unwrap();
    assert_eq!((delta(&s).1, delta(&s).2), (6 * gran, 5), "row 2 joins: its 2 granules in one chunk");
    // A copy into positions row 2 has not mapped is refused; within them it is done.
    let src = s.zeros(DType::F16, vec![1, 2, 1000, 64]).unwrap();
    let err = s.copy_into_pages((&src, 0), (&pages, 0, 2), 1000).unwrap_err().to_string();
    assert!(err.contains("has not mapped 1000 positions"), "{err}");
    s.copy_into_pages((&src, 0), (&pages, 31, 2), 300).unwrap();
    s.copy_pages((&pages, 2), (&pages, 0), 300).unwrap();
    let err = s.read_tensor(&view).unwrap_err().to_string();
    assert!(err.contains("paged tensor"), "{err}");
    // Trim to row 0 and 64 positions: its second granule, and rows 1 and 2, go.
    s.map_pages(&pages, 1, 64, true).unwrap();
    assert_eq!((delta(&s).1, delta(&s).3), (gran, 4), "row 0 keeps a granule; 4 chunks unmapped");
    assert_eq!(s.device_address(&view).unwrap(), at, "the views' addresses never move");
    s.map_pages(&pages, 3, 1000, false).unwrap();
    assert_eq!(delta(&s).1, 3 * (8 << 20), "every row's every page");
    drop((view, src, pages));
    s.reclaim();
    assert_eq!((delta(&s).0, delta(&s).1), (0, 0), "dropped: nothing reserved or mapped");
}

/// `seqlens_k` as an int32 tensor of `lens` valid positions per row.
fn seqlens_k(lens: &[i32]) -> kiln_host::Tensor {
    let bytes: Vec<u8> = lens.iter().map(|l| l - 1).flat_map(i32::to_le_bytes).collect();
    kiln_host::Tensor::new(kiln_kernel_abi::DType::I32, vec![lens.len()], bytes.into()).unwrap()
}

/// Prompt attention (kiln_gqa_prefill) against the CPU reference: first prompts of 150
/// positions (rows of 150, 97 and 1 valid tokens, right-padded) and a continuation prompt of 37
/// tokens over a past of 263 positions (batch 1, as GroupQueryAttention requires), in a shared
/// past/present buffer, with and without a local window, groups of 2 and 3 query heads per KV
/// head; in float32 (max |Δ| ≤ 1e-4) and in float16 (every input rounded to it; every element
/// within one float16 rounding, `f16_excess`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn prompt_attention_matches_the_cpu_reference() {
    for f16 in [false, true] {
        for (n, nk) in [(4, 2), (9, 3)] {
            for window in [-1i64, 40] {
                for (lens, s, total, past) in [(vec![150, 97, 1], 150, 150, 256), (vec![300], 37, 300, 512)] {
                    let model = gqa_model(64, n, nk, window, &lens, (s, total), true, past, 1024);
                    let what = format!("{n} heads, {nk} KV heads, window {window}, S {s}, total {total}");
                    gqa_gpu_matches_cpu(model, f16, &what);
                }
            }
        }
    }
}

/// ONNX Attention-23/24 in float16 on tensor cores (`kiln_attention_mma`, head sizes 64 and 128)
/// against the CPU reference (float64, rounded once): 4-D and 3-D Q/K/V, 4 query heads over 2 KV
/// heads, query tiles of 64 rows with a partial last tile (100 and 70 rows), as many and more keys
/// than queries (130: a partial key tile), causal or not, an additive float mask (random values,
/// every seventh key −inf, broadcast over heads) and opset 24's nonpad_kv_seqlen; every element
/// within one float16 rounding (`f16_excess`). The same cases in float32 (a block per query row,
/// `kiln_attention`), and 2,050 query rows over 2,053 keys in float32, enough tiles for
/// `kiln_attention_tiled` (64 query rows and 32 keys a tile on CUDA cores, partial tiles of both),
/// at head sizes 40 (outputs past the last full group of 32), 64 and 128; max |Δ| ≤ 1e-4. Then kiln's packed ReshapedAttention (`packed_attention_model`) in float16
/// (tensor cores) and float32.
#[test]
#[ignore = "needs a CUDA GPU"]
fn onnx_attention_on_tensor_cores_matches_the_cpu_reference() {
    // float32 over enough query tiles for `kiln_attention_tiled` (33 tiles × 4 heads × 2 ≥ 256
    // blocks; the smaller cases below run a block per query row): partial tiles of rows and keys,
    // a mask, causal.
    for head in [40, 64, 128] {
        for (causal, mask) in [(false, true), (true, false)] {
            let what = format!("head {head}, Sq 2050, Skv 2053, causal {causal}, mask {mask}, tiled");
            gqa_gpu_matches_cpu(onnx_attention_model(head, (2050, 2053), causal, mask, true, false), false, &what);
        }
    }
    for head in [64, 128] {
        for (sq, skv) in [(100, 100), (70, 130)] {
            for (causal, mask, three_d, nonpad) in [
                (false, false, false, false),
                (true, false, true, false),
                (false, true, false, true),
                (true, true, true, true),
            ] {
                let what = format!(
                    "head {head}, Sq {sq}, Skv {skv}, causal {causal}, mask {mask}, 3-D {three_d}, nonpad {nonpad}"
                );
                let model = || onnx_attention_model(head, (sq, skv), causal, mask, three_d, nonpad);
                gqa_gpu_matches_cpu(model(), true, &what);
                gqa_gpu_matches_cpu(model(), false, &what);
            }
        }
        // kiln's packed ReshapedAttention (the qkv-reshaped-attention fusions' op): Q, K and V
        // as the column blocks of one [B, S, 3E] tensor, in float16 and float32. Its CPU
        // reference rounds the scores and the softmax weights to the dtype, as the unfused MatMul
        // and Softmax store them, where the tensor-core kernel keeps both in f32: in float16 an
        // output may also differ by those roundings, 2⁻¹¹ of a weight each, allowed as 2⁻¹⁰ of
        // the largest output (the outputs here are means of about 100 values of ±1).
        for f16 in [true, false] {
            let (model, feeds) = packed_attention_model(head, 100);
            let largest = {
                let m = model::load_bytes(&kiln_tests::onnx::bytes(&model), None).unwrap();
                let out = Session::new(runtime(), m, SessionOptions::default()).unwrap().run(feeds.clone()).unwrap();
                out[0].1.to_f32().unwrap().iter().fold(0f32, |a, v| a.max(v.abs()))
            };
            let what = format!("packed, head {head}");
            gpu_matches_cpu_within((model, feeds), f16, &what, largest * 2f32.powi(-10));
        }
    }
}

/// One `ai.kiln::ReshapedAttention` node with packed = 1 and multiply = 1 (what the
/// `qkv-reshaped-attention-mul` fusion makes): qkv [2, `seq`, 3·4·`head`] random, 4 heads of
/// `head`, an additive mask [2, 1, 1, seq] (every fifth key of the second row −10000), the
/// scores · 1/√head; the model and its feeds.
fn packed_attention_model(head: usize, seq: usize) -> (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>) {
    use kiln_tests::onnx::{self, attr_int, node, value};
    let (b, n) = (2usize, 4usize);
    let e = n * head;
    let mut r = kiln_tests::Rng(0x9acd);
    let qkv = kiln_tests::f32_tensor(&[b, seq, 3 * e], &r.signed_unit(b * seq * 3 * e));
    let m: Vec<f32> = (0..b * seq).map(|i| if i >= seq && i % 5 == 4 { -10000.0 } else { 0.0 }).collect();
    let mask = kiln_tests::f32_tensor(&[b, 1, 1, seq], &m);
    let mut g = node(
        "ReshapedAttention",
        &["qkv", "", "", "mask", "c", "sq", "sk", "sv", "so"],
        &["Y"],
        vec![attr_int("multiply", 1), attr_int("packed", 1)],
    );
    g.domain = "ai.kiln".into();
    let (bi, si, ni, hi) = (b as i64, seq as i64, n as i64, head as i64);
    let inits = vec![
        onnx::init_f32("c", &[], &[1.0 / (head as f32).sqrt()]),
        onnx::init_i64("sq", &[4], &[bi, si, -1, hi]),
        onnx::init_i64("sk", &[4], &[bi, si, ni, hi]),
        onnx::init_i64("sv", &[4], &[0, 0, ni, hi]),
        onnx::init_i64("so", &[3], &[bi, si, -1]),
    ];
    let decl = vec![value("qkv", 1, &[bi, si, 3 * e as i64]), value("mask", 1, &[bi, 1, 1, si])];
    let mut y = value("Y", 1, &[]);
    y.type_ = Default::default();
    let mut model = onnx::model(vec![g], decl, vec![y], inits);
    model.opset_import.push(onnx::OperatorSetIdProto { domain: "ai.kiln".into(), version: 1, ..Default::default() });
    (model, vec![("qkv".to_string(), qkv), ("mask".to_string(), mask)])
}

/// One ONNX Attention node (opset 24 with `nonpad`, else 23) of 2 batch rows, 4 query heads over
/// 2 KV heads of `head` dimensions, `seq.0` queries and `seq.1` keys, random float32 values:
/// Q/K/V 4-D, or 3-D with q_num_heads / kv_num_heads (`three_d`); `is_causal`; an additive mask
/// [B, 1, Sq, Skv] (−inf at every seventh element in row-major order, but never a row's first
/// key) when `mask`; nonpad_kv_seqlen [Skv − 29, 0] when `nonpad` (the second row all NaN).
fn onnx_attention_model(
    head: usize,
    (sq, skv): (usize, usize),
    causal: bool,
    mask: bool,
    three_d: bool,
    nonpad: bool,
) -> (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>) {
    use kiln_host::Tensor;
    use kiln_kernel_abi::DType;
    use kiln_tests::onnx::{self, attr_int, node, value};
    let (b, n, nk) = (2usize, 4usize, 2usize);
    let mut r = kiln_tests::Rng(0xa77e);
    let f32t = |shape: &[usize], v: Vec<f32>| kiln_tests::f32_tensor(shape, &v);
    let shape = |heads: usize, seq: usize| if three_d { vec![b, seq, heads * head] } else { vec![b, heads, seq, head] };
    let mut inputs = vec![
        ("Q", f32t(&shape(n, sq), r.signed_unit(b * n * sq * head))),
        ("K", f32t(&shape(nk, skv), r.signed_unit(b * nk * skv * head))),
        ("V", f32t(&shape(nk, skv), r.signed_unit(b * nk * skv * head))),
    ];
    let mut names = vec!["Q", "K", "V"];
    if mask {
        let v: Vec<f32> = r
            .signed_unit(b * sq * skv)
            .into_iter()
            .enumerate()
            .map(|(i, x)| if i % 7 == 3 && i % skv != 0 { f32::NEG_INFINITY } else { x })
            .collect();
        inputs.push(("attn_mask", f32t(&[b, 1, sq, skv], v)));
        names.push("attn_mask");
    } else if nonpad {
        names.push("");
    }
    if nonpad {
        names.extend(["", ""]);
        // The second batch row attends to no key: every output of it is NaN, on both devices.
        let lens: Vec<u8> = [skv as i64 - 29, 0].iter().flat_map(|l| l.to_le_bytes()).collect();
        inputs.push(("nonpad_kv_seqlen", Tensor::new(DType::I64, vec![b], lens.into()).unwrap()));
        names.push("nonpad_kv_seqlen");
    }
    let mut attrs = vec![attr_int("is_causal", causal as i64)];
    if three_d {
        attrs.extend([attr_int("q_num_heads", n as i64), attr_int("kv_num_heads", nk as i64)]);
    }
    let g = node("Attention", &names, &["Y"], attrs);
    let code = |d: DType| if d == DType::F32 { 1 } else { 7 };
    let decl: Vec<_> = inputs
        .iter()
        .map(|(nm, t)| value(nm, code(t.dtype), &t.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))
        .collect();
    let mut y = value("Y", 1, &[]);
    y.type_ = Default::default();
    let mut m = onnx::model(vec![g], decl, vec![y], Vec::new());
    m.opset_import[0].version = if nonpad { 24 } else { 23 };
    (m, inputs.into_iter().map(|(nm, t)| (nm.to_string(), t)).collect())
}

/// One GroupQueryAttention node of `seq_total.0` new positions with total_sequence_length
/// `seq_total.1` over a past of `past` positions (shared with the present when
/// total_sequence_length or more) and cos/sin caches of `cache_rows` rows (float32, head size
/// `h`, rotary over all of it, scale 1/√h, local window `window`), `n` query heads and `nk` KV
/// heads, rows of `lens` valid positions, random values: the model and its feeds.
/// total_sequence_length is a feed when `total_fed`, else an initializer (so that every feed may
/// be a device tensor).
#[allow(clippy::too_many_arguments)]
fn gqa_model(
    h: usize,
    n: usize,
    nk: usize,
    window: i64,
    lens: &[i32],
    seq_total: (usize, usize),
    total_fed: bool,
    past: usize,
    cache_rows: usize,
) -> (kiln_tests::onnx::ModelProto, Vec<(String, kiln_host::Tensor)>) {
    use kiln_host::Tensor;
    use kiln_kernel_abi::DType;
    use kiln_tests::onnx::{self, attr_float, node, value};
    let ((s, pl), b, half) = (seq_total, lens.len(), h / 2);
    let mut r = kiln_tests::Rng(0x5eed);
    let f32t = |shape: &[usize], v: Vec<f32>| kiln_tests::f32_tensor(shape, &v);
    let total = Tensor::new(DType::I32, vec![], (pl as i32).to_le_bytes().to_vec().into()).unwrap();
    let mut inputs = vec![
        ("query", f32t(&[b, s, n * h], r.signed_unit(b * s * n * h))),
        ("key", f32t(&[b, s, nk * h], r.signed_unit(b * s * nk * h))),
        ("value", f32t(&[b, s, nk * h], r.signed_unit(b * s * nk * h))),
        ("past_key", f32t(&[b, nk, past, h], r.signed_unit(b * nk * past * h))),
        ("past_value", f32t(&[b, nk, past, h], r.signed_unit(b * nk * past * h))),
        ("seqlens_k", seqlens_k(lens)),
        ("total_sequence_length", total),
        ("cos_cache", f32t(&[cache_rows, half], r.signed_unit(cache_rows * half))),
        ("sin_cache", f32t(&[cache_rows, half], r.signed_unit(cache_rows * half))),
    ];
    let names: Vec<&str> = inputs.iter().map(|(nm, _)| *nm).collect();
    let int = onnx::attr_int;
    let mut g = node(
        "GroupQueryAttention",
        &names,
        &["output", "present_key", "present_value"],
        vec![
            int("num_heads", n as i64),
            int("kv_num_heads", nk as i64),
            attr_float("scale", 1.0 / (h as f32).sqrt()),
            int("local_window_size", window),
            int("do_rotary", 1),
        ],
    );
    g.domain = "com.microsoft".into();
    let mut inits = Vec::new();
    if !total_fed {
        inputs.retain(|(nm, _)| *nm != "total_sequence_length");
        inits.push(onnx::TensorProto {
            name: "total_sequence_length".into(),
            data_type: 6,
            int32_data: vec![pl as i32],
            ..Default::default()
        });
    }
    let code = |d: DType| if d == DType::F32 { 1 } else { 6 };
    let decl: Vec<_> = inputs
        .iter()
        .map(|(nm, t)| value(nm, code(t.dtype), &t.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))
        .collect();
    let outs: Vec<_> = ["output", "present_key", "present_value"]
        .iter()
        .map(|nm| {
            let mut v = value(nm, 1, &[]);
            v.type_ = Default::default();
            v
        })
        .collect();
    let mut m = onnx::model(vec![g], decl, outs, inits);
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "com.microsoft".into(), version: 1, ..Default::default() });
    (m, inputs.into_iter().map(|(nm, t)| (nm.to_string(), t)).collect())
}

/// A `seqlens_k` past the KV buffer, fed to a captured GroupQueryAttention decode (every input a
/// held device tensor, the outputs bound in place, the run a graph replay), fails that run at
/// its synchronization with the CPU reference's own reason, naming the node's package and op;
/// the kernels stay inside their buffers (compute-sanitizer checks that in `gpu-check.sh
/// sanitize`), and the next run with good lengths replays the same graph with the CPU's
/// result. A Gather index out of range fails the same way, eagerly.
#[test]
#[ignore = "needs a CUDA GPU"]
fn crafted_indices_fail_a_captured_run_with_the_cpu_error_and_the_next_run_works() {
    use kiln_host::ep::{Feed, Fetch, GraphMode};
    use kiln_host::Error;
    let good = [3000, 700, 1];
    let (m, feeds) = gqa_model(64, 4, 2, -1, &good, (1, 3072), false, 3072, 3072);
    let load = || model::load_bytes(&kiln_tests::onnx::bytes(&m), None).unwrap();
    let mut cpu = Session::new(runtime(), load(), SessionOptions::default()).unwrap();
    let want = cpu.run(feeds.clone()).unwrap();
    let mut s = Session::new(runtime(), load(), SessionOptions { graphs: GraphMode::On, ..cuda() }).unwrap();
    let held: Vec<_> = feeds
        .iter()
        .map(|(_, t)| {
            let d = s.zeros(t.dtype, t.shape.clone()).unwrap();
            s.write_tensor(&d, t).unwrap();
            d
        })
        .collect();
    let outs: Vec<_> = want.iter().map(|(_, t)| s.zeros(t.dtype, t.shape.clone()).unwrap()).collect();
    let out_names: Vec<String> = want.iter().map(|(nm, _)| nm.clone()).collect();
    let run = |s: &mut Session| -> kiln_host::Result<Vec<kiln_host::Tensor>> {
        let fed = feeds.iter().zip(&held).map(|((nm, _), d)| (nm.clone(), Feed::Device(d))).collect();
        let fetch: Vec<_> = out_names.iter().zip(&outs).map(|(nm, d)| (nm.as_str(), Fetch::Into(d))).collect();
        s.run_with(fed, &fetch)?;
        outs.iter().map(|d| s.read_tensor(d)).collect()
    };
    let check = |got: &[kiln_host::Tensor], when: &str| {
        for (g, (name, w)) in got.iter().zip(&want) {
            let d = max_abs_diff(&kiln_tests::f32_values(g), &kiln_tests::f32_values(w));
            assert!(d <= 1e-4, "{when}: {name}: max |Δ| {d}");
        }
    };
    // The present K/V are the past buffers' copies, written in place: feed the pasts afresh.
    let reset = |s: &mut Session| {
        for ((_, t), d) in feeds.iter().zip(&held) {
            s.write_tensor(d, t).unwrap();
        }
    };
    for i in 0..3 {
        reset(&mut s);
        check(&run(&mut s).unwrap(), &format!("run {i}"));
    }
    let seq_at = feeds.iter().position(|(nm, _)| nm == "seqlens_k").unwrap();
    for bad in [[5000, 700, 1], [3000, 0, 1], [3000, 700, 3073]] {
        let mut crafted = feeds.clone();
        crafted[seq_at].1 = seqlens_k(&bad);
        let Err(Error::Shim(cpu_err)) = cpu.run(crafted.clone()) else { panic!("the CPU accepts seqlens {bad:?}") };
        reset(&mut s);
        s.write_tensor(&held[seq_at], &crafted[seq_at].1).unwrap();
        let replays = s.report.graphs.replays;
        match run(&mut s) {
            Err(Error::DeviceCheck(d)) => {
                assert_eq!(d.reason, cpu_err.reason, "lengths {bad:?}");
                assert_eq!((d.package.as_str(), d.op.as_str()), (cpu_err.package.as_str(), "GroupQueryAttention"));
                println!("lengths {bad:?}: {d}");
            }
            other => panic!("lengths {bad:?}: expected a device check failure, got {:?}", other.map(|_| ())),
        }
        assert_eq!(s.report.graphs.replays, replays + 1, "the crafted run was a graph replay");
        reset(&mut s);
        check(&run(&mut s).unwrap(), &format!("after lengths {bad:?}"));
    }
    let st = &s.report.graphs;
    assert_eq!((st.captures, st.fallbacks.len()), (1, 0), "one capture, no fallback: {st:?}");

    // Run eagerly, with the other checks: a past shorter than a row's length (past and present
    // apart), a position past the cos/sin caches, and RotaryEmbedding's position_ids.
    let same_error = |m: &kiln_tests::onnx::ModelProto, feeds: Vec<(String, kiln_host::Tensor)>, what: &str| {
        let load = || model::load_bytes(&kiln_tests::onnx::bytes(m), None).unwrap();
        let cpu = Session::new(runtime(), load(), SessionOptions::default()).unwrap().run(feeds.clone());
        let Err(Error::Shim(cpu_err)) = cpu else { panic!("{what}: the CPU accepts it") };
        let opts = SessionOptions { small_integer_nodes_on_host: false, ..cuda() };
        match Session::new(runtime(), load(), opts).unwrap().run(feeds) {
            Err(Error::DeviceCheck(d)) => {
                assert_eq!(d.reason, cpu_err.reason, "{what}");
                println!("{what}: {d}");
            }
            other => panic!("{what}: expected a device check failure, got {:?}", other.map(|_| ())),
        }
    };
    let (m, feeds) = gqa_model(64, 4, 2, -1, &good, (1, 3072), false, 2048, 3072);
    same_error(&m, feeds, "past of 2048 positions");
    let (m, feeds) = gqa_model(64, 4, 2, -1, &good, (1, 3072), false, 3072, 2048);
    same_error(&m, feeds, "cos/sin caches of 2048 rows");
    let dir = kiln_tests::root().join("tests/contrib-node-tests/test_rotary_embedding");
    let rm = <kiln_tests::onnx::ModelProto as protobuf::Message>::parse_from_bytes(
        &std::fs::read(dir.join("model.onnx")).unwrap(),
    )
    .unwrap();
    let mut feeds = Vec::new();
    for (i, input) in rm.graph.input.iter().enumerate() {
        let t = tensorio::read_tensor_file(&dir.join(format!("test_data_set_0/input_{i}.pb"))).unwrap().0;
        feeds.push((input.name.clone(), t));
    }
    let pos = feeds.iter().position(|(_, t)| t.dtype == kiln_kernel_abi::DType::I64).expect("position_ids");
    let rows = feeds.iter().find(|(nm, _)| nm.contains("cos")).map(|(_, t)| t.shape[0]).unwrap() as i64;
    let p = &feeds[pos].1;
    let mut crafted: Vec<i64> = p.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    *crafted.last_mut().unwrap() = rows + 3;
    let bytes: Vec<u8> = crafted.iter().flat_map(|v| v.to_le_bytes()).collect();
    feeds[pos].1 = kiln_host::Tensor::new(p.dtype, p.shape.clone(), bytes.into()).unwrap();
    same_error(&rm, feeds, "RotaryEmbedding position past the caches");

    // Gather: an index past its axis.
    use kiln_tests::onnx::{self, node, value};
    let g = node("Gather", &["data", "idx"], &["y"], vec![onnx::attr_int("axis", 1)]);
    let gm = onnx::model(
        vec![g],
        vec![value("data", 1, &[2, 5]), value("idx", 7, &[3])],
        vec![value("y", 1, &[2, 3])],
        vec![],
    );
    let gload = || model::load_bytes(&onnx::bytes(&gm), None).unwrap();
    let data = kiln_tests::f32_tensor(&[2, 5], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    let idx = |v: [i64; 3]| {
        kiln_host::Tensor::new(
            kiln_kernel_abi::DType::I64,
            vec![3],
            v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>().into(),
        )
        .unwrap()
    };
    let opts = SessionOptions { small_integer_nodes_on_host: false, ..cuda() };
    let mut gs = Session::new(runtime(), gload(), opts).unwrap();
    let bad = vec![("data".to_string(), data.clone()), ("idx".to_string(), idx([1, 7, -2]))];
    let Err(Error::Shim(cpu_err)) =
        Session::new(runtime(), gload(), SessionOptions::default()).unwrap().run(bad.clone())
    else {
        panic!("the CPU accepts index 7 of 5")
    };
    match gs.run(bad) {
        Err(Error::DeviceCheck(d)) => assert_eq!(d.reason, cpu_err.reason),
        other => panic!("expected a device check failure, got {:?}", other.map(|_| ())),
    }
    let y = gs.run(vec![("data".to_string(), data), ("idx".to_string(), idx([1, 4, -2]))]).unwrap();
    assert_eq!(kiln_tests::f32_values(&y[0].1), vec![1.0, 4.0, 3.0, 6.0, 9.0, 8.0]);
}

/// MatMul at decode sizes (at most 8 rows of A, batch dimensions folded into M, against a 2-D B,
/// as every decode projection is; N on and off the 16-byte vector) on random shapes, float32 /
/// float16 / bfloat16, against the CPU reference, which sums in f64 and rounds once. Bound per
/// element: one ulp of the output dtype (2^-10 relative for float16, 2^-7 for bfloat16, 2^-23
/// for float32) plus K · 2^-22 for the f32 accumulation (|x|, |w| ≤ 1): far above what an f32
/// sum in any order loses on these inputs, below what partial sums rounded to float16 lose
/// (cuBLASLt's in-place split-K reduction failed it by 5 ulps at K = 1098).
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_sized_matmul_matches_the_float64_reference() {
    use kiln_tests::onnx::{self, node, value};
    let mut r = kiln_tests::Rng(0x9e3f);
    let int = onnx::attr_int;
    // (ONNX dtype code, relative ulp, vector elements)
    for (code, ulp, vec) in [(1i64, 2f32.powi(-23), 4usize), (10, 2f32.powi(-10), 8), (16, 2f32.powi(-7), 8)] {
        for case in 0..12 {
            let k = match case {
                0 => 1,
                1 => 7,
                _ => r.range(8, 2100),
            };
            // Last case: N off the 16-byte vector.
            let n = if case == 11 { vec * r.range(1, 40) + 3 } else { vec * r.range(1, 130) };
            let a_shape: Vec<usize> = match r.below(3) {
                0 => vec![r.range(1, 8), k],
                1 => vec![r.range(1, 8), 1, k],
                _ => vec![2, r.range(1, 4), k],
            };
            let x = kiln_tests::f32_tensor(&a_shape, &r.signed_unit(a_shape.iter().product()));
            let w = kiln_tests::f32_tensor(&[k, n], &r.signed_unit(k * n));
            let dims = |s: &[usize]| s.iter().map(|&d| d as i64).collect::<Vec<_>>();
            let mut y = value("y", 1, &[]);
            y.type_ = Default::default();
            let m = onnx::model(
                vec![
                    node("Cast", &["x"], &["xc"], vec![int("to", code)]),
                    node("Cast", &["w"], &["wc"], vec![int("to", code)]),
                    node("MatMul", &["xc", "wc"], &["y"], vec![]),
                ],
                vec![value("x", 1, &dims(&a_shape)), value("w", 1, &dims(&[k, n]))],
                vec![y],
                vec![],
            );
            let feeds = vec![("x".to_string(), x), ("w".to_string(), w)];
            let load = || model::load_bytes(&onnx::bytes(&m), None).unwrap();
            let want = Session::new(runtime(), load(), SessionOptions::default()).unwrap().run(feeds.clone()).unwrap();
            let got = Session::new(runtime(), load(), cuda()).unwrap().run(feeds).unwrap();
            let (got, want) = (got[0].1.to_f32().unwrap(), want[0].1.to_f32().unwrap());
            assert_eq!(got.len(), want.len());
            let acc = k as f32 * 2f32.powi(-22);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let tol = ulp * w.abs() + acc + 1e-7;
                assert!(
                    (g - w).abs() <= tol,
                    "dtype {code}, A {a_shape:?}, B [{k}, {n}]: element {i}: GPU {g}, reference {w} (|Δ| > {tol})"
                );
            }
        }
    }
}

/// Constant inputs (ABI.md §7.7) change when kiln-matmul's GEMVs load their weights, not what
/// they compute: tiny-llama fp16 (fused: RmsNormLinear, gate/up's with the SwiGLU epilogue, and
/// Linear over initializers)
/// gives bit-identical logits with and without the host telling the packages which inputs are
/// constant, at one row (the CUDA-core GEMV) and three (the tensor-core GEMV), prefill and four
/// decode steps.
#[test]
#[ignore = "needs a CUDA GPU"]
fn constant_inputs_change_no_logit() {
    use kiln_host::genai::{Generator, ModelFolder};
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda");
    let run = |constant_inputs: bool, prompts: &[Vec<i64>]| -> Vec<Vec<Vec<f32>>> {
        let options = SessionOptions { constant_inputs, ..cuda() };
        let mut g = Generator::new(runtime(), ModelFolder::open(&folder).unwrap(), options).unwrap();
        let (mut kv, first) = g.prefill(prompts, 32).unwrap();
        let mut all = vec![first];
        for step in 0..4 {
            let next: Vec<i64> = (0..prompts.len()).map(|r| (7 + step + r) as i64).collect();
            all.push(g.decode(&mut kv, &next).unwrap());
        }
        g.free(kv);
        all
    };
    for prompts in [vec![vec![1i64, 5, 9, 13]], vec![vec![1, 5, 9, 13], vec![1, 2], vec![3, 4, 5]]] {
        let (on, off) = (run(true, &prompts), run(false, &prompts));
        assert!(on == off, "{} rows: logits differ with constant inputs", prompts.len());
    }
}

/// Named outputs of a run.
type Outputs = Vec<(String, kiln_host::Tensor)>;

/// A graph of `nodes` (an ai.kiln op after Casts of its float32 inputs) whose graph inputs are
/// `feeds` (float32, or uint8 where the feed is) and whose initializers are `inits` (constant
/// inputs: ABI.md §7.7), outputs `outputs` of inferred types, run on the CPU and on the GPU:
/// (CPU outputs, GPU outputs).
fn run_kiln_op_on_cpu_and_gpu(
    nodes: Vec<kiln_tests::onnx::NodeProto>,
    outputs: &[&str],
    feeds: Vec<(String, kiln_host::Tensor)>,
    inits: Vec<kiln_tests::onnx::TensorProto>,
) -> (Outputs, Outputs) {
    use kiln_tests::onnx::{self, value};
    let dims = |s: &[usize]| s.iter().map(|&d| d as i64).collect::<Vec<_>>();
    let code = |t: &kiln_host::Tensor| if t.dtype == kiln_kernel_abi::DType::U8 { 2 } else { 1 };
    let graph_inputs = feeds.iter().map(|(name, t)| value(name, code(t), &dims(&t.shape))).collect();
    let graph_outputs = outputs
        .iter()
        .map(|o| {
            let mut v = value(o, 1, &[]);
            v.type_ = Default::default();
            v
        })
        .collect();
    let mut m = onnx::model(nodes, graph_inputs, graph_outputs, inits);
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "ai.kiln".into(), version: 1, ..Default::default() });
    let load = || model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let want = Session::new(runtime(), load(), SessionOptions::default()).unwrap().run(feeds.clone()).unwrap();
    let got = Session::new(runtime(), load(), cuda()).unwrap().run(feeds).unwrap();
    (want, got)
}

/// ArgMax and ArgMin over few long rows (kiln-reduce's `kiln_arg_rows_split`: a row's eight
/// slices in eight blocks, one thread block cluster on compute capability 9.0) give the planted
/// index and the CPU's: float32, float16 and bfloat16; 1, 8 and 64 rows (65 take one block per
/// row); 49,152 elements (a logits row) and 50,257 (rows off the 16-byte vector, scanned element
/// by element); the extreme twice in different slices (first index, or the last with
/// `select_last_index`); a row with NaN in two slices (the first NaN, or the last, wins).
#[test]
#[ignore = "needs a CUDA GPU"]
fn arg_max_and_min_over_long_rows_match_the_cpu() {
    use kiln_tests::onnx::{attr_int, node};
    let mut r = kiln_tests::Rng(0xa26);
    let mut cases = 0;
    for (code, rows, n) in [(1i64, 1usize, 49152usize), (10, 8, 49152), (16, 1, 50257), (10, 64, 50257), (1, 65, 20000)]
    {
        for (op, last) in [("ArgMax", 0i64), ("ArgMin", 1)] {
            let sign = if op == "ArgMax" { 1.0 } else { -1.0 };
            let mut x: Vec<f32> = r.signed_unit(rows * n);
            let mut want = Vec::with_capacity(rows);
            for row in 0..rows {
                // Two equal extremes in different eighths of the row, or two NaNs for row 2.
                let a = r.range(0, n / 8 * 3);
                let b = r.range(n / 8 * 5, n - 1);
                let v = if row == 2 { f32::NAN } else { 2.0 * sign };
                x[row * n + a] = v;
                x[row * n + b] = v;
                want.push(if last == 1 { b } else { a } as i64);
            }
            let feeds = vec![("x".to_string(), kiln_tests::f32_tensor(&[rows, n], &x))];
            let nodes = vec![
                node("Cast", &["x"], &["xc"], vec![attr_int("to", code)]),
                node(op, &["xc"], &["y"], vec![attr_int("axis", -1), attr_int("select_last_index", last)]),
            ];
            let (cpu, gpu) = run_kiln_op_on_cpu_and_gpu(nodes, &["y"], feeds, vec![]);
            let (cpu, gpu) = (cpu[0].1.to_i64().unwrap(), gpu[0].1.to_i64().unwrap());
            assert_eq!(cpu, want, "{op} dtype {code}, [{rows}, {n}]: the CPU against the planted indices");
            assert_eq!(gpu, want, "{op} dtype {code}, [{rows}, {n}]: the GPU against the planted indices");
            cases += 1;
        }
    }
    assert_eq!(cases, 10);
}

/// kiln-normalization's `ai.kiln::SkipLayerNormalization` on the GPU against its CPU reference
/// (f64, the sum rounded to the dtype, the output rounded once) on both row paths of
/// `kiln_skip_layer_norm`: whole 4-element chunks (`skip_norm_vec`: BERT's 768-wide rows, 1,000
/// columns with skip, beta and bias broadcast over the leading dimensions, and rows of 4,096 that
/// take a 1,024-thread block, which the kernel's 64-register bound lets launch) and element by
/// element (770 columns, off the chunk). float32 and float16. Tolerance: four units of the
/// dtype's last place relative to each value (at least 1): a wrong chunk or row is off by O(1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn skip_layer_normalization_matches_the_cpu_on_both_row_paths() {
    use kiln_tests::onnx::{self, node};
    let mut r = kiln_tests::Rng(0x5c1a);
    let mut cases = 0;
    for (code, ulp) in [(1i64, 2f32.powi(-23)), (10, 2f32.powi(-10))] {
        for (x_shape, suffix, extras) in [
            (vec![512usize, 768], false, false),
            (vec![2, 4096], false, false),
            (vec![2, 3, 1000], true, true),
            (vec![3, 770], false, true),
        ] {
            let hidden = x_shape[x_shape.len() - 1];
            let skip_shape = if suffix { vec![hidden] } else { x_shape.clone() };
            let mut feeds = vec![
                ("x".to_string(), kiln_tests::f32_tensor(&x_shape, &r.signed_unit(x_shape.iter().product()))),
                ("skip".into(), kiln_tests::f32_tensor(&skip_shape, &r.signed_unit(skip_shape.iter().product()))),
                ("gamma".into(), kiln_tests::f32_tensor(&[hidden], &r.signed_unit(hidden))),
            ];
            let mut names = vec!["x", "skip", "gamma"];
            if extras {
                feeds.push(("beta".into(), kiln_tests::f32_tensor(&[hidden], &r.signed_unit(hidden))));
                feeds.push(("bias".into(), kiln_tests::f32_tensor(&[hidden], &r.signed_unit(hidden))));
                names.extend(["beta", "bias"]);
            }
            let cast: Vec<String> = names.iter().map(|n| format!("{n}c")).collect();
            let mut nodes: Vec<_> = names
                .iter()
                .zip(&cast)
                .map(|(n, c)| node("Cast", &[n], &[c], vec![onnx::attr_int("to", code)]))
                .collect();
            let inputs: Vec<&str> = cast.iter().map(String::as_str).collect();
            let mut op = node("SkipLayerNormalization", &inputs, &["y"], vec![onnx::attr_float("epsilon", 1e-5)]);
            op.domain = "ai.kiln".into();
            nodes.push(op);
            let (want, got) = run_kiln_op_on_cpu_and_gpu(nodes, &["y"], feeds, vec![]);
            let (w, g) = (want[0].1.to_f32().unwrap(), got[0].1.to_f32().unwrap());
            assert_eq!(w.len(), g.len());
            for (i, (a, b)) in w.iter().zip(&g).enumerate() {
                assert!(
                    (a - b).abs() <= 4.0 * ulp * a.abs().max(1.0),
                    "dtype {code}, {x_shape:?}: element {i} is {b} on the GPU, {a} on the CPU"
                );
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 8);
}

/// kiln-matmul's `ai.kiln::Linear`, `RmsNormLinear` and `SwiGluLinear` on the GPU against their
/// CPU reference (f64, A rounded to the dtype, then Y rounded once), on random shapes: 1 to 4
/// rows (the CUDA-core GEMV for 1 row and float32; the tensor-core GEMV for 2 to 16 rows of
/// float16 and bfloat16, one or two n-tiles), more rows (prologue kernel + cuBLASLt),
/// K off the 16-byte vector (the cuBLASLt path at any row count), N from 1 up, skip broadcast
/// over the leading dimension. Tolerance: a relative ulp of the dtype on Y, the f32 accumulation
/// (K · 2^-22 · 4), and up to four elements of A that f32 and f64 round to neighbouring values
/// (4 · ulp · 4): a wrong index or a lost row is off by O(1).
#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_ops_match_their_cpu_reference() {
    use kiln_tests::onnx::{self, node};
    let mut r = kiln_tests::Rng(0x11ea);
    let int = onnx::attr_int;
    let mut cases = 0;
    for (code, ulp, vec) in [(1i64, 2f32.powi(-23), 4usize), (10, 2f32.powi(-10), 8), (16, 2f32.powi(-7), 8)] {
        for op in ["Linear", "RmsNormLinear", "SwiGluLinear"] {
            for case in 0..8 {
                let rows = match case {
                    0 => 1,
                    1 => 2,
                    2 => 4,
                    3 => 3,
                    4 => r.range(5, 70),
                    // Two n-tiles of the tensor-core GEMV (float16, bfloat16).
                    5 => r.range(9, 17),
                    _ => r.range(1, 5),
                };
                let k = if case == 7 { vec * r.range(1, 40) + 1 } else { vec * r.range(1, 200) };
                let n = if case == 6 { r.range(1, 7) } else { r.range(8, 400) };
                let lead: Vec<usize> = if rows % 2 == 0 && r.coin() { vec![2, rows / 2] } else { vec![rows] };
                let x_last = if op == "SwiGluLinear" { 2 * k } else { k };
                let x_shape: Vec<usize> = lead.iter().copied().chain([x_last]).collect();
                let mut feeds =
                    vec![("x".to_string(), kiln_tests::f32_tensor(&x_shape, &r.signed_unit(x_shape.iter().product())))];
                let mut inputs = vec!["xc"];
                let mut casts = vec![node("Cast", &["x"], &["xc"], vec![int("to", code)])];
                let mut outputs = vec!["y"];
                if op == "RmsNormLinear" {
                    // Skip of the whole shape, a broadcast suffix, or none.
                    let skip_shape: Option<Vec<usize>> = match case % 3 {
                        0 => Some(x_shape.clone()),
                        1 if lead.len() == 2 => Some(x_shape[1..].to_vec()),
                        _ => None,
                    };
                    if let Some(s) = &skip_shape {
                        feeds.push(("skip".into(), kiln_tests::f32_tensor(s, &r.signed_unit(s.iter().product()))));
                        casts.push(node("Cast", &["skip"], &["skipc"], vec![int("to", code)]));
                        inputs.push("skipc");
                        outputs.push("sum");
                    } else {
                        inputs.push("");
                    }
                    feeds.push(("gamma".into(), kiln_tests::f32_tensor(&[k], &r.signed_unit(k))));
                    casts.push(node("Cast", &["gamma"], &["gammac"], vec![int("to", code)]));
                    inputs.push("gammac");
                }
                feeds.push(("w".into(), kiln_tests::f32_tensor(&[n, k], &r.signed_unit(n * k))));
                casts.push(node("Cast", &["w"], &["wc"], vec![int("to", code)]));
                inputs.push("wc");
                let mut op_node = node(op, &inputs, &outputs, vec![]);
                op_node.domain = "ai.kiln".into();
                casts.push(op_node);
                let (want, got) = run_kiln_op_on_cpu_and_gpu(casts, &outputs, feeds, vec![]);
                for ((name, g), (_, w)) in got.iter().zip(&want) {
                    let (g, w) = (g.to_f32().unwrap(), w.to_f32().unwrap());
                    assert_eq!(g.len(), w.len());
                    let slack = if name == "y" {
                        k as f32 * 2f32.powi(-22) * 4.0 + 16.0 * ulp.max(2f32.powi(-23))
                    } else {
                        0.0
                    };
                    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                        let tol = ulp * b.abs() + slack + 1e-7;
                        assert!(
                            (a - b).abs() <= tol,
                            "{op} dtype {code}, X {x_shape:?}, W [{n}, {k}]: {name}[{i}]: GPU {a}, reference {b} (|Δ| > {tol})"
                        );
                    }
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 72);
}

/// `values` as the little-endian bytes of ONNX float type `code` (10 float16, 16 bfloat16, else
/// float32), each rounded to nearest even: an initializer's `raw_data`.
fn float_bytes(code: i64, values: &[f32]) -> Vec<u8> {
    match code {
        10 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// kiln-matmul's SwiGLU epilogue (`RmsNormLinear` with `swiglu = 1`, the `skip-rmsnorm-mlp`
/// fusion's gate/up) gives exactly SiLU(gate) · up of the product the plain `RmsNormLinear`
/// computes beside it on the same device: P rounded to the dtype, then Sigmoid, Mul and Mul each
/// rounded (here in f64, the kernels in f32), on the GPU and on the CPU. Float32, float16 and
/// bfloat16 at 1 to 4 rows (the CUDA-core GEMV's epilogue), 2 to 16 (the tensor-core GEMV's, one
/// or two n-tiles), 40 rows and K off the 16-byte vector (P in scratch, then
/// `kiln_linear_swiglu`), F odd and even; F of 8,200 at 1 and 8 rows (the CUDA-core GEMV's blocks
/// looping past 1,024, the tensor-core GEMV at one warp per tile); odd cases hold W as an
/// initializer of the dtype (constant: loaded before the grid-dependency wait). Tolerance: 4 ulp of the dtype relative to |Y| (the
/// sigmoid's f32 and f64 values may round to neighbouring values of the dtype) and 1e-6; a wrong
/// pairing of gate and up rows is off by O(|Y|).
#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_epilogue_is_silu_of_the_plain_product() {
    use kiln_tests::onnx::{self, node};
    let mut r = kiln_tests::Rng(0x5e1f);
    let int = onnx::attr_int;
    let mut cases = 0;
    for (code, ulp, vec) in [(1i64, 2f32.powi(-23), 4usize), (10, 2f32.powi(-10), 8), (16, 2f32.powi(-7), 8)] {
        let round = |v: f64| -> f64 {
            match code {
                10 => half::f16::from_f64(v).to_f64(),
                16 => half::bf16::from_f64(v).to_f64(),
                _ => v as f32 as f64,
            }
        };
        for (case, rows) in [1usize, 2, 3, 4, 8, 13, 16, 40, 3, 1, 8].into_iter().enumerate() {
            let k = match case {
                8 => vec * r.range(1, 40) + 1,
                9 | 10 => vec * 4,
                _ => vec * r.range(1, 120),
            };
            let f = if case >= 9 { 8200 } else { r.range(1, 150) };
            let mut feeds = vec![
                ("x".to_string(), kiln_tests::f32_tensor(&[rows, k], &r.signed_unit(rows * k))),
                ("skip".to_string(), kiln_tests::f32_tensor(&[rows, k], &r.signed_unit(rows * k))),
                ("gamma".to_string(), kiln_tests::f32_tensor(&[k], &r.signed_unit(k))),
            ];
            let w = r.signed_unit(2 * f * k);
            let mut nodes: Vec<_> = ["x", "skip", "gamma"]
                .iter()
                .map(|i| node("Cast", &[i], &[&format!("{i}c")], vec![int("to", code)]))
                .collect();
            let mut inits = Vec::new();
            if case % 2 == 1 {
                // W as an initializer of the dtype: a constant input.
                let raw_data = float_bytes(code, &w);
                let dims = vec![2 * f as i64, k as i64];
                inits.push(onnx::TensorProto {
                    name: "wc".into(),
                    data_type: code as i32,
                    dims,
                    raw_data,
                    ..Default::default()
                });
            } else {
                feeds.push(("w".to_string(), kiln_tests::f32_tensor(&[2 * f, k], &w)));
                nodes.push(node("Cast", &["w"], &["wc"], vec![int("to", code)]));
            }
            for (out, swiglu) in [("p", 0), ("y", 1)] {
                let mut n =
                    node("RmsNormLinear", &["xc", "skipc", "gammac", "wc"], &[out], vec![int("swiglu", swiglu)]);
                n.domain = "ai.kiln".into();
                nodes.push(n);
            }
            let (cpu, gpu) = run_kiln_op_on_cpu_and_gpu(nodes, &["p", "y"], feeds, inits);
            for (device, outs) in [("CPU", &cpu), ("GPU", &gpu)] {
                let (p, y) = (outs[0].1.to_f32().unwrap(), outs[1].1.to_f32().unwrap());
                assert_eq!((p.len(), y.len()), (rows * 2 * f, rows * f));
                for (i, got) in y.iter().enumerate() {
                    let (row, j) = (i / f, i % f);
                    let (g, u) = (p[row * 2 * f + j] as f64, p[row * 2 * f + f + j] as f64);
                    let s = if g >= 0.0 { 1.0 / (1.0 + (-g).exp()) } else { g.exp() / (1.0 + g.exp()) };
                    let want = round(round(g * round(s)) * u);
                    let tol = 4.0 * ulp as f64 * want.abs() + 1e-6;
                    assert!(
                        (*got as f64 - want).abs() <= tol,
                        "{device}, dtype {code}, X [{rows}, {k}], W [{}, {k}] (constant: {}): y[{i}] = {got}, SiLU(gate)·up of the plain product {want} (|Δ| > {tol})",
                        2 * f,
                        case % 2 == 1
                    );
                }
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 33);
}

/// kiln-matmul's linear ops over MatMulNBits weights (4 and 8 bits, default zero point; uint8 W
/// `[N, k_blocks, block · bits / 8]` and scales `[N, k_blocks]`) on the GPU against the same ops
/// on the CPU (the host's `qgemm`), float32, float16 and bfloat16, random shapes: 1 to 16 rows
/// (one kernel: 4 bits from 2 rows in float16 and bfloat16 on tensor cores, the rest on CUDA
/// cores, 1 to 8 rows per block), 20 to 40 rows and 4-bit K not a multiple of 32 (the weight
/// dequantized for cuBLASLt), blocks of 32, 64 and 128 (and 16 for 8 bits, with 8-bit K of 16
/// past a multiple of 32 in the GEMV); odd cases hold W and its scales as
/// initializers (constant inputs, ABI.md §7.7: loaded before the grid-dependency wait), even
/// cases feed them. Linear's Y is also checked against float64 (A = X rounded to the dtype, W
/// dequantized exactly). RmsNormLinear also runs with `swiglu = 1` (the GEMVs' SwiGLU epilogue over
/// an even N of [gate | up] rows, one case at N / 2 = 8,200 past the GEMVs' block limits; the CPU
/// rounds the product, then SiLU(gate)·up as Sigmoid, Mul and Mul do). Tolerance: as `linear_ops_match_their_cpu_reference`, with K · 2^-22 scaled by the
/// largest |scale| · 2^(bits − 1) (1/2); under the epilogue 4 ulp of |y| + 1 and twice the slack.
#[test]
#[ignore = "needs a CUDA GPU"]
fn quantized_linear_ops_match_their_cpu_reference_and_float64() {
    use kiln_tests::onnx::{self, node};
    let mut r = kiln_tests::Rng(0x4b17);
    let int = onnx::attr_int;
    let mut cases = 0;
    for (code, ulp, dtype) in [
        (1i64, 2f32.powi(-23), kiln_kernel_abi::DType::F32),
        (10, 2f32.powi(-10), kiln_kernel_abi::DType::F16),
        (16, 2f32.powi(-7), kiln_kernel_abi::DType::BF16),
    ] {
        let ops = [("Linear", 0i64), ("RmsNormLinear", 0), ("SwiGluLinear", 0), ("RmsNormLinear", 1)];
        for (op, swiglu, bits) in ops.into_iter().flat_map(|(op, s)| [(op, s, 4usize), (op, s, 8)]) {
            for case in 0..7 {
                let rows = match case {
                    0 => 1,
                    1 => 3,
                    2 => 8,
                    3 => r.range(9, 17),
                    4 => r.range(20, 41),
                    _ => r.range(1, 5),
                };
                // 8 bits also take blocks of 16 and a K of 16 past a multiple of 32 in the GEMV
                // (16 values per 16-byte chunk); 4 bits send a K of 8 past one to the prefill path.
                let block = if bits == 8 { r.pick(&[16usize, 32, 64, 128]) } else { r.pick(&[32usize, 64, 128]) };
                let k = match case {
                    6 if bits == 8 => 32 * r.range(1, 20) + 16,
                    6 => 32 * r.range(1, 20) + 8,
                    _ => 32 * r.range(1, 60),
                };
                // swiglu = 1: W's rows are [gate | up] halves (an even N), Y [rows, N / 2]; case
                // 5 at N / 2 = 8,200 over a short K: the CUDA-core GEMV's 1,025 column blocks
                // loop past 1,024, the tensor-core one runs one warp per tile (ksplit 1).
                let k = if swiglu == 1 && case == 5 { 32 * r.range(1, 8) } else { k };
                let kb = k.div_ceil(block);
                let n = match (swiglu, case) {
                    (1, 5) => 2 * 8200,
                    (1, _) => 2 * r.range(4, 150),
                    _ => r.range(8, 300),
                };
                let x_last = if op == "SwiGluLinear" { 2 * k } else { k };
                let x_shape = vec![rows, x_last];
                let xv = r.signed_unit(rows * x_last);
                let mut feeds = vec![("x".to_string(), kiln_tests::f32_tensor(&x_shape, &xv))];
                let mut inputs = vec!["xc"];
                let mut casts = vec![node("Cast", &["x"], &["xc"], vec![int("to", code)])];
                let mut outputs = vec!["y"];
                if op == "RmsNormLinear" {
                    feeds.push(("skip".into(), kiln_tests::f32_tensor(&x_shape, &r.signed_unit(rows * k))));
                    casts.push(node("Cast", &["skip"], &["skipc"], vec![int("to", code)]));
                    inputs.push("skipc");
                    outputs.push("sum");
                    feeds.push(("gamma".into(), kiln_tests::f32_tensor(&[k], &r.signed_unit(k))));
                    casts.push(node("Cast", &["gamma"], &["gammac"], vec![int("to", code)]));
                    inputs.push("gammac");
                }
                let blob = block * bits / 8;
                let wbytes: Vec<u8> = r.signed_unit(n * kb * blob).iter().map(|v| ((v + 1.0) * 127.9) as u8).collect();
                // Scales of a magnitude that keeps Y near 1 (exact in every dtype: multiples of
                // 1/256 for 4 bits, 1/4096 for 8, so that |scale| · 2^(bits − 1) ≤ 1/2 either way).
                let sv: Vec<f32> = r
                    .signed_unit(n * kb)
                    .iter()
                    .map(|v| (v * 16.0).round() / 256.0 * 8.0 / (1 << (bits - 1)) as f32)
                    .collect();
                // Odd cases hold W and its scales as initializers, which the host tells the package
                // are constant (the GEMVs then load them before the grid-dependency wait); even cases
                // feed them.
                let mut inits = Vec::new();
                if case % 2 == 1 {
                    let scale_bytes = float_bytes(code, &sv);
                    let init = |name: &str, data_type: i32, dims: Vec<i64>, raw_data: Vec<u8>| onnx::TensorProto {
                        name: name.into(),
                        data_type,
                        dims,
                        raw_data,
                        ..Default::default()
                    };
                    inits.push(init("w", 2, vec![n as i64, kb as i64, blob as i64], wbytes.clone()));
                    inits.push(init("scalesc", code as i32, vec![n as i64, kb as i64], scale_bytes));
                } else {
                    feeds.push((
                        "w".into(),
                        kiln_host::Tensor::new(kiln_kernel_abi::DType::U8, vec![n, kb, blob], wbytes.clone().into())
                            .unwrap(),
                    ));
                    feeds.push(("scales".into(), kiln_tests::f32_tensor(&[n, kb], &sv)));
                    casts.push(node("Cast", &["scales"], &["scalesc"], vec![int("to", code)]));
                }
                inputs.push("w");
                inputs.push("scalesc");
                let attrs = vec![int("bits", bits as i64), int("block_size", block as i64), int("swiglu", swiglu)];
                let mut op_node = node(op, &inputs, &outputs, attrs);
                op_node.domain = "ai.kiln".into();
                casts.push(op_node);
                let (want, got) = run_kiln_op_on_cpu_and_gpu(casts, &outputs, feeds, inits);
                let what = format!(
                    "{op} (swiglu {swiglu}) dtype {code}, X {x_shape:?}, W [{n}, {kb}, {blob}] ({bits} bits, block {block}, constant: {})",
                    case % 2 == 1
                );
                let slack = k as f32 * 2f32.powi(-22) * 4.0 * 8.0 / 16.0 + 16.0 * ulp.max(2f32.powi(-23));
                for ((name, g), (_, w)) in got.iter().zip(&want) {
                    let (g, w) = (g.to_f32().unwrap(), w.to_f32().unwrap());
                    assert_eq!(g.len(), w.len(), "{what}: {name}");
                    let slack = if name == "y" { slack } else { 0.0 };
                    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                        // SiLU(gate)·up of two products that may each round an ulp apart: up to
                        // about an ulp of gate·up each, then the three roundings of the SwiGLU.
                        let tol = if swiglu == 1 && name == "y" {
                            4.0 * ulp * (b.abs() + 1.0) + 2.0 * slack + 1e-7
                        } else {
                            ulp * b.abs() + slack + 1e-7
                        };
                        assert!((a - b).abs() <= tol, "{what}: {name}[{i}]: GPU {a}, CPU {b} (|Δ| > {tol})");
                    }
                }
                if op == "Linear" {
                    // Y in float64 from X rounded to the dtype and W dequantized exactly.
                    let round = |v: f32| -> f64 {
                        match dtype {
                            kiln_kernel_abi::DType::F16 => half::f16::from_f32(v).to_f64(),
                            kiln_kernel_abi::DType::BF16 => half::bf16::from_f32(v).to_f64(),
                            _ => v as f64,
                        }
                    };
                    let y = got[0].1.to_f32().unwrap();
                    for row in 0..rows {
                        for col in 0..n {
                            let mut acc = 0f64;
                            for kk in 0..k {
                                let byte = wbytes[col * kb * blob + kk * bits / 8];
                                let q = if bits == 8 { byte } else { (byte >> (4 * (kk % 2))) & 15 } as f64;
                                let q = q - (1 << (bits - 1)) as f64;
                                acc += round(xv[row * k + kk]) * q * round(sv[col * kb + kk / block]);
                            }
                            let a = y[row * n + col] as f64;
                            let tol = ulp as f64 * acc.abs() + slack as f64 + 1e-7;
                            assert!((a - acc).abs() <= tol, "{what}: y[{row}, {col}]: GPU {a}, float64 {acc}");
                        }
                    }
                }
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 168);
}

/// The resident set of this process, bytes (Linux `/proc/self/statm`).
/// A soak's memory at one point: what kiln holds on the device (its pool's in use and cached,
/// and the KV caches' mapped bytes), the
/// driver's free device memory (graphs and modules included), and the process's RSS, in bytes.
#[derive(Clone, Copy, Debug)]
struct MemorySample {
    kiln_holds: u64,
    driver_free: u64,
    rss: u64,
}

fn memory_sample(g: &kiln_host::genai::Generator) -> MemorySample {
    let (alloc, _) = g.session.gpu_stats().unwrap();
    let (driver_free, _) = kiln_host::cuda::memory_info().unwrap();
    MemorySample {
        kiln_holds: alloc.in_use_bytes + alloc.cached_bytes + alloc.vmm_mapped_bytes,
        driver_free,
        rss: rss_bytes(),
    }
}

/// Flat against the sample after a soak's warm-up: kiln's pool holds at most 1 MiB more, the
/// driver's free memory moves by less than 64 MiB, and the RSS by less than 16 MiB.
fn assert_memory_flat(when: &str, now: MemorySample, warm: MemorySample) {
    assert!(now.kiln_holds <= warm.kiln_holds + (1 << 20), "{when}: {now:?}, after warm-up {warm:?}");
    assert!(now.driver_free.abs_diff(warm.driver_free) < 64 << 20, "{when}: {now:?}, after warm-up {warm:?}");
    assert!(now.rss.abs_diff(warm.rss) < 16 << 20, "{when}: {now:?}, after warm-up {warm:?}");
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

/// A soak on one generator with graphs on: 20 generations of 512 new tokens (10 000+ decode
/// tokens) at batches 1, 3 (bucket 4), 8 and 2 in turn, the step buffers released every fifth
/// generation while a block is held (their graph re-captured at new addresses), and one failed
/// generation (a prompt
/// longer than max_length) in the middle. After a warm-up of 10 generations (every shape, and
/// two releases), against the last warm-up generation of the same shape (the paged KV cache
/// kept for the next generation is that shape's), kiln holds at most 1 MiB more (pool and
/// mapped KV), the driver's free memory (graphs and
/// modules included) moves by less than 64 MiB, and the process's RSS by less than 16 MiB.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_soak_of_10k_decode_tokens_keeps_device_memory_and_rss_flat() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::{GenerateOptions, SamplingParams};
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda");
    let mut g = gpu_generator(&folder, GraphMode::On);
    let vocab = g.folder.config.model.vocab_size;
    let shapes = [1usize, 3, 8, 2];
    let mut tokens = 0;
    let mut baseline: [Option<MemorySample>; 4] = [None; 4];
    let kv_dtype = g.folder.kv_dtype;
    let (nkv, hs) = (g.folder.config.model.decoder.num_key_value_heads, g.folder.config.model.decoder.head_size);
    for i in 0..20 {
        // New step buffers and a held block, so that they land elsewhere and the graph re-captures.
        let hold = (i % 5 == 4).then(|| {
            g.release_buffers();
            // A block of the size of one layer's KV cache of this generation.
            let rows = shapes[i % 4];
            let len = 3 + 4 * (rows - 1) + 512;
            g.session.zeros(kv_dtype, vec![kiln_host::genai::bucket(rows), nkv, len, hs]).unwrap()
        });
        if i == 10 {
            let opts = GenerateOptions {
                max_new_tokens: 8,
                max_length: Some(64),
                sampling: SamplingParams::default(),
                ignore_eos: true,
                stop: None,
            };
            let err = g.generate(&[vec![1; 100]], &opts, &mut |_, _| {}).unwrap_err().to_string();
            assert!(err.contains("max_length"), "{err}");
        }
        let out = greedy(&mut g, &prompts(shapes[i % 4], vocab), 512);
        tokens += out.timings.decode_tokens;
        if let Some(h) = hold {
            drop(h);
            g.session.reclaim();
        }
        let now = memory_sample(&g);
        println!("generation {i}: batch {}: {now:?}", shapes[i % 4]);
        // Against the last warm-up generation of the same shape: the spare paged cache kept
        // for the next generation is this shape's.
        match (i, &baseline[i % 4]) {
            (6..=9, _) => baseline[i % 4] = Some(now),
            (10.., Some(b)) => assert_memory_flat(&format!("generation {i}"), now, *b),
            _ => {}
        }
    }
    assert!(tokens >= 10_000, "{tokens} decode tokens");
    let st = &g.session.report.graphs;
    assert!(st.recaptures > 0 && st.fallbacks.is_empty(), "{st:?}");
}

/// `kiln package build`'s NVRTC check (`kiln_host::cuda::compile_package`, NVRTC only, no GPU
/// needed): every built-in package's sources compile for sm_90 with the headers of their
/// `[dependencies]` (kiln-cuda-std, resolved as a run resolves them) and define every kernel
/// their manifest lists; a listed kernel the source lacks is named with its file; a compile
/// error names the source's own file and line, or the in-memory header's; a header no
/// dependency provides is named.
#[test]
#[ignore = "needs a CUDA GPU"]
fn package_sources_compile_and_define_their_kernels() {
    use kiln_kernel_abi::manifest::Manifest;
    use std::collections::BTreeMap;
    let root = kiln_tests::root();
    let (reg, errors) = kiln_host::packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    let read =
        |dir: &std::path::Path| Manifest::parse(&std::fs::read_to_string(dir.join("kernel.toml")).unwrap()).unwrap();
    let (mut sources, mut with_deps) = (0, 0);
    for entry in std::fs::read_dir(root.join("kernels")).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("kernel.toml").is_file() {
            continue;
        }
        let m = read(&dir);
        let own: BTreeMap<String, String> =
            m.headers.iter().map(|h| (m.include_name(h), std::fs::read_to_string(dir.join(h)).unwrap())).collect();
        let id = format!("{}@{}", m.package.name, m.package.version);
        let headers = reg.includes_for(&id, &own, &m.dependencies).unwrap();
        with_deps += usize::from(!m.dependencies.is_empty());
        sources += kiln_host::cuda::compile_package(&dir, &m, &headers, "sm_90")
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    assert!(sources >= 9 && with_deps >= 4, "{sources} sources, {with_deps} packages with dependencies");
    let tmp = tempfile::tempdir().unwrap();
    let pkg = tmp.path().join("bias-gelu");
    std::fs::create_dir_all(pkg.join("cuda")).unwrap();
    let example = root.join("examples/third-party/bias-gelu");
    let cu = std::fs::read_to_string(example.join("cuda/bias_gelu.cu")).unwrap();
    let mut manifest = read(&example);
    let none = BTreeMap::new();
    manifest.cuda[0].kernels.push("bias_gelu_missing".into());
    std::fs::write(pkg.join("cuda/bias_gelu.cu"), &cu).unwrap();
    let err = kiln_host::cuda::compile_package(&pkg, &manifest, &none, "sm_90").unwrap_err().to_string();
    assert!(err.contains("bias_gelu_missing") && err.contains("cuda/bias_gelu.cu"), "{err}");
    manifest.cuda[0].kernels.pop();
    let line = cu.lines().count() + 1;
    std::fs::write(pkg.join("cuda/bias_gelu.cu"), format!("{cu}\nint broken = ;\n")).unwrap();
    let err = kiln_host::cuda::compile_package(&pkg, &manifest, &none, "sm_90").unwrap_err().to_string();
    assert!(err.contains(&format!("cuda/bias_gelu.cu({})", line + 1)), "the source's own line: {err}");
    // A dependency's header: its own name and line in NVRTC's message; an unknown one named.
    let bad = BTreeMap::from([("dep/bad.cuh".to_string(), "#pragma once\nint also_broken = ;\n".to_string())]);
    std::fs::write(pkg.join("cuda/bias_gelu.cu"), format!("#include \"dep/bad.cuh\"\n{cu}")).unwrap();
    let err = kiln_host::cuda::compile_package(&pkg, &manifest, &bad, "sm_90").unwrap_err().to_string();
    assert!(err.contains("dep/bad.cuh(2)"), "the header's own line: {err}");
    std::fs::write(pkg.join("cuda/bias_gelu.cu"), format!("#include \"kiln-cuda-std/nothing.cuh\"\n{cu}")).unwrap();
    let err = kiln_host::cuda::compile_package(&pkg, &manifest, &none, "sm_90").unwrap_err().to_string();
    assert!(err.contains("kiln-cuda-std/nothing.cuh"), "{err}");
}

/// `Session::view`: a view of a held device tensor is its first elements at its address (a KV
/// cache's first rows): what is written through the view is read through the tensor; the
/// tensor's buffer outlives its dropped handle while a view remains; both go back to the pool
/// once both are dropped; a view larger than its tensor is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_view_shares_its_tensors_buffer_and_keeps_it_alive() {
    use kiln_host::ep::GraphMode;
    use kiln_kernel_abi::DType;
    let mut g = gpu_generator(&kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"), GraphMode::Off);
    let s = &mut g.session;
    s.reclaim();
    let (held, in_use) = (s.held_tensors(), s.gpu_stats().unwrap().0.in_use_bytes);
    let t = s.zeros(DType::F32, vec![4, 8]).unwrap();
    let v = s.view(&t, vec![2, 8]).unwrap();
    let err = s.view(&t, vec![5, 8]).unwrap_err().to_string();
    assert!(err.contains("larger than its tensor"), "{err}");
    let values: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
    s.write_elements(&v, 0, &kiln_host::genai::f32_tensor(vec![16], &values).unwrap()).unwrap();
    let whole = s.read_tensor(&t).unwrap().to_f32().unwrap();
    assert_eq!(whole[..16], values[..], "written through the view, read through the tensor");
    assert!(whole[16..].iter().all(|&x| x == 0.0));
    drop(t);
    s.reclaim();
    assert_eq!(s.read_tensor(&v).unwrap().to_f32().unwrap(), values, "the view outlives its tensor's handle");
    assert!(s.gpu_stats().unwrap().0.in_use_bytes > in_use, "the buffer is still in use");
    drop(v);
    s.reclaim();
    assert_eq!(s.held_tensors(), held);
    assert_eq!(s.gpu_stats().unwrap().0.in_use_bytes, in_use, "both went back to the pool");
}

/// The server's soak on the GPU: one continuous batch of 16 slots with graphs on, as `kiln
/// serve` holds it, through 24 rounds of requests joining together (1 to 16 at once, prompts of
/// 3 to 99 tokens, so the padded prefills take several shapes; greedy and sampled), a quarter of
/// them leaving early as disconnected clients do, and one refused join (a prompt over
/// max_length) that the batch survives. The rows follow the load (1 to 16), each row count's
/// cache and graph kept once used. After a warm-up of 12 rounds (every prefill shape and row
/// count), kiln's pool holds at most 1 MiB more, the driver's free memory moves by less than
/// 64 MiB, and the process's RSS by less than 16 MiB.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_continuous_batch_soak_keeps_device_memory_and_rss_flat() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::{ContinuousBatch, Join, SamplingParams};
    let mut g = gpu_generator(&kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"), GraphMode::On);
    let vocab = g.folder.config.model.vocab_size;
    let mut batch = ContinuousBatch::new(&mut g, 16, Some(512)).unwrap();
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.8, top_k: 50, top_p: 0.9, repetition_penalty: 1.1, seed: 3 };
    let all = prompts(25, vocab);
    let (mut baseline, mut tokens) = (None, 0usize);
    for round in 0..24 {
        let n = [16, 3, 9, 1, 12, 5, 16, 2][round % 8];
        let params: Vec<SamplingParams> = (0..n)
            .map(|i| {
                if i % 2 == 0 {
                    SamplingParams::default()
                } else {
                    SamplingParams { seed: i as u64, ..sampled.clone() }
                }
            })
            .collect();
        let new: Vec<usize> = (0..n).map(|i| 20 + (7 * i + 5 * round) % 60).collect();
        let joins: Vec<Join<'_>> = (0..n)
            .map(|i| Join {
                prompt: &all[(i + round) % all.len()],
                sampling: &params[i],
                max_new_tokens: new[i],
                ignore_eos: true,
            })
            .collect();
        if round == 10 {
            let long = vec![1i64; 600];
            let refused = batch.join(&mut g, Join { prompt: &long, ..joins[0].clone() }).unwrap_err().to_string();
            assert!(refused.contains("max_length"), "{refused}");
        }
        let firsts = batch.join_many(&mut g, &joins).unwrap();
        let mut left: Vec<(usize, usize)> = firsts.iter().map(|e| (e.slot, 1)).collect();
        let leaving: Vec<usize> = firsts.iter().enumerate().filter(|(i, _)| i % 4 == 3).map(|(_, e)| e.slot).collect();
        let mut steps = 0;
        while batch.active() > 0 || batch.in_flight() {
            if steps == 5 {
                leaving.iter().for_each(|&s| batch.leave(s));
            }
            for e in batch.step(&mut g).unwrap() {
                if let Some(l) = left.iter_mut().find(|l| l.0 == e.slot) {
                    l.1 += 1;
                }
                tokens += 1;
            }
            steps += 1;
            assert!(steps < 2_000, "round {round}: the batch does not finish");
        }
        for (i, (slot, got)) in left.iter().enumerate() {
            if !leaving.contains(slot) {
                assert_eq!(*got, new[i], "round {round}: sequence {i} in slot {slot}");
            }
        }
        g.session.reclaim();
        let now = memory_sample(&g);
        println!("round {round}: {n} joined; {now:?}");
        match baseline {
            None if round == 11 => baseline = Some(now),
            Some(b) => assert_memory_flat(&format!("round {round}"), now, b),
            None => {}
        }
    }
    let stats = batch.stats();
    println!("{stats:?}; {tokens} tokens");
    assert!(stats.joined_in_place > 0 && stats.transitions > 0, "{stats:?}");
    assert!(g.session.report.graphs.fallbacks.is_empty(), "{:?}", g.session.report.graphs);
}

/// Continuous batching on graphs: 10 sequences (greedy, sampled, penalized) join a running
/// batch of 4 slots at different steps and wait for freed slots, over a 160-position cache, the
/// rows following the load (1, 2 and 4, joins growing them while a step is in flight). Graph
/// steps give exactly the eager steps' tokens; the steps replay the graphs of their row counts
/// (host rewrites of the step buffers between steps included), with no fallback. With the rows
/// fixed at 4 (batch-invariant), the shared mask column wraps. Each sequence's first token is its solo prefill's; the rest
/// are compared with its solo decode (batch 1 against the batch's bucket of 4: printed, as
/// GEMMs of other row counts may round differently).
#[test]
#[ignore = "needs a CUDA GPU"]
fn continuous_batch_steps_replay_the_graph_and_give_the_eager_tokens() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::SamplingParams;
    use kiln_tests::Arrival;
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.8, top_k: 50, top_p: 0.9, repetition_penalty: 1.2, seed: 11 };
    let penalized = SamplingParams { repetition_penalty: 1.3, ..SamplingParams::default() };
    for folder in [kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"), device_models().join("smollm2-arch-fp16-cuda")]
    {
        let mut eager = gpu_generator(&folder, GraphMode::Off);
        let mut graph = gpu_generator(&folder, GraphMode::On);
        let vocab = eager.folder.config.model.vocab_size;
        let p = prompts(10, vocab);
        let params = [SamplingParams::default(), sampled.clone(), penalized.clone()];
        let arrivals: Vec<Arrival> = (0..10)
            .map(|i| Arrival {
                at: i * 9,
                prompt: p[i][..3 + 4 * (i % 5)].to_vec(),
                sampling: params[i % 3].clone(),
                max_new_tokens: 60 + 13 * i,
            })
            .collect();
        let (_, want) = kiln_tests::run_continuous_batch(&mut eager, 4, 160, &arrivals);
        let before = graph.session.report.graphs.clone();
        let (batch, got) = kiln_tests::run_continuous_batch(&mut graph, 4, 160, &arrivals);
        let after = &graph.session.report.graphs;
        let stats = batch.stats();
        assert_eq!(got, want, "{}: graph vs eager continuous batch", folder.display());
        assert_eq!(stats.joins, 10, "{stats:?}");
        assert_eq!(after.fallbacks, before.fallbacks, "no fallback: {after:?}");
        assert!(stats.transitions > 0, "the rows followed the load: {stats:?}");
        // A replay per step, but for the first run of each row count (eager) and the one after
        // each move (whose bindings may be new).
        let replays = after.replays - before.replays;
        assert!(replays + 1 + 2 * stats.transitions >= stats.steps, "a replay per step: {stats:?} {after:?}");
        let mut agree = Vec::new();
        for (a, (_, tokens)) in arrivals.iter().zip(&got) {
            // The first token: from the join's prefill, padded as the batch pads it.
            let shape = kiln_host::genai::ContinuousBatch::prefill_shape(true, 1, a.prompt.len());
            let (kv, logits) = eager.prefill_padded(std::slice::from_ref(&a.prompt), 160, shape).unwrap();
            eager.free(kv);
            let first = kiln_host::genai::Sampler::new(a.sampling.clone()).next(&logits[0], &a.prompt, 0, 0);
            assert_eq!(tokens[0], first, "the first token comes from the same padded batch-1 prefill");
            let alone = kiln_tests::host_sampled_rows(
                &mut eager,
                std::slice::from_ref(&a.prompt),
                &[0],
                &a.sampling,
                tokens.len(),
            );
            agree.push(tokens.iter().zip(&alone[0]).take_while(|(x, y)| x == y).count() * 100 / tokens.len());
        }
        println!("{}: {stats:?}; % of each sequence equal to its solo decode: {agree:?}", folder.display());
        // At a fixed bucket (batch-invariant: the rows stay at 4) a greedy row does not depend
        // on the other rows: the first sequence alone in the batch (same slot) gets the tokens it
        // got beside nine others.
        let (fixed_batch, fixed) = kiln_tests::run_continuous_batch_with(&mut graph, 4, 160, &arrivals, true);
        assert!(fixed_batch.stats().compactions > 0, "the shared column wrapped: {:?}", fixed_batch.stats());
        let (_, alone) = kiln_tests::run_continuous_batch_with(&mut graph, 4, 160, &arrivals[..1], true);
        assert_eq!(alone[0], fixed[0], "{}: a greedy sequence alone vs in a full batch", folder.display());
    }
}

/// `kiln serve --batch-invariant` on the GPU: sequences joining a batch together (greedy and
/// sampled, prompts of 3 to 23 tokens) get exactly the tokens each gets joining alone, in
/// another slot, over a 64-slot graph bucket.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_invariant_joins_give_each_sequence_the_tokens_it_gets_alone_on_the_gpu() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::SamplingParams;
    let mut g = gpu_generator(&device_models().join("smollm2-arch-fp16-cuda"), GraphMode::On);
    let vocab = g.folder.config.model.vocab_size;
    let p = prompts(6, vocab);
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.8, top_k: 50, top_p: 0.9, repetition_penalty: 1.1, seed: 5 };
    let seqs: Vec<(Vec<i64>, SamplingParams)> = (0..6)
        .map(|i| {
            let params = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams { seed: 5 + i as u64, ..sampled.clone() }
            };
            (p[i].clone(), params)
        })
        .collect();
    let order: Vec<usize> = (0..6).collect();
    let together = kiln_tests::run_joined_together(&mut g, 64, 160, &seqs, &order, 64, true);
    let reversed: Vec<usize> = order.iter().rev().copied().collect();
    assert_eq!(together, kiln_tests::run_joined_together(&mut g, 64, 160, &seqs, &reversed, 64, true));
    for (i, s) in seqs.iter().enumerate() {
        let alone = kiln_tests::run_joined_together(&mut g, 64, 160, std::slice::from_ref(s), &[0], 64, true);
        assert_eq!(together[i], alone[0], "sequence {i}: joined with five others vs alone");
    }
}

/// A reserved tensor (VMM): its rows are mapped as asked, in whole 2 MiB chunks of the H200's
/// granularity, at one address that never moves; growing keeps the rows written and zeroes the
/// new ones, views past the mapped rows are refused, shrinking waits for views of the rows it
/// unmaps and gives their chunks back, and dropping it unmaps and frees everything.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_reserved_tensor_maps_its_rows_in_place() {
    use kiln_host::ep::GraphMode;
    use kiln_kernel_abi::DType;
    let mut g = gpu_generator(&kiln_tests::fixture("llm/tiny-llama-v512-fp16-cuda"), GraphMode::Off);
    let s = &mut g.session;
    s.reclaim();
    let gran = kiln_host::cuda::granularity(0).unwrap();
    let base = s.gpu_stats().unwrap().0;
    // Rows of 1.5 granules (3 MiB on the H200), 8 of them reserved, 1 mapped.
    let row = (3 * gran / 2 / 4) as usize;
    let t = s.reserve(DType::F32, vec![8, row], 1).unwrap();
    let at = s.device_address(&t).unwrap().unwrap();
    let stats = s.gpu_stats().unwrap().0;
    assert_eq!(stats.vmm_reserved_bytes - base.vmm_reserved_bytes, 12 * gran, "8 rows of 1.5 granules");
    assert_eq!(stats.vmm_mapped_bytes - base.vmm_mapped_bytes, 2 * gran, "1 row rounds up to 2 granules");
    assert_eq!(s.tensor_type(&t).unwrap().1, vec![1, row]);
    let first: Vec<f32> = (0..row).map(|i| (i % 1000) as f32).collect();
    s.write_elements(&t, 0, &kiln_host::genai::f32_tensor(vec![row], &first).unwrap()).unwrap();
    let err = s.view(&t, vec![2, row]).unwrap_err().to_string();
    assert!(err.contains("larger than its tensor"), "a view past the mapped rows: {err}");

    s.map_rows(&t, 5).unwrap();
    let grown = s.gpu_stats().unwrap().0;
    assert_eq!(s.device_address(&t).unwrap(), Some(at), "growing keeps the address");
    assert_eq!(grown.vmm_mapped_bytes - base.vmm_mapped_bytes, 8 * gran, "5 rows: 7.5 granules, rounded up");
    assert_eq!(grown.vmm_maps - base.vmm_maps, 2, "one chunk per growth");
    let whole = s.read_tensor(&t).unwrap().to_f32().unwrap();
    assert_eq!(whole.len(), 5 * row);
    assert_eq!(whole[..row], first[..], "the first row kept its values");
    assert!(whole[row..].iter().all(|&x| x == 0.0), "the new rows are zeros");
    let err = s.map_rows(&t, 9).unwrap_err().to_string();
    assert!(err.contains("reserved for 8"), "{err}");

    let v = s.view(&t, vec![5, row]).unwrap();
    let err = s.map_rows(&t, 1).unwrap_err().to_string();
    assert!(err.contains("still reads"), "a view of the rows being unmapped: {err}");
    drop(v);
    s.map_rows(&t, 1).unwrap();
    let shrunk = s.gpu_stats().unwrap().0;
    assert_eq!(shrunk.vmm_mapped_bytes - base.vmm_mapped_bytes, 2 * gran, "the second chunk is unmapped");
    assert_eq!(shrunk.vmm_unmaps - base.vmm_unmaps, 1);
    assert_eq!(s.read_tensor(&t).unwrap().to_f32().unwrap(), first, "the first row survives the shrink");
    assert_eq!(s.device_address(&t).unwrap(), Some(at));

    drop(t);
    s.reclaim();
    let after = s.gpu_stats().unwrap().0;
    assert_eq!((after.vmm_reserved_bytes, after.vmm_mapped_bytes), (base.vmm_reserved_bytes, base.vmm_mapped_bytes));
    assert_eq!(after.vmm_unmaps - base.vmm_unmaps, 2, "every chunk unmapped");
}

/// Arrivals every `every` steps: `n` prompts of 3 to 19 tokens, greedy and sampled in turn,
/// `new` tokens each.
fn arrivals(n: usize, every: usize, new: usize, vocab: usize) -> Vec<kiln_tests::Arrival> {
    use kiln_host::genai::SamplingParams;
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.8, top_k: 50, top_p: 0.9, repetition_penalty: 1.1, seed: 5 };
    let p = prompts(n, vocab);
    (0..n)
        .map(|i| kiln_tests::Arrival {
            at: i * every,
            prompt: p[i][..3 + 4 * (i % 5)].to_vec(),
            sampling: if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams { seed: i as u64, ..sampled.clone() }
            },
            max_new_tokens: new,
        })
        .collect()
}

/// The server's KV cache grows in place: on the SmolLM2-architecture fp16 folder with the VMM
/// chunk set to the device's granularity, 16 sequences join a 16-slot graph batch one every 24
/// steps, so the rows grow 1 → 2 → 4 → 8 → 16 over 600+ steps while the sequences grow to about
/// 640 positions of 2,048. Graph steps give exactly the eager steps' tokens (both at the same
/// rows), every step after each row count's first replays its graph, with no fallback, for both
/// kinds of shared cache, which give the same tokens:
/// - paged (kiln-attention reads paged caches): one reservation of 16 row regions of 32 pages
///   (64 positions of all 60 cache tensors, 1.4 MiB) each; every row maps as the shared column
///   grows (3 chunk boundaries crossed along positions at least), so at the end less than half
///   the reservation is mapped;
/// - by rows: each cache tensor reserved for 16 rows of 768 KiB and mapped by rows (4 chunks
///   per tensor at least).
///
/// Dropped, the batch unmaps every chunk.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_continuous_batchs_kv_cache_grows_in_place_over_chunks_on_graphs() {
    use kiln_host::ep::{GraphMode, KvPages, PageGeometry};
    use kiln_host::genai::{Generator, ModelFolder};
    let folder = device_models().join("smollm2-arch-fp16-cuda");
    let generator = |graphs, paged| {
        let options = SessionOptions { graphs, vmm_chunk_bytes: 0, ..cuda() };
        let mut g = Generator::new(runtime(), ModelFolder::open(&folder).unwrap(), options).unwrap();
        assert_eq!(g.set_paged_kv(paged), paged, "kiln-attention takes paged caches");
        g
    };
    let gran = kiln_host::cuda::granularity(0).unwrap();
    let mut tokens = Vec::new();
    for paged in [true, false] {
        let (mut eager, mut graph) = (generator(GraphMode::Off, paged), generator(GraphMode::On, paged));
        let vocab = eager.folder.config.model.vocab_size;
        let d = eager.folder.config.model.decoder.clone();
        let tensors = 2 * d.num_hidden_layers as u64;
        let work = arrivals(16, 24, 250, vocab);
        let (_, want) = kiln_tests::run_continuous_batch(&mut eager, 16, 2048, &work);
        let before = (graph.session.report.graphs.clone(), graph.session.gpu_stats().unwrap().0);
        let (batch, got) = kiln_tests::run_continuous_batch(&mut graph, 16, 2048, &work);
        let (after, mem) = (&graph.session.report.graphs, graph.session.gpu_stats().unwrap().0);
        let stats = batch.stats();
        println!("paged {paged}: {stats:?}; {mem:?}; {after:?}");
        assert_eq!(got, want, "paged {paged}: graph vs eager tokens");
        assert!(stats.steps >= 512, "{stats:?}");
        assert!(stats.transitions >= 4, "the rows grew 1 → 16: {stats:?}");
        assert_eq!(after.fallbacks, before.0.fallbacks, "no fallback: {after:?}");
        let replays = after.replays - before.0.replays;
        assert!(replays + 1 + 2 * stats.transitions >= stats.steps, "a replay per step: {stats:?} {after:?}");
        let (reserved, mapped, maps) = (
            mem.vmm_reserved_bytes - before.1.vmm_reserved_bytes,
            mem.vmm_mapped_bytes - before.1.vmm_mapped_bytes,
            mem.vmm_maps - before.1.vmm_maps,
        );
        if paged {
            let shape = KvPages {
                tensors: tensors as usize,
                rows: 16,
                kv_heads: d.num_key_value_heads,
                positions: 2048,
                head_size: d.head_size,
            };
            let g = PageGeometry::new(shape, 2, gran).unwrap();
            assert_eq!(g.page_stride * 2, 1440 << 10, "1.4 MiB per page");
            assert_eq!(reserved, g.reserved_bytes(), "one reservation of 16 rows");
            // Each row's first map covers what it needs then; every later one is a page crossing.
            assert!(maps >= 16 + 3 * 16, "3 growths along positions per row at least: {mem:?}");
            assert!(mapped < reserved / 2, "the rows map their positions, not max_length's: {mem:?}");
        } else {
            let row = (d.num_key_value_heads * 2048 * d.head_size * 2) as u64;
            assert_eq!(row, 768 << 10, "768 KiB per row of a layer's key or value");
            assert_eq!(reserved, tensors * (16 * row).div_ceil(gran) * gran, "16 rows per tensor");
            assert!(maps >= 4 * tensors, "4 chunks per tensor at least: {mem:?}");
        }
        drop(batch);
        graph.session.reclaim();
        let now = graph.session.gpu_stats().unwrap().0;
        assert_eq!(
            (now.vmm_reserved_bytes, now.vmm_mapped_bytes),
            (before.1.vmm_reserved_bytes, before.1.vmm_mapped_bytes),
            "dropped, all unmapped"
        );
        tokens.push(got);
    }
    assert_eq!(tokens[0], tokens[1], "paged and by-rows caches give the same tokens");
}

/// A KV cache's growth that `--device-memory-limit` refuses: a batch on the SmolLM2-architecture
/// fp16 folder (45 MiB of KV per row at 2,048 positions) limited to about what one sequence
/// needs plus 200 MiB refuses 15 sequences joining beside the running one with an
/// out-of-memory error that names the KV cache's growth; the running sequence goes on to the
/// tokens it gets without the refused join, and the batch then takes a new sequence.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_kv_cache_growth_over_the_memory_limit_is_refused_and_the_batch_goes_on() {
    use kiln_host::ep::GraphMode;
    use kiln_host::genai::{ContinuousBatch, Generator, Join, ModelFolder};
    let folder = device_models().join("smollm2-arch-fp16-cuda");
    let generator = |limit| {
        let options = SessionOptions { graphs: GraphMode::On, device_memory_limit: limit, ..cuda() };
        Generator::new(runtime(), ModelFolder::open(&folder).unwrap(), options).unwrap()
    };
    let mut free = generator(None);
    let vocab = free.folder.config.model.vocab_size;
    let work = arrivals(16, 0, 40, vocab);
    let (_, alone) = kiln_tests::run_continuous_batch(&mut free, 16, 2048, &work[..1]);
    let peak = free.session.gpu_stats().unwrap().0.peak_bytes;
    drop(free);

    let mut g = generator(Some(peak + (200 << 20)));
    let mut batch = ContinuousBatch::new(&mut g, 16, Some(2048)).unwrap();
    fn join(a: &kiln_tests::Arrival) -> Join<'_> {
        Join { prompt: &a.prompt, sampling: &a.sampling, max_new_tokens: a.max_new_tokens, ignore_eos: true }
    }
    let first = batch.join(&mut g, join(&work[0])).unwrap();
    let mut tokens = vec![first.token];
    for _ in 0..5 {
        tokens.extend(batch.step(&mut g).unwrap().iter().map(|e| e.token));
    }
    let joins: Vec<Join<'_>> = work[1..].iter().map(join).collect();
    let err = batch.join_many(&mut g, &joins).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, kiln_host::Error::OutOfMemory(_)), "{err:?}");
    assert!(text.contains("KV cache cannot grow") && text.contains("device memory limit"), "{text}");
    while batch.active() > 0 || batch.in_flight() {
        tokens.extend(batch.step(&mut g).unwrap().iter().map(|e| e.token));
    }
    assert_eq!(tokens, alone[0].1, "the running sequence's tokens");
    let next = batch.join(&mut g, join(&work[2])).unwrap();
    let mut more = vec![next.token];
    while batch.active() > 0 || batch.in_flight() {
        more.extend(batch.step(&mut g).unwrap().iter().map(|e| e.token));
    }
    assert_eq!(more.len(), 40, "a new sequence after the refusal");
}

/// tests/real-models on the GPU (the packages' CUDA kernels: direct convolutions, pooling,
/// HardSwish, the BERT encoder's attention and layer norms): max|Δ| ≤ 1e-3·max|ref| of
/// onnxruntime's CPU outputs and the same top-5 classes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn small_real_models_match_onnxruntime_on_the_gpu() {
    let checked = kiln_tests::check_real_models(&kiln_tests::root().join("tests/real-models"), &cuda());
    assert_eq!(checked.len(), 2, "{checked:?}");
    println!("{checked:?}");
}

/// The full-size models of scripts/make-big-models.py on the GPU, from the folder
/// `KILN_BIG_MODELS` names (made on the GPU machine; too large to travel): max|Δ| ≤
/// 1e-3·max|ref| of onnxruntime's CPU outputs, the same top-5 classes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn big_real_models_match_onnxruntime_on_the_gpu() {
    let Some(dir) = std::env::var_os("KILN_BIG_MODELS") else {
        panic!("set KILN_BIG_MODELS to scripts/make-big-models.py's folder");
    };
    println!("{:?}", kiln_tests::check_real_models(std::path::Path::new(&dir), &cuda()));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_convolutions_on_the_gpu_match_the_unfused_graph_on_the_cpu() {
    // kiln-conv's fusions (Conv + Relu, Conv + Add + Relu, with and without bias): each pattern
    // fused on the GPU (conv.cu's epilogue) against the unfused ops on the CPU, as `kiln verify`.
    let rt = runtime();
    let pkg = rt.registry.packages().find(|p| p.manifest.package.name == "kiln-conv").expect("kiln-conv").clone();
    let cases = kiln_host::cli::verify_fusion::fusion_cases(&rt, &pkg, Device::Cuda(0), 2);
    assert!(cases.len() >= 4 * 3, "{} cases", cases.len());
    for c in &cases {
        assert!(
            matches!(c.outcome, Outcome::Passed),
            "{} {}: {:?} (max rel error {})",
            c.fusion,
            c.dtype,
            c.outcome,
            c.max_rel_error
        );
    }
}

/// A float tensor of ONNX dtype `dtype` (1 float32, 10 float16, else bfloat16) from f64 values.
fn float_tensor(dtype: i32, shape: &[usize], v: &[f64]) -> kiln_host::Tensor {
    let (d, bytes): (kiln_kernel_abi::DType, Vec<u8>) = match dtype {
        1 => (kiln_kernel_abi::DType::F32, v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()),
        10 => (kiln_kernel_abi::DType::F16, v.iter().flat_map(|x| half::f16::from_f64(*x).to_le_bytes()).collect()),
        _ => (kiln_kernel_abi::DType::BF16, v.iter().flat_map(|x| half::bf16::from_f64(*x).to_le_bytes()).collect()),
    };
    kiln_host::Tensor::new(d, shape.to_vec(), bytes.into()).unwrap()
}

/// A model at ONNX dtype `dtype`: `nodes` over graph inputs `inputs` (name, shape, values) and
/// initializers `inits`, outputs `outputs` (shapes left to inference).
fn float_model(
    dtype: i32,
    nodes: Vec<kiln_tests::onnx::NodeProto>,
    inputs: &[(&str, Vec<usize>, Vec<f64>)],
    inits: &[(&str, Vec<usize>, Vec<f64>)],
    outputs: &[&str],
) -> kiln_host::model::Model {
    use kiln_tests::onnx;
    let tensor = |shape: &[usize], v: &[f64]| float_tensor(dtype, shape, v);
    let dims = |s: &[usize]| s.iter().map(|&d| d as i64).collect::<Vec<_>>();
    let decl = inputs.iter().map(|(n, s, _)| onnx::value(n, dtype, &dims(s))).collect();
    // Weights as initializers: the fusions need their dtype at load.
    let inits = inits
        .iter()
        .map(|(n, s, v)| onnx::TensorProto {
            name: n.to_string(),
            dims: dims(s),
            data_type: dtype,
            raw_data: tensor(s, v).data.to_vec(),
            ..Default::default()
        })
        .collect();
    let mut m = onnx::model(nodes, decl, outputs.iter().map(|o| onnx::value(o, dtype, &[])).collect(), inits);
    for o in m.graph.as_mut().unwrap().output.iter_mut() {
        o.type_.as_mut().unwrap().mut_tensor_type().shape.clear();
    }
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

/// A convolution model at ONNX dtype `dtype` on `options` ([`float_model`]; inputs on a grid of
/// 1/16, exact in every float dtype), run once from the host. Returns the outputs as f64 and the
/// session's convolution report.
fn conv_model(
    options: &SessionOptions,
    dtype: i32,
    nodes: Vec<kiln_tests::onnx::NodeProto>,
    inputs: &[(&str, Vec<usize>, Vec<f64>)],
    inits: &[(&str, Vec<usize>, Vec<f64>)],
    outputs: &[&str],
) -> (Vec<Vec<f64>>, kiln_host::trace::ConvStats) {
    let m = float_model(dtype, nodes, inputs, inits, outputs);
    let mut s = Session::new(runtime(), m, options.clone()).unwrap();
    let feeds = inputs.iter().map(|(n, sh, v)| (n.to_string(), float_tensor(dtype, sh, v))).collect();
    let out = s.run(feeds).unwrap_or_else(|e| panic!("dtype {dtype} on {:?}: {e}", options.device));
    let values = out.iter().map(|(_, t)| t.to_f32().unwrap().into_iter().map(f64::from).collect()).collect();
    (values, s.report.convolutions.clone())
}

/// Conv and ConvTranspose through cuDNN (ABI.md §4.8): float32 and float16 (bfloat16 with a bias
/// runs kiln-conv's kernels, the reason reported), 1-D to 3-D, groups, strides, dilations, output
/// padding, and ConvRelu / ConvAddRelu (cuDNN's fused bias and
/// activation, or its steps one by one) give the CPU reference's values (the host's im2col GEMMs;
/// on these exact grid values float32 sums agree but for Winograd's rounding); asymmetric padding
/// runs kiln-conv's own kernels with the reason in the report. With `--cudnn off` every one runs
/// kiln-conv's kernels, the report saying so, with the same values.
#[test]
#[ignore = "needs a CUDA GPU"]
fn convolutions_run_through_cudnn_and_fall_back_to_the_packages_kernels_with_the_reason() {
    use kiln_tests::onnx::{attr_int, attr_ints, attr_string, node};
    let lib = kiln_host::cuda::cudnn_library().unwrap_or_else(|why| panic!("cuDNN: {why}"));
    println!("{lib}");
    let mut rng = kiln_tests::Rng(31);
    let mut v = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.int(-32, 32) as f64 / 16.0).collect() };
    struct Case {
        what: &'static str,
        op: &'static str,
        x: Vec<usize>,
        w: Vec<usize>,
        out_ch: usize,
        attrs: Vec<kiln_tests::onnx::AttributeProto>,
        /// Whether cuDNN takes it (else: the fallback's reason contains this).
        declined: Option<&'static str>,
    }
    let cases = vec![
        Case {
            what: "2-D, groups, strides, dilations",
            op: "Conv",
            x: vec![2, 4, 13, 12],
            w: vec![6, 2, 3, 3],
            out_ch: 6,
            attrs: vec![
                attr_int("group", 2),
                attr_ints("strides", &[2, 1]),
                attr_ints("dilations", &[1, 2]),
                attr_ints("pads", &[1, 2, 1, 2]),
            ],
            declined: None,
        },
        Case {
            what: "ResNet's stem: 7×7 stride 2",
            op: "Conv",
            x: vec![1, 3, 32, 32],
            w: vec![16, 3, 7, 7],
            out_ch: 16,
            attrs: vec![attr_ints("strides", &[2, 2]), attr_ints("pads", &[3, 3, 3, 3])],
            declined: None,
        },
        Case {
            what: "1-D",
            op: "Conv",
            x: vec![2, 3, 17],
            w: vec![4, 3, 5],
            out_ch: 4,
            attrs: vec![attr_ints("pads", &[2, 2])],
            declined: None,
        },
        Case {
            what: "3-D",
            op: "Conv",
            x: vec![1, 2, 5, 6, 4],
            w: vec![4, 2, 3, 3, 3],
            out_ch: 4,
            attrs: vec![attr_ints("pads", &[1, 1, 1, 1, 1, 1])],
            declined: None,
        },
        Case {
            what: "depthwise, stride 2",
            op: "Conv",
            x: vec![1, 8, 9, 9],
            w: vec![8, 1, 3, 3],
            out_ch: 8,
            attrs: vec![attr_int("group", 8), attr_ints("strides", &[2, 2]), attr_ints("pads", &[1, 1, 1, 1])],
            declined: None,
        },
        Case {
            what: "SAME_UPPER, stride 2 (padding 0 before, 1 after)",
            op: "Conv",
            x: vec![1, 3, 8, 8],
            w: vec![4, 3, 3, 3],
            out_ch: 4,
            attrs: vec![attr_string("auto_pad", "SAME_UPPER"), attr_ints("strides", &[2, 2])],
            declined: Some("same on both sides"),
        },
        Case {
            what: "transposed, groups, strides, output padding",
            op: "ConvTranspose",
            x: vec![2, 4, 5, 4],
            w: vec![4, 3, 3, 3],
            out_ch: 6,
            attrs: vec![
                attr_int("group", 2),
                attr_ints("strides", &[2, 2]),
                attr_ints("output_padding", &[1, 1]),
                attr_ints("pads", &[1, 1, 1, 1]),
            ],
            declined: None,
        },
        Case {
            what: "transposed 1-D, dilations",
            op: "ConvTranspose",
            x: vec![1, 2, 7],
            w: vec![2, 3, 3],
            out_ch: 3,
            attrs: vec![attr_ints("dilations", &[2])],
            declined: None,
        },
    ];
    let cpu = SessionOptions::default();
    let gpu = cuda();
    let off = SessionOptions { cudnn: kiln_host::ep::CudnnMode::Off, ..cuda() };
    for c in &cases {
        let (x, w, b) = (v(c.x.iter().product()), v(c.w.iter().product()), v(c.out_ch));
        let inputs = [("x", c.x.clone(), x), ("w", c.w.clone(), w), ("b", vec![c.out_ch], b)];
        for dtype in [1, 10, 16] {
            let nodes = || vec![node(c.op, &["x", "w", "b"], &["y"], c.attrs.clone())];
            let (want, _) = conv_model(&cpu, dtype, nodes(), &inputs, &[], &["y"]);
            let scale = want[0].iter().fold(1f64, |m, v| m.max(v.abs()));
            // float32: Winograd's and FFT's transforms round; the 16-bit types round their output.
            let tol = match dtype {
                1 => 1e-5 * scale,
                10 => 2f64.powi(-10) * scale * 2.0,
                _ => 2f64.powi(-7) * scale * 2.0,
            };
            for (options, mode) in [(&gpu, "cuDNN"), (&off, "off")] {
                let (got, report) = conv_model(options, dtype, nodes(), &inputs, &[], &["y"]);
                for (i, (g, w)) in got[0].iter().zip(&want[0]).enumerate() {
                    assert!(
                        (g - w).abs() <= tol,
                        "{} ({mode}, dtype {dtype}): element {i} is {g}, the CPU gives {w}",
                        c.what
                    );
                }
                let fallbacks: Vec<&String> = report.fallbacks.keys().collect();
                // Every case has a bias, which cuDNN takes for float32 and float16 only.
                let declined = if dtype == 16 { Some("bfloat16") } else { c.declined };
                match (mode, declined) {
                    ("cuDNN", None) => {
                        assert_eq!((report.library_dispatches, fallbacks.len()), (1, 0), "{}: {report:?}", c.what)
                    }
                    ("cuDNN", Some(why)) => {
                        assert_eq!(report.library_dispatches, 0, "{}", c.what);
                        assert!(fallbacks.len() == 1 && fallbacks[0].contains(why), "{}: {report:?}", c.what);
                    }
                    _ => {
                        assert_eq!(report.library_dispatches, 0, "{}", c.what);
                        assert_eq!(fallbacks, [&"turned off (--cudnn off)".to_string()], "{}", c.what);
                        assert!(report.render().contains("turned off (--cudnn off)"), "{}", report.render());
                    }
                }
            }
        }
    }
    // ConvRelu with a bias (cuDNN's fused bias + Relu), ConvAddRelu with a whole Z (fused, Z as
    // its second addend), ConvRelu without a bias (the product, then cudnnActivationForward).
    let nodes = || {
        let pads = attr_ints("pads", &[1, 1, 1, 1]);
        vec![
            node("Conv", &["x", "w", "b"], &["c1"], vec![pads.clone()]),
            node("Relu", &["c1"], &["y1"], vec![]),
            node("Conv", &["x", "w", "b"], &["c2"], vec![pads.clone()]),
            node("Add", &["c2", "z"], &["s"], vec![]),
            node("Relu", &["s"], &["y2"], vec![]),
            node("Conv", &["x", "w"], &["c3"], vec![pads, attr_ints("strides", &[2, 2])]),
            node("Relu", &["c3"], &["y3"], vec![]),
        ]
    };
    let inputs = [("x", vec![2, 8, 10, 10], v(1600)), ("z", vec![2, 16, 10, 10], v(3200))];
    let inits = [("w", vec![16, 8, 3, 3], v(1152)), ("b", vec![16], v(16))];
    for dtype in [1, 10] {
        let (want, _) = conv_model(&cpu, dtype, nodes(), &inputs, &inits, &["y1", "y2", "y3"]);
        let (got, report) = conv_model(&gpu, dtype, nodes(), &inputs, &inits, &["y1", "y2", "y3"]);
        assert_eq!(report.library_dispatches, 3, "{report:?}");
        for (o, (g, w)) in got.iter().zip(&want).enumerate() {
            let scale = w.iter().fold(1f64, |m, v| m.max(v.abs()));
            let tol = if dtype == 1 { 1e-5 * scale } else { 2f64.powi(-9) * scale };
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                assert!((a - b).abs() <= tol, "fused output {o} at dtype {dtype}, element {i}: {a} vs {b}");
            }
        }
    }
}

/// Channels-last convolutions in an execution plan (`ep::layout`): a ResNet-like float16 graph
/// (a stem whose output a MaxPool reads, two residual blocks, a GlobalAveragePool) run from held
/// tensors, so that it goes through a plan and is captured and replayed. The four convolutions
/// between the pool and the global pooling keep their values NHWC (the stem's output, the
/// pool's and the graph outputs stay NCHW, transformed in the workspace); their outputs match
/// the CPU's within float16 roundings, and the same graph with `--channels-last off` or in
/// float32 keeps every value NCHW. In bfloat16 (no cuDNN epilogue for it) every convolution
/// falls back to the package's kernels with its reason and matches the CPU within bfloat16
/// roundings.
#[test]
#[ignore = "needs a CUDA GPU"]
fn channels_last_convolutions_in_an_execution_plan_match_the_cpu() {
    use kiln_host::ep::{Feed, Fetch, GraphMode};
    use kiln_tests::onnx::{attr_ints, node};
    let mut rng = kiln_tests::Rng(47);
    let mut v = |n: usize, scale: f64| -> Vec<f64> { (0..n).map(|_| rng.int(-32, 32) as f64 / 32.0 * scale).collect() };
    let pads = || attr_ints("pads", &[1, 1, 1, 1]);
    let nodes = || {
        vec![
            node("Conv", &["x", "w0", "b0"], &["c0"], vec![pads()]),
            node("Relu", &["c0"], &["r0"], vec![]),
            node("MaxPool", &["r0"], &["p"], vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("strides", &[2, 2])]),
            node("Conv", &["p", "w1", "b1"], &["c1"], vec![]),
            node("Relu", &["c1"], &["a1"], vec![]),
            node("Conv", &["a1", "w2", "b2"], &["c2"], vec![pads()]),
            node("Add", &["c2", "p"], &["d2"], vec![]),
            node("Relu", &["d2"], &["s1"], vec![]),
            node("Conv", &["s1", "w3", "b3"], &["c3"], vec![pads()]),
            node("Relu", &["c3"], &["a3"], vec![]),
            node("Conv", &["a3", "w4", "b4"], &["c4"], vec![pads()]),
            node("Add", &["c4", "s1"], &["d4"], vec![]),
            node("Relu", &["d4"], &["s2"], vec![]),
            node("GlobalAveragePool", &["s2"], &["g"], vec![]),
        ]
    };
    let inputs = [("x", vec![2, 8, 16, 16], v(4096, 1.0))];
    let inits = [
        ("w0", vec![16, 8, 3, 3], v(1152, 0.25)),
        ("b0", vec![16], v(16, 0.25)),
        ("w1", vec![16, 16, 1, 1], v(256, 0.5)),
        ("b1", vec![16], v(16, 0.25)),
        ("w2", vec![16, 16, 3, 3], v(2304, 0.125)),
        ("b2", vec![16], v(16, 0.25)),
        ("w3", vec![16, 16, 3, 3], v(2304, 0.125)),
        ("b3", vec![16], v(16, 0.25)),
        ("w4", vec![16, 16, 3, 3], v(2304, 0.125)),
        ("b4", vec![16], v(16, 0.25)),
    ];
    let outputs = ["s2", "g"];
    let run = |options: SessionOptions, dtype: i32| {
        let mut s = Session::new(runtime(), float_model(dtype, nodes(), &inputs, &inits, &outputs), options).unwrap();
        let x = float_tensor(dtype, &inputs[0].1, &inputs[0].2);
        let xin = s.zeros(x.dtype, x.shape.clone()).unwrap();
        s.write_tensor(&xin, &x).unwrap();
        let d = x.dtype;
        let held = [s.zeros(d, vec![2, 16, 8, 8]).unwrap(), s.zeros(d, vec![2, 16, 1, 1]).unwrap()];
        let mut got = Vec::new();
        for _ in 0..3 {
            let fetch: Vec<_> = outputs.iter().zip(&held).map(|(n, h)| (*n, Fetch::Into(h))).collect();
            s.run_with(vec![("x".into(), Feed::Device(&xin))], &fetch).unwrap();
            got = held.iter().map(|h| s.read_tensor(h).unwrap().to_f32().unwrap()).collect::<Vec<_>>();
        }
        let g = &s.report.graphs;
        assert_eq!((g.plans_built, g.captures, g.replays), (1, 1, 2), "dtype {dtype}: {g:?}");
        (got, s.report.convolutions.clone())
    };
    let cpu = |dtype: i32| {
        let m = float_model(dtype, nodes(), &inputs, &inits, &outputs);
        let mut s = Session::new(runtime(), m, SessionOptions::default()).unwrap();
        let out = s.run(vec![("x".into(), float_tensor(dtype, &inputs[0].1, &inputs[0].2))]).unwrap();
        out.iter().map(|(_, t)| t.to_f32().unwrap()).collect::<Vec<_>>()
    };
    let graphs = || SessionOptions { graphs: GraphMode::Auto, ..cuda() };
    // float16 (10): five convolutions through cuDNN, four channels-last. bfloat16 (16): cuDNN's
    // tensor ops take no bfloat16 bias, residual or Relu here, so every convolution (each has
    // one) runs the package's kernels, reported with that reason, and nothing is channels-last;
    // its unit roundoff is 2⁻⁸ where float16's is 2⁻¹¹.
    for (dtype, eps, cudnn, last_convs) in [(10, 2f32.powi(-11), 5, 4), (16, 2f32.powi(-8), 0, 0)] {
        let cpu = cpu(dtype);
        let (last, report) = run(graphs(), dtype);
        assert_eq!((report.library_dispatches, report.channels_last), (cudnn, last_convs), "dtype {dtype}: {report:?}");
        if dtype == 10 {
            assert!(report.render().contains("4 compute channels-last"), "{}", report.render());
        } else {
            let reason = "unsupported: a bfloat16 convolution's bias, residual or Relu";
            let fell_back: u64 = report.fallbacks.iter().filter(|(r, _)| r.starts_with(reason)).map(|(_, n)| *n).sum();
            assert_eq!(fell_back, 5, "dtype {dtype}: {report:?}");
        }
        let (first, report_off) = run(SessionOptions { channels_last: false, ..graphs() }, dtype);
        assert_eq!(
            (report_off.library_dispatches, report_off.channels_last),
            (cudnn, 0),
            "dtype {dtype}: {report_off:?}"
        );
        for (o, name) in outputs.iter().enumerate() {
            let scale = cpu[o].iter().fold(1f32, |m, x| m.max(x.abs()));
            // Five 16-bit layers, each output rounded once on both devices: a few roundings of
            // the largest value.
            let tol = 8.0 * eps * scale;
            for (what, got) in [("channels-last", &last[o]), ("NCHW", &first[o])] {
                let d = max_abs_diff(got, &cpu[o]);
                assert!(d <= tol, "dtype {dtype}, {name} ({what}): max |Δ| {d} against the CPU, tolerance {tol}");
            }
        }
    }
    let (_, report32) = run(graphs(), 1);
    assert_eq!((report32.library_dispatches, report32.channels_last), (5, 0), "{report32:?}");
}
