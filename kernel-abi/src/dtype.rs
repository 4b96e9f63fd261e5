//! Element types, numbered as ONNX's `TensorProto.DataType` (onnx/onnx.proto).

use core::fmt;

/// A tensor element type. The discriminant is the ONNX `TensorProto.DataType` code, which is
/// also how the ABI encodes a dtype (`i32`).
///
/// `String` tensors cannot cross the ABI (their bytes are not fixed-size); they exist here so
/// that the host can name them in errors.
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
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 14] = [
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
    ];

    /// The dtype with ONNX code `code`, or `None` for codes kiln does not represent
    /// (complex, float8, int4, …).
    pub fn from_code(code: i32) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as i32 == code)
    }

    /// The ONNX `TensorProto.DataType` code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// Size of one element in bytes; `None` for `String`.
    pub fn size(self) -> Option<usize> {
        Some(match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
            DType::String => return None,
        })
    }

    /// The prelude's tag type of this dtype (`kiln.cuh`, ABI.md §7.3.1): `kiln_tag_f32`,
    /// `kiln_tag_f16`, `kiln_tag_bf16`, `kiln_tag_f64`, `kiln_tag_i8` … `kiln_tag_u64`,
    /// `kiln_tag_bool`, each with a `storage` typedef of its element's C type. The template
    /// argument a kernel templated over the element type takes, so that a shim names it with
    /// [`crate::names::kernel_name`] and keeps no table of its own. `None` for `string`.
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
        })
    }

    /// The name used in manifests, CLI output and errors: `float32`, `float16`, `bfloat16`,
    /// `float64`, `int8` … `uint64`, `bool`, `string`.
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
