//! TCP and UDP coalescing (GRO) for writes to a TUN device opened with a virtio-net header.
//!
//! Decrypted packets of one flow usually arrive in order and back to back. Handing them to the
//! kernel as one large segment (with `VIRTIO_NET_HDR_GSO_TCPV4/6`, or `VIRTIO_NET_HDR_GSO_UDP_L4`
//! where the device has UDP segmentation offload) costs one write and one pass through the
//! kernel's receive path instead of one per packet. The TCP rules follow the kernel's own GRO:
//! same flow and acknowledgement, consecutive sequence numbers, equal TCP options and IP header
//! fields, only ACK or ACK|PSH flags, every segment the size of the first but the last, PSH only
//! on the last. UDP datagrams of one flow merge under the same size rule, at most
//! [`UDP_MAX_SEGMENTS`] to a write. A packet that cannot join closes its flow's open segment, so
//! nothing of a flow is ever reordered.
//!
//! Checksums are not verified: every packet written here was decrypted and authenticated by
//! WireGuard, so nothing changed it since its sender checksummed it (the kernel's WireGuard
//! marks such packets `CHECKSUM_UNNECESSARY` for the same reason). Every TCP and UDP packet,
//! merged or alone, is written with `VIRTIO_NET_HDR_F_NEEDS_CSUM` and its checksum field holding
//! the pseudo-header sum: the kernel then takes it as checked (`CHECKSUM_PARTIAL`) instead of
//! summing it again, and completes the checksum itself should it forward the packet. The
//! `VIRTIO_NET_HDR_F_DATA_VALID` flag would say the same more directly, but the TUN driver
//! ignores it on writes (Linux 6.18 still verifies such packets).
//!
//! Pure: no I/O, no allocation after the buffers first grow.

/// Bytes of the virtio-net header in front of every packet written.
pub const VNET_HDR_LEN: usize = 10;
/// Output buffers per round: more than one 64 KiB segment's worth of full-size packets.
pub const ROUND: usize = 64;
/// Most UDP datagrams merged into one write (the kernel refuses more than `UDP_MAX_SEGMENTS`,
/// 64 before Linux 6.11).
pub const UDP_MAX_SEGMENTS: usize = 64;
/// Largest IP packet (IPv4 total length, IPv6 payload length).
const MAX_IP: usize = 65_535;

/// virtio-net header flag: the kernel completes the checksum from `csum_start`.
const NEEDS_CSUM: u8 = 1;
/// virtio-net header GSO types: a TCP/IPv4, TCP/IPv6 or UDP super-packet.
const GSO_TCPV4: u8 = 1;
const GSO_TCPV6: u8 = 4;
const GSO_UDP_L4: u8 = 5;
/// TCP flags a coalesced packet may carry (ACK always; PSH only on the last segment).
const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;
/// IP protocol numbers.
const TCP: u8 = 6;
const UDP: u8 = 17;
/// Bytes of a UDP header.
const UDP_HEADER: usize = 8;

/// A flow: source and destination addresses (IPv4 in the first 8 bytes), ports, protocol.
type Tuple = ([u8; 32], u32, u8);

/// Where a TCP or UDP packet's checksum is and what covers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Transport {
    v6: bool,
    /// [`TCP`] or [`UDP`].
    proto: u8,
    iph_len: usize,
}

impl Transport {
    /// Offset of the checksum field within the transport header.
    fn csum_offset(self) -> usize {
        if self.proto == TCP {
            16
        } else {
            6
        }
    }
}

/// A TCP or UDP packet that may be coalesced.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    transport: Transport,
    /// TCP header length, or [`UDP_HEADER`].
    l4h_len: usize,
    tuple: Tuple,
    /// TCP only: sequence and acknowledgement numbers, PSH.
    seq: u32,
    ack: u32,
    psh: bool,
    payload: usize,
}

/// The open (still growing) segment of one flow.
#[derive(Debug, Clone, Copy)]
struct Open {
    tuple: Tuple,
    ack: u32,
    buffer: usize,
    next_seq: u32,
    segment: usize,
    segments: usize,
    closed: bool,
}

