//! `kgctl`: Kilo's command-line client. Its commands arrive with the control plane; until then
//! this binary only reports that.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("kgctl: graph, showconf and connect arrive with the control plane");
    ExitCode::from(2)
}
