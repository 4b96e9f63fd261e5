//! `kiln bench ops`: GPU microbenchmarks of the packages' kernels through kiln's own paths
//! (launch plans from the shims, `Gpu::execute`), timed with CUDA events:
//! - GEMM TFLOP/s (f16, bf16; 4096³ and 8192³) through the `gemm` host import (cuBLASLt);
//! - elementwise Add f16 on 256 Mi elements (kiln-binary's kernel) in GB/s, beside the
//!   measured device-to-device copy bandwidth;
//! - host overhead per op: eager dispatch through a memoized launch plan vs a bare
//!   cuLaunchKernel of the same kernel.
//!
//! PyTorch's numbers come from `bench/torch_ops.py`, run in the same session.

use super::output::say;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Subcommand;
use cudarc::driver::sys::CUevent_flags;
use kiln_kernel_abi::wire::{Epilogue, Gemm, Operand};
use kiln_kernel_abi::DType;
use kiln_registry::Package;
use serde_json::json;

use crate::cuda::Gpu;
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind, LaunchPlan, PlanStep, Sandbox, SandboxConfig};
use crate::{Error, Result};

use super::{registry, PackageArgs};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// GEMM, elementwise and dispatch-overhead microbenchmarks on the GPU.
    Ops {
        /// Write the numbers as JSON.
        #[arg(long, value_name = "FILE")]
        json: Option<std::path::PathBuf>,
        #[command(flatten)]
        packages: PackageArgs,
    },
    /// LLM decode speed of an onnxruntime-genai model folder (prompt, greedy new tokens).
    Decode(super::bench_decode::DecodeArgs),
    /// Latency of whole-model runs on random inputs: p50/p90/p99, throughput.
    Run(super::bench_run::BenchRunArgs),
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode> {
    let (json, packages) = match cmd {
        BenchCommand::Ops { json, packages } => (json, packages),
        BenchCommand::Decode(a) => return super::bench_decode::run(a),
        BenchCommand::Run(a) => return super::bench_run::run(a),
    };
    super::output::check_path("--json", &json)?;
    let human = super::output::Human::new(&[&json]);
    let ordinal = super::require_gpu("bench ops")?;
    let reg = registry(&packages)?;
    let find = |name: &str| {
        reg.packages()
            .find(|p| p.name() == name)
            .cloned()
            .ok_or_else(|| Error::Input(format!("package {name} is not installed")))
    };
    let (binary, unary) = (find("kiln-binary")?, find("kiln-unary")?);
    let mut gpu = Gpu::open(ordinal, None)?;
    say!(human, "device: {} ({})", gpu.info.name, gpu.info.arch);
    let mut doc = json!({ "device": gpu.info.name });
    for (n, dtype) in [(4096u64, DType::F16), (4096, DType::BF16), (8192, DType::F16), (8192, DType::BF16)] {
        let tflops = gemm_tflops(&mut gpu, n, dtype)?;
        say!(human, "gemm {n}x{n}x{n} {dtype}: {tflops:.1} TFLOP/s");
        doc[format!("gemm_{n}_{dtype}_tflops")] = json!(tflops);
    }
    let (copy, add) = bandwidth(&mut gpu, &binary)?;
    say!(human, "device-to-device copy (256 Mi f16, read + write): {copy:.0} GB/s");
    say!(human, "Add f16, 256 Mi elements (2 reads + 1 write): {add:.0} GB/s ({:.0} % of copy)", 100.0 * add / copy);
    doc["copy_gbps"] = json!(copy);
    doc["add_f16_gbps"] = json!(add);
    let (plan_us, bare_us) = launch_overhead(&mut gpu, &unary)?;
    say!(
        human,
        "host time per op: memoized launch plan {plan_us:.2} µs, bare cuLaunchKernel {bare_us:.2} µs (+{:.2} µs)",
        plan_us - bare_us
    );
    doc["plan_launch_us"] = json!(plan_us);
    doc["bare_launch_us"] = json!(bare_us);
    if let Some(p) = json {
        super::output::write_json(&p, &doc)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Milliseconds of `iters` calls of `f` on the GPU's stream, timed with CUDA events after
/// `warmup` untimed calls.
fn time_ms(gpu: &mut Gpu, warmup: usize, iters: usize, mut f: impl FnMut(&mut Gpu) -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f(gpu)?;
    }
    let ev = |g: &Gpu| {
        g.device.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| Error::Device(e.to_string()))
    };
    let (start, end) = (ev(gpu)?, ev(gpu)?);
    start.record(&gpu.device.enqueue()).map_err(|e| Error::Device(e.to_string()))?;
    for _ in 0..iters {
        f(gpu)?;
    }
    end.record(&gpu.device.enqueue()).map_err(|e| Error::Device(e.to_string()))?;
    end.synchronize().map_err(|e| Error::Device(e.to_string()))?;
    Ok(start.elapsed_ms(&end).map_err(|e| Error::Device(e.to_string()))? as f64 / iters as f64)
}

