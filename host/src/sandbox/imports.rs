//! The host imports of module `kiln` (ABI v1). Each validates every argument and refuses a
//! bad call with a negative status (see `kiln_kernel_abi::status`), remembering the first
//! refusal so the node fails with the host's reason.

use std::ops::Range;

use kiln_kernel_abi::manifest::ParamKind;
use kiln_kernel_abi::status::{E_ARG, E_BOUNDS, E_CALL, E_HANDLE, E_LIMIT, E_MEMORY, E_READONLY, E_UNAVAILABLE};
use kiln_kernel_abi::wire::{Conv, Gemm, KernelArg, Launch, Operand, QGemm, QZeroPoints, TensorAt};
use kiln_kernel_abi::{imports as imp, DType, IMPORT_MODULE};
use wasmtime::{Caller, Engine, Linker};

use super::handles::{Access, Slot};
use super::shim::{CallKind, CallState, ConvService};
use super::{PlanArg, PlanStep};

/// Longest `fail` message kept, in bytes.
const MAX_MESSAGE: usize = 4096;
/// Largest rank `set_output` accepts.
const MAX_RANK: u32 = 64;

/// The guest memory and the call state.
fn split<'a>(caller: &'a mut Caller<'_, CallState>) -> Option<(&'a mut [u8], &'a mut CallState)> {
    let mem = caller.get_export("memory")?.into_memory()?;
    Some(mem.data_and_store_mut(caller))
}

/// `ptr..ptr+len` when inside guest memory of `size` bytes.
fn guest_range(size: usize, ptr: i32, len: usize) -> Option<Range<usize>> {
    let start = ptr as u32 as usize;
    let end = start.checked_add(len)?;
    (end <= size).then_some(start..end)
}

/// Runs `product` (a host product of a CPU call) and adds its time to the call's
/// `host_compute`.
fn timed<R>(st: &mut CallState, product: impl FnOnce(&mut CallState) -> R) -> R {
    let t0 = std::time::Instant::now();
    let r = product(st);
    st.host_compute += t0.elapsed();
    r
}

/// An import that takes one descriptor (`conv`, `qgemm`): refused in a call kind outside
/// `allowed` or for a descriptor outside the shim's memory; else `decode`d and handed to
/// `serve`, whose `Ok` is the import's return value (0, or `E_UNAVAILABLE` for a `conv` the
/// device declines) and whose error becomes an `E_ARG` refusal the call keeps.
fn descriptor_call<D, E: std::fmt::Display>(
    c: &mut Caller<'_, CallState>,
    import: &str,
    allowed: &[CallKind],
    (ptr, len): (i32, i32),
    decode: fn(&[u8]) -> Result<D, E>,
    serve: fn(&mut CallState, D) -> Result<i32, String>,
) -> i32 {
    let Some((mem, st)) = split(c) else { return E_CALL };
    if let Err(code) = expect_kind(st, import, allowed) {
        return code;
    }
    let Some(r) = guest_range(mem.len(), ptr, len as u32 as usize) else {
        return st.refuse(E_MEMORY, format!("{import}: descriptor {ptr:#x}+{len} is outside the shim's memory"));
    };
    match decode(&mem[r]).map_err(|e| format!("{import}: malformed descriptor: {e}")).and_then(|d| serve(st, d)) {
        Ok(code) => code,
        Err(msg) => st.refuse(E_ARG, msg),
    }
}

/// `conv` (checked): in a CPU call computed now on the host tensors; in a dispatch (manifest
/// schema 10) a [`PlanStep::Conv`] where the session's [`ConvService`] takes it, else
/// `E_UNAVAILABLE` (not remembered as a refusal: the shim runs its own kernels) with the reason
/// in the call's `declined`.
fn serve_conv(st: &mut CallState, cv: Conv) -> Result<i32, String> {
    let cv = check_conv(st, cv)?;
    if st.kind != Some(CallKind::Dispatch) {
        return timed(st, |st| super::cpu_conv::run(st.table.slots_mut(), &cv)).map(|()| 0);
    }
    let served = match &st.conv {
        ConvService::Unavailable(why) => Err(why.to_string()),
        ConvService::Library { takes } => takes(&cv),
    };
    Ok(match served {
        Ok(()) => push_step(st, PlanStep::Conv(cv)),
        Err(why) => {
            st.declined.push(why);
            E_UNAVAILABLE
        }
    })
}

