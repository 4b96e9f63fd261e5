//! onnxruntime-genai model folders on the CPU, against the shared fixtures' references
//! (fixtures/README.md): onnxruntime's logits for a prefill and 8 decode steps (max |Δ| ≤
//! 1e-3 × max |reference logit|, same argmax) and onnxruntime-genai's 32 greedy tokens.

use std::path::Path;

use kiln_host::ep::SessionOptions;
use kiln_host::genai::{GenerateOptions, Generator, ModelFolder, SamplingParams};
use kiln_tests::fixture;
use serde_json::Value;

fn generator(folder: &str) -> Generator {
    let rt = kiln_tests::builtin_runtime();
    let folder = ModelFolder::open(&fixture(&format!("llm/{folder}"))).unwrap();
    Generator::new(rt, folder, SessionOptions::default()).unwrap()
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

/// Prefill + 8 decode steps fed with the reference's tokens: max |Δlogit| ≤ 1e-3 × max
/// |reference logit| and the same argmax at every step.
fn teacher_forced_logits_match(folder: &str) {
    teacher_forced_logits_match_with(&mut generator(folder), folder);
}

fn teacher_forced_logits_match_with(g: &mut Generator, folder: &str) {
    kiln_tests::teacher_forced(g, &fixture(&format!("llm/references/{folder}")), |s| {
        let max_ref = s.reference.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let max_diff = s.kiln.iter().zip(s.reference).map(|(a, b)| (a - *b as f64).abs()).fold(0.0, f64::max);
        assert!(
            max_diff <= 1e-3 * max_ref,
            "{folder} {} step {}: max |Δlogit| {max_diff} > 1e-3 × {max_ref}",
            s.prompt,
            s.step
        );
        let argmax = s.kiln.iter().enumerate().fold(0, |b, (i, v)| if *v > s.kiln[b] { i } else { b });
        assert_eq!(argmax, s.reference_argmax, "{folder} {} step {}: argmax", s.prompt, s.step);
    });
}

/// onnxruntime-genai's greedy generation of 32 tokens, prompt by prompt and as one batch.
fn greedy_tokens_match(folder: &str, batched: bool) {
    greedy_tokens_match_with(&mut generator(folder), folder, batched);
}

fn greedy_tokens_match_with(g: &mut Generator, folder: &str, batched: bool) {
    let doc = json(&fixture(&format!("llm/references/{folder}/genai_greedy.json")));
    let runs = doc["runs"].as_array().unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 32,
        max_length: None,
        sampling: SamplingParams::default(),
        ignore_eos: false,
        stop: None,
    };
    let mut prompts = Vec::new();
    for run in runs {
        let text = run["prompt_text"].as_str().unwrap();
        let prompt_ids = g.folder.encode(text).unwrap();
        assert_eq!(prompt_ids, ids(&run["prompt_token_ids"]), "{folder}: tokenization of {text:?}");
        if run["prompt_kind"] == "chat" {
            // The chat template reproduces the reference's prompt text.
            let user = "What is the capital of France?";
            assert_eq!(g.folder.chat_prompt(user).unwrap(), text);
        }
        prompts.push(prompt_ids);
    }
    let results: Vec<_> = if batched {
        g.generate(&prompts, &opts, &mut |_, _| {}).unwrap().rows
    } else {
        prompts
            .iter()
            .map(|p| g.generate(std::slice::from_ref(p), &opts, &mut |_, _| {}).unwrap().rows.remove(0))
            .collect()
    };
    for (run, r) in runs.iter().zip(&results) {
        assert_eq!(
            r.generated_ids,
            ids(&run["generated_token_ids"]),
            "{folder} {} (batched: {batched})",
            run["prompt_id"]
        );
    }
}

#[test]
fn tiny_llama_fp32_matches_onnxruntime_logits() {
    teacher_forced_logits_match("tiny-llama-v512-fp32-cpu");
}

#[test]
fn tiny_llama_int4_matches_onnxruntime_logits() {
    teacher_forced_logits_match("tiny-llama-v512-int4-acc1-cpu");
}

