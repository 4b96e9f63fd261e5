//! A `.kpkg` archive from arbitrary bytes, unpacked and verified as `kiln publish` and a
//! registry's loads read one: a package or an error, never a panic or an allocation past the
//! archive limits.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kiln_registry::archive::unpack("fuzz.kpkg", data);
});