fn expect_kind(st: &mut CallState, import: &str, allowed: &[CallKind]) -> Result<(), i32> {
    match st.kind {
        Some(k) if allowed.contains(&k) => Ok(()),
        Some(k) => Err(st.refuse(E_CALL, format!("{import} may not be called during {k:?} (allowed: {allowed:?})"))),
        None => Err(st.refuse(E_CALL, format!("{import} called outside of a call"))),
    }
}

/// Checks that `[offset, offset+len)` lies in the tensor and returns its slot.
fn slot_range<'s>(
    st: &'s mut CallState,
    import: &str,
    handle: u32,
    offset: i64,
    len: usize,
) -> Result<(&'s mut Slot, Range<usize>), i32> {
    let nbytes = match st.table.get(handle) {
        Ok(slot) => slot.nbytes,
        Err(e) => return Err(st.refuse(E_HANDLE, format!("{import}: {e}"))),
    };
    let end = u64::try_from(offset).ok().and_then(|o| o.checked_add(len as u64)).filter(|e| *e <= nbytes);
    let Some(end) = end else {
        return Err(st.refuse(
            E_BOUNDS,
            format!("{import}: bytes {offset}..+{len} are outside handle {handle:#x} of {nbytes} bytes"),
        ));
    };
    let (start, end) = (offset as u64, end);
    // A tile's output holds only the tile's share of the tensor (ABI.md §6.1.2).
    let window = match st.table.get(handle) {
        Ok(Slot { access: Access::Window { start, bytes }, .. }) => Some((*start, *start + bytes.len() as u64)),
        _ => None,
    };
    let shift = match window {
        Some((lo, hi)) if start < lo || end > hi => {
            return Err(st.refuse(
                E_BOUNDS,
                format!(
                    "{import}: bytes {start}..{end} of handle {handle:#x} are outside this tile's share {lo}..{hi}"
                ),
            ));
        }
        Some((lo, _)) => lo,
        None => 0,
    };
    let slot = st.table.get_mut(handle).map_err(|_| E_HANDLE)?;
    Ok((slot, (start - shift) as usize..(end - shift) as usize))
}

