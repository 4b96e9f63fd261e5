//! Helpers shared by the integration tests.

use std::path::PathBuf;

use bytes::Bytes;
use kiln_host::Tensor;
use kiln_kernel_abi::DType;

pub mod isolate;
pub mod mutate;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The version of the built-in package in `kernels/<dir>` as its manifest states it, so that
/// tests which name a built-in package by `name@version` follow its version bumps.
pub fn builtin_version(dir: &str) -> String {
    let path = root().join("kernels").join(dir).join("kernel.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    kiln_kernel_abi::manifest::Manifest::parse(&text).unwrap().package.version.to_string()
}

/// A float32 tensor.
pub fn f32_tensor(shape: &[usize], values: &[f32]) -> Tensor {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Tensor::new(DType::F32, shape.to_vec(), Bytes::from(data)).expect("consistent tensor")
}

/// The elements of a float32 tensor.
pub fn f32_values(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype, DType::F32);
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The folder of ONNX 1.20.0's node tests, fetched into `.cache/` on first use by
/// `scripts/fetch-onnx-node-tests.sh` (pip download of the onnx wheel, unzip of the tests).
pub fn onnx_node_tests() -> PathBuf {
    let dir = root().join(".cache/onnx-node-1.20.0/node");
    if !dir.join("test_relu/model.onnx").is_file() {
        let script = root().join("scripts/fetch-onnx-node-tests.sh");
        let status = std::process::Command::new("bash").arg(&script).status();
        assert!(
            matches!(status, Ok(s) if s.success()) && dir.is_dir(),
            "the ONNX node tests are missing from {} and {} could not fetch them (it needs python3 -m pip and \
             network access to PyPI); run it by hand",
            dir.display(),
            script.display()
        );
    }
    dir
}

/// Building small ONNX models in tests.
pub mod onnx {
    pub use onnx_protobuf::*;
    use protobuf::{EnumOrUnknown, MessageField};

    /// A node `op(inputs) -> outputs` with attributes.
    pub fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
        NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: attrs,
            ..Default::default()
        }
    }

    pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::INTS),
            ints: v.to_vec(),
            ..Default::default()
        }
    }

    pub fn attr_int(name: &str, v: i64) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::INT),
            i: v,
            ..Default::default()
        }
    }

    pub fn attr_float(name: &str, v: f32) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::FLOAT),
            f: v,
            ..Default::default()
        }
    }

    pub fn attr_string(name: &str, v: &str) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::STRING),
            s: v.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    /// A tensor attribute (Constant's `value`).
    pub fn attr_tensor(name: &str, t: TensorProto) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::TENSOR),
            t: MessageField::some(t),
            ..Default::default()
        }
    }

    /// A subgraph attribute (If's branches, Loop's and Scan's body).
    pub fn attr_graph(name: &str, g: GraphProto) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            type_: EnumOrUnknown::new(attribute_proto::AttributeType::GRAPH),
            g: MessageField::some(g),
            ..Default::default()
        }
    }

    /// A graph (a subgraph, or a model's) without initializers.
    pub fn graph(
        name: &str,
        nodes: Vec<NodeProto>,
        inputs: Vec<ValueInfoProto>,
        outputs: Vec<ValueInfoProto>,
    ) -> GraphProto {
        GraphProto { name: name.into(), node: nodes, input: inputs, output: outputs, ..Default::default() }
    }

    /// A tensor value declaration: ONNX dtype code and dims (negative = symbolic "n").
    pub fn value(name: &str, dtype: i32, dims: &[i64]) -> ValueInfoProto {
        let dim = dims
            .iter()
            .map(|&d| tensor_shape_proto::Dimension {
                value: Some(if d >= 0 {
                    tensor_shape_proto::dimension::Value::DimValue(d)
                } else {
                    tensor_shape_proto::dimension::Value::DimParam("n".into())
                }),
                ..Default::default()
            })
            .collect();
        ValueInfoProto {
            name: name.into(),
            type_: MessageField::some(TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: dtype,
                    shape: MessageField::some(TensorShapeProto { dim, ..Default::default() }),
                    ..Default::default()
                })),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A float32 initializer.
    pub fn init_f32(name: &str, dims: &[i64], v: &[f32]) -> TensorProto {
        TensorProto {
            name: name.into(),
            data_type: 1,
            dims: dims.to_vec(),
            float_data: v.to_vec(),
            ..Default::default()
        }
    }

    /// An int64 initializer.
    pub fn init_i64(name: &str, dims: &[i64], v: &[i64]) -> TensorProto {
        TensorProto {
            name: name.into(),
            data_type: 7,
            dims: dims.to_vec(),
            int64_data: v.to_vec(),
            ..Default::default()
        }
    }

    /// A model with one graph, opset 21 of ai.onnx.
    pub fn model(
        nodes: Vec<NodeProto>,
        inputs: Vec<ValueInfoProto>,
        outputs: Vec<ValueInfoProto>,
        inits: Vec<TensorProto>,
    ) -> ModelProto {
        ModelProto {
            ir_version: 10,
            opset_import: vec![OperatorSetIdProto { domain: String::new(), version: 21, ..Default::default() }],
            graph: MessageField::some(GraphProto {
                name: "g".into(),
                node: nodes,
                input: inputs,
                output: outputs,
                initializer: inits,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub fn bytes(m: &ModelProto) -> Vec<u8> {
        protobuf::Message::write_to_bytes(m).expect("serializable")
    }
}

/// The shared fixtures folder: `KILN_FIXTURES`, or `../shared/fixtures` beside the repository.
/// Fails with what to do when it or `sub` is missing.
pub fn fixture(sub: &str) -> PathBuf {
    let base =
        std::env::var_os("KILN_FIXTURES").map(PathBuf::from).unwrap_or_else(|| root().join("../shared/fixtures"));
    let path = base.join(sub);
    assert!(
        path.exists(),
        "fixture {} is missing: set KILN_FIXTURES to the shared fixtures folder (default ../shared/fixtures; see its README.md)",
        path.display()
    );
    path
}

/// A runtime with the built-in packages (and no load errors).
pub fn builtin_runtime() -> std::sync::Arc<kiln_host::ep::Runtime> {
    let (reg, errors) = kiln_host::packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    // Compiled shims are cached under target/, so that only the first test compiles them.
    let config = kiln_host::sandbox::SandboxConfig {
        module_cache: Some(root().join("target/kiln-test-shims")),
        ..kiln_host::sandbox::SandboxConfig::default()
    };
    kiln_host::ep::Runtime::new(reg, config).expect("runtime")
}

/// Real models in `dir` (ONNX's backend test layout: tests/real-models, made by
/// scripts/make-real-models.py, or the full-size ones of scripts/make-big-models.py), each run
/// on its inputs with `options`: every output within 1e-3·max|ref| of onnxruntime's (the
/// general-ONNX issue's criterion), and a classifier's top-5 classes (an output named `logits`)
/// those of the reference, row by row. Returns the models checked, with their largest error
/// relative to max|ref|.
pub fn check_real_models(dir: &std::path::Path, options: &kiln_host::ep::SessionOptions) -> Vec<(String, f64)> {
    use kiln_host::ep::Session;
    use kiln_host::tensorio::read_tensor_file;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "{} holds no model folder", dir.display());
    let rt = builtin_runtime();
    let files = |d: &std::path::Path, prefix: &str| -> Vec<(Tensor, String)> {
        let set = d.join("test_data_set_0");
        (0..)
            .map(|k| set.join(format!("{prefix}_{k}.pb")))
            .take_while(|p| p.is_file())
            .map(|p| read_tensor_file(&p).unwrap())
            .collect()
    };
    let mut checked = Vec::new();
    for d in dirs {
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        let m = kiln_host::model::load(&d.join("model.onnx")).unwrap();
        let mut s = Session::new(rt.clone(), m, options.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let feeds = files(&d, "input").into_iter().map(|(t, n)| (n, t)).collect();
        let outs = s.run(feeds).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut worst = 0f64;
        for (want, out_name) in files(&d, "output") {
            let got = &outs.iter().find(|(n, _)| *n == out_name).unwrap_or_else(|| panic!("{name}: no {out_name}")).1;
            assert_eq!(got.shape, want.shape, "{name}: {out_name}");
            let (g, w) = (f32_values(got), f32_values(&want));
            let scale = w.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
            let err = g.iter().zip(&w).fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
            assert!(err <= 1e-3 * scale, "{name}: {out_name}: max|Δ| {err} over 1e-3 · max|ref| {scale}");
            worst = worst.max(err / scale);
            if out_name == "logits" {
                let classes = *want.shape.last().unwrap();
                let top5 = |v: &[f32]| {
                    let mut i: Vec<usize> = (0..v.len()).collect();
                    i.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
                    i.truncate(5);
                    i
                };
                for (r, (gr, wr)) in g.chunks(classes).zip(w.chunks(classes)).enumerate() {
                    assert_eq!(top5(gr), top5(wr), "{name}: row {r}'s top-5 classes");
                }
            }
        }
        checked.push((name, worst));
    }
    checked
}

/// One step of a teacher-forced run: kiln's and onnxruntime's last-position logits.
pub struct StepLogits<'a> {
    pub prompt: &'a str,
    pub step: usize,
    pub kiln: &'a [f64],
    pub reference: &'a [f32],
    /// onnxruntime's argmax at this step.
    pub reference_argmax: usize,
}

/// Runs `g` as the fixture references' `ort_greedy.json` ran onnxruntime (fixtures/README.md):
/// each prompt's prefill, then one decode step per reference token (teacher forcing), through
/// the generator's KV cache; calls `check` on every step's last-position logits.
pub fn teacher_forced(g: &mut kiln_host::genai::Generator, refs: &std::path::Path, mut check: impl FnMut(&StepLogits)) {
    let json = |p: PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).expect("reference")).expect("json")
    };
    let ids =
        |v: &serde_json::Value| -> Vec<i64> { v.as_array().expect("ids").iter().filter_map(|x| x.as_i64()).collect() };
    let doc = json(refs.join("ort_greedy.json"));
    let vocab = g.folder.config.model.vocab_size;
    for prompt in doc["prompts"].as_array().expect("prompts") {
        let name = prompt["prompt_id"].as_str().unwrap_or("?");
        let bin = std::fs::read(refs.join(prompt["logits_file"].as_str().expect("logits_file"))).expect("logits");
        let reference: Vec<f32> = bin.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let tokens = ids(&prompt["prompt_token_ids"]);
        let generated = ids(&prompt["generated_token_ids"]);
        let steps = reference.len() / vocab;
        let (mut kv, first) = g.prefill(std::slice::from_ref(&tokens), tokens.len() + steps).expect("prefill");
        let mut logits = first.into_iter().next().expect("one row");
        for step in 0..steps {
            let kiln: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
            check(&StepLogits {
                prompt: name,
                step,
                kiln: &kiln,
                reference: &reference[step * vocab..(step + 1) * vocab],
                reference_argmax: prompt["steps"][step]["argmax"].as_u64().expect("argmax") as usize,
            });
            if step + 1 < steps {
                logits =
                    g.decode(&mut kv, &[generated[step]]).expect("decode step").into_iter().next().expect("one row");
            }
        }
        g.free(kv);
    }
}

