//! A loader that no input can abort (issue 11): seeded mutants of ONNX's node tests, the
//! examples, and the built-in packages' manifests, index lines and archives, each loaded (and a
//! model run on the CPU) on a thread of its own. Every mutant must give a result or a clean
//! error: a panic fails the test naming the seed and mutant, a mutant running past
//! [`LIMIT`] is a hang, and an allocation over 1 GiB (a size read from the input) aborts
//! after naming them ([`AllocGuard`]).
//!
//! Reproduce one mutant: `KILN_MUTATION_SEED=0x… KILN_MUTANT=N cargo test --release -p
//! kiln-tests --test mutation`; `KILN_MUTANTS=N` runs more (or fewer) of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::sandbox::SandboxConfig;
use kiln_host::tensorio::{read_npy, read_pb, write_npy};
use kiln_host::{model, packages, Error, Tensor};
use kiln_registry::{archive, parse_index, signing, IndexLine, OpRegistry, Package};
use kiln_tests::isolate::{run_cases, AllocGuard, Report};
use kiln_tests::{mutate, onnx, Rng};
use protobuf::Message;
use sha2::{Digest, Sha256};

#[global_allocator]
static ALLOC: AllocGuard = AllocGuard(1 << 30);

/// The fixed seed ("kiln-11"), unless `KILN_MUTATION_SEED` gives another.
const SEED: u64 = 0x006b_696c_6e2d_3131;
/// A mutant still running after this long is a hang.
const LIMIT: Duration = Duration::from_secs(30);
/// Mutants of models and their inputs.
const MODEL_MUTANTS: usize = 10_000;
/// Mutants of manifests, index files and archives.
const REGISTRY_MUTANTS: usize = 5_000;

fn seed() -> u64 {
    let Ok(v) = std::env::var("KILN_MUTATION_SEED") else { return SEED };
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    parsed.unwrap_or_else(|_| panic!("KILN_MUTATION_SEED={v:?} is not a number"))
}

/// The mutants to run: `KILN_MUTANT` alone, or the first `KILN_MUTANTS` (default `count`).
fn indices(count: usize) -> Vec<usize> {
    let var = |k: &str| std::env::var(k).ok().map(|v| v.parse::<usize>().unwrap_or_else(|_| panic!("{k}={v:?}")));
    match var("KILN_MUTANT") {
        Some(i) => vec![i],
        None => (0..var("KILN_MUTANTS").unwrap_or(count)).collect(),
    }
}

/// Panics with every failure of `report`, and how to reproduce each.
fn assert_no_failures<O>(report: &Report<O>, what: &str) {
    assert!(
        report.failures.is_empty(),
        "{what}: {} of the mutants did not end with a result or a clean error:\n{}\n(reproduce one with \
         KILN_MUTATION_SEED={:#x} KILN_MUTANT=N)",
        report.failures.len(),
        report.failures_text(),
        report.seed
    );
}

/// A file the model mutants are made from.
#[derive(Clone)]
enum Input {
    Pb(Vec<u8>),
    Npy(Vec<u8>),
}

/// A model and the inputs of its first data set.
struct Original {
    name: String,
    model: Vec<u8>,
    inputs: Vec<Input>,
}

