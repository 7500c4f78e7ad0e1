//! One worker's loop: poll its TUN queue, its sockets and its waker; read a batch, run it
//! through the engine, write what comes out. A failed read of the queue goes to its
//! [`QueueHealth`]: retried after a pause, or the end of the worker with the loss reported.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::link::{self, QueueHealth, Verdict};
use super::{Shared, BATCH, MAX_PACKET, TUN_BATCH, UDP_SLOTS};
use crate::eventfd::{poll, readable};
use crate::io::{RecvBatch, TunBatch, TunIo, UdpIo};
use crate::outbox::{Batch, Outbox};

/// The worker loop: poll, read a batch, run it through the engine, write the output.
pub(super) fn worker<S: UdpIo, T: TunIo>(shared: &Shared<S>, index: usize, tun: &T) {
    let mut out = Outbox::with_capacity(BATCH * 2, 2048);
    let mut tun_batch = TunBatch::new(TUN_BATCH, MAX_PACKET);
    // With UDP GRO each slot may hold up to 64 datagrams, so few slots still make big batches.
    let mut udp_batch = RecvBatch::new(UDP_SLOTS, MAX_PACKET);
    let waker = &shared.wakers[index];
    let mut generation = u64::MAX;
    let mut sockets = shared.sockets.load_full();
    let mut health = QueueHealth::new(index);
    while !shared.stop.load(Ordering::Acquire) {
        let current = shared.generation.load(Ordering::Acquire);
        if current != generation {
            sockets = shared.sockets.load_full();
            generation = current;
        }
        let v4 = pick(&sockets.v4, index);
        let v6 = pick(&sockets.v6, index);
        // Negative descriptors (a family with no socket) are ignored by poll. No timeout: a
        // shutdown or a socket change wakes the worker through its eventfd.
        let mut fds = [
            readable(tun.readiness_fd()),
            readable(v4.map_or(-1, UdpIo::readiness_fd)),
            readable(v6.map_or(-1, UdpIo::readiness_fd)),
            readable(waker.fd()),
        ];
        if poll(&mut fds, None) == 0 {
            continue;
        }
        if fds[3].revents != 0 {
            waker.drain();
        }
        if shared.generation.load(Ordering::Acquire) != generation {
            // The sockets were replaced while we slept: reload before sending anything.
            continue;
        }
        let tun_events = fds[0].revents;
        if tun_events != 0 {
            let broken = tun_events & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
            match tun.recv_batch(&mut tun_batch) {
                Ok(_) => {
                    health.ok();
                    shared
                        .engine
                        .handle_tunnel_packets(Instant::now(), tun_batch.iter(), &mut out);
                    flush(shared, tun, v4, v6, &mut out);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !broken => health.ok(),
                Err(e) => match health.failed(tun.is_attached(), &read_error(e)) {
                    Verdict::Retry => {
                        // Not a spin: the next read after a pause (sooner on a stop).
                        let mut pause = [readable(waker.fd())];
                        poll(&mut pause, Some(link::RETRY_PAUSE));
                    }
                    Verdict::Lost(loss) => {
                        if shared.lost.report(loss.clone()) {
                            tracing::info!(queue = index, "{loss}: the device's workers end");
                        }
                        return;
                    }
                },
            }
        }
        for (slot, socket) in [(1, v4), (2, v6)] {
            let Some(socket) = socket else { continue };
            if fds[slot].revents & libc::POLLIN == 0 {
                continue;
            }
            if socket.recv_batch(&mut udp_batch).is_ok() {
                shared.engine.handle_datagrams(
                    Instant::now(),
                    udp_batch.iter_endpoints(),
                    &mut out,
                );
                flush(shared, tun, v4, v6, &mut out);
            }
        }
    }
}

/// A failed read's error; a read that found nothing on a queue `poll` called broken is one too.
fn read_error(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::other("poll reports the queue broken (POLLERR, POLLHUP or POLLNVAL)")
    } else {
        e
    }
}

pub(super) fn pick<S>(sockets: &[S], index: usize) -> Option<&S> {
    if sockets.is_empty() {
        None
    } else {
        sockets.get(index % sockets.len())
    }
}

/// Writes the outbox: decrypted packets to the TUN queue, datagrams to the sockets.
fn flush<S: UdpIo, T: TunIo>(
    shared: &Shared<S>,
    tun: &T,
    v4: Option<&S>,
    v6: Option<&S>,
    out: &mut Outbox,
) {
    if !out.to_tunnel.is_empty() {
        let failed = tun.send_batch(&out.to_tunnel);
        if failed > 0 {
            shared
                .tun_write_errors
                .fetch_add(failed as u64, Ordering::Relaxed);
        }
    }
    if !out.to_network.is_empty() {
        send(shared, [v4, v6], &out.to_network);
    }
    out.clear();
}

/// Sends `datagrams` on `sockets`; a source address a socket refused (it left the host) is
/// forgotten, so that later datagrams do not ask for it.
pub(super) fn send<S: UdpIo>(shared: &Shared<S>, sockets: [Option<&S>; 2], datagrams: &Batch) {
    for socket in sockets.into_iter().flatten() {
        if let Ok(outcome) = socket.send_batch(datagrams) {
            if let Some(gone) = outcome.refused_source {
                let peers = shared.engine.forget_local(gone);
                tracing::debug!(address = %gone, peers, "a source address left the host: sending from the kernel's choice");
            }
        }
    }
}