/// A seeded pseudo-random generator for test cases (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
    /// Uniform in `lo..=hi`.
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
    /// `len` values uniform in `[-1, 1)`, each from the top 24 bits of one draw (exact in f32).
    pub fn signed_unit(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect()
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
}

/// The host sampler's tokens for `prompts`: prefill, then one host-sampled decode step at a
/// time (logits downloaded), every row's history and step as `Generator::generate` keeps them.
pub fn host_sampled(
    g: &mut kiln_host::genai::Generator,
    prompts: &[Vec<i64>],
    params: &kiln_host::genai::SamplingParams,
    new: usize,
) -> Vec<Vec<i64>> {
    let rows: Vec<usize> = (0..prompts.len()).collect();
    host_sampled_rows(g, prompts, &rows, params, new)
}

/// As [`host_sampled`], with prompt `b`'s draws keyed as row `rows[b]` of a batch (the slot a
/// continuous batch gave it).
pub fn host_sampled_rows(
    g: &mut kiln_host::genai::Generator,
    prompts: &[Vec<i64>],
    rows: &[usize],
    params: &kiln_host::genai::SamplingParams,
    new: usize,
) -> Vec<Vec<i64>> {
    let sampler = kiln_host::genai::Sampler::new(params.clone());
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let (mut kv, mut logits) = g.prefill(prompts, longest + new).unwrap();
    let mut history = prompts.to_vec();
    let mut out = vec![Vec::new(); prompts.len()];
    for step in 0..new {
        let next: Vec<i64> =
            logits.iter().enumerate().map(|(b, l)| sampler.next(l, &history[b], rows[b], step)).collect();
        for (b, t) in next.iter().enumerate() {
            history[b].push(*t);
            out[b].push(*t);
        }
        if step + 1 < new {
            logits = g.decode(&mut kv, &next).unwrap();
        }
    }
    g.free(kv);
    out
}

