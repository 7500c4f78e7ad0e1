//! Which WireGuard kg creates the interface with (`--wireguard`), and the kernel half of that
//! choice: finding, creating or replacing the kernel's WireGuard link, and falling back to the
//! embedded engine with nothing half-made left behind.

use anyhow::{Context, Result};

use crate::agent::shells::Kernel;

/// Which WireGuard kg drives when it creates the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WireGuardChoice {
    /// The engine inside kg: needs no kernel module.
    Embedded,
    /// The kernel's WireGuard where the kernel has it, the embedded engine elsewhere: one
    /// DaemonSet for a mixed fleet.
    Auto,
    /// The kernel's WireGuard; kg fails to start where the kernel has none.
    Kernel,
}

/// The kernel's WireGuard link `name` for `choice`, opened with `open`, or `None` where kg
/// runs the embedded engine instead. `available` says whether the kernel has WireGuard; it is
/// asked at most once, and not when a WireGuard link of the last run is there.
///
/// On the way to `None`, a kernel WireGuard link called `name` (the last run's, or one this
/// attempt made before a later step failed) is deleted, so the engine's TUN link can take the
/// name. `--wireguard=kernel` fails instead, naming the flag; `auto` logs once why it falls
/// back.
pub(super) async fn kernel_link<N: Kernel, T>(
    choice: WireGuardChoice,
    name: &str,
    netlink: &N,
    available: impl FnOnce() -> Result<()>,
    open: impl Fn(&str) -> Result<T>,
) -> Result<Option<T>> {
    let existing = netlink.link_kind(name).await?;
    let kept = existing.as_deref() == Some("wireguard");
    let mut has_wireguard = kept;
    let attempt = match choice {
        WireGuardChoice::Embedded => None,
        WireGuardChoice::Kernel | WireGuardChoice::Auto => {
            let ready = if kept { Ok(()) } else { available() };
            has_wireguard |= ready.is_ok();
            Some(match ready {
                Ok(()) => create(name, existing.as_deref(), netlink, &open).await,
                Err(e) => Err(e),
            })
        }
    };
    let failed = match (choice, attempt) {
        (_, Some(Ok(kernel))) => return Ok(Some(kernel)),
        (WireGuardChoice::Kernel, Some(Err(e))) => Some(e.context("--wireguard=kernel")),
        (_, Some(Err(e))) if has_wireguard => {
            tracing::warn!(
                wireguard = "embedded",
                reason = format!("{e:#}"),
                "--wireguard=auto: the kernel has WireGuard but kg cannot drive it; running the embedded engine on {name}"
            );
            None
        }
        (_, Some(Err(e))) => {
            tracing::info!(
                wireguard = "embedded",
                reason = format!("{e:#}"),
                "--wireguard=auto: running the embedded engine on {name}"
            );
            None
        }
        (_, None) => {
            tracing::info!(
                wireguard = "embedded",
                "running the embedded engine on {name} (--wireguard=embedded)"
            );
            None
        }
    };
    // Nothing half-made stays: a wireguard link this attempt created goes whether kg falls
    // back or fails; the last run's goes only for the embedded engine.
    let remove = match &failed {
        Some(_) => !kept,
        None => true,
    };
    if remove && netlink.link_kind(name).await?.as_deref() == Some("wireguard") {
        if kept {
            tracing::info!(
                "replacing the kernel's WireGuard link {name} of the last run by the embedded engine"
            );
        }
        if let Some(link) = netlink.link_by_name(name).await? {
            netlink.delete_link(link.index).await?;
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(None),
    }
}

/// The kernel's WireGuard link `name`: the one there, or a new one in place of `existing`
/// (a link of another kind, left by the embedded engine's last run). The caller has made sure
/// the kernel has WireGuard.
async fn create<N: Kernel, T>(
    name: &str,
    existing: Option<&str>,
    netlink: &N,
    open: &impl Fn(&str) -> Result<T>,
) -> Result<T> {
    match existing {
        Some("wireguard") => {
            let kernel = open(name)?;
            tracing::info!(
                wireguard = "kernel",
                "driving the kernel's WireGuard link {name}, kept from the last run with its sessions"
            );
            return Ok(kernel);
        }
        Some(kind) => {
            tracing::info!(
                "replacing the {kind} link {name} of the last run by the kernel's WireGuard"
            );
            if let Some(link) = netlink.link_by_name(name).await? {
                netlink.delete_link(link.index).await?;
            }
        }
        None => {}
    }
    netlink
        .add_wireguard(name)
        .await
        .with_context(|| format!("creating the WireGuard link {name}"))?;
    // Up at once, as a TUN link is when it opens: the kernel's WireGuard opens its UDP socket
    // only while the link is up, and the restored peers' handshakes start before the first
    // reconcile.
    let link = netlink
        .link_by_name(name)
        .await?
        .with_context(|| format!("the WireGuard link {name} vanished once created"))?;
    netlink.set_up(link.index, true).await?;
    let kernel = open(name)?;
    tracing::info!(
        wireguard = "kernel",
        "driving the kernel's WireGuard on {name}: the kernel created a wireguard link"
    );
    Ok(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::shells::twins::MemKernel;

    const NAME: &str = "kilo0";

    fn has_wireguard() -> Result<()> {
        Ok(())
    }

    fn lacks_wireguard() -> Result<()> {
        anyhow::bail!("no generic netlink family \"wireguard\"")
    }

    fn opens(name: &str) -> Result<String> {
        Ok(format!("driver for {name}"))
    }

    fn refuses(name: &str) -> Result<String> {
        anyhow::bail!("reading WireGuard device {name}: Operation not permitted")
    }

    fn asked_twice() -> Result<()> {
        panic!("kg asks whether the kernel has WireGuard only when it will use the answer")
    }

    #[tokio::test]
    async fn auto_drives_the_kernel_where_it_can_create_the_link() {
        let kernel = MemKernel::default().with_wireguard();
        let got = kernel_link(WireGuardChoice::Auto, NAME, &kernel, has_wireguard, opens)
            .await
            .unwrap();
        assert_eq!(got.as_deref(), Some("driver for kilo0"));
        assert_eq!(kernel.link_kind_of(NAME).as_deref(), Some("wireguard"));
        assert!(kernel.link_up(NAME));
    }

    #[tokio::test]
    async fn auto_falls_back_where_the_kernel_has_no_wireguard() {
        let kernel = MemKernel::default();
        let got = kernel_link(WireGuardChoice::Auto, NAME, &kernel, lacks_wireguard, opens)
            .await
            .unwrap();
        assert_eq!(got, None);
        assert_eq!(kernel.link_names(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn auto_falls_back_where_the_module_loads_but_the_link_cannot_be_created() {
        // The generic netlink family resolves, but creating the link is refused (a container
        // without the capability, a locked-down kernel): the twin has no wireguard link kind.
        let kernel = MemKernel::default();
        let got = kernel_link(WireGuardChoice::Auto, NAME, &kernel, has_wireguard, opens)
            .await
            .unwrap();
        assert_eq!(got, None);
        assert_eq!(kernel.link_names(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_link_made_before_a_later_step_failed_is_removed_before_falling_back() {
        let kernel = MemKernel::default().with_wireguard();
        let got = kernel_link(WireGuardChoice::Auto, NAME, &kernel, has_wireguard, refuses)
            .await
            .unwrap();
        assert_eq!(got, None);
        assert_eq!(
            kernel.link_names(),
            Vec::<String>::new(),
            "the half-made wireguard link would keep the engine's TUN link from taking its name"
        );
    }

    #[tokio::test]
    async fn forcing_the_kernel_leaves_no_half_made_link_when_it_fails() {
        let kernel = MemKernel::default().with_wireguard();
        let e = kernel_link(
            WireGuardChoice::Kernel,
            NAME,
            &kernel,
            has_wireguard,
            refuses,
        )
        .await
        .unwrap_err();
        assert!(
            format!("{e:#}").starts_with("--wireguard=kernel: "),
            "{e:#}"
        );
        assert_eq!(kernel.link_names(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn forcing_the_kernel_where_it_has_none_is_an_error_naming_the_flag() {
        for (kernel, available) in [
            (MemKernel::default(), lacks_wireguard as fn() -> Result<()>),
            (MemKernel::default(), has_wireguard),
        ] {
            let e = kernel_link(WireGuardChoice::Kernel, NAME, &kernel, available, opens)
                .await
                .unwrap_err();
            let text = format!("{e:#}");
            assert!(text.starts_with("--wireguard=kernel: "), "{text}");
        }
    }

    #[tokio::test]
    async fn the_last_runs_kernel_link_is_kept_with_its_sessions() {
        let kernel = MemKernel::default().with_wireguard();
        kernel.add_wireguard(NAME).await.unwrap();
        let writes = kernel.calls().writes;
        for choice in [WireGuardChoice::Auto, WireGuardChoice::Kernel] {
            let got = kernel_link(choice, NAME, &kernel, asked_twice, opens)
                .await
                .unwrap();
            assert_eq!(got.as_deref(), Some("driver for kilo0"));
        }
        assert_eq!(kernel.calls().writes, writes, "nothing recreated");
    }

    #[tokio::test]
    async fn switching_kinds_on_restart_replaces_the_last_runs_link() {
        // The engine's TUN link of the last run gives way to the kernel's WireGuard...
        let kernel = MemKernel::default().with_wireguard();
        kernel.add_link_of_kind(NAME, "tun");
        let got = kernel_link(WireGuardChoice::Auto, NAME, &kernel, has_wireguard, opens)
            .await
            .unwrap();
        assert!(got.is_some());
        assert_eq!(kernel.link_kind_of(NAME).as_deref(), Some("wireguard"));
        // ...and the kernel's link to the engine, whose TUN link takes the name.
        let got = kernel_link(WireGuardChoice::Embedded, NAME, &kernel, asked_twice, opens)
            .await
            .unwrap();
        assert_eq!(got, None);
        assert_eq!(kernel.link_names(), Vec::<String>::new());
    }
}
