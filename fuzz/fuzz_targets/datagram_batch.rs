#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dataplane::fuzzing::datagram_batch(data));
