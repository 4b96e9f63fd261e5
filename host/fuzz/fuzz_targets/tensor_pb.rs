//! A `.pb` tensor file (ONNX `TensorProto`, as the node tests' inputs and `kiln run --input`
//! read them) from arbitrary bytes: a tensor or an error, never a panic or an allocation of a
//! declared size the bytes do not hold.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((t, _name)) = kiln_host::tensorio::read_pb(data) {
        assert_eq!(t.data.len() as u64, kiln_host::tensor::byte_size(t.dtype, &t.shape).unwrap());
    }
});
