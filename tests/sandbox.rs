//! Hostile shims: every abuse of the ABI is a clear error naming package, op and reason, the
//! host keeps running, and the next call (or another package) still works.

use std::time::Duration;

use bytes::Bytes;
use kiln_host::sandbox::{
    Access, ArgTensor, CallArgs, CallKind, FailureKind, ParamKind, Sandbox, SandboxConfig, ShimFailure,
};
use kiln_kernel_abi::wire::{Conv, Epilogue, Gemm, KernelArg, Launch, Operand, QGemm, QZeroPoints, TensorAt};
use kiln_kernel_abi::DType;

const PACKAGE: &str = "hostile@6.6.6";

/// A complete ABI v1 module whose export bodies are given (each `(param $p i32) (param $n i32)
/// (result i32)`). The first call of an instance names its input 0x10000 and output 0x10001.
fn shim(infer: &str, cpu: &str, dispatch: &str, extra: &str) -> Vec<u8> {
    let text = format!(
        r#"(module
  (import "kiln" "fail" (func $fail (param i32 i32)))
  (import "kiln" "set_output" (func $set_output (param i32 i32 i32 i32) (result i32)))
  (import "kiln" "read" (func $read (param i32 i64 i32 i32) (result i32)))
  (import "kiln" "write" (func $write (param i32 i64 i32 i32) (result i32)))
  (import "kiln" "scratch" (func $scratch (param i64) (result i32)))
  (import "kiln" "launch" (func $launch (param i32 i32) (result i32)))
  (import "kiln" "gemm" (func $gemm (param i32 i32) (result i32)))
  (import "kiln" "conv" (func $conv (param i32 i32) (result i32)))
  (import "kiln" "qgemm" (func $qgemm (param i32 i32) (result i32)))
  (memory (export "memory") 2)
  (global $saved (mut i32) (i32.const 0))
  (data (i32.const 64) "\04\00\00\00\00\00\00\00")
  {extra}
  (func (export "kiln_abi_version") (result i32) (i32.const 1))
  (func (export "kiln_alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "kiln_infer") (param $p i32) (param $n i32) (result i32) {infer})
  (func (export "kiln_cpu") (param $p i32) (param $n i32) (result i32) {cpu})
  (func (export "kiln_dispatch") (param $p i32) (param $n i32) (result i32) {dispatch})
)"#
    );
    wat::parse_str(&text).unwrap_or_else(|e| panic!("bad test module: {e}\n{text}"))
}

/// Infers output 0 as float32 [4] (dims at offset 64).
const INFER_OK: &str =
    "(drop (call $set_output (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 64))) (i32.const 0)";
const OK: &str = "(i32.const 0)";

fn sandbox() -> Sandbox {
    Sandbox::new(SandboxConfig {
        call_timeout: Duration::from_millis(300),
        memory_limit_bytes: 16 << 20,
        ..SandboxConfig::default()
    })
    .expect("sandbox")
}

fn input(values: [f32; 4]) -> ArgTensor<'static> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    ArgTensor {
        dtype: Some(DType::F32),
        dims: Some(vec![4]),
        value: None,
        nbytes: 16,
        access: Access::Read(Bytes::from(bytes)),
        paged: None,
        constant: false,
        in_place_of: None,
    }
}

fn output() -> ArgTensor<'static> {
    ArgTensor {
        dtype: Some(DType::F32),
        dims: Some(vec![4]),
        value: None,
        nbytes: 16,
        access: Access::Write(vec![0; 16]),
        paged: None,
        constant: false,
        in_place_of: None,
    }
}

fn args() -> CallArgs<'static> {
    CallArgs {
        domain: "",
        op_type: "Relu",
        opset: 14,
        node_name: "evil_node",
        attributes: vec![],
        inputs: vec![Some(input([1.0, -2.0, 3.0, -4.0]))],
        outputs: vec![Some(output())],
        tile: None,
    }
}

/// Loads `wasm` and makes one call of `kind`; returns the failure.
fn fails(sb: &Sandbox, wasm: &[u8], kind: CallKind) -> ShimFailure {
    let module = sb.load(PACKAGE, wasm, declared()).expect("the module loads");
    let mut inst = module.instantiate().expect("instantiates");
    match inst.call(kind, args()) {
        Ok(_) => panic!("the hostile call succeeded"),
        Err(f) => f,
    }
}