pub(super) fn linker(engine: &Engine) -> Linker<CallState> {
    let mut l = Linker::new(engine);
    let m = IMPORT_MODULE;
    // Defining functions on a fresh linker with distinct names cannot fail.
    l.func_wrap(m, imp::FAIL, |mut c: Caller<'_, CallState>, ptr: i32, len: i32| {
        let Some((mem, st)) = split(&mut c) else { return };
        let len = (len as u32 as usize).min(MAX_MESSAGE);
        match guest_range(mem.len(), ptr, len) {
            Some(r) => st.failure = Some(String::from_utf8_lossy(&mem[r]).into_owned()),
            None => {
                st.refuse(E_MEMORY, format!("fail: message {ptr:#x}+{len} is outside the shim's memory"));
            }
        }
    })
    .expect("define fail");
    l.func_wrap(
        m,
        imp::SET_OUTPUT,
        |mut c: Caller<'_, CallState>, index: i32, dtype: i32, rank: i32, dims: i32| -> i32 {
            let Some((mem, st)) = split(&mut c) else { return E_CALL };
            if let Err(code) = expect_kind(st, "set_output", &[CallKind::Infer]) {
                return code;
            }
            let i = index as u32 as usize;
            if st.output_slots.get(i).is_none_or(|s| s.is_none()) {
                return st.refuse(
                    E_ARG,
                    format!("set_output: output {index} does not exist (the node has {} outputs)", st.n_outputs),
                );
            }
            let Some(dt) = DType::from_code(dtype) else {
                return st.refuse(
                    E_ARG,
                    format!("set_output: output {index}: dtype code {dtype} is not an ONNX dtype kiln has"),
                );
            };
            if rank as u32 > MAX_RANK {
                return st.refuse(E_ARG, format!("set_output: output {index}: rank {rank} is over {MAX_RANK}"));
            }
            let Some(r) = guest_range(mem.len(), dims, rank as usize * 8) else {
                return st
                    .refuse(E_MEMORY, format!("set_output: dims {dims:#x}+{} is outside the shim's memory", rank * 8));
            };
            let dims: Vec<i64> =
                mem[r].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
            let mut shape = Vec::with_capacity(dims.len());
            let mut numel: u64 = 1;
            for d in &dims {
                match u64::try_from(*d).ok().and_then(|d| numel.checked_mul(d).map(|n| (d, n))) {
                    Some((d, n)) => {
                        numel = n;
                        shape.push(d as usize);
                    }
                    None => {
                        return st.refuse(
                            E_ARG,
                            format!("set_output: output {index}: shape {dims:?} is negative or overflows"),
                        )
                    }
                }
            }
            st.inferred[i] = Some((dt, shape));
            0
        },
    )
    .expect("define set_output");
    l.func_wrap(m, imp::READ, |mut c: Caller<'_, CallState>, handle: i32, offset: i64, dst: i32, len: i32| -> i32 {
        let Some((mem, st)) = split(&mut c) else { return E_CALL };
        if let Err(code) = expect_kind(st, "read", &[CallKind::Cpu]) {
            return code;
        }
        let len = len as u32 as usize;
        let Some(g) = guest_range(mem.len(), dst, len) else {
            return st.refuse(E_MEMORY, format!("read: destination {dst:#x}+{len} is outside the shim's memory"));
        };
        let (slot, r) = match slot_range(st, "read", handle as u32, offset, len) {
            Ok(x) => x,
            Err(code) => return code,
        };
        // An input bound in place reads its output's bytes (ABI.md §7.8).
        if let Access::Alias(output) = slot.access {
            let Some(src) = super::handles::readable(st.table.slots(), output).and_then(|b| b.get(r)) else {
                return st.refuse(
                    E_CALL,
                    format!("read: handle {handle:#x} is bound in place to an output without host bytes"),
                );
            };
            mem[g].copy_from_slice(src);
            return 0;
        }
        match &slot.access {
            Access::Read(b) => mem[g].copy_from_slice(&b[r]),
            Access::Write(v) | Access::Window { bytes: v, .. } => mem[g].copy_from_slice(&v[r]),
            Access::Strings(v) if r.end <= v.len() => mem[g].copy_from_slice(&v[r]),
            Access::Strings(v) => {
                let n = v.len();
                return st.refuse(
                    E_BOUNDS,
                    format!("read: bytes {r:?} of string output {handle:#x} are past the {n} written"),
                );
            }
            Access::Opaque | Access::InPlace | Access::Alias(_) => {
                return st.refuse(E_CALL, format!("read: handle {handle:#x} has no host bytes"))
            }
        }
        0
    })
    .expect("define read");
    l.func_wrap(m, imp::WRITE, |mut c: Caller<'_, CallState>, handle: i32, offset: i64, src: i32, len: i32| -> i32 {
        let Some((mem, st)) = split(&mut c) else { return E_CALL };
        if let Err(code) = expect_kind(st, "write", &[CallKind::Cpu]) {
            return code;
        }
        let len = len as u32 as usize;
        let Some(g) = guest_range(mem.len(), src, len) else {
            return st.refuse(E_MEMORY, format!("write: source {src:#x}+{len} is outside the shim's memory"));
        };
        let (slot, r) = match slot_range(st, "write", handle as u32, offset, len) {
            Ok(x) => x,
            Err(code) => return code,
        };
        match &mut slot.access {
            Access::Write(v) | Access::Window { bytes: v, .. } => v[r].copy_from_slice(&mem[g]),
            // A string output grows only by what is written at its end (no gaps to fill).
            Access::Strings(v) if r.start > v.len() => {
                let n = v.len();
                return st.refuse(
                    E_BOUNDS,
                    format!(
                        "write: string output {handle:#x} has {n} bytes; a write may start at most there, not at {}",
                        r.start
                    ),
                );
            }
            Access::Strings(v) => {
                if v.len() < r.end {
                    v.resize(r.end, 0);
                }
                v[r].copy_from_slice(&mem[g])
            }
            _ => return st.refuse(E_READONLY, format!("write: handle {handle:#x} is an input (read-only)")),
        }
        0
    })
    .expect("define write");
    l.func_wrap(m, imp::SCRATCH, |mut c: Caller<'_, CallState>, nbytes: i64| -> i32 {
        let Some((_, st)) = split(&mut c) else { return E_CALL };
        if let Err(code) = expect_kind(st, "scratch", &[CallKind::Cpu, CallKind::Dispatch]) {
            return code;
        }
        let kind = st.kind.unwrap_or(CallKind::Cpu);
        let total = u64::try_from(nbytes).ok().and_then(|n| st.scratch_total.checked_add(n));
        let Some(total) = total.filter(|t| *t <= st.max_scratch) else {
            return st.refuse(
                E_LIMIT,
                format!("scratch: {nbytes} bytes would exceed the per-call limit of {} bytes", st.max_scratch),
            );
        };
        if st.table.len() >= super::handles::MAX_SLOTS {
            return st.refuse(E_LIMIT, "scratch: too many tensors in one call".into());
        }
        st.scratch_total = total;
        let n = nbytes as u64;
        let access = match kind {
            CallKind::Cpu => Access::Write(vec![0u8; n as usize]),
            _ => {
                st.plan.scratch_bytes.push(n);
                Access::Opaque
            }
        };
        st.table.push(Slot { dtype: None, nbytes: n, access, writable: true }) as i32
    })
    .expect("define scratch");
    l.func_wrap(m, imp::LAUNCH, |mut c: Caller<'_, CallState>, ptr: i32, len: i32| -> i32 {
        let Some((mem, st)) = split(&mut c) else { return E_CALL };
        if let Err(code) = expect_kind(st, "launch", &[CallKind::Dispatch]) {
            return code;
        }
        let Some(r) = guest_range(mem.len(), ptr, len as u32 as usize) else {
            return st.refuse(E_MEMORY, format!("launch: descriptor {ptr:#x}+{len} is outside the shim's memory"));
        };
        match Launch::decode(&mem[r])
            .map_err(|e| format!("launch: malformed descriptor: {e}"))
            .and_then(|l| check_launch(st, &l))
        {
            Ok(step) => push_step(st, step),
            Err(msg) => st.refuse(E_ARG, msg),
        }
    })
    .expect("define launch");
    l.func_wrap(m, imp::GEMM, |mut c: Caller<'_, CallState>, ptr: i32, len: i32| -> i32 {
        let Some((mem, st)) = split(&mut c) else { return E_CALL };
        if let Err(code) = expect_kind(st, "gemm", &[CallKind::Dispatch, CallKind::Cpu]) {
            return code;
        }
        let Some(r) = guest_range(mem.len(), ptr, len as u32 as usize) else {
            return st.refuse(E_MEMORY, format!("gemm: descriptor {ptr:#x}+{len} is outside the shim's memory"));
        };
        match Gemm::decode(&mem[r])
            .map_err(|e| format!("gemm: malformed descriptor: {e}"))
            .and_then(|g| check_gemm(st, g))
        {
            // A CPU call computes the product now, on the call's host tensors.
            Ok(PlanStep::Gemm(g)) if st.kind == Some(CallKind::Cpu) => {
                match timed(st, |st| super::cpu_gemm::run(st.table.slots_mut(), &g)) {
                    Ok(()) => 0,
                    Err(msg) => st.refuse(E_ARG, msg),
                }
            }
            Ok(step) => push_step(st, step),
            Err(msg) => st.refuse(E_ARG, msg),
        }
    })
    .expect("define gemm");
    l.func_wrap(m, imp::CONV, |mut c: Caller<'_, CallState>, ptr: i32, len: i32| -> i32 {
        descriptor_call(&mut c, "conv", &[CallKind::Cpu, CallKind::Dispatch], (ptr, len), Conv::decode, serve_conv)
    })
    .expect("define conv");
    l.func_wrap(m, imp::QGEMM, |mut c: Caller<'_, CallState>, ptr: i32, len: i32| -> i32 {
        descriptor_call(&mut c, "qgemm", &[CallKind::Cpu], (ptr, len), QGemm::decode, |st, q| {
            check_qgemm(st, q).and_then(|q| timed(st, |st| super::cpu_qgemm::run(st.table.slots_mut(), &q))).map(|()| 0)
        })
    })
    .expect("define qgemm");
    l
}