/// One request of [`run_continuous_batch`]: it joins at step `at` (or, all slots taken, at the
/// first step after a slot frees).
pub struct Arrival {
    pub at: usize,
    pub prompt: Vec<i64>,
    pub sampling: kiln_host::genai::SamplingParams,
    pub max_new_tokens: usize,
}

/// Runs `arrivals` through a continuous batch of `rows` slots (sequences of at most
/// `max_length` positions, end-of-sequence ignored); returns each request's slot and tokens.
pub fn run_continuous_batch(
    g: &mut kiln_host::genai::Generator,
    rows: usize,
    max_length: usize,
    arrivals: &[Arrival],
) -> (kiln_host::genai::ContinuousBatch, Vec<(usize, Vec<i64>)>) {
    run_continuous_batch_with(g, rows, max_length, arrivals, false)
}

/// [`run_continuous_batch`], batch-invariant when `invariant` (the steps keep every slot's row).
pub fn run_continuous_batch_with(
    g: &mut kiln_host::genai::Generator,
    rows: usize,
    max_length: usize,
    arrivals: &[Arrival],
    invariant: bool,
) -> (kiln_host::genai::ContinuousBatch, Vec<(usize, Vec<i64>)>) {
    use kiln_host::genai::{ContinuousBatch, Join};
    let mut batch = ContinuousBatch::new(g, rows, Some(max_length)).unwrap();
    batch.set_batch_invariant(invariant);
    let mut out: Vec<(usize, Vec<i64>)> = vec![(usize::MAX, Vec::new()); arrivals.len()];
    let mut owner: Vec<Option<usize>> = vec![None; batch.capacity()];
    let (mut next, mut done, mut step) = (0, 0, 0);
    while done < arrivals.len() {
        while next < arrivals.len() && arrivals[next].at <= step && owner.iter().any(Option::is_none) {
            let a = &arrivals[next];
            let join =
                Join { prompt: &a.prompt, sampling: &a.sampling, max_new_tokens: a.max_new_tokens, ignore_eos: true };
            let e = batch.join(g, join).unwrap();
            out[next] = (e.slot, vec![e.token]);
            if e.finished.is_some() {
                done += 1;
            } else {
                owner[e.slot] = Some(next);
            }
            next += 1;
        }
        for e in batch.step(g).unwrap() {
            let r = owner[e.slot].expect("a token for a free slot");
            out[r].1.push(e.token);
            if e.finished.is_some() {
                owner[e.slot] = None;
                done += 1;
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
    }
    (batch, out)
}

/// Runs `seqs` (prompt and sampling each, `new` tokens, end-of-sequence ignored) through a new
/// continuous batch of `rows` slots (`invariant`: batch-invariant joins), all joining at once
/// in the order `order` gives; returns each sequence's tokens, in `seqs`' order.
pub fn run_joined_together(
    g: &mut kiln_host::genai::Generator,
    rows: usize,
    max_length: usize,
    seqs: &[(Vec<i64>, kiln_host::genai::SamplingParams)],
    order: &[usize],
    new: usize,
    invariant: bool,
) -> Vec<Vec<i64>> {
    use kiln_host::genai::{ContinuousBatch, Join};
    let mut batch = ContinuousBatch::new(g, rows, Some(max_length)).unwrap();
    batch.set_batch_invariant(invariant);
    let joins: Vec<Join> = order
        .iter()
        .map(|&i| Join { prompt: &seqs[i].0, sampling: &seqs[i].1, max_new_tokens: new, ignore_eos: true })
        .collect();
    let mut out = vec![Vec::new(); seqs.len()];
    let mut owner = vec![usize::MAX; batch.capacity()];
    for (e, &i) in batch.join_many(g, &joins).unwrap().iter().zip(order) {
        owner[e.slot] = i;
        out[i].push(e.token);
    }
    while batch.active() > 0 || batch.in_flight() {
        for e in batch.step(g).unwrap() {
            out[owner[e.slot]].push(e.token);
        }
    }
    out
}