/// The ONNX node tests (first data set) and kiln's contrib node tests that run on the CPU
/// unmutated, and the examples.
fn model_corpus(rt: &Arc<Runtime>, ext: &Path) -> Vec<Original> {
    let root = kiln_tests::root();
    let mut dirs = kiln_host::conformance::test_dirs(&kiln_tests::onnx_node_tests(), None).unwrap();
    dirs.extend(kiln_host::conformance::test_dirs(&root.join("tests/contrib-node-tests"), None).unwrap());
    dirs.extend(kiln_host::conformance::test_dirs(&root.join("tests/onnx-node-tests"), None).unwrap());
    let mut out: Vec<Original> = dirs
        .iter()
        .map(|d| {
            let set = d.join("test_data_set_0");
            let inputs = (0..).map(|k| set.join(format!("input_{k}.pb"))).take_while(|p| p.is_file());
            Original {
                name: d.file_name().unwrap().to_string_lossy().into_owned(),
                model: std::fs::read(d.join("model.onnx")).unwrap(),
                inputs: inputs.map(|p| Input::Pb(std::fs::read(p).unwrap())).collect(),
            }
        })
        .filter(|o: &Original| run_model(rt, ext, &o.model, &o.inputs) == "ran")
        .collect();
    assert!(out.len() > 700, "only {} node tests run", out.len());
    for ex in ["examples/mlp", "examples/third-party"] {
        out.push(Original {
            name: ex.into(),
            model: std::fs::read(root.join(ex).join("model.onnx")).unwrap(),
            inputs: vec![Input::Npy(std::fs::read(root.join(ex).join("x.npy")).unwrap())],
        });
    }
    out
}

/// `t` as `.npy` bytes.
fn npy_bytes(t: &Tensor) -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.npy");
    write_npy(&p, t).unwrap();
    std::fs::read(p).unwrap()
}

/// A mutant of `o`: its model (structure or bytes), an input (structure or bytes), or an input
/// as `.npy`, mutated 1 to 3 times.
fn model_mutant(rng: &mut Rng, o: &Original) -> (String, Vec<u8>, Vec<Input>) {
    let (mut model, mut inputs) = (o.model.clone(), o.inputs.clone());
    let rounds = rng.range(1, 3);
    let kind = rng.below(100);
    let what = match kind {
        0..=39 => {
            let mut m = onnx::ModelProto::parse_from_bytes(&model).unwrap();
            (0..rounds).for_each(|_| mutate::model(rng, &mut m));
            model = onnx::bytes(&m);
            "model structure"
        }
        40..=59 => {
            (0..rounds).for_each(|_| mutate::bytes(rng, &mut model));
            "model bytes"
        }
        _ if inputs.is_empty() => {
            (0..rounds).for_each(|_| mutate::bytes(rng, &mut model));
            "model bytes"
        }
        _ => {
            let k = rng.below(inputs.len());
            let what = match (&mut inputs[k], kind) {
                (Input::Pb(b), 60..=79) => {
                    let mut t = onnx::TensorProto::parse_from_bytes(b).unwrap();
                    (0..rounds).for_each(|_| mutate::tensor(rng, &mut t));
                    *b = t.write_to_bytes().unwrap();
                    "input structure"
                }
                (Input::Pb(b), 80..=87) => {
                    (0..rounds).for_each(|_| mutate::bytes(rng, b));
                    "input bytes"
                }
                (input, _) => {
                    let mut b = match input {
                        Input::Npy(b) => b.clone(),
                        Input::Pb(b) => read_pb(b).map(|t| npy_bytes(&t.0)).unwrap_or_default(),
                    };
                    (0..rounds).for_each(|_| mutate::npy(rng, &mut b));
                    *input = Input::Npy(b);
                    "input .npy"
                }
            };
            return (format!("{}: {what} x{rounds} of input {k}", o.name), model, inputs);
        }
    };
    (format!("{}: {what} x{rounds}", o.name), model, inputs)
}

