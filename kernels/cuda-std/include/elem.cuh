// kiln-cuda-std/elem.cuh — element types by the prelude's dtype tag (kiln_tag_f32 … kiln_tag_u64):
// kiln_elem<Tag>::S is the storage type (the tag's `storage`), C the type arithmetic runs in
// (float for float32, float16 and bfloat16; double for float64; the 64-bit two's complement
// pattern for integers), ld / st convert between them, is_float and is_signed describe it.
// Kernels templated over the tag (manifest name expressions, ABI.md §7.3.1) reach their element
// type through it.
#pragma once
#include "kiln.cuh"

template <typename Tag> struct kiln_elem;
template <> struct kiln_elem<kiln_tag_f32> {
    typedef kiln_tag_f32::storage S;
    typedef float C;
    static const bool is_float = true;
    static const bool is_signed = true;
    __device__ static C ld(S v) { return v; }
    __device__ static S st(C v) { return v; }
};
template <> struct kiln_elem<kiln_tag_f16> {
    typedef kiln_tag_f16::storage S;
    typedef float C;
    static const bool is_float = true;
    static const bool is_signed = true;
    __device__ static C ld(S v) { return kiln_f16_to_f32(v); }
    __device__ static S st(C v) { return kiln_f32_to_f16(v); }
};
template <> struct kiln_elem<kiln_tag_bf16> {
    typedef kiln_tag_bf16::storage S;
    typedef float C;
    static const bool is_float = true;
    static const bool is_signed = true;
    __device__ static C ld(S v) { return kiln_bf16_to_f32(v); }
    __device__ static S st(C v) { return kiln_f32_to_bf16(v); }
};
template <> struct kiln_elem<kiln_tag_f64> {
    typedef kiln_tag_f64::storage S;
    typedef double C;
    static const bool is_float = true;
    static const bool is_signed = true;
    __device__ static C ld(S v) { return v; }
    __device__ static S st(C v) { return v; }
};
// Integers compute on their 64-bit two's complement pattern (sign- or zero-extended), as the
// CPU reference widens to i64; storing truncates (wraps).
template <typename Tag, bool SIGNED>
struct kiln_int_elem {
    typedef typename Tag::storage S;
    typedef kiln_u64 C;
    static const bool is_float = false;
    static const bool is_signed = SIGNED;
    __device__ static C ld(S v) { return (kiln_u64)v; }
    __device__ static S st(C v) { return (S)v; }
};
template <> struct kiln_elem<kiln_tag_i8> : kiln_int_elem<kiln_tag_i8, true> {};
template <> struct kiln_elem<kiln_tag_i16> : kiln_int_elem<kiln_tag_i16, true> {};
template <> struct kiln_elem<kiln_tag_i32> : kiln_int_elem<kiln_tag_i32, true> {};
template <> struct kiln_elem<kiln_tag_i64> : kiln_int_elem<kiln_tag_i64, true> {};
template <> struct kiln_elem<kiln_tag_u8> : kiln_int_elem<kiln_tag_u8, false> {};
template <> struct kiln_elem<kiln_tag_u16> : kiln_int_elem<kiln_tag_u16, false> {};
template <> struct kiln_elem<kiln_tag_u32> : kiln_int_elem<kiln_tag_u32, false> {};
template <> struct kiln_elem<kiln_tag_u64> : kiln_int_elem<kiln_tag_u64, false> {};
