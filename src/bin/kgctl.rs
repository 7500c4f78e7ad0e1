//! `kgctl`: inspect a Kilo mesh (graph, WireGuard configurations) from the Kubernetes API or a
//! cluster directory.

use std::process::ExitCode;

use clap::Parser;
use kilotun::kgctl::{self, Command, KgctlArgs};

fn main() -> ExitCode {
    let args = KgctlArgs::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kgctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let snapshot = kgctl::snapshot(&args).await?;
        let view = kgctl::view(
            &snapshot,
            &args.mesh_granularity,
            &args.topology_label,
            kgctl::now_unix(),
        )?;
        match &args.command {
            Command::Graph => Ok((kgctl::graph(&view)?, String::new())),
            Command::Showconf(show) => kgctl::showconf(&view, show, args.port),
        }
    });
    match result {
        Ok((out, err)) => {
            print!("{out}");
            eprint!("{err}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kgctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
