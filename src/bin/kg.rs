//! `kg`: the Kilo node agent. Its control plane is the next milestone; until it lands this
//! binary only reports that, so nobody mistakes it for a working agent.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!(
        "kg: the control plane is not part of this build yet; run `kilotun {}` for the \
         userspace WireGuard device",
        control::DEFAULT_INTERFACE
    );
    ExitCode::from(2)
}