/// Checks that the operand at `t`, `bytes` long (`None`: its size overflowed), lies inside its
/// tensor at a byte offset that is a multiple of `elem`; rewrites its handle to the slot index
/// and returns that. Errors name `what` (the import and operand).
fn check_tensor_at(
    st: &CallState,
    what: &str,
    t: &mut TensorAt,
    bytes: Option<u64>,
    elem: u64,
) -> Result<usize, String> {
    let slot = st.table.index(t.handle).map_err(|e| format!("{what}: {e}"))?;
    let nbytes = st.table.get(t.handle).map(|s| s.nbytes).unwrap_or(0);
    match bytes.and_then(|b| b.checked_add(t.offset)) {
        Some(end) if end <= nbytes && t.offset.is_multiple_of(elem) => {
            t.handle = slot as u32;
            Ok(slot)
        }
        _ => Err(format!(
            "{what}: the operand at byte offset {} reaches past the end of handle {:#x} ({nbytes} bytes) \
             or does not start on a whole {elem}-byte element",
            t.offset, t.handle
        )),
    }
}

/// Checks a block-quantized product: dtype, bits (2, 4, 8), a block that is a whole number of
/// bytes, m, n, k at least 1, every operand's extent inside its tensor at a whole-element offset,
/// Y an output or scratch tensor that no operand shares; rewrites handles to slot indices.
fn check_qgemm(st: &CallState, mut q: QGemm) -> Result<QGemm, String> {
    if !matches!(q.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("qgemm: dtype {} is not supported (float32, float16, bfloat16)", q.dtype));
    }
    if !matches!(q.bits, 2 | 4 | 8) || q.block == 0 || q.block > 1 << 16 || !(q.block * q.bits as u64).is_multiple_of(8)
    {
        return Err(format!(
            "qgemm: {} bits in blocks of {} (2, 4 or 8 bits; whole bytes per block, at most 65536)",
            q.bits, q.block
        ));
    }
    if q.m == 0 || q.n == 0 || q.k == 0 {
        return Err("qgemm: m, n and k must be at least 1".into());
    }
    let size = q.dtype.size().unwrap_or(4) as u64;
    let kb = q.k.div_ceil(q.block);
    let elems = |a: u64, b: u64| a.checked_mul(b);
    let check = |name: &str, t: &mut TensorAt, bytes: Option<u64>, elem: u64| {
        check_tensor_at(st, &format!("qgemm {name}"), t, bytes, elem)
    };
    if !st.table.get(q.y.handle).is_ok_and(|s| s.writable) {
        return Err(format!("qgemm Y: handle {:#x} is not an output or scratch tensor", q.y.handle));
    }
    let y = check("Y", &mut q.y, elems(q.m, q.n).and_then(|e| e.checked_mul(size)), size)?;
    let mut read = vec![
        check("A", &mut q.a, elems(q.m, q.k).and_then(|e| e.checked_mul(size)), size)?,
        check("B", &mut q.b, elems(q.n, kb).and_then(|e| e.checked_mul(q.block * q.bits as u64 / 8)), 1)?,
        check("scales", &mut q.scales, elems(q.n, kb).and_then(|e| e.checked_mul(size)), size)?,
    ];
    match &mut q.zero_points {
        QZeroPoints::Default => {}
        QZeroPoints::Packed(t) => read.push(check("zero points", t, elems(q.n, (kb * q.bits as u64).div_ceil(8)), 1)?),
        QZeroPoints::Float(t) => {
            read.push(check("zero points", t, elems(q.n, kb).and_then(|e| e.checked_mul(size)), size)?)
        }
    }
    if let Some(b) = q.bias.as_mut() {
        read.push(check("bias", b, q.n.checked_mul(size), size)?);
    }
    if read.contains(&y) {
        return Err("qgemm: Y must be a tensor of its own, not an operand".into());
    }
    Ok(q)
}