#[test]
fn smollm2_int4_matches_onnxruntime_logits() {
    // Fused: kiln-matmul's `*-nbits` fusions take every MatMulNBits with the norm before it or
    // the SwiGLU between gate/up and down: per layer one RmsNormLinear for QKV, a Linear for the
    // output projection, RmsNormLinear over [gate | up] with the SwiGLU (swiglu = 1) and a Linear
    // for down; the final norm and the LM head one more RmsNormLinear.
    let mut g = generator("smollm2-135m-int4-acc1-cpu");
    let f = &g.session.report.fusions;
    let counts = f.applied_counts();
    for (name, n) in [
        ("skip-rmsnorm-mlp-nbits", 30),
        ("skip-rmsnorm-linear-nbits", 29),
        ("rmsnorm-linear-nbits", 1),
        ("linear-nbits", 30),
        ("skip-rmsnorm-linear-last-nbits", 1),
    ] {
        assert_eq!(counts.get(name), Some(&n), "{name}: {}", f.render());
    }
    let nodes = &g.session.model().graph.nodes;
    let ops = |op: &str| nodes.iter().filter(|n| n.op_type == op).count();
    assert_eq!((ops("RmsNormLinear"), ops("Linear"), ops("SwiGluLinear"), ops("MatMulNBits")), (61, 60, 0, 0));
    teacher_forced_logits_match_with(&mut g, "smollm2-135m-int4-acc1-cpu");
}

#[test]
fn tiny_llama_fp32_matches_genai_greedy_tokens_alone_and_batched() {
    greedy_tokens_match("tiny-llama-v512-fp32-cpu", false);
    greedy_tokens_match("tiny-llama-v512-fp32-cpu", true);
}

#[test]
fn fused_and_unfused_tiny_llama_fp32_both_match_onnxruntime() {
    // The default generator fuses each layer's norms and projections into kiln-matmul's
    // RmsNormLinear (gate/up's with the SwiGLU as its epilogue) and Linear (weights stored
    // [N, K]); with fusion off the graph runs as written.
    let folder = "tiny-llama-v512-fp32-cpu";
    let fused = generator(folder);
    let f = &fused.session.report.fusions;
    let counts = f.applied_counts();
    assert_eq!(counts.get("skip-rmsnorm-mlp"), Some(&2), "{}", f.render());
    assert_eq!(counts.get("linear"), Some(&2), "{}", f.render());
    assert_eq!(counts.get("rmsnorm-linear"), Some(&1), "{}", f.render());
    assert_eq!(counts.get("skip-rmsnorm-linear"), Some(&1), "{}", f.render());
    assert_eq!(counts.get("skip-rmsnorm-linear-last"), Some(&1), "{}", f.render());
    let rt = kiln_tests::builtin_runtime();
    let dir = ModelFolder::open(&fixture(&format!("llm/{folder}"))).unwrap();
    let mut unfused = Generator::new(rt, dir, SessionOptions { fuse: false, ..SessionOptions::default() }).unwrap();
    assert!(unfused.session.report.fusions.applied.is_empty());
    let ops = |g: &Generator, op: &str| g.session.model().graph.nodes.iter().filter(|n| n.op_type == op).count();
    assert_eq!((ops(&unfused, "MatMul"), ops(&fused, "MatMul")), (11, 0), "every MatMul is fused");
    // Per layer RmsNormLinear for QKV and for gate/up, Linear for the output and down
    // projections; the final norm and the LM head one more RmsNormLinear.
    assert_eq!((ops(&fused, "RmsNormLinear"), ops(&fused, "Linear"), ops(&fused, "SwiGluLinear")), (5, 4, 0));
    teacher_forced_logits_match_with(&mut unfused, folder);
    greedy_tokens_match_with(&mut unfused, folder, true);
}

#[test]
fn without_a_shared_buffer_the_past_grows_from_step_to_step() {
    // The same fixture with `past_present_share_buffer` off: each step's presents (kept by the
    // session) become the next step's pasts.
    let folder = "tiny-llama-v512-fp32-cpu";
    let mut g = generator(folder);
    g.folder.config.search.past_present_share_buffer = false;
    teacher_forced_logits_match_with(&mut g, folder);
    greedy_tokens_match_with(&mut g, folder, false);
}

