//! The send scratch of a UDP socket: datagrams grouped into `sendmmsg` messages (GSO runs of
//! one destination, one source and one size), and each message's header and control messages.

use std::net::SocketAddr;

use socket2::SockAddr;

use super::cmsg::{self, Control};
use super::{MAX_GSO_BYTES, MAX_MMSG, MAX_SEGMENTS};
use crate::endpoint::LocalAddr;

/// One message of a [`SendRun`]: a run of iovecs (datagrams) to one destination, from one
/// source.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Message {
    pub(super) first_iovec: usize,
    pub(super) iovecs: usize,
    /// Size of every datagram but possibly the last (the `UDP_SEGMENT` value).
    pub(super) segment: u16,
    pub(super) bytes: usize,
    /// A datagram shorter than `segment` ended the message.
    pub(super) closed: bool,
}

/// Datagrams gathered for one `sendmmsg`, grouped into messages: consecutive datagrams to the
/// same destination from the same source, all of the first one's size but the last (which may
/// be shorter), up to [`MAX_SEGMENTS`] and [`MAX_GSO_BYTES`] per message. Without GSO each datagram is a message.
/// The headers and control buffers point into the run itself (and at the batch's bytes) only
/// while one `sendmmsg` is prepared and made; between sends they are stale and never read.
pub(super) struct SendRun {
    pub(super) headers: [libc::mmsghdr; MAX_MMSG],
    pub(super) controls: [Control; MAX_MMSG],
    pub(super) names: [libc::sockaddr_in6; MAX_MMSG],
    pub(super) name_lens: [libc::socklen_t; MAX_MMSG],
    pub(super) destinations: [Option<SocketAddr>; MAX_MMSG],
    /// Each message's source address, if it names one.
    pub(super) sources: [Option<LocalAddr>; MAX_MMSG],
    pub(super) iovecs: [libc::iovec; MAX_MMSG],
    pub(super) message: [Message; MAX_MMSG],
    pub(super) datagrams: usize,
    pub(super) messages: usize,
}

impl std::fmt::Debug for SendRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRun")
            .field("datagrams", &self.datagrams)
            .field("messages", &self.messages)
            .finish_non_exhaustive()
    }
}

// SAFETY: the raw pointers in the headers and iovecs are written and used only inside one
// `send_batch` call, under the socket's scratch lock; no pointer is followed across threads.
unsafe impl Send for SendRun {}

impl SendRun {
    pub(super) fn new() -> Self {
        Self {
            // SAFETY: an all-zero mmsghdr is a valid value (null pointers, zero lengths).
            headers: [unsafe { std::mem::zeroed() }; MAX_MMSG],
            controls: [Control::ZERO; MAX_MMSG],
            // SAFETY: an all-zero sockaddr_in6 is a valid value; it is overwritten before use.
            names: [unsafe { std::mem::zeroed() }; MAX_MMSG],
            name_lens: [0; MAX_MMSG],
            destinations: [None; MAX_MMSG],
            sources: [None; MAX_MMSG],
            iovecs: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; MAX_MMSG],
            message: [Message::default(); MAX_MMSG],
            datagrams: 0,
            messages: 0,
        }
    }

    pub(super) fn is_full(&self) -> bool {
        self.datagrams == MAX_MMSG
    }

    pub(super) fn is_empty(&self) -> bool {
        self.datagrams == 0
    }

    pub(super) fn clear(&mut self) {
        self.datagrams = 0;
        self.messages = 0;
    }

    /// Adds `packet` for `destination` from `source`, to the open message if `gso` allows,
    /// else to a new one.
    pub(super) fn push(
        &mut self,
        destination: SocketAddr,
        source: Option<LocalAddr>,
        packet: &[u8],
        gso: bool,
    ) {
        let index = self.datagrams;
        self.iovecs[index] = libc::iovec {
            iov_base: packet.as_ptr() as *mut libc::c_void,
            iov_len: packet.len(),
        };
        self.datagrams += 1;
        if gso && self.messages > 0 {
            let last = self.messages - 1;
            let open = &mut self.message[last];
            let joins = !open.closed
                && self.destinations[last] == Some(destination)
                && self.sources[last] == source
                && packet.len() <= usize::from(open.segment)
                && open.iovecs < MAX_SEGMENTS
                && open.bytes + packet.len() <= MAX_GSO_BYTES;
            if joins {
                open.iovecs += 1;
                open.bytes += packet.len();
                open.closed = packet.len() < usize::from(open.segment);
                return;
            }
        }
        let m = self.messages;
        self.messages += 1;
        let name = SockAddr::from(destination);
        // SAFETY: a socket address of either family is at most sizeof(sockaddr_in6) bytes,
        // copied from socket2's storage into our slot.
        unsafe {
            std::ptr::copy_nonoverlapping(
                name.as_ptr().cast::<u8>(),
                (&mut self.names[m] as *mut libc::sockaddr_in6).cast::<u8>(),
                name.len() as usize,
            );
        }
        self.name_lens[m] = name.len();
        self.destinations[m] = Some(destination);
        self.sources[m] = source;
        self.message[m] = Message {
            first_iovec: index,
            iovecs: 1,
            segment: u16::try_from(packet.len()).unwrap_or(u16::MAX),
            bytes: packet.len(),
            // A datagram too large to be a segment never takes followers.
            closed: packet.len() > MAX_GSO_BYTES,
        };
    }
}

impl SendRun {
    /// Writes message `m`'s header: its name, iovecs and control messages (the GSO segment
    /// size for a run of datagrams, the source address if it names one).
    pub(super) fn prepare(&mut self, m: usize) {
        let message = self.message[m];
        let control = &mut self.controls[m].0;
        let mut control_len = 0;
        if message.iovecs > 1 {
            control_len = cmsg::put_segment(control, 0, message.segment).unwrap_or(0);
        }
        if let Some(source) = &self.sources[m] {
            control_len = cmsg::put_source(control, control_len, source).unwrap_or(control_len);
        }
        // Every field is written: the slot holds whatever the last send left there.
        let header = &mut self.headers[m].msg_hdr;
        header.msg_name = (&mut self.names[m] as *mut libc::sockaddr_in6).cast();
        header.msg_namelen = self.name_lens[m];
        header.msg_iov = &mut self.iovecs[message.first_iovec];
        header.msg_iovlen = message.iovecs;
        header.msg_control = std::ptr::null_mut();
        header.msg_controllen = 0;
        header.msg_flags = 0;
        if control_len > 0 {
            header.msg_control = (&mut self.controls[m] as *mut Control).cast();
            header.msg_controllen = control_len as _;
        }
    }

    /// Drops the source `ip` from message `from` on and from every later message that names
    /// it.
    pub(super) fn forget_source(&mut self, ip: std::net::IpAddr, from: usize) {
        for m in from..self.messages {
            if self.sources[m].is_some_and(|s| s.ip == ip) {
                self.sources[m] = None;
                self.prepare(m);
            }
        }
    }
}