/// How a model mutant ended: the stage and, for an error, its kind.
fn run_model(rt: &Arc<Runtime>, ext: &Path, model_bytes: &[u8], inputs: &[Input]) -> String {
    let stage = |stage: &str, e: Error| format!("{stage}: {}", error_kind(&e));
    let m = match model::load_bytes(model_bytes, Some(ext.to_path_buf())) {
        Ok(m) => m,
        Err(e) => return stage("load", e),
    };
    let mut feeds = Vec::new();
    for i in inputs {
        match i {
            Input::Pb(b) => match read_pb(b) {
                Ok((t, _)) => feeds.push(t),
                Err(e) => return stage("read .pb", e),
            },
            Input::Npy(b) => match read_npy(b) {
                Ok(t) => feeds.push(t),
                Err(e) => return stage("read .npy", e),
            },
        }
    }
    // Small tensors and a short shim deadline keep every mutant quick; the limits are the
    // ones a user sets, through the same checks.
    // A mutated trip count must end as an error well inside the hang limit.
    let options =
        SessionOptions { max_tensor_bytes: 16 << 20, max_loop_iterations: 10_000, ..SessionOptions::default() };
    let mut s = match Session::new(rt.clone(), m, options) {
        Ok(s) => s,
        Err(e) => return stage("session", e),
    };
    let names = s.input_names();
    match s.run(names.into_iter().zip(feeds).collect()) {
        Ok(_) => "ran".into(),
        Err(e) => stage("run", e),
    }
}

fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::Io { .. } => "io",
        Error::Model(_) => "model",
        Error::Unsupported(_) => "unsupported",
        Error::Unresolved { .. } => "unresolved",
        Error::Shim(_) => "shim",
        Error::Registry(_) => "registry",
        Error::Input(_) => "input",
        Error::Device(_) => "device",
        Error::OutOfMemory(_) => "out of memory",
        Error::DeviceCheck(_) => "device check",
    }
}

/// The outcomes' counts, most common first, as `count  outcome` lines.
fn tally<'a>(outcomes: impl Iterator<Item = &'a str>) -> (BTreeMap<&'a str, usize>, String) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for o in outcomes {
        *counts.entry(o).or_default() += 1;
    }
    let mut lines: Vec<(&&str, &usize)> = counts.iter().collect();
    lines.sort_by(|a, b| b.1.cmp(a.1));
    let text = lines.iter().map(|(o, n)| format!("{n:>6}  {o}")).collect::<Vec<_>>().join("\n");
    (counts, text)
}

#[test]
fn mutants_of_the_node_tests_and_examples_load_and_run_or_fail_cleanly() {
    let (reg, errors) = packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    let config = SandboxConfig {
        call_timeout: Duration::from_secs(5),
        module_cache: Some(kiln_tests::root().join("target/kiln-test-shims")),
        ..SandboxConfig::default()
    };
    let rt = Runtime::new(reg, config).unwrap();
    let ext = tempfile::tempdir().unwrap();
    mutate::external_folder(ext.path()).unwrap();
    let ext_dir: PathBuf = ext.path().to_path_buf();
    let corpus = Arc::new(model_corpus(&rt, &ext_dir));
    let c = corpus.clone();
    let report = run_cases(
        seed(),
        indices(MODEL_MUTANTS),
        LIMIT,
        move |rng, _| {
            let o = &c[rng.below(c.len())];
            let (what, model, inputs) = model_mutant(rng, o);
            (what, (model, inputs))
        },
        move |(model, inputs)| run_model(&rt, &ext_dir, &model, &inputs),
    );
    let (counts, text) = tally(report.outcomes.iter().map(|(_, _, o)| o.as_str()));
    println!("{} model mutants in {:.1} s:\n{text}", report.outcomes.len(), report.elapsed.as_secs_f64());
    assert_no_failures(&report, "model mutants");
    if std::env::var_os("KILN_MUTANT").is_none() {
        // The mutants reach every stage: loading, reading inputs, preparing and running (the
        // least percentage of mutants that end at each).
        let n = |stage: &str| counts.iter().filter(|(o, _)| o.starts_with(stage)).map(|(_, n)| n).sum::<usize>();
        let total = report.outcomes.len();
        let stages = [("load: model", 10), ("read .pb: input", 5), ("read .npy: input", 2), ("run:", 1), ("ran", 5)];
        for (stage, least) in stages {
            assert!(
                n(stage) * 100 >= total * least,
                "only {} of {total} mutants ended at {stage:?}:\n{text}",
                n(stage)
            );
        }
    }
}