#[test]
fn tiny_llama_int4_matches_genai_greedy_tokens() {
    greedy_tokens_match("tiny-llama-v512-int4-acc1-cpu", true);
}

#[test]
fn smollm2_int4_answers_the_capital_of_france_like_genai() {
    greedy_tokens_match("smollm2-135m-int4-acc1-cpu", false);
    let mut g = generator("smollm2-135m-int4-acc1-cpu");
    let prompt = g.folder.encode(&g.folder.chat_prompt("What is the capital of France?").unwrap()).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 10,
        max_length: None,
        sampling: SamplingParams::default(),
        ignore_eos: false,
        stop: None,
    };
    let out = g.generate(&[prompt], &opts, &mut |_, _| {}).unwrap();
    let text = g.folder.decode(&out.rows[0].generated_ids).unwrap();
    assert!(text.starts_with("The capital of France is Paris, capital of"), "{text:?}");
}

#[test]
fn a_bad_model_folder_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = |d: &Path| ModelFolder::open(d).err().expect("refused").to_string();
    assert!(err(&dir.path().join("nope")).contains("not a folder"));
    assert!(err(dir.path()).contains("genai_config.json"));
    let src = fixture("llm/tiny-llama-v512-fp32-cpu");
    for f in ["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    ModelFolder::open(dir.path()).unwrap();
    let cfg = std::fs::read_to_string(src.join("genai_config.json")).unwrap();
    std::fs::write(dir.path().join("genai_config.json"), cfg.replace("present.%d.key", "present_key.%d")).unwrap();
    assert!(err(dir.path()).contains("no output \"present_key.0\""), "{}", err(dir.path()));
    std::fs::write(dir.path().join("genai_config.json"), "{").unwrap();
    assert!(err(dir.path()).contains("genai_config.json"));
    std::fs::write(dir.path().join("genai_config.json"), cfg).unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "not json").unwrap();
    assert!(err(dir.path()).contains("tokenizer.json"));
}

/// Greedy steps that choose their tokens on the device (ArgMax and the mask update as graph
/// nodes, here through the packages' CPU references) give the tokens of host sampling from
/// downloaded logits: a right-padded batch of two, 20 steps.
#[test]
fn device_sampled_greedy_steps_match_host_argmax() {
    use kiln_host::genai::sampling::argmax;
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    assert!(g.samples_on_device());
    let prompts =
        vec![g.folder.encode("Once upon a time").unwrap(), g.folder.encode("The capital of France is").unwrap()];
    let opts = GenerateOptions {
        max_new_tokens: 20,
        max_length: None,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        stop: None,
    };
    let out = g.generate(&prompts, &opts, &mut |_, _| {}).unwrap();
    assert!(out.timings.device_sampling);
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let (mut kv, logits) = g.prefill(&prompts, longest + 20).unwrap();
    let mut host: Vec<Vec<i64>> = logits.iter().map(|l| vec![argmax(l) as i64]).collect();
    for _ in 1..20 {
        let last: Vec<i64> = host.iter().map(|h| *h.last().unwrap()).collect();
        let l = g.decode(&mut kv, &last).unwrap();
        host.iter_mut().zip(&l).for_each(|(h, l)| h.push(argmax(l) as i64));
    }
    g.free(kv);
    for (row, h) in out.rows.iter().zip(&host) {
        assert_eq!(&row.generated_ids, h);
    }
}