/// `n` random values in [-1, 1) as float16 or bfloat16 bytes (GEMM speed depends on the data
/// through power draw, so the operands are random, as PyTorch's `randn` ones are).
fn random_half(n: usize, dtype: DType, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        let bits = match dtype {
            DType::BF16 => half::bf16::from_f32(v).to_bits(),
            _ => half::f16::from_f32(v).to_bits(),
        };
        out.extend_from_slice(&bits.to_le_bytes());
    }
    out
}

fn gemm_tflops(gpu: &mut Gpu, n: u64, dtype: DType) -> Result<f64> {
    let bytes = n * n * 2;
    let shape = vec![(n * n) as usize];
    let a = crate::Tensor::new(dtype, shape.clone(), random_half((n * n) as usize, dtype, 1).into())?;
    let b = crate::Tensor::new(dtype, shape, random_half((n * n) as usize, dtype, 2).into())?;
    let bufs = [gpu.upload(&a)?, gpu.upload(&b)?, gpu.alloc.alloc(bytes)?];
    gpu.synchronize()?;
    let slots: Vec<_> = bufs.iter().map(|b| (b.ptr, bytes)).collect();
    let op = |slot: u32| Operand { handle: slot, offset: 0, ld: n, batch_stride: 0 };
    let g = Gemm {
        dtype,
        trans_a: false,
        trans_b: false,
        m: n,
        n,
        k: n,
        batch: 1,
        alpha: 1.0,
        beta: 0.0,
        a: op(0),
        b: op(1),
        c: None,
        d: op(2),
        bias: None,
        epilogue: Epilogue::None,
    };
    let plan = LaunchPlan { scratch_bytes: vec![], steps: vec![PlanStep::Gemm(g)] };
    let pkg = dummy_package()?;
    let ms = time_ms(gpu, 3, 20, |g| g.execute(&pkg, &plan, &slots, 0))?;
    drop(bufs);
    Ok(2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12)
}

/// A package with no kernels, for plans that hold only GEMMs.
fn dummy_package() -> Result<Package> {
    use sha2::{Digest, Sha256};
    let shim = b"\0asm";
    let text = format!(
        "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"bench\"\nversion = \"0.0.0\"\n[[ops]]\nop_types = [\"None\"]\nsince_opset = 1\ndtypes = [\"float32\"]\nmax_rank = 1\n[files]\n\"shim.wasm\" = \"{}\"\n",
        hex::encode(Sha256::digest(shim))
    );
    Ok(Package::load_files("bench", &[("kernel.toml", text.as_bytes()), ("shim.wasm", shim)])?)
}