/// The failure names package, op and node, has the right kind, and its reason says `why`.
fn check(f: &ShimFailure, kind: FailureKind, why: &str) {
    let text = f.to_string();
    assert_eq!(f.kind, kind, "{text}");
    assert!(text.contains(PACKAGE) && text.contains("Relu") && text.contains("evil_node"), "{text}");
    assert!(text.contains(why), "{text:?} should say {why:?}");
}

#[test]
fn an_infinite_loop_hits_the_deadline() {
    let sb = sandbox();
    let f = fails(&sb, &shim(INFER_OK, "(loop (br 0)) (i32.const 0)", OK, ""), CallKind::Cpu);
    check(&f, FailureKind::Timeout, "time limit");
}

#[test]
fn a_memory_growth_bomb_hits_the_cap() {
    let sb = sandbox();
    let bomb = "(loop (br_if 0 (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))) unreachable";
    let f = fails(&sb, &shim(INFER_OK, bomb, OK, ""), CallKind::Cpu);
    check(&f, FailureKind::MemoryLimit, "limit of 16777216 bytes");
}

#[test]
fn forged_stale_and_out_of_bounds_handles_are_refused() {
    let sb = sandbox();
    let read = |h: &str, off: i64| {
        format!("(drop (call $read {h} (i64.const {off}) (i32.const 128) (i32.const 4))) (i32.const 0)")
    };
    check(
        &fails(&sb, &shim(INFER_OK, &read("(i32.const 7)", 0), OK, ""), CallKind::Cpu),
        FailureKind::Refused,
        "not in this call's handle table",
    );
    check(
        &fails(&sb, &shim(INFER_OK, &read("(i32.const 0x10000)", 13), OK, ""), CallKind::Cpu),
        FailureKind::Refused,
        "outside handle",
    );
    check(
        &fails(&sb, &shim(INFER_OK, &read("(i32.const 0x10000)", -4), OK, ""), CallKind::Cpu),
        FailureKind::Refused,
        "outside handle",
    );
    // A handle kept from the first call (inference) and used in the second.
    let keep = "(global.set $saved (i32.const 0x10000)) (drop (call $set_output (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 64))) (i32.const 0)";
    let module = sb.load(PACKAGE, &shim(keep, &read("(global.get $saved)", 0), OK, ""), vec![]).unwrap();
    let mut inst = module.instantiate().unwrap();
    inst.call(CallKind::Infer, args()).expect("the first call is fine");
    check(&inst.call(CallKind::Cpu, args()).unwrap_err(), FailureKind::Refused, "stale");
}