/// Sampled decode steps (the Sample node, here through kiln-sampling's CPU reference) give the
/// host sampler's tokens for the same seed: temperature with top-k and top-p and a repetition
/// penalty, temperature over the whole vocabulary, and greedy with a penalty; a right-padded
/// batch of two, 24 tokens. The sampled tokens are not the greedy ones.
#[test]
fn device_sampled_steps_match_the_host_sampler() {
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let prompts =
        vec![g.folder.encode("Once upon a time").unwrap(), g.folder.encode("The capital of France is").unwrap()];
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.3, seed: 7 };
    let whole = SamplingParams { top_k: 0, top_p: 1.0, repetition_penalty: 1.0, temperature: 1.5, ..sampled.clone() };
    let penalized = SamplingParams { repetition_penalty: 1.5, ..SamplingParams::default() };
    let run = |g: &mut Generator, sampling: &SamplingParams| {
        let opts = GenerateOptions {
            max_new_tokens: 24,
            max_length: None,
            sampling: sampling.clone(),
            ignore_eos: true,
            stop: None,
        };
        let out = g.generate(&prompts, &opts, &mut |_, _| {}).unwrap();
        assert!(out.timings.device_sampling, "{sampling:?} should sample on the device");
        out.rows.into_iter().map(|r| r.generated_ids).collect::<Vec<_>>()
    };
    let greedy = run(&mut g, &SamplingParams::default());
    for params in [sampled, whole, penalized] {
        let device = run(&mut g, &params);
        let host = kiln_tests::host_sampled(&mut g, &prompts, &params, 24);
        assert_eq!(device, host, "{params:?}: device steps vs host sampler");
        assert_ne!(device, greedy, "{params:?}: not the greedy tokens");
    }
}

#[test]
fn a_set_stop_flag_ends_the_generation_with_the_tokens_so_far() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static STOP: AtomicBool = AtomicBool::new(false);
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let prompt = g.folder.encode("Once upon a time").unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 32,
        max_length: None,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        stop: Some(&STOP),
    };
    let mut seen = 0;
    let r = g
        .generate(&[prompt], &opts, &mut |_, _| {
            seen += 1;
            if seen == 3 {
                STOP.store(true, Ordering::SeqCst);
            }
        })
        .unwrap();
    assert_eq!(r.rows[0].generated_ids.len(), 3);
    assert_eq!(r.rows[0].stopped_by, kiln_host::genai::StopReason::Interrupted);
}

/// Streamed text pieces join to the whole sequence's decoding (held back at the end: at most an
/// incomplete character), for the byte-level tokenizers of the fixtures, over text with
/// multi-byte characters that tokens split.
#[test]
fn streamed_pieces_join_to_the_whole_decoding() {
    use kiln_host::genai::TextStream;
    for folder in ["tiny-llama-v512-fp16-cuda", "tiny-llama-v512-fp32-cpu"] {
        let tok = ModelFolder::open(&fixture(&format!("llm/{folder}"))).unwrap().tokenizer;
        let vocab = tok.get_vocab_size(true) as u32;
        let texts = ["Once upon a time, there was a little girl.", "naïve café — 東京 🙂 ok", "a  b\n\nc\td"];
        let mut cases: Vec<Vec<u32>> =
            texts.iter().map(|t| tok.encode(*t, false).unwrap().get_ids().to_vec()).collect();
        // What a random model emits: byte tokens that do not make characters, mid-text.
        cases.push((0..300u32).map(|i| (i * 7919 + 13) % vocab).collect());
        for ids in cases {
            let mut s = TextStream::new(tok.clone());
            let joined: String = ids.iter().filter_map(|&i| s.push(i as i64)).collect();
            let whole = tok.decode(&ids, true).unwrap();
            assert!(whole.starts_with(&joined) && whole.len() - joined.len() <= 4, "{folder}: {joined:?} vs {whole:?}");
            if !whole.ends_with('\u{FFFD}') {
                assert_eq!(joined, whole, "{folder}: nothing held back at a character boundary");
            }
            assert_eq!(format!("{joined}{}", s.rest(&whole)), whole, "{folder}: the rest completes the text");
        }
    }
}

