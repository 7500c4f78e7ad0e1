//! Kilo's firewall as the nftables table `inet kilo` ([`control::nftables`]), applied with
//! `nft -f -`: one atomic transaction per change, adding and removing set elements only, and a
//! whole table written only at start or when a resync finds it changed by someone else.
//!
//! A resync lists the table only when the kernel's ruleset generation moved since kg last
//! found the table as wanted: every committed transaction, anyone's, moves it, and asking for
//! it is one netlink message, where a listing is a child process and a line per set element.

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use control::iptables::RuleSet;
use control::nftables::{change_script, full_script, FirewallSets, TableView, TABLE};

/// The `nft` binary (`KILOTUN_NFT` overrides it, for a test that wants another one).
fn nft() -> String {
    std::env::var("KILOTUN_NFT").unwrap_or_else(|_| "nft".to_string())
}

/// Runs `nft -f -` with `script` as one transaction.
fn run(script: &str) -> Result<()> {
    let bin = nft();
    if let Some(error) = super::feed(&bin, &["-f", "-"], script, " (is nftables installed?)")? {
        bail!("{bin} -f refused the transaction: {error}");
    }
    Ok(())
}

/// The table as the kernel holds it; `None` when there is none.
pub fn view() -> Result<Option<TableView>> {
    let bin = nft();
    let out = Command::new(&bin)
        .args(["-j", "list", "table", "inet", TABLE])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin}"))?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(Some(TableView::from_listing(&String::from_utf8_lossy(
        &out.stdout,
    ))?))
}

/// The table as last found wanted: in which network namespace (its inode), at which ruleset
/// generation (read before the listing), and what it held.
struct Verified {
    netns: u64,
    generation: u32,
    table: TableView,
}

static VERIFIED: Mutex<Option<Verified>> = Mutex::new(None);

/// The calling thread's network namespace, by the inode of its `ns/net`.
fn netns() -> Option<u64> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .ok()
        .map(|m| m.ino())
}

/// True when nothing was committed since the table was found to be `wanted` in this namespace.
fn still_verified(netns: Option<u64>, generation: Option<u32>, wanted: &TableView) -> bool {
    let (Some(netns), Some(generation)) = (netns, generation) else {
        return false;
    };
    VERIFIED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|v| v.netns == netns && v.generation == generation && &v.table == wanted)
}

/// `nfnetlink`'s subsystem of nftables, and its messages asking for and giving the ruleset
/// generation (`linux/netfilter/nfnetlink.h`, `linux/netfilter/nf_tables.h`).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;

/// The kernel's nftables ruleset generation in this network namespace (`NFT_MSG_GETGEN`).
fn generation() -> Result<u32> {
    use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};
    let mut socket = Socket::new(NETLINK_NETFILTER).context("opening nfnetlink")?;
    socket.bind_auto().context("binding nfnetlink")?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .context("connecting nfnetlink")?;
    // The kernel answers at once; a socket that never does must not hold up the firewall.
    let timeout = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: the socket is open, and `timeout` lives through the call with its size given.
    let set = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        bail!(
            "setting a timeout on nfnetlink: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut request = Vec::with_capacity(20);
    request.extend(20u32.to_ne_bytes());
    request.extend(((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN).to_ne_bytes());
    request.extend(NLM_F_REQUEST.to_ne_bytes());
    request.extend(1u32.to_ne_bytes());
    request.extend(0u32.to_ne_bytes());
    // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, resource 0.
    request.extend([0u8, 0, 0, 0]);
    socket
        .send(&request, 0)
        .context("asking for the ruleset generation")?;
    let (answer, _) = socket
        .recv_from_full()
        .context("reading the ruleset generation")?;
    parse_generation(&answer)
}

/// The generation in the kernel's answer to `NFT_MSG_GETGEN`.
fn parse_generation(answer: &[u8]) -> Result<u32> {
    let u16_at = |at: usize| {
        answer
            .get(at..at + 2)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]))
    };
    let kind = u16_at(4).context("a short nfnetlink answer")?;
    if kind == NLMSG_ERROR {
        let code = answer
            .get(16..20)
            .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        bail!(
            "nfnetlink refused NFT_MSG_GETGEN: {}",
            std::io::Error::from_raw_os_error(-code)
        );
    }
    if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
        bail!("nfnetlink answered NFT_MSG_GETGEN with message type {kind:#x}");
    }
    // The netlink header (16 bytes) and nfgenmsg (4), then the attributes.
    let mut at = 20;
    while let (Some(len), Some(kind)) = (u16_at(at), u16_at(at + 2)) {
        let len = len as usize;
        if len < 4 {
            break;
        }
        if kind & 0x3fff == NFTA_GEN_ID {
            if let Some(b) = answer.get(at + 4..at + 8) {
                return Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        at += (len + 3) & !3;
    }
    bail!("nfnetlink's answer to NFT_MSG_GETGEN holds no generation")
}

/// Checks that the kernel takes every construct the table uses (interval sets of both
/// families, a NAT chain that masquerades, filter chains) in one transaction that creates a
/// scratch table and deletes it again: nothing stays behind either way.
pub fn probe() -> Result<()> {
    let scratch = full_script(&FirewallSets::default(), true)
        .replace(&format!("inet {TABLE}"), &format!("inet {TABLE}_probe"));
    run(&format!("{scratch}delete table inet {TABLE}_probe\n"))
}

/// Takes the table to `rules`. With `previous` (the rules last applied) only the difference is
/// sent; without it (at start, on a resync) the kernel's table is listed and rewritten whole
/// when it differs. Returns true when something was changed.
pub fn reconcile(rules: &RuleSet, previous: Option<&RuleSet>, v6: bool) -> Result<bool> {
    let sets = FirewallSets::of(rules)?;
    if let Some(previous) = previous {
        let script = change_script(&FirewallSets::of(previous)?, &sets, v6);
        if script.is_empty() {
            return Ok(false);
        }
        match run(&script) {
            Ok(()) => return Ok(true),
            // Someone else changed the table (an element already gone): write it whole.
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "an incremental nftables change failed; rewriting the table"
            ),
        }
    } else {
        let wanted = TableView::wanted(&sets, v6);
        let netns = netns();
        let generation = generation().ok();
        if still_verified(netns, generation, &wanted) {
            return Ok(false);
        }
        if view()?.as_ref() == Some(&wanted) {
            if let (Some(netns), Some(generation)) = (netns, generation) {
                *VERIFIED.lock().unwrap_or_else(|e| e.into_inner()) = Some(Verified {
                    netns,
                    generation,
                    table: wanted,
                });
            }
            return Ok(false);
        }
    }
    run(&full_script(&sets, v6))?;
    Ok(true)
}

