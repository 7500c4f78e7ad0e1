#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| control::fuzzing::topology(data));
