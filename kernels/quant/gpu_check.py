import ctypes, math, sys, os
import numpy as np
import torch

torch.zeros(1, device="cuda")
nvrtc = ctypes.CDLL("libnvrtc.so.13")
cu = ctypes.CDLL("libcuda.so.1")
ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../.."
PRE = open(ROOT + "/host/cuda/kiln.cuh", "rb").read()


def load(path):
    prog = ctypes.c_void_p()
    src = open(path, "rb").read()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"x.cu", 1, (ctypes.c_char_p * 1)(PRE), (ctypes.c_char_p * 1)(b"kiln.cuh")) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    mod = ctypes.c_void_p()
    assert cu.cuModuleLoadData(ctypes.byref(mod), ptx) == 0
    return mod


def fn(mod, name):
    f = ctypes.c_void_p()
    assert cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()) == 0, name
    return f


def launch(mod, name, grid, block, args):
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            vals.append(ctypes.c_uint64(a.data_ptr()))
        else:
            k, v = a
            vals.append({"u32": ctypes.c_uint32, "i32": ctypes.c_int32, "u64": ctypes.c_uint64, "f32": ctypes.c_float}[k](v))
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    rc = cu.cuLaunchKernel(fn(mod, name), *grid, *block, 0, None, ptrs, None)
    assert rc == 0, (name, rc)
    torch.cuda.synchronize()


U32 = lambda v: ("u32", int(v))
I32 = lambda v: ("i32", int(v))
U64 = lambda v: ("u64", int(v))
F32 = lambda v: ("f32", float(v))
SUF = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
rng = np.random.default_rng(1)
fails = 0


def check(what, got, want, tol):
    global fails
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    err = np.abs(got - want).max() if got.size else 0
    scale = max(1.0, np.abs(want).max() if want.size else 1)
    ok = err <= tol * scale and not np.isnan(got).any()
    if not ok:
        fails += 1
    print(("ok  " if ok else "FAIL"), what, f"err={err:.3g} scale={scale:.3g}")


def rnd(dt, *shape):
    return torch.tensor(rng.uniform(-1, 1, shape), dtype=dt, device="cuda")


def f64(t):
    return t.double().cpu().numpy()


# ------------------------------------------------------------------------------------------
# MatMulNBits
qm = load(ROOT + "/kernels/quant/cuda/quant.cu")