/// What [`reconcile`] would change, one line per difference; empty when the table is as wanted.
pub fn drift(rules: &RuleSet, v6: bool) -> Result<Vec<String>> {
    let wanted = TableView::wanted(&FirewallSets::of(rules)?, v6);
    let Some(have) = view()? else {
        return Ok(vec![format!("nft: table inet {TABLE} is missing")]);
    };
    let mut lines = Vec::new();
    for (name, nets) in &wanted.sets {
        let empty = Default::default();
        let held = have.sets.get(name).unwrap_or(&empty);
        for net in nets.difference(held) {
            lines.push(format!("nft: set {name} lacks {net}"));
        }
        for net in held.difference(nets) {
            lines.push(format!("nft: set {name} holds {net}, which kg did not add"));
        }
    }
    for (chain, rules) in &wanted.chains {
        if have.chains.get(chain) != Some(rules) {
            lines.push(format!("nft: chain {chain} is missing or differs"));
        }
    }
    Ok(lines)
}

/// Deletes the table, if there is one.
pub fn clean_up() -> Result<()> {
    if view().ok().flatten().is_some() {
        run(&format!("delete table inet {TABLE}\n"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's answer: the netlink header, nfgenmsg, then NFTA_GEN_ID (big-endian),
    /// NFTA_GEN_PROC_PID and NFTA_GEN_PROC_NAME.
    fn answer(generation: u32) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend(0u32.to_ne_bytes());
        a.extend(((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN).to_ne_bytes());
        a.extend(0u16.to_ne_bytes());
        a.extend(1u32.to_ne_bytes());
        a.extend(0u32.to_ne_bytes());
        a.extend([0u8, 0, 0, 0]);
        a.extend(8u16.to_ne_bytes());
        a.extend(NFTA_GEN_ID.to_ne_bytes());
        a.extend(generation.to_be_bytes());
        a.extend(8u16.to_ne_bytes());
        a.extend(2u16.to_ne_bytes());
        a.extend(4242u32.to_be_bytes());
        a.extend(7u16.to_ne_bytes());
        a.extend(3u16.to_ne_bytes());
        a.extend(*b"nft\0");
        let len = a.len() as u32;
        a[..4].copy_from_slice(&len.to_ne_bytes());
        a
    }

    #[test]
    fn the_generation_is_read_from_the_kernels_answer() {
        assert_eq!(parse_generation(&answer(0x0102_0304)).unwrap(), 0x0102_0304);
        let mut refused = answer(1);
        refused[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        refused[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        let e = parse_generation(&refused).unwrap_err().to_string();
        assert!(e.contains("refused NFT_MSG_GETGEN"), "{e}");
        assert!(parse_generation(&answer(1)[..22]).is_err(), "cut short");
        assert!(parse_generation(&[1, 2, 3]).is_err(), "no header");
    }

    #[test]
    fn a_table_is_verified_only_in_its_namespace_at_its_generation() {
        let table = TableView::default();
        *VERIFIED.lock().unwrap() = Some(Verified {
            netns: 7,
            generation: 3,
            table: table.clone(),
        });
        assert!(still_verified(Some(7), Some(3), &table));
        assert!(!still_verified(Some(7), Some(4), &table), "a commit since");
        assert!(
            !still_verified(Some(8), Some(3), &table),
            "another namespace"
        );
        assert!(!still_verified(None, Some(3), &table));
        assert!(!still_verified(Some(7), None, &table), "no generation read");
        let mut other = TableView::default();
        other.sets.insert("x".into(), Default::default());
        assert!(
            !still_verified(Some(7), Some(3), &other),
            "another table wanted"
        );
    }
}
