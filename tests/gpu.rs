//! GPU tests (the H200 machine: `.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst
//! --workspace-remap . --run-ignored all`). Each needs a CUDA GPU and says so when ignored.

use kiln_host::conformance::{run_test, summary, test_dirs, Outcome};
use kiln_host::ep::{Device, Runtime, Session, SessionOptions};
use kiln_host::sandbox::SandboxConfig;
use kiln_host::{model, packages, tensorio};

fn runtime() -> std::sync::Arc<Runtime> {
    let (reg, errors) = packages::registry(&[]);
    assert!(errors.is_empty(), "{errors:?}");
    Runtime::new(reg, SandboxConfig::default()).unwrap()
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
    use kiln_host::conformance::to_f64;
    use kiln_host::genai::{Generator, ModelFolder};
    use kiln_host::Tensor;
    let folder = "tiny-llama-v512-fp16-cuda";
    let refs = kiln_tests::fixture(&format!("llm/references/{folder}"));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(refs.join("ort_greedy.json")).unwrap()).unwrap();
    let mf = ModelFolder::open(&kiln_tests::fixture(&format!("llm/{folder}"))).unwrap();
    let mut g = Generator::new(runtime(), mf, cuda()).unwrap();
    let d = g.folder.config.model.decoder.clone();
    let vocab = g.folder.config.model.vocab_size;
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect::<Vec<i64>>();
    for prompt in doc["prompts"].as_array().unwrap() {
        let bin = std::fs::read(refs.join(prompt["logits_file"].as_str().unwrap())).unwrap();
        let reference: Vec<f32> = bin.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut tokens = ids(&prompt["prompt_token_ids"]);
        let generated = ids(&prompt["generated_token_ids"]);
        let mut past: Vec<(String, Tensor)> = Vec::new();
        for l in 0..d.num_hidden_layers {
            for tmpl in [&d.inputs.past_key_names, &d.inputs.past_value_names] {
                let shape = vec![1, d.num_key_value_heads, 0, d.head_size];
                past.push((
                    tmpl.replace("%d", &l.to_string()),
                    Tensor::new(g.folder.kv_dtype, shape, Vec::new().into()).unwrap(),
                ));
            }
        }
        let mut feed = tokens.clone();
        let steps = reference.len() / vocab;
        for step in 0..steps {
            let (logits, next) = g.step(&feed, 1, &vec![1i64; tokens.len()], past).unwrap();
            past = next;
            let all = to_f64(&logits);
            let last = &all[all.len() - vocab..];
            let want = &reference[step * vocab..(step + 1) * vocab];
            let max_diff = last.iter().zip(want).map(|(a, b)| (a - *b as f64).abs()).fold(0.0, f64::max);
            assert!(max_diff <= 0.15, "{} step {step}: max |Δlogit| {max_diff}", prompt["prompt_id"]);
            let ref_argmax = prompt["steps"][step]["argmax"].as_i64().unwrap() as usize;
            let above = last.iter().filter(|v| **v > last[ref_argmax]).count();
            assert!(above <= 1, "{} step {step}: the reference argmax is not in kiln's top 2", prompt["prompt_id"]);
            if step + 1 < steps {
                feed = vec![generated[step]];
                tokens.push(generated[step]);
            }
        }
    }
}
