//! GPU tests (the H200 machine: `.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst
//! --workspace-remap . --run-ignored all`). Each needs a CUDA GPU and says so when ignored.

use kiln_host::conformance::{run_test, summary, test_dirs, Outcome};
use kiln_host::ep::{Device, Runtime, Session, SessionOptions};
use kiln_host::{model, tensorio};

fn runtime() -> std::sync::Arc<Runtime> {
    kiln_tests::builtin_runtime()
}

fn cuda() -> SessionOptions {
    assert!(kiln_host::cuda::device_count() > 0, "no CUDA GPU visible");
    SessionOptions { device: Device::Cuda(0), ..SessionOptions::default() }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_example_runs_on_the_gpu_and_matches_onnxruntime() {
    let root = kiln_tests::root();
    let m = model::load(&root.join("examples/mlp/model.onnx")).unwrap();
    let x = tensorio::read_tensor_file(&root.join("examples/mlp/x.npy")).unwrap().0;
    let want = tensorio::read_tensor_file(&root.join("examples/mlp/expected.npy")).unwrap().0;
    let mut s = Session::new(runtime(), m, cuda()).unwrap();
    for _ in 0..3 {
        let out = s.run(vec![("x".into(), x.clone())]).unwrap();
        assert_eq!(kiln_host::conformance::compare(&out[0].1, &want, 1e-3, 1e-5), None);
    }
    assert!(s.report.plan_hits > 0, "later runs reuse the launch plans: {:?}", s.report);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn onnx_node_tests_that_pass_on_the_cpu_pass_on_the_gpu() {
    let dir = kiln_tests::onnx_node_tests();
    let rt = runtime();
    let dirs = test_dirs(&dir, None).unwrap();
    let cpu: Vec<_> = dirs.iter().map(|d| run_test(&rt, d, &SessionOptions::default())).collect();
    let gpu: Vec<_> = dirs.iter().map(|d| run_test(&rt, d, &cuda())).collect();
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