#[test]
fn garbage_pointers_and_lengths_are_refused_by_every_import() {
    let sb = sandbox();
    let far = "(i32.const 0x7ffffff0)";
    let cases: Vec<(CallKind, String, &str)> = vec![
        (CallKind::Cpu, format!("(call $fail {far} (i32.const 100)) (i32.const 0)"), "fail: message"),
        (
            CallKind::Infer,
            format!("(drop (call $set_output (i32.const 0) (i32.const 1) (i32.const 3) {far})) (i32.const 0)"),
            "set_output: dims",
        ),
        (
            CallKind::Infer,
            "(drop (call $set_output (i32.const 5) (i32.const 1) (i32.const 1) (i32.const 64))) (i32.const 0)".into(),
            "output 5 does not exist",
        ),
        (
            CallKind::Infer,
            "(drop (call $set_output (i32.const 0) (i32.const 99) (i32.const 1) (i32.const 64))) (i32.const 0)".into(),
            "dtype code 99",
        ),
        (
            CallKind::Infer,
            "(drop (call $set_output (i32.const 0) (i32.const 1) (i32.const 1000) (i32.const 64))) (i32.const 0)"
                .into(),
            "rank 1000",
        ),
        (
            CallKind::Cpu,
            format!("(drop (call $read (i32.const 0x10000) (i64.const 0) {far} (i32.const 16))) (i32.const 0)"),
            "read: destination",
        ),
        (
            CallKind::Cpu,
            "(drop (call $read (i32.const 0x10000) (i64.const 0) (i32.const 0) (i32.const -1))) (i32.const 0)".into(),
            "read: destination",
        ),
        (
            CallKind::Cpu,
            format!("(drop (call $write (i32.const 0x10001) (i64.const 0) {far} (i32.const 16))) (i32.const 0)"),
            "write: source",
        ),
        (
            CallKind::Cpu,
            "(drop (call $write (i32.const 0x10001) (i64.const 8) (i32.const 0) (i32.const 16))) (i32.const 0)".into(),
            "outside handle",
        ),
        (
            CallKind::Cpu,
            "(drop (call $write (i32.const 0x10000) (i64.const 0) (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "read-only",
        ),
        (CallKind::Cpu, "(drop (call $scratch (i64.const 0x7fffffffffffffff))) (i32.const 0)".into(), "per-call limit"),
        (CallKind::Cpu, "(drop (call $scratch (i64.const -5))) (i32.const 0)".into(), "per-call limit"),
        (CallKind::Dispatch, format!("(drop (call $launch {far} (i32.const 64))) (i32.const 0)"), "launch: descriptor"),
        (
            CallKind::Dispatch,
            "(drop (call $launch (i32.const 0) (i32.const 64))) (i32.const 0)".into(),
            "launch: malformed",
        ),
        (CallKind::Dispatch, format!("(drop (call $gemm {far} (i32.const 64))) (i32.const 0)"), "gemm: descriptor"),
        (
            CallKind::Dispatch,
            "(drop (call $gemm (i32.const 0) (i32.const 200))) (i32.const 0)".into(),
            "gemm: malformed",
        ),
        (CallKind::Cpu, format!("(drop (call $conv {far} (i32.const 64))) (i32.const 0)"), "conv: descriptor"),
        (CallKind::Cpu, "(drop (call $conv (i32.const 0) (i32.const 200))) (i32.const 0)".into(), "conv: malformed"),
        (CallKind::Cpu, "(drop (call $qgemm (i32.const 0) (i32.const 90))) (i32.const 0)".into(), "qgemm: malformed"),
        (
            CallKind::Dispatch,
            "(drop (call $qgemm (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "qgemm may not be called during Dispatch",
        ),
        // Imports outside the call kinds that may use them.
        (
            CallKind::Infer,
            "(drop (call $write (i32.const 0x10001) (i64.const 0) (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "write may not be called during Infer",
        ),
        (
            CallKind::Cpu,
            "(drop (call $launch (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "launch may not be called during Cpu",
        ),
        (
            CallKind::Dispatch,
            "(drop (call $conv (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "conv: malformed descriptor",
        ),
        (
            CallKind::Dispatch,
            format!("(drop (call $conv {far} (i32.const 64))) (i32.const 0)"),
            "conv: descriptor 0x7ffffff0+64 is outside the shim's memory",
        ),
        (
            CallKind::Infer,
            "(drop (call $conv (i32.const 0) (i32.const 4))) (i32.const 0)".into(),
            "conv may not be called during Infer",
        ),
    ];
    for (kind, body, why) in cases {
        let (infer, cpu, dispatch) = match kind {
            CallKind::Infer => (body.as_str(), OK, OK),
            CallKind::Cpu => (INFER_OK, body.as_str(), OK),
            CallKind::Dispatch => (INFER_OK, OK, body.as_str()),
        };
        check(&fails(&sb, &shim(infer, cpu, dispatch, ""), kind), FailureKind::Refused, why);
    }
}

/// A data segment holding `bytes` at `offset`.
fn data(offset: u32, bytes: &[u8]) -> String {
    let escaped: String = bytes.iter().map(|b| format!("\\{b:02x}")).collect();
    format!("(data (i32.const {offset}) \"{escaped}\")")
}

/// The kernel the test shims may launch: `declared_kernel(float* x, unsigned long long n)`.
fn declared() -> Vec<(String, Vec<ParamKind>)> {
    vec![("declared_kernel".into(), vec![ParamKind::Tensor, ParamKind::U64])]
}