/// A built-in package's files, its kernel.toml first.
type Files = Vec<(String, Vec<u8>)>;

/// The built-in packages, and the third-party example's manifest (its shim is not built).
fn package_corpus() -> Vec<(String, Files)> {
    let mut out: Vec<(String, Files)> = kiln_builtin_kernels::PACKAGES
        .iter()
        .map(|p| (p.dir.to_string(), p.files.iter().map(|(n, b)| (n.to_string(), b.to_vec())).collect()))
        .collect();
    let toml = std::fs::read(kiln_tests::root().join("examples/third-party/bias-gelu/kernel.toml")).unwrap();
    out.push(("bias-gelu".into(), vec![("kernel.toml".into(), toml)]));
    out
}

/// The index file of a built-in package: a line per version (the manifest's, then newer
/// patch versions), every other one signed by a fixed key.
fn index_file(files: &Files, key: &signing::SecretKey) -> (String, Vec<u8>) {
    let m = kiln_kernel_abi::manifest::Manifest::parse(std::str::from_utf8(&files[0].1).unwrap()).unwrap();
    let mut text = String::new();
    for patch in 0..3u64 {
        let mut vers = m.package.version.clone();
        vers.patch += patch;
        let mut line = IndexLine {
            name: m.package.name.clone(),
            vers,
            abi: m.abi,
            cksum: hex::encode(Sha256::digest(&files[0].1)),
            ops: m.ops.clone(),
            device: m.device.clone(),
            deps: m.dependencies.clone(),
            yanked: patch == 1,
            signature: None,
        };
        if patch % 2 == 0 {
            signing::sign(&mut line, key);
        }
        text += &serde_json::to_string(&line).unwrap();
        text.push('\n');
    }
    (m.package.name, text.into_bytes())
}

/// A fixed publisher key (a key file written and read back).
fn fixed_key() -> signing::SecretKey {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("key");
    std::fs::write(&p, format!("kiln-ed25519-secret-v1 {}\n", "2a".repeat(32))).unwrap();
    signing::SecretKey::read(&p).unwrap()
}

/// A `.kpkg` archive of the package `files`.
fn archive_of(files: &Files) -> Vec<u8> {
    let d = tempfile::tempdir().unwrap();
    for (rel, bytes) in files {
        let p = d.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    archive::pack(d.path()).unwrap()
}

/// A registry mutant: the thing mutated and its bytes.
enum RegistryMutant {
    Manifest(Files),
    Index(String, Vec<u8>),
    Archive(Vec<u8>),
}

fn run_registry(m: RegistryMutant) -> &'static str {
    match m {
        RegistryMutant::Manifest(files) => {
            let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
            match Package::load_files("mutant", &refs) {
                Ok(p) => {
                    let mut reg = OpRegistry::new();
                    reg.add(p, kiln_registry::USER);
                    reg.link();
                    "manifest: loaded"
                }
                Err(_) => "manifest: error",
            }
        }
        RegistryMutant::Index(name, bytes) => {
            match parse_index(&name, Path::new("index").join(&name).as_path(), &bytes) {
                Ok(lines) => {
                    let verified = lines.iter().filter(|l| signing::verify(l).is_ok_and(|k| k.is_some())).count();
                    let _ = lines.iter().any(|l| l.provides("ai.onnx::Relu"));
                    if verified > 0 {
                        "index: parsed, a signature verified"
                    } else {
                        "index: parsed"
                    }
                }
                Err(_) => "index: error",
            }
        }
        RegistryMutant::Archive(bytes) => match archive::unpack("mutant.kpkg", &bytes) {
            Ok(_) => "archive: unpacked",
            Err(_) => "archive: error",
        },
    }
}

