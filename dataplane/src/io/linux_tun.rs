//! The Linux TUN device, through tun-rs: created by name or attached to an existing TUN link,
//! one queue per worker (`IFF_MULTI_QUEUE`) when the device allows it.
//!
//! Devices for WireGuard open with segmentation offload where the kernel has it
//! (`IFF_VNET_HDR` with `TUNSETOFFLOAD` for checksum and TCP segmentation, and UDP segmentation
//! where available, Linux 6.2 on): one read returns up to 64 KiB of one flow, which tun-rs splits
//! into MTU-sized packets, and one write takes consecutive segments of a TCP flow (and datagrams
//! of a UDP flow, with UDP segmentation) coalesced back into one by [`crate::gro`] (which
//! allocates nothing per packet). That saves a syscall and a pass through the kernel's stack per
//! packet. Where the kernel refuses, the device opens without offload and moves one packet per
//! syscall.
//!
//! The device never changes its link's state: a link it creates starts down, as the kernel makes
//! it (and as wireguard-go leaves it), and an existing link keeps its state. Its MTU is set only
//! when it creates the link. An agent (or an operator with `ip`) may change the MTU, addresses
//! and state at any time; while the link is down, writes fail with `EIO` and are dropped.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use parking_lot::Mutex;
use tun_rs::{DeviceBuilder, SyncDevice, VIRTIO_NET_HDR_LEN};

use super::{TunBatch, TunIo};
use crate::gro::Coalescer;
use crate::outbox::Batch;

/// `txqueuelen` of a TUN device kilotun creates (the kernel's default for TUN is 500).
pub const TX_QUEUE_LEN: u32 = 5000;
/// Fewest free packet buffers a read with offload needs: a 64 KiB segment split at 512 bytes.
const SPLIT_ROOM: usize = 128;

/// MTU a new TUN device gets, as wireguard-go does.
pub const DEFAULT_MTU: u16 = 1420;

/// Why the TUN device could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TunError {
    /// `/dev/net/tun` does not exist.
    #[error("/dev/net/tun is missing: load the tun module or give the container the device")]
    NoTunDevice,
    /// `/dev/net/tun` exists but may not be opened: a device rule of the container runtime
    /// (the devices cgroup) or a `nodev` mount denies it, whatever the process's capabilities.
    #[error("/dev/net/tun exists but opening it is denied ({source}): the container runtime's device rules leave it out (runc 1.2.0 to 1.2.3 and crun from 2022 to 2025 dropped it from their default devices); allow the character device 10:200 for the container (a device plugin such as `kg device-plugin`, whose manifests/tun-device-plugin.yaml gives it as squat.ai/tun; a CDI device; or a runtime with it in its defaults) or run it privileged")]
    DeviceDenied {
        /// The error opening the device.
        source: io::Error,
    },
    /// The caller lacks CAP_NET_ADMIN.
    #[error("creating TUN device {name:?} needs CAP_NET_ADMIN (run as root)")]
    NotPermitted {
        /// The interface name.
        name: String,
    },
    /// A link of another kind already has the name.
    #[error("interface {name:?} exists and is not a TUN device")]
    NameTaken {
        /// The interface name.
        name: String,
    },
    /// The name is empty or longer than 15 bytes.
    #[error("invalid interface name {name:?}: 1 to 15 bytes, no '/' or whitespace")]
    BadName {
        /// The interface name.
        name: String,
    },
    /// Another error from the kernel.
    #[error("opening TUN device {name:?}: {source}")]
    Io {
        /// The interface name.
        name: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// One queue of a TUN device.
pub struct LinuxTun {
    device: SyncDevice,
    /// Buffers for reading and writing with a virtio-net header; `None` without offload.
    /// Each queue is driven by one worker, so the lock is never contended.
    offload: Option<Mutex<OffloadBuffers>>,
}

/// What reads and writes with offload reuse from call to call.
struct OffloadBuffers {
    /// One raw read: the virtio-net header and up to 64 KiB of packet.
    read: Vec<u8>,
    /// Packets to write, segments of a flow coalesced (UDP too when the device has UDP
    /// segmentation offload), each behind its virtio-net header.
    coalescer: Coalescer,
}

impl OffloadBuffers {
    fn new(udp_offload: bool) -> Self {
        Self {
            read: vec![0; VIRTIO_NET_HDR_LEN + 65535],
            coalescer: Coalescer::with_udp(udp_offload),
        }
    }
}

impl std::fmt::Debug for LinuxTun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinuxTun")
            .field("fd", &self.device.as_raw_fd())
            .field("offload", &self.offload.is_some())
            .finish()
    }
}

/// Checks an interface name the way the kernel will.
pub fn validate_name(name: &str) -> Result<(), TunError> {
    let bad = name.is_empty()
        || name.len() > 15
        || name == "."
        || name == ".."
        || name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace());
    if bad {
        return Err(TunError::BadName { name: name.into() });
    }
    Ok(())
}