#[test]
fn launches_are_checked_against_the_manifest_and_device_limits() {
    let sb = sandbox();
    let launch_with = |kernel: &str, block: u32, args: Vec<KernelArg>| {
        Launch { kernel, grid: [1, 1, 1], block: [block, 1, 1], shared_mem_bytes: 0, args }.encode()
    };
    let launch = |kernel: &str, block: u32, handle: u32, offset: u64| {
        launch_with(kernel, block, vec![KernelArg::Tensor { handle, offset }, KernelArg::U64(4)])
    };
    let x = KernelArg::Tensor { handle: 0x10000, offset: 0 };
    let body = |len: usize| format!("(drop (call $launch (i32.const 1024) (i32.const {len}))) (i32.const 0)");
    for (bytes, why) in [
        (launch("evil", 32, 0x10000, 0), "kernel \"evil\" is not declared"),
        (launch("declared_kernel", 4096, 0x10000, 0), "over the device limits"),
        (launch("declared_kernel", 32, 0x30000, 0), "stale"),
        (launch("declared_kernel", 32, 0x10001, 17), "past the end"),
        // Against the kernel's signature (ABI.md §7.3): nothing of these reaches a driver.
        (
            launch_with("declared_kernel", 32, vec![x]),
            "1 arguments, but kernel.toml declares 2 parameters (tensor, u64)",
        ),
        (
            launch_with("declared_kernel", 32, vec![x, KernelArg::U64(4), KernelArg::U32(1)]),
            "3 arguments, but kernel.toml declares 2 parameters",
        ),
        (
            launch_with("declared_kernel", 32, vec![KernelArg::U64(0), KernelArg::U64(4)]),
            "argument 0 is a 8-byte scalar u64 but parameter 0 is declared a tensor",
        ),
        (
            launch_with("declared_kernel", 32, vec![x, x]),
            "argument 1 is a tensor but parameter 1 is declared a 8-byte scalar u64",
        ),
        (
            launch_with("declared_kernel", 32, vec![x, KernelArg::U32(4)]),
            "argument 1 is a 4-byte scalar u32 but parameter 1 is declared a 8-byte scalar u64",
        ),
    ] {
        let f = fails(&sb, &shim(INFER_OK, OK, &body(bytes.len()), &data(1024, &bytes)), CallKind::Dispatch);
        check(&f, FailureKind::Refused, why);
    }
    // A good launch is recorded with slot indices, not handles.
    let bytes = launch("declared_kernel", 32, 0x10001, 4);
    let module = sb.load(PACKAGE, &shim(INFER_OK, OK, &body(bytes.len()), &data(1024, &bytes)), declared()).unwrap();
    let plan = module.instantiate().unwrap().call(CallKind::Dispatch, args()).unwrap().plan;
    assert_eq!(plan.steps.len(), 1);
    assert!(format!("{:?}", plan.steps[0]).contains("Tensor { slot: 1, offset: 4 }"), "{:?}", plan.steps[0]);
}