/// Checks a convolution: dtype, channel and group counts, spatial values (each at most
/// `i32::MAX`, so positions stay within i64), every operand's extent inside its tensor (Z: Y's),
/// Y an output or scratch tensor that no operand shares; rewrites handles to slot indices.
fn check_conv(st: &CallState, mut c: Conv) -> Result<Conv, String> {
    if !matches!(c.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("conv: dtype {} is not supported (float32, float16, bfloat16)", c.dtype));
    }
    let (n, cin, mout, g) = (c.batch, c.in_channels, c.out_channels, c.groups);
    if [n, cin, mout, g].contains(&0) || cin % g != 0 || mout % g != 0 {
        return Err(format!(
            "conv: batch {n}, channels {cin} in and {mout} out and groups {g} must be at least 1, the channels whole \
             multiples of groups"
        ));
    }
    let rank = c.input.len();
    let limit = i32::MAX as u64;
    let axes = [&c.output, &c.kernel, &c.strides, &c.dilations];
    if axes.iter().any(|a| a.len() != rank) || c.pads_begin.len() != rank {
        return Err("conv: every spatial list must have the same length".into());
    }
    for (what, a) in [
        ("input", &c.input),
        ("output", &c.output),
        ("kernel", &c.kernel),
        ("strides", &c.strides),
        ("dilations", &c.dilations),
    ] {
        if a.iter().any(|&v| v == 0 || v > limit) {
            return Err(format!("conv: every {what} value must be 1 to {limit}, got {a:?}"));
        }
    }
    if c.pads_begin.iter().any(|p| p.unsigned_abs() > limit) {
        return Err(format!("conv: pads_begin {:?} are out of range (±{limit})", c.pads_begin));
    }
    let size = c.dtype.size().unwrap_or(4) as u64;
    let prod = |v: &[u64]| v.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
    let taps = prod(&c.kernel);
    let w_elems = match c.transposed {
        false => taps.and_then(|t| t.checked_mul(mout)?.checked_mul(cin / g)),
        true => taps.and_then(|t| t.checked_mul(cin)?.checked_mul(mout / g)),
    };
    let x_elems = prod(&c.input).and_then(|p| p.checked_mul(n)?.checked_mul(cin));
    let y_elems = prod(&c.output).and_then(|p| p.checked_mul(n)?.checked_mul(mout));
    let check = |name: &str, t: &mut TensorAt, elems: Option<u64>| {
        check_tensor_at(st, &format!("conv {name}"), t, elems.and_then(|e| e.checked_mul(size)), size)
    };
    if !st.table.get(c.y.handle).is_ok_and(|s| s.writable) {
        return Err(format!("conv Y: handle {:#x} is not an output or scratch tensor", c.y.handle));
    }
    let y = check("Y", &mut c.y, y_elems)?;
    let mut read = vec![check("X", &mut c.x, x_elems)?, check("W", &mut c.w, w_elems)?];
    if let Some(b) = c.bias.as_mut() {
        read.push(check("bias", b, Some(mout))?);
    }
    if let Some(z) = c.z.as_mut() {
        read.push(check("Z", z, y_elems)?);
    }
    if read.contains(&y) {
        return Err("conv: Y must be a tensor of its own, not X, W, bias or Z".into());
    }
    Ok(c)
}