/// Whether a link named `name` exists, and if so whether it is a TUN device.
pub fn existing_link(name: &str) -> Option<bool> {
    let dir = Path::new("/sys/class/net").join(name);
    dir.exists().then(|| dir.join("tun_flags").exists())
}

impl LinuxTun {
    /// Opens `queues` queues of the TUN device `name`, creating it (MTU [`DEFAULT_MTU`]) if no
    /// link has that name, attaching to it if a TUN link does. Falls back to a single queue
    /// when an existing device was created without multi-queue support.
    ///
    /// # Errors
    /// [`TunError`] naming what is wrong.
    pub fn open(name: &str, queues: usize) -> Result<(Vec<Self>, bool), TunError> {
        Self::open_with(name, queues, false)
    }

    /// [`LinuxTun::open`] with segmentation offload when the kernel supports it (and without
    /// when it does not). [`LinuxTun::has_offload`] tells which.
    ///
    /// # Errors
    /// [`TunError`] naming what is wrong.
    pub fn open_offloaded(name: &str, queues: usize) -> Result<(Vec<Self>, bool), TunError> {
        Self::open_with(name, queues, true)
    }

    /// Whether reads split and writes coalesce TCP segments (virtio-net header on).
    pub fn has_offload(&self) -> bool {
        self.offload.is_some()
    }

    fn open_with(name: &str, queues: usize, offload: bool) -> Result<(Vec<Self>, bool), TunError> {
        validate_name(name)?;
        check_device(Path::new("/dev/net/tun"))?;
        let existed = match existing_link(name) {
            Some(false) => return Err(TunError::NameTaken { name: name.into() }),
            Some(true) => true,
            None => false,
        };
        let queues = queues.max(1);
        let first = match Self::build_falling_back(name, queues > 1, existed, offload) {
            Ok(device) => device,
            Err(e) if existed && queues > 1 && e.raw_os_error() == Some(libc::EINVAL) => {
                Self::build_falling_back(name, false, existed, offload)
                    .map_err(|e| map_error(name, e))?
            }
            Err(e) => return Err(map_error(name, e)),
        };
        let multi = queues > 1 && first.is_multi_queue();
        let mut all = vec![first];
        if multi {
            for _ in 1..queues {
                let clone = all[0].device.try_clone().map_err(|e| map_error(name, e))?;
                clone
                    .set_nonblocking(true)
                    .map_err(|e| map_error(name, e))?;
                let offload = all[0]
                    .offload
                    .as_ref()
                    .map(|_| Mutex::new(OffloadBuffers::new(clone.udp_gso())));
                all.push(Self {
                    device: clone,
                    offload,
                });
            }
        }
        Ok((all, existed))
    }

    /// Builds with offload if asked and possible, else without (permission and name errors
    /// are the same either way, so they are returned at once).
    fn build_falling_back(
        name: &str,
        multi_queue: bool,
        existed: bool,
        offload: bool,
    ) -> io::Result<Self> {
        if offload {
            match Self::build(name, multi_queue, existed, true) {
                Ok(device) => return Ok(device),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)) => {
                    return Err(e)
                }
                Err(_) => {}
            }
        }
        Self::build(name, multi_queue, existed, false)
    }

    fn build(name: &str, multi_queue: bool, existed: bool, offload: bool) -> io::Result<Self> {
        // tun-rs brings a link up unless told to leave its state alone.
        let mut builder = DeviceBuilder::new()
            .name(name)
            .multi_queue(multi_queue)
            .offload(offload)
            .inherit_enable_state();
        if !existed {
            builder = builder.mtu(DEFAULT_MTU);
        }
        let device = builder.build_sync()?;
        device.set_nonblocking(true)?;
        if !existed {
            // Best effort: a longer queue absorbs bursts from fast UDP senders (at 500, a 1.5
            // Gbit/s UDP flow lost 12% here; at 5,000, none). TCP's own queue limits keep its
            // share of the queue small.
            let _ = device.set_tx_queue_len(TX_QUEUE_LEN);
        }
        // tun-rs asks for TUN_F_USO4 | TUN_F_USO6 as well and opens without them when the
        // kernel refuses (before Linux 6.2); udp_gso() tells which.
        let offload = device
            .tcp_gso()
            .then(|| Mutex::new(OffloadBuffers::new(device.udp_gso())));
        Ok(Self { device, offload })
    }

    /// Makes the device outlive this process (`TUNSETPERSIST`): after a crash the link, its
    /// addresses and its routes stay, and the next process attaches to it.
    ///
    /// # Errors
    /// The ioctl's error.
    pub fn set_persist(&self, persist: bool) -> io::Result<()> {
        const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
        // SAFETY: an ioctl on our own open TUN descriptor with an integer argument.
        let rc = unsafe {
            libc::ioctl(
                self.device.as_raw_fd(),
                TUNSETPERSIST,
                libc::c_ulong::from(persist),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn is_multi_queue(&self) -> bool {
        // The kernel reports IFF_MULTI_QUEUE (0x0100) in tun_flags of a multi-queue device.
        let name = match self.device.name() {
            Ok(n) => n,
            Err(_) => return false,
        };
        std::fs::read_to_string(Path::new("/sys/class/net").join(name).join("tun_flags"))
            .ok()
            .and_then(|s| u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
            .is_some_and(|flags| flags & 0x0100 != 0)
    }
}

/// Whether this process may open `/dev/net/tun` at all (the device exists and the container
/// runtime's device rules allow it), without creating a link: what a process that will need
/// a TUN device later can check before it says it is ready.
pub fn check_tun_device() -> Result<(), TunError> {
    check_device(Path::new("/dev/net/tun"))
}

/// Opens the clone device once to tell a missing or denied device from a missing capability
/// (opening needs none: only creating or attaching to a link needs CAP_NET_ADMIN).
fn check_device(path: &Path) -> Result<(), TunError> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(TunError::NoTunDevice),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) => {
            Err(TunError::DeviceDenied { source: e })
        }
        Err(e)
            if e.raw_os_error() == Some(libc::ENXIO) || e.raw_os_error() == Some(libc::ENODEV) =>
        {
            Err(TunError::NoTunDevice)
        }
        Err(_) => Ok(()), // anything else shows up, with its name, when the link is made
    }
}

