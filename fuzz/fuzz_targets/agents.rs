#![no_main]
// Many kg agents driven by the events the input decodes to (see kilotun::model): any broken
// invariant or missed convergence panics with the events that led to it.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(violation) = kilotun::model::run(data) {
        panic!("{violation}");
    }
});