#[test]
fn mutants_of_manifests_index_lines_and_archives_load_or_fail_cleanly() {
    let packages = package_corpus();
    let key = fixed_key();
    let indexes: Vec<(String, Vec<u8>)> = packages.iter().map(|(_, f)| index_file(f, &key)).collect();
    let archives: Vec<Vec<u8>> =
        packages.iter().filter(|(d, _)| d != "bias-gelu").map(|(_, f)| archive_of(f)).collect();
    let (packages, indexes, archives) = (Arc::new(packages), Arc::new(indexes), Arc::new(archives));
    let report = run_cases(
        seed(),
        indices(REGISTRY_MUTANTS),
        LIMIT,
        move |rng, _| {
            let rounds = rng.range(1, 3);
            match rng.below(10) {
                0..=3 => {
                    let (dir, mut files) = packages[rng.below(packages.len())].clone();
                    let k = if files.len() > 1 && rng.below(5) == 0 { rng.range(1, files.len() - 1) } else { 0 };
                    (0..rounds).for_each(|_| mutate::text(rng, &mut files[k].1));
                    (format!("{dir}: {} x{rounds}", files[k].0), RegistryMutant::Manifest(files))
                }
                4..=7 => {
                    let (name, mut bytes) = indexes[rng.below(indexes.len())].clone();
                    (0..rounds).for_each(|_| mutate::text(rng, &mut bytes));
                    (format!("index/{name} x{rounds}"), RegistryMutant::Index(name, bytes))
                }
                _ => {
                    let i = rng.below(archives.len());
                    let mut bytes = archives[i].clone();
                    (0..rounds).for_each(|_| mutate::bytes(rng, &mut bytes));
                    (format!("archive {i} x{rounds}"), RegistryMutant::Archive(bytes))
                }
            }
        },
        run_registry,
    );
    let (counts, text) = tally(report.outcomes.iter().map(|(_, _, o)| *o));
    println!("{} registry mutants in {:.1} s:\n{text}", report.outcomes.len(), report.elapsed.as_secs_f64());
    assert_no_failures(&report, "registry mutants");
    if std::env::var_os("KILN_MUTANT").is_none() {
        for outcome in ["manifest: loaded", "manifest: error", "index: parsed", "index: error", "archive: error"] {
            assert!(counts.get(outcome).is_some_and(|n| *n > 0), "no mutant ended as {outcome:?}:\n{text}");
        }
    }
}

#[test]
fn the_harness_names_the_seed_and_index_of_a_panicking_and_a_hanging_case() {
    let report = run_cases(
        7,
        0..6,
        Duration::from_millis(500),
        |rng, i| (format!("case {i}"), rng.next_u64()),
        |v| {
            if v.is_multiple_of(3) {
                panic!("boom {v}");
            }
            v
        },
    );
    // Which cases panic follows from the seed alone: 2 and 4 of seed 7.
    let expected: Vec<usize> =
        (0..6).filter(|&i| kiln_tests::isolate::case_rng(7, i).next_u64().is_multiple_of(3)).collect();
    assert_eq!(expected, [2, 4]);
    let panicked: Vec<usize> = report
        .failures
        .iter()
        .filter_map(|f| match f {
            kiln_tests::isolate::Failure::Panicked { index, message, .. } => {
                assert!(message.starts_with("boom "), "{message}");
                Some(*index)
            }
            _ => None,
        })
        .collect();
    assert_eq!(panicked, expected);
    assert_eq!(report.outcomes.len() + panicked.len(), 6);
    assert!(
        report.failures_text().starts_with("seed 0x7 case 2 (case 2) panicked: boom "),
        "{}",
        report.failures_text()
    );
    let hung = run_cases(
        9,
        0..3,
        Duration::from_millis(200),
        |_, i| (format!("sleeper {i}"), i),
        |i| std::thread::sleep(Duration::from_millis(if i == 1 { 2_000 } else { 0 })),
    );
    assert_eq!(hung.outcomes.len(), 1);
    assert_eq!(hung.failures_text(), "seed 0x9 case 1 (sleeper 1) ran past 200ms");
}