/// What each used output buffer holds.
#[derive(Debug, Clone, Copy, Default)]
struct Written {
    /// Coalesced segments in it (1: one packet as received).
    segments: usize,
    segment: usize,
    /// The packet's TCP or UDP checksum, for the kernel to take as checked; `None` for any
    /// other packet, written with an empty virtio-net header.
    transport: Option<Transport>,
    l4h_len: usize,
}

/// Coalesces a round of packets into at most [`ROUND`] writes, each behind a virtio-net header.
#[derive(Debug)]
pub struct Coalescer {
    buffers: Vec<Vec<u8>>,
    written: Vec<Written>,
    used: usize,
    open: Vec<Open>,
    /// Whether UDP datagrams are merged (the device has UDP segmentation offload).
    udp: bool,
}

impl Default for Coalescer {
    fn default() -> Self {
        Self::new()
    }
}

impl Coalescer {
    /// An empty coalescer that merges TCP segments only; buffers are created on first use and
    /// reused after.
    pub fn new() -> Self {
        Self {
            buffers: Vec::new(),
            written: vec![Written::default(); ROUND],
            used: 0,
            open: Vec::with_capacity(ROUND),
            udp: false,
        }
    }

    /// An empty coalescer that also merges UDP datagrams (`udp`), for a device opened with
    /// `TUN_F_USO4 | TUN_F_USO6`.
    pub fn with_udp(udp: bool) -> Self {
        Self { udp, ..Self::new() }
    }

    /// Starts a new round, forgetting the last one's writes.
    pub fn clear(&mut self) {
        self.used = 0;
        self.open.clear();
    }

    /// Adds one IP packet. Returns `false` (and takes nothing) when the round has no buffer
    /// left for it: write out [`Coalescer::finish`], [`Coalescer::clear`], and push again.
    pub fn push(&mut self, packet: &[u8]) -> bool {
        let transport = transport(packet);
        let candidate = transport.and_then(|t| candidate(packet, t, self.udp));
        // The flow's open segment, looked up once per packet.
        let mut existing = None;
        if let Some(c) = candidate {
            existing = self.open.iter().position(|o| o.tuple == c.tuple);
            if let Some(i) = existing {
                if self.try_append(i, packet, &c) {
                    return true;
                }
                // It cannot join: the open segment must not take anything after it.
                self.open[i].closed = true;
            }
        } else if let Some(t) = transport {
            // A packet we do not coalesce (SYN, FIN, a bare ACK…) ends its flow's segment.
            let tuple = tuple(packet, t);
            for open in self.open.iter_mut().filter(|o| o.tuple == tuple) {
                open.closed = true;
            }
        }
        if self.used == ROUND {
            return false;
        }
        if self.buffers.len() == self.used {
            self.buffers.push(Vec::with_capacity(VNET_HDR_LEN + MAX_IP));
        }
        let index = self.used;
        self.used += 1;
        let buffer = &mut self.buffers[index];
        buffer.clear();
        buffer.extend_from_slice(&[0; VNET_HDR_LEN]);
        buffer.extend_from_slice(packet);
        self.written[index] = Written {
            segments: 1,
            transport: transport.filter(|t| has_checksum(packet, *t)),
            ..Written::default()
        };
        if let Some(c) = candidate {
            self.written[index].segment = c.payload;
            self.written[index].l4h_len = c.l4h_len;
            let open = Open {
                tuple: c.tuple,
                ack: c.ack,
                buffer: index,
                next_seq: c.seq.wrapping_add(c.payload as u32),
                segment: c.payload,
                segments: 1,
                closed: c.psh,
            };
            match existing {
                Some(i) => self.open[i] = open,
                None => self.open.push(open),
            }
        }
        true
    }