def pack(vals, bits):
    per = 8 // bits
    vals = vals.reshape(-1)
    out = np.zeros((len(vals) + per - 1) // per, dtype=np.uint8)
    for i, v in enumerate(vals):
        out[i // per] |= (int(v) << ((i % per) * bits)) & 0xFF
    return out


def mnb_case(dt, M, N, K, bits, block, zp_kind, bias, gemm):
    kb = (K + block - 1) // block
    q = rng.integers(0, 1 << bits, size=(N, kb * block))
    B = np.concatenate([pack(q[n], bits) for n in range(N)])
    scales = rnd(dt, N, kb) * 0.1
    zrow = (kb * bits + 7) // 8
    if zp_kind == 0:
        z = np.full((N, kb), float(1 << (bits - 1)))
        zp_u8, zp_f = torch.tensor(B, device="cuda"), scales
    elif zp_kind == 1:
        zq = rng.integers(0, 1 << bits, size=(N, kb))
        z = zq.astype(np.float64)
        zp_u8 = torch.tensor(np.concatenate([pack(zq[n], bits) for n in range(N)]), device="cuda")
        assert zp_u8.numel() == N * zrow
        zp_f = scales
    else:
        zp_f = (rnd(dt, N, kb) + 1) * (1 << (bits - 1))
        z = f64(zp_f)
        zp_u8 = torch.tensor(B, device="cuda")
    Bt = torch.tensor(B, device="cuda")
    A = rnd(dt, M, K)
    bias_t = rnd(dt, N)
    W = (q[:, :K] - z.repeat(block, axis=1)[:, :K]) * f64(scales).repeat(block, axis=1)[:, :K]
    want = f64(A) @ W.T + (f64(bias_t) if bias else 0)
    Y = torch.zeros(M, N, dtype=dt, device="cuda")
    s = SUF[dt]
    quant = [U32(block), U32(bits), U32(kb), U32(zp_kind), U32(zrow), U32(0)]
    if not gemm:
        launch(qm, "kiln_mnb_gemv_" + s, ((N + 7) // 8, (M + 7) // 8, 1), (256, 1, 1),
               [A, Bt, scales, zp_u8, zp_f, Bt, bias_t if bias else Y, Y, U64(M), U32(N), U32(K)] + quant + [U32(bias)])
    else:
        Wt = torch.zeros(N, K, dtype=dt, device="cuda")
        launch(qm, "kiln_mnb_dequant_" + s, (max(1, min((N * K + 255) // 256, 65535 * 32)), 1, 1), (256, 1, 1),
               [Bt, scales, zp_u8, zp_f, Bt, Wt, U32(N), U32(K)] + quant)
        check(f"mnb dequant {s} N={N} K={K} bits={bits} block={block} zp={zp_kind}", f64(Wt), W, TOL[dt])
        Y = (A.float() @ Wt.float().T + (bias_t.float() if bias else 0)).to(dt)
    check(f"mnb {'gemm' if gemm else 'gemv'} {s} M={M} N={N} K={K} bits={bits} block={block} zp={zp_kind} bias={bias}",
          f64(Y), want, TOL[dt] * 4)


for dt in SUF:
    for (M, N, K, bits, block, zp, bias) in [(1, 64, 128, 4, 32, 0, 0), (3, 37, 200, 4, 64, 1, 1), (8, 20, 77, 8, 16, 2, 1),
                                             (11, 9, 300, 2, 128, 1, 0), (1, 300, 512, 8, 256, 0, 1), (2, 5, 33, 4, 16, 2, 0)]:
        mnb_case(dt, M, N, K, bits, block, zp, bias, False)
    mnb_case(dt, 17, 24, 100, 4, 32, 1, 1, True)
    # fill
    bias_t = rnd(dt, 7)
    Y = torch.full((3, 7), 5.0, dtype=dt, device="cuda")
    launch(qm, "kiln_mnb_fill_" + SUF[dt], (1, 1, 1), (256, 1, 1), [bias_t, Y, U64(21), U32(7), U32(1)])
    check("mnb fill", f64(Y), np.tile(f64(bias_t), (3, 1)), 0)

# GatherBlockQuantized: data [R, C/comps] packed along last axis, quantize_axis last
for dt in SUF:
    for bits, has_zp, idx64 in [(4, 1, 0), (8, 0, 1), (2, 1, 1)]:
        comps = 8 // bits
        R, C, block = 10, 96, 32
        q = rng.integers(0, 1 << bits, size=(R, C))
        data = torch.tensor(np.concatenate([pack(q[r], bits) for r in range(R)]), device="cuda")
        qb = C // block
        scales = rnd(dt, R, qb)
        zq = rng.integers(0, 1 << bits, size=(R, qb))
        zrow = (qb + comps - 1) // comps
        zp = torch.tensor(np.concatenate([pack(zq[r], bits) for r in range(R)]) if comps > 1 else zq.astype(np.uint8).reshape(-1), device="cuda")
        idx = np.array([3, -1, 0, 12, 9])
        ind = torch.tensor(idx, dtype=torch.int64 if idx64 else torch.int32, device="cuda")
        out = torch.full((5, C), 7.0, dtype=dt, device="cuda")
        launch(qm, "kiln_gbq_" + SUF[dt], (3, 1, 1), (256, 1, 1),
               [data, ind, scales, zp if has_zp else data, out, U64(5 * C), U64(R), U64(C), U64(C), U64(1), U64(qb), U32(block), U32(bits), U32(has_zp), U32(idx64)])
        z = zq if has_zp else np.full((R, qb), 1 << (bits - 1))
        deq = (q - z.repeat(block, axis=1)) * f64(scales).repeat(block, axis=1)
        want = np.stack([deq[i] if -R <= i < R else np.zeros(C) for i in idx])
        check(f"gbq {SUF[dt]} bits={bits} zp={has_zp} i64={idx64}", f64(out), want, TOL[dt])

# ------------------------------------------------------------------------------------------
# Attention
am = load(ROOT + "/kernels/attention/cuda/attention.cu")


def rot_ref(x, c, s, interleaved):
    x = x.copy()
    half = len(c)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        xa, xb = x[a], x[b]
        x[a] = xa * c[i] - xb * s[i]
        x[b] = xa * s[i] + xb * c[i]
    return x


def rnd_dt(x, dt):
    return torch.tensor(x, dtype=torch.float64).to(dt).double().numpy()


def gqa_case(dt, B, S, N, Nk, H, P, total, lens, rotary, interleaved, packed, window, softcap, sink_mode, bias):
    s_ = SUF[dt]
    group = N // Nk
    first = S == total
    PL = max(total, P)
    shared = P > 0 and P >= total
    q = rnd(dt, B, S, N * H)
    k = rnd(dt, B, S, Nk * H)
    v = rnd(dt, B, S, Nk * H)
    pk = rnd(dt, B, Nk, P, H) if P else None
    pv = rnd(dt, B, Nk, P, H) if P else None
    rows, half = max(64, PL), (rotary if rotary else 0)
    cos = rnd(dt, rows, max(half, 1))
    sin = rnd(dt, rows, max(half, 1))
    seql = torch.tensor([l - 1 for l in lens], dtype=torch.int32, device="cuda")
    biasd = (1 if bias == 2 else B, N if bias else 1)
    bias_t = rnd(dt, biasd[0], biasd[1], S, total) if bias else q
    sink_t = rnd(dt, N)
    scale = 1 / math.sqrt(H)
    if packed:
        qin = torch.cat([q, k, v], dim=2).contiguous()
        kv_w, k_off, v_off, q_w = (N + 2 * Nk) * H, N * H, (N + Nk) * H, (N + 2 * Nk) * H
        ksrc = vsrc = qin
    else:
        qin, ksrc, vsrc = q, k, v
        kv_w, k_off, v_off, q_w = Nk * H, 0, 0, N * H
    presk = torch.full((B, Nk, PL, H), 9.0, dtype=dt, device="cuda")
    presv = torch.full((B, Nk, PL, H), 9.0, dtype=dt, device="cuda")
    out = torch.full((B, S, N * H), 9.0, dtype=dt, device="cuda")
    n = B * Nk * PL * H
    launch(am, "kiln_gqa_kv_" + s_, (max(1, min((n + 255) // 256, 65535 * 32)), 1, 1), (256, 1, 1),
           [ksrc, vsrc, pk if P else qin, pv if P else qin, seql, cos, sin, presk, presv, U32(B), U32(S), U32(Nk), U32(H),
            U32(PL), U32(P), U64(kv_w), U64(k_off), U64(v_off), U32(first), U32(shared), U64(rows if rotary else 0),
            U32(half), U32(interleaved)])
    warps = 8 if S == 1 else 4
    launch(am, "kiln_gqa_attn_" + s_, (S, N, B), (32 * warps, 1, 1),
           [qin, presk, presv, seql, cos, sin, bias_t, sink_t if sink_mode == 2 else q, out, U32(S), U32(N), U32(Nk), U32(H),
            U32(PL), U64(q_w), U32(first), U64(rows if rotary else 0), U32(half), U32(interleaved), F32(scale), F32(softcap),
            I32(window), U32(bool(bias)), U32(biasd[0]), U32(biasd[1]), U32(total), U32(sink_mode)])
    # reference
    Q, K, V = f64(q), f64(k), f64(v)
    C, Sn = f64(cos), f64(sin)
    refk = f64(pk).copy() if shared else np.zeros((B, Nk, PL, H))
    refv = f64(pv).copy() if shared else np.zeros((B, Nk, PL, H))
    o = np.zeros((B, S, N * H))
    for b in range(B):
        t_b = lens[b]
        past_b = 0 if first else t_b - S
        for j in range(Nk):
            if not shared and past_b > 0:
                refk[b, j, :past_b] = f64(pk)[b, j, :past_b]
                refv[b, j, :past_b] = f64(pv)[b, j, :past_b]
            for s in range(S):
                kr = K[b, s, j * H:(j + 1) * H]
                if rotary:
                    kr = kr.copy()
                    kr[:2 * half] = rot_ref(kr[:2 * half], C[past_b + s], Sn[past_b + s], interleaved)
                    kr = rnd_dt(kr, dt)
                refk[b, j, past_b + s] = kr
                refv[b, j, past_b + s] = V[b, s, j * H:(j + 1) * H]
        for h in range(N):
            j = h // group
            for s in range(S):
                causal = past_b + s + 1
                start = causal - window if window >= 0 and causal > window else 0
                end = min(causal, t_b)
                if start >= end:
                    continue
                qr = Q[b, s, h * H:(h + 1) * H].copy()
                if rotary:
                    qr[:2 * half] = rot_ref(qr[:2 * half], C[past_b + s], Sn[past_b + s], interleaved)
                    qr = rnd_dt(qr, dt)
                x = refk[b, j, start:end] @ qr * scale
                if softcap > 0:
                    x = softcap * np.tanh(x / softcap)
                if bias:
                    x = x + f64(bias_t)[0 if biasd[0] == 1 else b, h, s, start:end]
                mx = x.max()
                sv = None if sink_mode == 0 else (0.0 if sink_mode == 1 else f64(sink_t)[h])
                if sv is not None:
                    mx = max(mx, sv)
                e = np.exp(x - mx)
                den = e.sum() + (np.exp(sv - mx) if sv is not None else 0)
                o[b, s, h * H:(h + 1) * H] = (e / den) @ refv[b, j, start:end]
    name = f"gqa {s_} B={B} S={S} N={N}/{Nk} H={H} P={P} total={total} lens={lens} rot={rotary}{'i' if interleaved else ''} packed={packed} win={window} cap={softcap} sink={sink_mode} bias={bias}"
    check(name + " out", f64(out), o, TOL[dt] * 2)
    check(name + " pk", f64(presk), refk, TOL[dt])
    check(name + " pv", f64(presv), refv, TOL[dt])


for dt in SUF:
    # prompt with right padding, no past
    gqa_case(dt, 2, 5, 4, 2, 16, 0, 5, [5, 3], 8, False, False, -1, 0.0, 0, 0)
    # prompt into shared buffer, packed, interleaved rotary, head 80 (partial rotary)
    gqa_case(dt, 2, 6, 8, 2, 80, 12, 6, [6, 4], 16, True, True, -1, 0.0, 0, 0)
    # decode, shared buffer
    gqa_case(dt, 3, 1, 32, 8, 128, 40, 30, [30, 12, 1], 64, False, False, -1, 0.0, 0, 0)
    # decode non-shared (past shorter than total), window, softcap, sink, bias
    gqa_case(dt, 2, 1, 6, 3, 64, 20, 21, [21, 9], 32, False, False, 7, 30.0, 2, 1)
    # chunked prefill with past (batch 1), smooth softmax, broadcast bias, head 256
    gqa_case(dt, 1, 4, 4, 1, 256, 16, 14, [14], 0, False, False, -1, 0.0, 1, 2)
    # long decode
    gqa_case(dt, 1, 1, 8, 2, 128, 600, 555, [555], 64, False, False, -1, 0.0, 0, 0)

# RotaryEmbedding
for dt in SUF:
    for transposed, scalar, inter, rd in [(False, True, False, 32), (True, False, True, 16), (False, False, False, 64)]:
        B, S, N, H = 2, 5, 3, 64
        half = rd // 2
        rows = 40
        x = rnd(dt, B, N, S, H) if transposed else rnd(dt, B, S, N * H)
        cos, sin = rnd(dt, rows, half), rnd(dt, rows, half)
        pos = torch.tensor([7] if scalar else rng.integers(0, rows, size=(B, S)), dtype=torch.int64, device="cuda")
        y = torch.full_like(x, 9.0)
        tot = x.numel()
        launch(am, "kiln_rope_" + SUF[dt], ((tot + 255) // 256, 1, 1), (256, 1, 1),
               [x, pos, cos, sin, y, U64(tot), U32(S), U32(N), U32(H), U32(half), U64(rows), U32(transposed), U32(scalar), U32(inter)])
        X = f64(x)
        W = X.copy()
        P = f64(pos)
        for b in range(B):
            for s in range(S):
                p = int(P[0] + s) if scalar else int(P[b, s])
                for n in range(N):
                    sl = (b, n, s, slice(0, rd)) if transposed else (b, s, slice(n * H, n * H + rd))
                    W[sl] = rot_ref(X[sl], f64(cos)[p], f64(sin)[p], inter)
        check(f"rope {SUF[dt]} transposed={transposed} scalar={scalar} inter={inter} rd={rd}", f64(y), W, TOL[dt])

print("FAILURES", fails)
sys.exit(1 if fails else 0)