fn push_step(st: &mut CallState, step: PlanStep) -> i32 {
    if st.plan.steps.len() >= st.max_steps {
        return st.refuse(E_LIMIT, format!("more than {} launches in one dispatch", st.max_steps));
    }
    st.plan.steps.push(step);
    0
}

fn check_launch(st: &CallState, l: &Launch<'_>) -> Result<PlanStep, String> {
    let Some(params) = st.kernels.get(l.kernel) else {
        return Err(format!("launch: kernel {:?} is not declared in the package's kernel.toml", l.kernel));
    };
    check_signature(l, params)?;
    let lim = &st.limits;
    let threads = l.block.iter().map(|&b| b as u64).product::<u64>();
    let dims_ok = |v: &[u32; 3], max: &[u32; 3]| v.iter().zip(max).all(|(a, m)| *a >= 1 && a <= m);
    if !dims_ok(&l.block, &lim.max_block) || threads > lim.max_threads_per_block as u64 {
        return Err(format!(
            "launch {}: block {:?} is over the device limits {:?} / {} threads",
            l.kernel, l.block, lim.max_block, lim.max_threads_per_block
        ));
    }
    if !dims_ok(&l.grid, &lim.max_grid) {
        return Err(format!("launch {}: grid {:?} is outside 1..={:?}", l.kernel, l.grid, lim.max_grid));
    }
    if l.shared_mem_bytes > lim.max_shared_mem_bytes {
        return Err(format!(
            "launch {}: {} bytes of shared memory is over the limit of {}",
            l.kernel, l.shared_mem_bytes, lim.max_shared_mem_bytes
        ));
    }
    let mut args = Vec::with_capacity(l.args.len());
    for a in &l.args {
        args.push(match *a {
            KernelArg::Tensor { handle, offset } => {
                let slot = st.table.index(handle).map_err(|e| format!("launch {}: {e}", l.kernel))?;
                let nbytes = st.table.get(handle).map(|s| s.nbytes).unwrap_or(0);
                if offset > nbytes {
                    return Err(format!(
                        "launch {}: offset {offset} is past the end of handle {handle:#x} ({nbytes} bytes)",
                        l.kernel
                    ));
                }
                PlanArg::Tensor { slot, offset }
            }
            KernelArg::Counters(n) if n == 0 || n > kiln_kernel_abi::wire::MAX_COUNTERS => {
                return Err(format!(
                    "launch {}: {n} counters (1 to {} per node)",
                    l.kernel,
                    kiln_kernel_abi::wire::MAX_COUNTERS
                ));
            }
            scalar => PlanArg::Scalar(scalar),
        });
    }
    Ok(PlanStep::Launch {
        kernel: l.kernel.to_string(),
        grid: l.grid,
        block: l.block,
        shared_mem_bytes: l.shared_mem_bytes,
        args,
    })
}