#[test]
fn a_trap_half_way_fails_the_node_and_the_next_instance_works() {
    let sb = sandbox();
    let half = "(drop (call $write (i32.const 0x10001) (i64.const 0) (i32.const 64) (i32.const 8))) unreachable";
    let wasm = shim(INFER_OK, half, OK, "");
    let f = fails(&sb, &wasm, CallKind::Cpu);
    check(&f, FailureKind::Trap, "unreachable");
    // The shim's own message travels with the trap.
    let panicky = "(call $fail (i32.const 512) (i32.const 22)) unreachable";
    let f = fails(&sb, &shim(INFER_OK, panicky, OK, &data(512, b"shim panicked: boom!!!")), CallKind::Cpu);
    check(&f, FailureKind::Trap, "shim panicked: boom!!! (wasm trap: wasm `unreachable` instruction executed)");
    // A well-behaved shim in the same sandbox still runs.
    let copy = "(drop (call $read (i32.const 0x10000) (i64.const 0) (i32.const 256) (i32.const 16))) \
                (drop (call $write (i32.const 0x10001) (i64.const 0) (i32.const 256) (i32.const 16))) (i32.const 0)";
    let good = sb.load("good@1.0.0", &shim(INFER_OK, copy, OK, ""), vec![]).unwrap();
    let out = good.instantiate().unwrap().call(CallKind::Cpu, args()).unwrap();
    match &out.slots[1].access {
        Access::Write(v) => {
            assert_eq!(&v[..], &[1.0f32, -2.0, 3.0, -4.0].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()[..])
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_statuses_and_unset_outputs_fail_the_node() {
    let sb = sandbox();
    check(
        &fails(&sb, &shim(INFER_OK, "(i32.const 77)", OK, ""), CallKind::Cpu),
        FailureKind::Failed,
        "unknown status 77",
    );
    check(&fails(&sb, &shim(OK, OK, OK, ""), CallKind::Infer), FailureKind::Failed, "did not set output 0");
    let msg = "(call $fail (i32.const 512) (i32.const 17)) (i32.const 2)";
    let f = fails(&sb, &shim(msg, OK, OK, &data(512, b"no such attribute")), CallKind::Infer);
    check(&f, FailureKind::Unsupported, "unsupported: no such attribute");
}

#[test]
fn modules_that_break_the_abi_are_refused_at_load() {
    let sb = sandbox();
    let good = shim(INFER_OK, OK, OK, "");
    let load_err = |wasm: &[u8]| sb.load(PACKAGE, wasm, vec![]).err().expect("refused").to_string();
    // Wrong ABI version.
    let text = String::from_utf8_lossy(&wat_text(INFER_OK))
        .replace("(result i32) (i32.const 1))", "(result i32) (i32.const 2))");
    let e = load_err(&wat::parse_str(&text).unwrap());
    assert!(e.contains(PACKAGE) && e.contains("kernel ABI 2"), "{e}");
    // A missing export.
    let text = String::from_utf8_lossy(&wat_text(INFER_OK)).replace("(export \"kiln_cpu\")", "");
    let e = load_err(&wat::parse_str(&text).unwrap());
    assert!(e.contains("missing export kiln_cpu"), "{e}");
    // WASI or any other import.
    let e = load_err(
        &wat::parse_str(
            "(module (import \"wasi_snapshot_preview1\" \"fd_write\" (func (param i32 i32 i32 i32) (result i32))))",
        )
        .unwrap(),
    );
    assert!(e.contains("wasi_snapshot_preview1::fd_write") && e.contains("may import only"), "{e}");
    // Not wasm at all, and a truncated module.
    assert!(load_err(b"\x7fELF").contains("not a valid WebAssembly module"));
    assert!(load_err(&good[..good.len() / 2]).contains("not a valid WebAssembly module"));
    // An import with the wrong signature.
    let text = String::from_utf8_lossy(&wat_text(INFER_OK))
        .replace("(func $scratch (param i64)", "(func $scratch (param i32)");
    assert!(load_err(&wat::parse_str(&text).unwrap()).contains("scratch"));
}

/// A minimal valid module's text, for edits that break it.
fn wat_text(infer: &str) -> Vec<u8> {
    format!(
        r#"(module
  (import "kiln" "fail" (func $fail (param i32 i32)))
  (import "kiln" "set_output" (func $set_output (param i32 i32 i32 i32) (result i32)))
  (import "kiln" "scratch" (func $scratch (param i64) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 64) "\04\00\00\00\00\00\00\00")
  (func (export "kiln_abi_version") (result i32) (i32.const 1))
  (func (export "kiln_alloc") (param i32) (result i32) (i32.const 4096))
  (func (export "kiln_infer") (param $p i32) (param $n i32) (result i32) {infer})
  (func (export "kiln_cpu") (param $p i32) (param $n i32) (result i32) (i32.const 0))
  (func (export "kiln_dispatch") (param $p i32) (param $n i32) (result i32) (i32.const 0))
)"#
    )
    .into_bytes()
}

/// The module cache: the second load of a shim comes from the cache file the first wrote
/// (and behaves the same, sandbox limits included); a damaged cache file is compiled again
/// and replaced.
#[test]
fn compiled_shims_are_cached_and_a_damaged_cache_file_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let sb = Sandbox::new(SandboxConfig {
        call_timeout: Duration::from_millis(300),
        memory_limit_bytes: 16 << 20,
        module_cache: Some(dir.path().to_path_buf()),
        ..SandboxConfig::default()
    })
    .unwrap();
    // A shim whose CPU call loops forever: the deadline must hold for a cached module too.
    let wasm = shim(INFER_OK, "(loop (br 0)) (i32.const 0)", OK, "");
    let files =
        || -> Vec<std::path::PathBuf> { std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect() };
    for _ in 0..2 {
        let module = sb.load(PACKAGE, &wasm, declared()).expect("loads");
        let mut inst = module.instantiate().expect("instantiates");
        let f = inst.call(CallKind::Cpu, args()).expect_err("the loop is stopped");
        check(&f, FailureKind::Timeout, "time limit");
        let cached = files();
        assert_eq!(cached.len(), 1, "one cache file: {cached:?}");
        assert!(cached[0].extension().is_some_and(|e| e == "cwasm"));
    }
    let file = files().remove(0);
    let good = std::fs::read(&file).unwrap();
    assert_eq!(&good[..8], kiln_host::native_cache::MAGIC, "a sealed entry");
    // Not an entry at all; one altered byte in the compiled code (the digest no longer
    // matches: never deserialized); a truncated file.
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x40;
    for damaged in [b"not a compiled module".to_vec(), flipped, good[..good.len() / 3].to_vec()] {
        std::fs::write(&file, &damaged).unwrap();
        let module = sb.load(PACKAGE, &wasm, declared()).expect("a damaged cache file is compiled again");
        let f = module.instantiate().unwrap().call(CallKind::Cpu, args()).expect_err("stopped");
        check(&f, FailureKind::Timeout, "time limit");
        let replaced =
            kiln_host::native_cache::read_sealed(&file).expect("the damaged file is replaced by a sealed one");
        assert_eq!(replaced.map(|p| p.len()), Some(good.len() - 40), "by the same compiled module");
    }
    // Another shim gets its own file.
    sb.load(PACKAGE, &shim(INFER_OK, OK, OK, ""), vec![]).expect("loads");
    assert_eq!(files().len(), 2);
}

/// A module cache entry that other users may write is not used (it would be native code that
/// anyone could plant): the shim is compiled again and the entry replaced by one only this user
/// may write; a cache folder of this user's that others may write loses those bits first.
#[cfg(unix)]
#[test]
fn a_module_cache_entry_others_may_write_is_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sb = Sandbox::new(SandboxConfig { module_cache: Some(dir.path().to_path_buf()), ..SandboxConfig::default() })
        .unwrap();
    sb.load(PACKAGE, &shim(INFER_OK, OK, OK, ""), vec![]).expect("loads");
    assert_eq!(std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777, 0o755, "the folder is tightened");
    let entry = std::fs::read_dir(dir.path()).unwrap().next().unwrap().unwrap().path();
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o666)).unwrap();
    sb.load(PACKAGE, &shim(INFER_OK, OK, OK, ""), vec![]).expect("compiled again");
    assert_eq!(std::fs::metadata(&entry).unwrap().permissions().mode() & 0o777, 0o600, "and replaced");
}