    fn try_append(&mut self, i: usize, packet: &[u8], c: &Candidate) -> bool {
        let open = self.open[i];
        let head = &self.buffers[open.buffer][VNET_HDR_LEN..];
        let w = self.written[open.buffer];
        let t = c.transport;
        let mut fits = !open.closed
            && c.payload <= open.segment
            && w.transport == Some(t)
            && w.l4h_len == c.l4h_len
            && head.len() + c.payload <= MAX_IP
            && same_ip_fields(head, packet, t.v6);
        if t.proto == TCP {
            fits = fits
                && open.ack == c.ack
                && open.next_seq == c.seq
                && head[t.iph_len + 20..t.iph_len + w.l4h_len]
                    == packet[t.iph_len + 20..t.iph_len + c.l4h_len];
        } else {
            fits = fits && open.segments < UDP_MAX_SEGMENTS;
        }
        if !fits {
            return false;
        }
        let buffer = &mut self.buffers[open.buffer];
        buffer.extend_from_slice(&packet[t.iph_len + c.l4h_len..]);
        if c.psh {
            buffer[VNET_HDR_LEN + t.iph_len + 13] |= TCP_PSH;
        }
        let o = &mut self.open[i];
        o.next_seq = o.next_seq.wrapping_add(c.payload as u32);
        o.segments += 1;
        o.closed = c.psh || c.payload < o.segment;
        self.written[open.buffer].segments += 1;
        true
    }

    /// Finishes the round: fixes the headers of coalesced packets and fills every virtio-net
    /// header. Returns the buffers to write, in order.
    pub fn finish(&mut self) -> impl Iterator<Item = &[u8]> + '_ {
        for (buffer, w) in self.buffers.iter_mut().zip(&self.written).take(self.used) {
            if let Some(t) = w.transport {
                if w.segments > 1 {
                    finish_coalesced(buffer, w, t);
                } else {
                    finish_single(buffer, t);
                }
            }
        }
        self.buffers[..self.used].iter().map(Vec::as_slice)
    }
}

/// Rewrites a coalesced packet's lengths and checksums and its virtio-net header.
fn finish_coalesced(buffer: &mut [u8], w: &Written, t: Transport) {
    let (header, packet) = buffer.split_at_mut(VNET_HDR_LEN);
    if t.v6 {
        let payload = (packet.len() - 40) as u16;
        packet[4..6].copy_from_slice(&payload.to_be_bytes());
    } else {
        let total = packet.len() as u16;
        packet[2..4].copy_from_slice(&total.to_be_bytes());
        packet[10..12].fill(0);
        let ip = !fold(ones_sum(&packet[..20], 0));
        packet[10..12].copy_from_slice(&ip.to_be_bytes());
    }
    let gso_type = if t.proto == UDP {
        let udp_len = (packet.len() - t.iph_len) as u16;
        packet[t.iph_len + 4..t.iph_len + 6].copy_from_slice(&udp_len.to_be_bytes());
        GSO_UDP_L4
    } else if t.v6 {
        GSO_TCPV6
    } else {
        GSO_TCPV4
    };
    set_partial_checksum(header, packet, t);
    header[1] = gso_type;
    header[2..4].copy_from_slice(&((t.iph_len + w.l4h_len) as u16).to_ne_bytes());
    header[4..6].copy_from_slice(&(w.segment as u16).to_ne_bytes());
}

/// Writes one TCP or UDP packet's header for the kernel to take its checksum as checked.
fn finish_single(buffer: &mut [u8], t: Transport) {
    let (header, packet) = buffer.split_at_mut(VNET_HDR_LEN);
    set_partial_checksum(header, packet, t);
}

/// Sets `NEEDS_CSUM` with the checksum's start and offset in `header`, and the pseudo-header
/// sum (not complemented) in the packet's checksum field: with that flag the kernel completes
/// the checksum from `csum_start` when it needs one and otherwise trusts it.
fn set_partial_checksum(header: &mut [u8], packet: &mut [u8], t: Transport) {
    let l4_len = (packet.len() - t.iph_len) as u64;
    let addresses = if t.v6 {
        &packet[8..40]
    } else {
        &packet[12..20]
    };
    let pseudo = fold(ones_sum(addresses, u64::from(t.proto) + l4_len));
    let field = t.iph_len + t.csum_offset();
    packet[field..field + 2].copy_from_slice(&pseudo.to_be_bytes());
    header[0] = NEEDS_CSUM;
    header[6..8].copy_from_slice(&(t.iph_len as u16).to_ne_bytes());
    header[8..10].copy_from_slice(&(t.csum_offset() as u16).to_ne_bytes());
}