/// The launch plan `pkg`'s shim records for `op` on float16 tensors of `shape` (inputs
/// `n_in`, one output).
fn plan_for(pkg: &Package, op: &str, n_in: usize, dtype: DType, shape: &[usize]) -> Result<LaunchPlan> {
    let sb = Sandbox::new(SandboxConfig::default())?;
    let module = sb.load(&pkg.id(), &pkg.shim, pkg.manifest.kernel_signatures())?;
    let mut inst = module.instantiate()?;
    let nbytes = shape.iter().product::<usize>() as u64 * dtype.size().unwrap_or(1) as u64;
    let t = || {
        Some(ArgTensor {
            dtype: Some(dtype),
            dims: Some(shape.iter().map(|&d| d as i64).collect()),
            value: None,
            nbytes,
            access: Access::Opaque,
            paged: None,
            constant: false,
            in_place_of: None,
        })
    };
    let args = CallArgs {
        domain: "",
        op_type: op,
        opset: 21,
        node_name: "bench",
        attributes: vec![],
        inputs: (0..n_in).map(|_| t()).collect(),
        outputs: vec![t()],
        tile: None,
    };
    Ok(inst.call(CallKind::Dispatch, args)?.plan)
}

fn bandwidth(gpu: &mut Gpu, binary: &Arc<Package>) -> Result<(f64, f64)> {
    let n: usize = 256 << 20;
    let bytes = (n * 2) as u64;
    let bufs = [gpu.alloc.alloc(bytes)?, gpu.alloc.alloc(bytes)?, gpu.alloc.alloc(bytes)?];
    let slots: Vec<_> = bufs.iter().map(|b| (b.ptr, bytes)).collect();
    let (src, dst) = (bufs[0].ptr, bufs[2].ptr);
    let copy_ms = time_ms(gpu, 3, 20, |g| {
        // SAFETY: both buffers hold `bytes` bytes.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes as usize, g.device.enqueue().cu_stream()) }
            .map_err(|e| Error::Device(e.to_string()))
    })?;
    let plan = plan_for(binary, "Add", 2, DType::F16, &[n])?;
    let add_ms = time_ms(gpu, 3, 20, |g| g.execute(binary, &plan, &slots, 0))?;
    drop(bufs);
    Ok((2.0 * bytes as f64 / (copy_ms * 1e-3) / 1e9, 3.0 * bytes as f64 / (add_ms * 1e-3) / 1e9))
}

/// Host microseconds per op: `Gpu::execute` of a memoized plan (a 256-element Relu) vs bare
/// `cuLaunchKernel` of the same kernel with the same arguments.
fn launch_overhead(gpu: &mut Gpu, unary: &Arc<Package>) -> Result<(f64, f64)> {
    let shape = [256usize];
    let bytes = 1024u64;
    let bufs = [gpu.alloc.alloc(bytes)?, gpu.alloc.alloc(bytes)?];
    let slots: Vec<_> = bufs.iter().map(|b| (b.ptr, bytes)).collect();
    let plan = plan_for(unary, "Relu", 1, DType::F32, &shape)?;
    let memo: std::collections::HashMap<u64, LaunchPlan> = [(0u64, plan)].into_iter().collect();
    let iters = 20_000;
    gpu.execute(unary, &memo[&0], &slots, 0)?;
    gpu.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        let plan = memo.get(&0).ok_or_else(|| Error::Device("plan".into()))?;
        gpu.execute(unary, plan, &slots, 0)?;
    }
    let plan_us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    gpu.synchronize()?;
    let f = gpu.function(unary, "kiln_unary<kiln_tag_f32>")?;
    let mut cells: [u64; 6] = [bufs[0].ptr, bufs[1].ptr, 256, 0, 0, 0];
    let stream = gpu.device.enqueue();
    let t1 = Instant::now();
    for _ in 0..iters {
        let mut params: Vec<*mut std::ffi::c_void> =
            cells.iter_mut().map(|c| c as *mut u64 as *mut std::ffi::c_void).collect();
        // SAFETY: the kernel's parameters are (x, y, n, op, alpha, beta) over 256 floats.
        unsafe { cudarc::driver::result::launch_kernel(f, (1, 1, 1), (256, 1, 1), 0, stream.cu_stream(), &mut params) }
            .map_err(|e| Error::Device(e.to_string()))?;
    }
    let bare_us = t1.elapsed().as_secs_f64() * 1e6 / iters as f64;
    drop(stream);
    gpu.synchronize()?;
    drop(bufs);
    Ok((plan_us, bare_us))
}