/// Continuous batching: sequences join a running batch of 3 slots at different steps (one waits
/// for a slot to free), with greedy, sampled and penalized parameters side by side, and the
/// mask's shared column wraps (a 32-position cache over more than 32 steps; the rows fixed at 3,
/// batch-invariant). Each sequence gets exactly the tokens it gets alone, its draws keyed by its
/// seed; a prompt too long for the cache is refused and the batch goes on.
#[test]
fn sequences_joining_a_running_batch_get_their_own_tokens() {
    use kiln_tests::Arrival;
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.3, seed: 7 };
    let whole = SamplingParams { top_k: 0, top_p: 1.0, repetition_penalty: 1.0, temperature: 1.5, ..sampled.clone() };
    let penalized = SamplingParams { repetition_penalty: 1.5, ..SamplingParams::default() };
    let arrivals = vec![
        Arrival {
            at: 0,
            prompt: g.folder.encode("Once upon a time").unwrap(),
            sampling: SamplingParams::default(),
            max_new_tokens: 12,
        },
        Arrival {
            at: 3,
            prompt: g.folder.encode("The capital of France is").unwrap(),
            sampling: sampled,
            max_new_tokens: 18,
        },
        Arrival { at: 5, prompt: g.folder.encode("Hello").unwrap(), sampling: penalized, max_new_tokens: 9 },
        Arrival { at: 6, prompt: g.folder.encode("a b c").unwrap(), sampling: whole, max_new_tokens: 20 },
        Arrival {
            at: 6,
            prompt: g.folder.encode("Tom and Lily").unwrap(),
            sampling: SamplingParams::default(),
            max_new_tokens: 1,
        },
    ];
    // Batch-invariant, so that the rows stay at 3 (rows following the load rewrite every row
    // at each move, and the shared column would not wrap).
    let (mut batch, out) = kiln_tests::run_continuous_batch_with(&mut g, 3, 32, &arrivals, true);
    assert_eq!(out[3].0, 0, "the fourth sequence waits for the first one's slot");
    for (a, (slot, tokens)) in arrivals.iter().zip(&out) {
        let alone =
            kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&a.prompt), &[0], &a.sampling, a.max_new_tokens);
        assert_eq!(tokens, &alone[0], "{:?} in slot {slot}", a.sampling);
    }
    assert!(batch.stats().compactions > 0, "the shared column wrapped: {:?}", batch.stats());
    let long = vec![1i64; 32];
    let params = SamplingParams::default();
    let join = kiln_host::genai::Join { prompt: &long, sampling: &params, max_new_tokens: 4, ignore_eos: true };
    let err = batch.join(&mut g, join).unwrap_err();
    assert!(err.to_string().contains("32 tokens"), "{err}");
    let prompt = g.folder.encode("Once upon a time").unwrap();
    let join = kiln_host::genai::Join { prompt: &prompt, sampling: &params, max_new_tokens: 4, ignore_eos: true };
    let first = batch.join(&mut g, join).unwrap();
    let mut tokens = vec![first.token];
    while tokens.len() < 4 {
        tokens.extend(batch.step(&mut g).unwrap().iter().map(|e| e.token));
    }
    assert_eq!(tokens, out[0].1[..4], "the batch serves after a refusal");
}

/// On the CPU a continuous batch's cache follows its sequences, not `max_length`: it starts at
/// `CPU_MIN_LIMIT` positions, grows when a sequence outgrows it (its rows moving to the new
/// cache), and shrinks back when an empty batch takes a short sequence. Every sequence gets the
/// tokens it gets alone, across both reallocations.
#[test]
fn a_cpu_batchs_cache_grows_and_shrinks_with_its_sequences() {
    use kiln_host::genai::CPU_MIN_LIMIT;
    use kiln_tests::Arrival;
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 5 };
    let arrivals = vec![
        Arrival {
            at: 0,
            prompt: g.folder.encode("Once upon a time").unwrap(),
            sampling: SamplingParams::default(),
            max_new_tokens: 2 * CPU_MIN_LIMIT,
        },
        Arrival { at: 150, prompt: g.folder.encode("The cat sat").unwrap(), sampling: sampled, max_new_tokens: 30 },
    ];
    let (mut batch, out) = kiln_tests::run_continuous_batch(&mut g, 2, 2048, &arrivals);
    let grown = batch.stats();
    assert!(grown.resizes >= 1, "the cache grew past {CPU_MIN_LIMIT} positions: {grown:?}");
    for (a, (slot, tokens)) in arrivals.iter().zip(&out) {
        let alone =
            kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&a.prompt), &[0], &a.sampling, a.max_new_tokens);
        assert_eq!(tokens, &alone[0], "{:?} in slot {slot}", a.sampling);
    }
    // The batch is empty: a short sequence joining starts over at the smallest cache.
    let prompt = g.folder.encode("Hello").unwrap();
    let params = SamplingParams::default();
    let join = kiln_host::genai::Join { prompt: &prompt, sampling: &params, max_new_tokens: 6, ignore_eos: true };
    let mut tokens = vec![batch.join(&mut g, join).unwrap().token];
    while tokens.len() < 6 {
        tokens.extend(batch.step(&mut g).unwrap().iter().map(|e| e.token));
    }
    assert_eq!(batch.stats().resizes, grown.resizes + 1, "the cache shrank back: {:?}", batch.stats());
    let alone = kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&prompt), &[0], &params, 6);
    assert_eq!(tokens, alone[0]);
}

