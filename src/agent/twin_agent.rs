//! An agent on the shells' in-memory twins ([`super::shells::twins`]), for tests and benchmarks
//! that count what a reconcile asks of the host.

use anyhow::Result;

use super::shells::twins::{Calls, MemEngine, MemFirewall, MemKernel};

/// An agent on in-memory twins, and the twins, to count what it does.
pub struct TwinAgent {
    /// The agent.
    pub agent: crate::agent::Agent<MemKernel, MemFirewall, MemEngine>,
    /// Its kernel.
    pub kernel: MemKernel,
    /// Its firewall.
    pub firewall: MemFirewall,
    /// Its WireGuard device.
    pub engine: MemEngine,
}

impl TwinAgent {
    /// Starts an agent with `kg` flags `args` (which must use `--backend=file`, whose
    /// directory it may write its Node into) on a fresh kernel ([`MemKernel::host`]), firewall
    /// and device.
    pub async fn start(args: &[&str]) -> Result<Self> {
        use clap::Parser as _;
        let settings = crate::agent::args::KgArgs::try_parse_from(
            std::iter::once("kg").chain(args.iter().copied()),
        )?
        .settings()?;
        let backend = crate::backend::Backend::File(crate::backend::file::FileBackend::open(
            std::path::Path::new(&settings.args.cluster_dir),
        )?);
        let kernel = MemKernel::host(&settings.args.interface);
        let firewall = MemFirewall::default();
        let engine = MemEngine::default();
        let shells = crate::agent::Shells {
            kernel: kernel.clone(),
            firewall: firewall.clone(),
            engine: engine.clone(),
        };
        let key = dataplane::SecretKey::generate();
        let agent = crate::agent::Agent::with_shells(settings, key, backend, shells, None).await?;
        Ok(Self {
            agent,
            kernel,
            firewall,
            engine,
        })
    }

    /// Every twin's calls: kernel, firewall, device.
    pub fn calls(&self) -> [Calls; 3] {
        [
            self.kernel.calls(),
            self.firewall.calls(),
            self.engine.calls(),
        ]
    }
}
