//! Element types, numbered as ONNX's `TensorProto.DataType` (onnx/onnx.proto).

use core::fmt;

/// A tensor element type. The discriminant is the ONNX `TensorProto.DataType` code, which is
/// also how the ABI encodes a dtype (`i32`).
///
/// `String` tensors cross the ABI in [`crate::strings`]' layout (manifest schema 12), and only
/// on the CPU: their elements have no fixed size.
///
/// The float8 types (`float8e4m3fn` … `float8e8m0`) take one byte per element. The 4-bit and
/// 2-bit types (`int4`, `uint4`, `float4e2m1`, `int2`, `uint2`) are packed as ONNX packs them
/// (onnx.proto): two or four elements per byte, the first in the lowest bits, the last byte
/// padded with zero bits; a tensor of them takes [`DType::storage_bytes`] bytes, not
/// `numel × size` ([`DType::size`] is `None` for them). [`crate::minifloat`] converts their values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum DType {
    F32 = 1,
    U8 = 2,
    I8 = 3,
    U16 = 4,
    I16 = 5,
    I32 = 6,
    I64 = 7,
    String = 8,
    Bool = 9,
    F16 = 10,
    F64 = 11,
    U32 = 12,
    U64 = 13,
    BF16 = 16,
    /// float8, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN `S.1111.111`.
    F8E4M3FN = 17,
    /// float8, 4 exponent bits (bias 8), 3 mantissa bits; no infinities, no −0, NaN `0x80`.
    F8E4M3FNUZ = 18,
    /// float8, 5 exponent bits (bias 15), 2 mantissa bits; IEEE-style infinities and NaNs.
    F8E5M2 = 19,
    /// float8, 5 exponent bits (bias 16), 2 mantissa bits; no infinities, no −0, NaN `0x80`.
    F8E5M2FNUZ = 20,
    /// Unsigned 4-bit integer, two per byte.
    U4 = 21,
    /// Signed (two's complement) 4-bit integer, two per byte.
    I4 = 22,
    /// float4, 2 exponent bits (bias 1), 1 mantissa bit; no infinities or NaN; two per byte.
    F4E2M1 = 23,
    /// float8 of exponent only: the value 2^(e − 127), `0xFF` NaN (the OCP MX scale type).
    F8E8M0 = 24,
    /// Unsigned 2-bit integer, four per byte.
    U2 = 25,
    /// Signed (two's complement) 2-bit integer, four per byte.
    I2 = 26,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 24] = [
        DType::F32,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::String,
        DType::Bool,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::U64,
        DType::BF16,
        DType::F8E4M3FN,
        DType::F8E4M3FNUZ,
        DType::F8E5M2,
        DType::F8E5M2FNUZ,
        DType::U4,
        DType::I4,
        DType::F4E2M1,
        DType::F8E8M0,
        DType::U2,
        DType::I2,
    ];

    /// The dtype with ONNX code `code`, or `None` for codes kiln does not represent
    /// (complex64, complex128, and codes after 26).
    pub fn from_code(code: i32) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as i32 == code)
    }

    /// The ONNX `TensorProto.DataType` code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// Size of one element in bytes; `None` for `String` and for the packed sub-byte types
    /// (see [`DType::bits`] and [`DType::storage_bytes`]).
    pub fn size(self) -> Option<usize> {
        match self.bits()? {
            b if b % 8 == 0 => Some(b as usize / 8),
            _ => None,
        }
    }

    /// Bits of one element: 2 (`int2`, `uint2`), 4 (`int4`, `uint4`, `float4e2m1`), 8 … 64;
    /// `None` for `String`.
    pub fn bits(self) -> Option<u32> {
        Some(match self {
            DType::U2 | DType::I2 => 2,
            DType::U4 | DType::I4 | DType::F4E2M1 => 4,
            DType::U8 | DType::I8 | DType::Bool => 8,
            DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 => 8,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 16,
            DType::F32 | DType::I32 | DType::U32 => 32,
            DType::I64 | DType::U64 | DType::F64 => 64,
            DType::String => return None,
        })
    }

    /// Bytes that `numel` elements take: `numel × size`, or for the packed types
    /// ⌈`numel` × bits / 8⌉ (the last byte padded). `None` for `String` and on overflow.
    pub fn storage_bytes(self, numel: u64) -> Option<u64> {
        let bits = numel.checked_mul(self.bits()? as u64)?;
        Some(bits.div_ceil(8))
    }

    /// Whether elements are packed several to a byte (`int4`, `uint4`, `float4e2m1`, `int2`,
    /// `uint2`).
    pub fn is_packed(self) -> bool {
        self.bits().is_some_and(|b| b < 8)
    }

    /// Whether this is one of the narrow float types that ONNX defines for storage and
    /// conversion (float8 in its five forms, float4e2m1): values are converted with
    /// [`crate::minifloat`], not computed on.
    pub fn is_minifloat(self) -> bool {
        matches!(
            self,
            DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 | DType::F4E2M1
        )
    }

    /// Whether this is a 4-bit or 2-bit integer (`int4`, `uint4`, `int2`, `uint2`).
    pub fn is_narrow_int(self) -> bool {
        matches!(self, DType::U4 | DType::I4 | DType::U2 | DType::I2)
    }

    /// The manifest schema from which packages list this dtype in `dtypes` and the host passes
    /// tensors of it (ABI.md §7.2): 11 for the float8, 4-bit and 2-bit types, 12 for `string`
    /// (§6's string layout), 1 for the rest.
    pub fn since_schema(self) -> u32 {
        match self {
            DType::String => 12,
            d if d.is_minifloat() || d.is_narrow_int() => 11,
            _ => 1,
        }
    }

    /// Whether this is one of the dtypes of manifest schema 11 (the float8, 4-bit and 2-bit
    /// types), which kernels take by their code.
    pub fn since_schema_11(self) -> bool {
        self.since_schema() == 11
    }

    /// The prelude's tag type of this dtype (`kiln.cuh`, ABI.md §7.3.1): `kiln_tag_f32`,
    /// `kiln_tag_f16`, `kiln_tag_bf16`, `kiln_tag_f64`, `kiln_tag_i8` … `kiln_tag_u64`,
    /// `kiln_tag_bool`, each with a `storage` typedef of its element's C type. The template
    /// argument a kernel templated over the element type takes, so that a shim names it with
    /// [`crate::names::kernel_name`] and keeps no table of its own. `None` for `string` and the
    /// float8, 4-bit and 2-bit types (kernels take those by their dtype code).
    pub fn cuda_tag(self) -> Option<&'static str> {
        Some(match self {
            DType::F32 => "kiln_tag_f32",
            DType::U8 => "kiln_tag_u8",
            DType::I8 => "kiln_tag_i8",
            DType::U16 => "kiln_tag_u16",
            DType::I16 => "kiln_tag_i16",
            DType::I32 => "kiln_tag_i32",
            DType::I64 => "kiln_tag_i64",
            DType::String => return None,
            DType::Bool => "kiln_tag_bool",
            DType::F16 => "kiln_tag_f16",
            DType::F64 => "kiln_tag_f64",
            DType::U32 => "kiln_tag_u32",
            DType::U64 => "kiln_tag_u64",
            DType::BF16 => "kiln_tag_bf16",
            _ => return None,
        })
    }

    /// The name used in manifests, CLI output and errors: `float32`, `float16`, `bfloat16`,
    /// `float64`, `int8` … `uint64`, `bool`, `string`, and ONNX's names in lower case for the
    /// rest: `float8e4m3fn`, `float8e4m3fnuz`, `float8e5m2`, `float8e5m2fnuz`, `float8e8m0`,
    /// `float4e2m1`, `int4`, `uint4`, `int2`, `uint2`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::String => "string",
            DType::Bool => "bool",
            DType::F16 => "float16",
            DType::F64 => "float64",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::BF16 => "bfloat16",
            DType::F8E4M3FN => "float8e4m3fn",
            DType::F8E4M3FNUZ => "float8e4m3fnuz",
            DType::F8E5M2 => "float8e5m2",
            DType::F8E5M2FNUZ => "float8e5m2fnuz",
            DType::U4 => "uint4",
            DType::I4 => "int4",
            DType::F4E2M1 => "float4e2m1",
            DType::F8E8M0 => "float8e8m0",
            DType::U2 => "uint2",
            DType::I2 => "int2",
        }
    }

    /// Parses a name given by [`DType::name`]; also accepts ONNX's upper-case spellings
    /// (`FLOAT`, `FLOAT16`, `BFLOAT16`, `DOUBLE`, `INT64`, …).
    pub fn from_name(name: &str) -> Option<DType> {
        if let Some(d) = DType::ALL.iter().copied().find(|d| d.name() == name) {
            return Some(d);
        }
        let upper = |s: &str| s.eq_ignore_ascii_case(name);
        DType::ALL.iter().copied().find(|d| {
            let onnx = match d {
                DType::F32 => "FLOAT",
                DType::F64 => "DOUBLE",
                DType::F16 => "FLOAT16",
                DType::BF16 => "BFLOAT16",
                other => other.name(),
            };
            upper(onnx)
        })
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether this is a signed or unsigned integer type (not bool).
    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8 | DType::I8 | DType::U16 | DType::I16 | DType::I32 | DType::I64 | DType::U32 | DType::U64
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