/// A continuous batch's rows follow its load: a batch of 8 slots runs its steps over one row
/// while one sequence runs, grows a row at a time as four more join (the running sequences'
/// rows moving to each new cache), shrinks back once they end, and grows again. Slots stay with their sequences throughout, and every sequence
/// (greedy, sampled and penalized) gets the tokens it gets alone. Batch-invariant, the rows stay
/// at 8.
#[test]
fn a_batchs_rows_follow_its_load() {
    use kiln_tests::Arrival;
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 9 };
    let penalized = SamplingParams { repetition_penalty: 1.4, ..SamplingParams::default() };
    let texts = ["Once upon a time", "The cat", "Lily went to", "A big red", "Tom had a dog", "The sun"];
    let params = [SamplingParams::default(), sampled.clone(), penalized, sampled, SamplingParams::default()];
    let arrivals: Vec<Arrival> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| Arrival {
            at: [0, 3, 4, 5, 6, 40][i],
            prompt: g.folder.encode(t).unwrap(),
            sampling: SamplingParams { seed: 9 + i as u64, ..params[i % 5].clone() },
            max_new_tokens: [60, 12, 9, 14, 10, 8][i],
        })
        .collect();
    let (batch, out) = kiln_tests::run_continuous_batch(&mut g, 8, 128, &arrivals);
    let stats = batch.stats();
    // 8 → 1, then 2, 3, 4, 5 as four join, 1 once they end, 2 for the last.
    assert!(stats.transitions >= 6, "{stats:?}");
    assert_eq!(batch.capacity(), 8);
    let slots: Vec<usize> = out.iter().map(|(slot, _)| *slot).collect();
    assert_eq!(slots, [0, 1, 2, 3, 4, 1], "each joins the lowest free slot");
    for (a, (slot, tokens)) in arrivals.iter().zip(&out) {
        let alone =
            kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&a.prompt), &[0], &a.sampling, a.max_new_tokens);
        assert_eq!(tokens, &alone[0], "{:?} in slot {slot}", a.sampling);
    }
    // Made batch-invariant once it has shrunk, the batch grows back to every slot's row for
    // joins that need more rows than it has.
    let mut batch = batch;
    assert!(batch.rows() < 3, "the batch shrank: {} rows", batch.rows());
    batch.set_batch_invariant(true);
    let joins: Vec<_> = arrivals[..3]
        .iter()
        .map(|a| kiln_host::genai::Join {
            prompt: &a.prompt,
            sampling: &a.sampling,
            max_new_tokens: 4,
            ignore_eos: true,
        })
        .collect();
    let firsts = batch.join_many(&mut g, &joins).unwrap();
    assert_eq!(batch.rows(), 8);
    for (e, (_, want)) in firsts.iter().zip(&out) {
        assert_eq!(e.token, want[0], "slot {}", e.slot);
    }
    let mut fixed = kiln_host::genai::ContinuousBatch::new(&mut g, 8, Some(128)).unwrap();
    fixed.set_batch_invariant(true);
    let a = &arrivals[0];
    let join = kiln_host::genai::Join { prompt: &a.prompt, sampling: &a.sampling, max_new_tokens: 6, ignore_eos: true };
    let mut tokens = vec![fixed.join(&mut g, join).unwrap().token];
    while tokens.len() < 6 {
        tokens.extend(fixed.step(&mut g).unwrap().iter().map(|e| e.token));
        assert_eq!(fixed.rows(), 8, "batch-invariant: every slot's row, always");
    }
    assert_eq!(tokens, out[0].1[..6]);
    assert_eq!(fixed.stats().transitions, 0);
}

