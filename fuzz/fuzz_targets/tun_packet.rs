#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| dataplane::fuzzing::tun_packet(data));