fn map_error(name: &str, e: io::Error) -> TunError {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => TunError::NotPermitted { name: name.into() },
        Some(libc::ENOENT) | Some(libc::ENODEV) => TunError::NoTunDevice,
        _ => TunError::Io {
            name: name.into(),
            source: e,
        },
    }
}

impl TunIo for LinuxTun {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.device.recv(buf)
    }

    fn send(&self, packet: &[u8]) -> io::Result<()> {
        self.device.send(packet).map(|_| ())
    }

    fn readiness_fd(&self) -> RawFd {
        self.device.as_raw_fd()
    }

    fn is_attached(&self) -> io::Result<bool> {
        // TUNGETIFF (what tun-rs reads the name with) answers EBADFD once the link is gone.
        match self.device.name() {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EBADFD) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn recv_batch(&self, batch: &mut TunBatch) -> io::Result<usize> {
        let Some(offload) = &self.offload else {
            return super::recv_each(self, batch);
        };
        let mut buffers = offload.lock();
        batch.count = 0;
        // Each read is one (possibly 64 KiB) packet; keep reading while a full split fits.
        let mut reads = 0;
        while batch.bufs.len() - batch.count >= SPLIT_ROOM && reads < batch.bufs.len() {
            reads += 1;
            let at = batch.count;
            match self.device.recv_multiple(
                &mut buffers.read,
                &mut batch.bufs[at..],
                &mut batch.sizes[at..],
                0,
            ) {
                Ok(n) => batch.count += n,
                // Nothing waiting, or the device itself failed (EBADFD once deleted): stop.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.raw_os_error().is_some() => {
                    if batch.count == 0 {
                        return Err(e);
                    }
                    break;
                }
                // A packet the kernel marked in a way tun-rs cannot split: that packet is lost
                // (the read consumed it), the queue is fine.
                Err(_) => continue,
            }
        }
        Ok(batch.count)
    }

    fn send_batch(&self, packets: &Batch) -> usize {
        let Some(offload) = &self.offload else {
            return super::send_each(self, packets);
        };
        let mut buffers = offload.lock();
        let coalescer = &mut buffers.coalescer;
        coalescer.clear();
        let mut failed = 0;
        for (_, packet) in packets.iter() {
            if !coalescer.push(packet) {
                failed += self.write_all(coalescer);
                coalescer.clear();
                // An empty round always has room.
                let _ = coalescer.push(packet);
            }
        }
        failed + self.write_all(coalescer)
    }
}

impl LinuxTun {
    /// Writes a finished round, one `write` per buffer; returns how many failed.
    fn write_all(&self, coalescer: &mut Coalescer) -> usize {
        coalescer
            .finish()
            .filter(|buffer| self.device.send(buffer).is_err())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_like_the_kernel_does() {
        assert!(validate_name("kilo0").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("sixteen-chars-xx").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("a b").is_err());
    }

    #[test]
    fn a_missing_clone_device_is_named() {
        let err = check_device(Path::new("/surely/absent/net/tun")).unwrap_err();
        assert!(matches!(err, TunError::NoTunDevice), "{err}");
        // (A denied device is tested end to end, under a devices cgroup, in
        // tests/netns/bad_input.rs.)
    }

    #[test]
    fn loopback_is_reported_as_a_non_tun_link() {
        assert_eq!(existing_link("lo"), Some(false));
        assert_eq!(existing_link("surely-absent0"), None);
    }
}