/// The launch's arguments against the kernel's declared parameters (ABI.md §7.3): their number,
/// and each one's kind (a tensor or a scalar of a type and width). A mismatch never reaches the
/// driver, which would read a parameter buffer of the wrong layout.
fn check_signature(l: &Launch<'_>, params: &[ParamKind]) -> Result<(), String> {
    if l.args.len() != params.len() {
        return Err(format!(
            "launch {}: {} arguments, but kernel.toml declares {} parameters ({})",
            l.kernel,
            l.args.len(),
            params.len(),
            params.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
        ));
    }
    for (i, (a, p)) in l.args.iter().zip(params).enumerate() {
        let got = ParamKind::of(a);
        if got != *p {
            return Err(format!(
                "launch {}: argument {i} is {} but parameter {i} is declared {}",
                l.kernel,
                describe(got),
                describe(*p)
            ));
        }
    }
    Ok(())
}

fn describe(k: ParamKind) -> String {
    match k {
        ParamKind::Tensor => "a tensor".into(),
        ParamKind::Status => "the status record".into(),
        ParamKind::Counters => "the node's counters".into(),
        scalar => format!("a {}-byte scalar {}", scalar.size(), scalar.name()),
    }
}

/// Checks every operand's extent (the last element any matrix of the batch touches) and
/// rewrites handles to slot indices.
fn check_gemm(st: &CallState, mut g: Gemm) -> Result<PlanStep, String> {
    if !matches!(g.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("gemm: dtype {} is not supported (float32, float16, bfloat16)", g.dtype));
    }
    if g.m == 0 || g.n == 0 || g.k == 0 || g.batch == 0 {
        return Err("gemm: m, n, k and batch must be at least 1".into());
    }
    let size = g.dtype.size().unwrap_or(4) as u64;
    let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    let check = |name: &str, o: &mut Operand, rows: u64, cols: u64| -> Result<(), String> {
        let slot = st.table.index(o.handle).map_err(|e| format!("gemm {name}: {e}"))?;
        let nbytes = st.table.get(o.handle).map(|s| s.nbytes).unwrap_or(0);
        if o.ld < cols && rows > 1 {
            return Err(format!("gemm {name}: leading dimension {} is below {cols} columns", o.ld));
        }
        // A one-row operand's ld and a one-matrix batch's stride are never used: made plain so
        // that no consumer sees an arbitrary stride.
        if rows == 1 {
            o.ld = cols;
        }
        if g.batch == 1 {
            o.batch_stride = 0;
        }
        let last = (g.batch - 1)
            .checked_mul(o.batch_stride)
            .and_then(|x| x.checked_add((rows - 1).checked_mul(o.ld)?))
            .and_then(|x| x.checked_add(cols))
            .and_then(|x| x.checked_mul(size))
            .and_then(|x| x.checked_add(o.offset));
        match last {
            Some(end) if end <= nbytes => {
                o.handle = slot as u32;
                Ok(())
            }
            _ => {
                Err(format!("gemm {name}: the operand reaches past the end of handle {:#x} ({nbytes} bytes)", o.handle))
            }
        }
    };
    let (m, n) = (g.m, g.n);
    if g.beta != 0.0 && g.c.is_none() {
        return Err("gemm: beta is not 0 but C is absent".into());
    }
    if !st.table.get(g.d.handle).is_ok_and(|s| s.writable) {
        return Err(format!("gemm D: handle {:#x} is not an output or scratch tensor", g.d.handle));
    }
    check("A", &mut g.a, ar, ac)?;
    check("B", &mut g.b, br, bc)?;
    check("D", &mut g.d, m, n)?;
    // D's matrices must not overlap (no two write one element): one after another, or side by
    // side within each row (heads of one row, as an attention output lays them out).
    let stacked = g.d.batch_stride >= (m - 1) * g.d.ld + n;
    let side_by_side = g.d.batch_stride >= n && (g.batch - 1) * g.d.batch_stride + n <= g.d.ld;
    if g.batch > 1 && !stacked && !side_by_side {
        return Err(format!(
            "gemm D: batch stride {} overlaps its matrices of {m} rows (ld {}) of {n}",
            g.d.batch_stride, g.d.ld
        ));
    }
    if let Some(c) = g.c.as_mut() {
        check("C", c, m, n)?;
    }
    if let Some(b) = g.bias.as_mut() {
        b.ld = n;
        b.batch_stride = 0;
        check("bias", b, 1, n)?;
    }
    Ok(PlanStep::Gemm(g))
}