/// Whether `packet` carries a checksum: always for TCP; for UDP unless the field is zero (no
/// checksum, allowed over IPv4), which must stay so.
fn has_checksum(packet: &[u8], t: Transport) -> bool {
    let at = t.iph_len + t.csum_offset();
    t.proto == TCP || packet[at..at + 2] != [0, 0]
}

/// Parses `packet` as a segment that may be coalesced (UDP only with `udp`).
fn candidate(packet: &[u8], t: Transport, udp: bool) -> Option<Candidate> {
    let l4 = &packet[t.iph_len..];
    if t.proto == UDP {
        let length = usize::from(u16::from_be_bytes([l4[4], l4[5]]));
        return (udp && length == l4.len() && l4.len() > UDP_HEADER && has_checksum(packet, t))
            .then(|| Candidate {
                transport: t,
                l4h_len: UDP_HEADER,
                tuple: tuple(packet, t),
                seq: 0,
                ack: 0,
                psh: false,
                payload: l4.len() - UDP_HEADER,
            });
    }
    let tcph_len = usize::from(l4[12] >> 4) * 4;
    if !(20..=60).contains(&tcph_len) || l4.len() <= tcph_len {
        return None;
    }
    let flags = l4[13];
    if flags != TCP_ACK && flags != TCP_ACK | TCP_PSH {
        return None;
    }
    Some(Candidate {
        transport: t,
        l4h_len: tcph_len,
        tuple: tuple(packet, t),
        seq: u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]),
        ack: u32::from_be_bytes([l4[8], l4[9], l4[10], l4[11]]),
        psh: flags & TCP_PSH != 0,
        payload: l4.len() - tcph_len,
    })
}

fn tuple(packet: &[u8], t: Transport) -> Tuple {
    let mut addresses = [0u8; 32];
    if t.v6 {
        addresses.copy_from_slice(&packet[8..40]);
    } else {
        addresses[..8].copy_from_slice(&packet[12..20]);
    }
    let p = &packet[t.iph_len..];
    (
        addresses,
        u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
        t.proto,
    )
}

/// The IP header of a whole, unfragmented IPv4 or IPv6 packet carrying TCP or UDP with no IP
/// options or extension headers, long enough for its transport header's fixed part.
fn transport(packet: &[u8]) -> Option<Transport> {
    let fixed = |proto| if proto == TCP { 20 } else { UDP_HEADER };
    match packet.first()? >> 4 {
        4 if packet.len() >= 20 => {
            let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
            let fragment = u16::from_be_bytes([packet[6], packet[7]]) & 0x3fff;
            let proto = packet[9];
            (packet[0] & 0x0f == 5
                && matches!(proto, TCP | UDP)
                && total == packet.len()
                && packet.len() >= 20 + fixed(proto)
                && fragment == 0)
                .then_some(Transport {
                    v6: false,
                    proto,
                    iph_len: 20,
                })
        }
        6 if packet.len() >= 40 => {
            let payload = usize::from(u16::from_be_bytes([packet[4], packet[5]]));
            let proto = packet[6];
            (matches!(proto, TCP | UDP) && payload + 40 == packet.len() && payload >= fixed(proto))
                .then_some(Transport {
                    v6: true,
                    proto,
                    iph_len: 40,
                })
        }
        _ => None,
    }
}

/// IP header fields that must match for packets to merge: TOS, DF and TTL (IPv4); traffic
/// class and hop limit (IPv6).
fn same_ip_fields(a: &[u8], b: &[u8], v6: bool) -> bool {
    if v6 {
        a[0] == b[0] && a[1] >> 4 == b[1] >> 4 && a[7] == b[7]
    } else {
        a[1] == b[1] && a[6] >> 5 == b[6] >> 5 && a[8] == b[8]
    }
}

/// The ones'-complement sum of `data` (as big-endian 16-bit words) added to `initial`, unfolded.
fn ones_sum(data: &[u8], initial: u64) -> u64 {
    let mut sum = initial;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        sum += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    let mut i = 0;
    while i + 1 < rest.len() {
        sum += u64::from(u16::from_be_bytes([rest[i], rest[i + 1]]));
        i += 2;
    }
    if i < rest.len() {
        sum += u64::from(rest[i]) << 8;
    }
    sum
}

/// Folds a ones'-complement sum to 16 bits.
fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

#[cfg(test)]
mod tests;