/// A CPU shim whose `kiln_cpu` passes the descriptor at 1024 (`len` bytes) to `import`.
fn calling(import: &str, desc: &[u8]) -> Vec<u8> {
    let body = format!("(call ${import} (i32.const 1024) (i32.const {}))", desc.len());
    shim(INFER_OK, &body, OK, &data(1024, desc))
}

fn conv_desc(y: u32, w_channels: u64) -> Conv {
    let at = |handle| TensorAt { handle, offset: 0 };
    Conv {
        dtype: DType::F32,
        transposed: false,
        batch: 1,
        in_channels: w_channels,
        out_channels: 1,
        groups: 1,
        input: vec![2, 2],
        output: vec![1, 1],
        kernel: vec![2, 2],
        strides: vec![1, 1],
        dilations: vec![1, 1],
        pads_begin: vec![0, 0],
        x: at(0x10000),
        w: at(0x10000),
        bias: None,
        z: None,
        y: at(y),
        epilogue: Epilogue::Relu,
    }
}

#[test]
fn cpu_calls_compute_gemm_and_conv_on_the_host_and_bad_descriptors_are_refused() {
    let sb = sandbox();
    let run = |wasm: &[u8]| -> Result<Vec<f32>, ShimFailure> {
        let out = sb
            .load(PACKAGE, wasm, vec![])
            .expect("loads")
            .instantiate()
            .expect("instantiates")
            .call(CallKind::Cpu, args())?;
        match &out.slots[1].access {
            Access::Write(v) => Ok(v.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            other => panic!("{other:?}"),
        }
    };
    // X = [[1, -2], [3, -4]] (input 0), D the output: X·Xᵀ = [[5, 11], [11, 25]].
    let op = |handle| Operand { handle, offset: 0, ld: 2, batch_stride: 0 };
    let g = Gemm {
        dtype: DType::F32,
        trans_a: false,
        trans_b: true,
        m: 2,
        n: 2,
        k: 2,
        batch: 1,
        alpha: 1.0,
        beta: 0.0,
        a: op(0x10000),
        b: op(0x10000),
        c: None,
        d: op(0x10001),
        bias: None,
        epilogue: Epilogue::None,
    };
    assert_eq!(run(&calling("gemm", &g.encode())).unwrap(), vec![5.0, 11.0, 11.0, 25.0]);
    // Y = A · dequant(B)ᵀ with A = the input [1, 4] = [1, -2, 3, -4] (float32), B one row of
    // four 8-bit values (the input's first four bytes), the default zero point 2^7 and the scale
    // the input's first float (1.0): Σ a·(q − 128).
    let qd = |b: u32| TensorAt { handle: b, offset: 0 };
    let q = QGemm {
        dtype: DType::F32,
        m: 1,
        n: 1,
        k: 4,
        bits: 8,
        block: 4,
        a: qd(0x10000),
        b: qd(0x10000),
        scales: qd(0x10000),
        zero_points: QZeroPoints::Default,
        bias: None,
        y: qd(0x10001),
        accuracy_level: 0,
    };
    let bytes: Vec<u8> = [1.0f32, -2.0, 3.0, -4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let want: f32 = [1.0f32, -2.0, 3.0, -4.0].iter().zip(&bytes[..4]).map(|(a, &b)| a * (b as f32 - 128.0)).sum();
    assert_eq!(run(&calling("qgemm", &q.encode())).unwrap()[0], want);
    let q_past = QGemm { k: 8, block: 8, ..q.clone() };
    check(
        &run(&calling("qgemm", &q_past.encode())).expect_err("A past its end"),
        FailureKind::Refused,
        "reaches past the end",
    );
    // A 2×2 kernel over the 2×2 input, the input as its own weight: Σ x² = 30, then relu.
    assert_eq!(run(&calling("conv", &conv_desc(0x10001, 1).encode())).unwrap(), vec![30.0, 0.0, 0.0, 0.0]);
    // Refused: an operand past its tensor, D an input, Y an input.
    let past = Gemm { m: 3, ..g.clone() };
    let into_input = Gemm { d: op(0x10000), ..g.clone() };
    // A huge batch over one broadcast matrix would run without end: D's matrices must not overlap.
    let one = |handle| Operand { handle, offset: 0, ld: 1, batch_stride: 0 };
    let endless =
        Gemm { m: 1, n: 1, k: 1, batch: 1 << 40, a: one(0x10000), b: one(0x10000), d: one(0x10001), ..g.clone() };
    let wide = conv_desc(0x10001, 2);
    let in_place = conv_desc(0x10000, 1);
    for (wasm, why) in [
        (calling("gemm", &past.encode()), "reaches past the end"),
        (calling("gemm", &into_input.encode()), "is not an output or scratch tensor"),
        (calling("gemm", &endless.encode()), "overlaps its matrices"),
        (calling("conv", &wide.encode()), "reaches past the end"),
        (calling("conv", &in_place.encode()), "is not an output or scratch tensor"),
    ] {
        check(&run(&wasm).expect_err(why), FailureKind::Refused, why);
    }
}

/// `conv` in a dispatch (ABI.md §4.8, manifest schema 10): a checked descriptor the session's
/// service takes becomes a plan step over slots; where none serves, or the service declines it,
/// the shim gets `E_UNAVAILABLE` (−8), which is no refusal (the call succeeds, its plan empty)
/// and the reason is in the outcome's `declined`.
#[test]
fn conv_in_a_dispatch_is_served_or_declined_with_its_reason() {
    use kiln_host::sandbox::ConvService;
    let sb = sandbox();
    let at = |handle| TensorAt { handle, offset: 0 };
    // A 1-D convolution of X [1, 1, 4] by a one-tap W (X's first element) into Y [1, 1, 4].
    let desc = Conv {
        dtype: DType::F32,
        transposed: false,
        batch: 1,
        in_channels: 1,
        out_channels: 1,
        groups: 1,
        input: vec![4],
        output: vec![4],
        kernel: vec![1],
        strides: vec![1],
        dilations: vec![1],
        pads_begin: vec![0],
        x: at(0x10000),
        w: at(0x10000),
        bias: None,
        z: None,
        y: at(0x10001),
        epilogue: Epilogue::None,
    }
    .encode();
    // The dispatch returns 0 when conv answered `want`, else traps.
    let body = |want: i32| {
        format!(
            "(if (i32.ne (call $conv (i32.const 1024) (i32.const {})) (i32.const {want})) (then unreachable)) (i32.const 0)",
            desc.len()
        )
    };
    let run = |want: i32, service: Option<ConvService>| {
        let module = sb.load(PACKAGE, &shim(INFER_OK, OK, &body(want), &data(1024, &desc)), declared()).unwrap();
        let mut inst = module.instantiate().unwrap();
        if let Some(s) = service {
            inst.set_conv_service(s);
        }
        inst.call(CallKind::Dispatch, args()).unwrap_or_else(|f| panic!("conv answered otherwise than {want}: {f}"))
    };
    let out = run(kiln_kernel_abi::status::E_UNAVAILABLE, None);
    assert!(out.plan.steps.is_empty());
    assert_eq!(out.declined.len(), 1);
    assert!(out.declined[0].contains("CPU session"), "{:?}", out.declined);
    let nope = ConvService::Library { takes: std::sync::Arc::new(|_| Err("cuDNN pads both sides alike".into())) };
    let out = run(kiln_kernel_abi::status::E_UNAVAILABLE, Some(nope));
    assert_eq!((out.plan.steps.len(), out.declined), (0, vec!["cuDNN pads both sides alike".to_string()]));
    let yes =
        ConvService::Library { takes: std::sync::Arc::new(|c| if c.input == [4] { Ok(()) } else { Err("?".into()) }) };
    let out = run(0, Some(yes));
    assert!(out.declined.is_empty());
    match out.plan.steps.as_slice() {
        [kiln_host::sandbox::PlanStep::Conv(c)] => {
            assert_eq!((c.x.handle, c.w.handle, c.y.handle), (0, 0, 1), "handles become slots");
        }
        other => panic!("{other:?}"),
    }
}

/// A tile's call (ABI.md §6.1.2) reads and writes only its share of an output: bytes 8..16 of
/// 16 here, which its window holds; a write elsewhere in the tensor is refused.
#[test]
fn a_tile_writes_only_its_share_of_an_output() {
    let sb = sandbox();
    let write = |off: i64| format!("(call $write (i32.const 0x10001) (i64.const {off}) (i32.const 128) (i32.const 8))");
    let tiled = || CallArgs {
        outputs: vec![Some(ArgTensor { access: Access::Window { start: 8, bytes: vec![0; 8] }, ..output() })],
        tile: Some(kiln_kernel_abi::wire::Tile { start: 2, end: 4 }),
        ..args()
    };
    let bytes = r#"(data (i32.const 128) "\01\02\03\04\05\06\07\08")"#;
    let module = sb.load(PACKAGE, &shim(INFER_OK, &write(8), OK, bytes), vec![]).unwrap();
    let out = module.instantiate().unwrap().call(CallKind::Cpu, tiled()).unwrap();
    assert!(
        matches!(&out.slots[1].access, Access::Window { start: 8, bytes } if bytes[..] == [1, 2, 3, 4, 5, 6, 7, 8]),
        "{:?}",
        out.slots[1].access
    );
    let module = sb.load(PACKAGE, &shim(INFER_OK, &write(4), OK, bytes), vec![]).unwrap();
    let err = module.instantiate().unwrap().call(CallKind::Cpu, tiled()).unwrap_err();
    check(&err, FailureKind::Refused, "bytes 4..12 of handle 0x10001 are outside this tile's share 8..16");
}

/// An input bound in place to an output's buffer (ABI.md §7.8, schema 18: `Access::InPlace`, the
/// output's `in_place_of`) reads the output's bytes, what the shim wrote there included: the shim
/// writes bytes 0..4 of the output, reads the input's 16 bytes and writes their first four at 12,
/// so the output ends as the write, the output's own 8 bytes, then the write again. Without an
/// output bound in place to it, such an input has no host bytes and a read is refused.
#[test]
fn an_input_bound_in_place_reads_its_outputs_bytes() {
    let sb = sandbox();
    let cpu = "(drop (call $write (i32.const 0x10001) (i64.const 0) (i32.const 128) (i32.const 4))) \
               (if (call $read (i32.const 0x10000) (i64.const 0) (i32.const 256) (i32.const 16)) \
                   (then (return (i32.const 7)))) \
               (call $write (i32.const 0x10001) (i64.const 12) (i32.const 256) (i32.const 4))";
    let bytes = r#"(data (i32.const 128) "\01\02\03\04")"#;
    let module = sb.load(PACKAGE, &shim(INFER_OK, cpu, OK, bytes), vec![]).unwrap();
    let in_place = |bound: bool| CallArgs {
        inputs: vec![Some(ArgTensor { access: Access::InPlace, ..input([0.0; 4]) })],
        outputs: vec![Some(ArgTensor {
            access: Access::Write(vec![9; 16]),
            in_place_of: bound.then_some(0),
            ..output()
        })],
        ..args()
    };
    let out = module.instantiate().unwrap().call(CallKind::Cpu, in_place(true)).unwrap();
    let want = [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 1, 2, 3, 4];
    assert!(matches!(&out.slots[1].access, Access::Write(v) if v[..] == want), "{:?}", out.slots[1].access);
    assert!(matches!(out.slots[0].access, Access::Alias(1)), "{:?}", out.slots[0].access);
    let err = module.instantiate().unwrap().call(CallKind::Cpu, in_place(false)).unwrap_err();
    check(&err, FailureKind::Refused, "read: handle 0x10000 has no host bytes");
}