/// A sequence longer than the running batch's shared mask column joins by writing its own rows
/// and moving the column forward: the sampled sequence already running keeps its draws (its
/// seeds move with the column), and both get the tokens they get alone.
#[test]
fn a_longer_sequence_joins_in_place_and_moves_the_shared_column() {
    use kiln_tests::Arrival;
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 11 };
    let short = g.folder.encode("Hi").unwrap();
    let long = g.folder.encode("One day, a little girl named Lily found a needle in her room").unwrap();
    assert!(long.len() > short.len() + 4, "{} vs {} tokens", long.len(), short.len());
    let arrivals = vec![
        Arrival { at: 0, prompt: short, sampling: sampled.clone(), max_new_tokens: 16 },
        Arrival { at: 2, prompt: long, sampling: SamplingParams { seed: 12, ..sampled }, max_new_tokens: 10 },
    ];
    // Batch-invariant, so that the rows stay at 2 and the second sequence finds a free row.
    let (batch, out) = kiln_tests::run_continuous_batch_with(&mut g, 2, 64, &arrivals, true);
    let stats = batch.stats();
    assert_eq!((stats.joined_in_place, stats.moves, stats.rewrites), (1, 1, 1), "{stats:?}");
    for (a, (slot, tokens)) in arrivals.iter().zip(&out) {
        let alone =
            kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&a.prompt), &[0], &a.sampling, a.max_new_tokens);
        assert_eq!(tokens, &alone[0], "seed {} in slot {slot}", a.sampling.seed);
    }
}

/// Sequences joining together (with `kiln serve --batch-invariant`'s joins, each prefilled
/// alone), greedy and sampled, get the tokens each gets joining alone, in whatever slot, and the
/// tokens a single prompt gets from the host sampler with the same seed: a sequence's draws
/// follow its seed, not its slot. (On the CPU a prefill's rows do not depend on each other with
/// or without the flag; the GPU test checks the flag where they can.)
#[test]
fn batch_invariant_joins_give_each_sequence_the_tokens_it_gets_alone() {
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let sampled =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 3 };
    let seqs: Vec<(Vec<i64>, SamplingParams)> = ["Once upon a time", "The cat sat", "Lily and Tom went to the park"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let params = if i == 1 {
                SamplingParams::default()
            } else {
                SamplingParams { seed: 3 + i as u64, ..sampled.clone() }
            };
            (g.folder.encode(t).unwrap(), params)
        })
        .collect();
    let together = kiln_tests::run_joined_together(&mut g, 4, 48, &seqs, &[0, 1, 2], 12, true);
    let reversed = kiln_tests::run_joined_together(&mut g, 4, 48, &seqs, &[2, 1, 0], 12, true);
    assert_eq!(together, reversed, "the slots changed, the tokens did not");
    for (i, s) in seqs.iter().enumerate() {
        let alone = kiln_tests::run_joined_together(&mut g, 4, 48, std::slice::from_ref(s), &[0], 12, true);
        assert_eq!(together[i], alone[0], "sequence {i} alone");
        let host = kiln_tests::host_sampled_rows(&mut g, std::slice::from_ref(&s.0), &[0], &s.1, 12);
        assert_eq!(together[i], host[0], "sequence {i} against the host sampler");
    }
}

/// A prefill padded to more rows and positions (as a continuous batch pads joins on a GPU)
/// gives the real rows the logits of the unpadded prefill.
#[test]
fn a_padded_prefill_gives_the_unpadded_logits() {
    let mut g = generator("tiny-llama-v512-fp32-cpu");
    let prompts = vec![g.folder.encode("Once upon a time").unwrap(), g.folder.encode("The cat").unwrap()];
    let (kv, want) = g.prefill(&prompts, 96).unwrap();
    g.free(kv);
    let (kv, got) = g.prefill_padded(&prompts, 96, (4, 64)).unwrap();
    assert_eq!(kv.len(), 64, "the padded length");
    g.free(kv);
    assert_eq!(got.len(), 2, "logits of the real rows only");
    for (b, (x, y)) in got.iter().zip(&want).enumerate() {
        let d = x.iter().zip(y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-4, "row {b}: max |Δ| {d}");
    }
}
