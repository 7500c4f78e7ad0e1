//! TCP coalescing (GRO) for writes to a TUN device opened with a virtio-net header.
//!
//! Decrypted packets of one TCP flow usually arrive in order and back to back. Handing them to
//! the kernel as one large segment (with `VIRTIO_NET_HDR_GSO_TCPV4/6`) costs one write and one
//! pass through the kernel's TCP receive path instead of one per packet. The rules follow the
//! kernel's own GRO: same flow and acknowledgement, consecutive sequence numbers, equal TCP
//! options and IP header fields, only ACK or ACK|PSH flags, every segment the size of the first
//! but the last, PSH only on the last, valid checksums. A packet that cannot join closes its
//! flow's open segment, so nothing of a flow is ever reordered.
//!
//! Pure: no I/O, no allocation after the buffers first grow.

/// Bytes of the virtio-net header in front of every packet written.
pub const VNET_HDR_LEN: usize = 10;
/// Output buffers per round: more than one 64 KiB segment's worth of full-size packets.
pub const ROUND: usize = 64;
/// Largest IP packet (IPv4 total length, IPv6 payload length).
const MAX_IP: usize = 65_535;

/// virtio-net header flag: the kernel completes the checksum from `csum_start`.
const NEEDS_CSUM: u8 = 1;
/// virtio-net header GSO types: a TCP/IPv4 or TCP/IPv6 super-packet.
const GSO_TCPV4: u8 = 1;
const GSO_TCPV6: u8 = 4;
/// TCP flags a coalesced packet may carry (ACK always; PSH only on the last segment).
const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;

/// A TCP packet that may be coalesced.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    v6: bool,
    iph_len: usize,
    tcph_len: usize,
    /// Source and destination addresses (IPv4 in the first 8 bytes) and ports.
    tuple: ([u8; 32], u32),
    seq: u32,
    ack: u32,
    psh: bool,
    payload: usize,
}

/// The open (still growing) segment of one flow.
#[derive(Debug, Clone, Copy)]
struct Open {
    tuple: ([u8; 32], u32),
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
    /// Coalesced segments in it (1: written as is).
    segments: usize,
    segment: usize,
    v6: bool,
    iph_len: usize,
    tcph_len: usize,
}

/// Coalesces a round of packets into at most [`ROUND`] writes, each behind a virtio-net header.
#[derive(Debug)]
pub struct TcpCoalescer {
    buffers: Vec<Vec<u8>>,
    written: Vec<Written>,
    used: usize,
    open: Vec<Open>,
}

impl Default for TcpCoalescer {
    fn default() -> Self {
        Self::new()
    }
}

impl TcpCoalescer {
    /// An empty coalescer; buffers are created on first use and reused after.
    pub fn new() -> Self {
        Self {
            buffers: Vec::new(),
            written: vec![Written::default(); ROUND],
            used: 0,
            open: Vec::with_capacity(ROUND),
        }
    }

    /// Starts a new round, forgetting the last one's writes.
    pub fn clear(&mut self) {
        self.used = 0;
        self.open.clear();
    }

    /// Adds one IP packet. Returns `false` (and takes nothing) when the round has no buffer
    /// left for it: write out [`TcpCoalescer::finish`], [`TcpCoalescer::clear`], and push again.
    pub fn push(&mut self, packet: &[u8]) -> bool {
        let candidate = candidate(packet);
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
        } else if let Some(tuple) = tcp_tuple(packet) {
            // A TCP packet we do not coalesce (SYN, FIN, a bare ACK…) ends its flow's segment.
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
        buffer.resize(VNET_HDR_LEN, 0);
        buffer.extend_from_slice(packet);
        self.written[index] = Written {
            segments: 1,
            ..Written::default()
        };
        if let Some(c) = candidate {
            self.written[index] = Written {
                segments: 1,
                segment: c.payload,
                v6: c.v6,
                iph_len: c.iph_len,
                tcph_len: c.tcph_len,
            };
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
        let fits = !open.closed
            && open.ack == c.ack
            && open.next_seq == c.seq
            && c.payload <= open.segment
            && w.v6 == c.v6
            && w.tcph_len == c.tcph_len
            && head.len() + c.payload <= MAX_IP
            && same_ip_fields(head, packet, c.v6)
            && head[w.iph_len + 20..w.iph_len + w.tcph_len]
                == packet[c.iph_len + 20..c.iph_len + c.tcph_len]
            && (open.segments > 1 || tcp_checksum_valid(head, w.iph_len, w.v6))
            && tcp_checksum_valid(packet, c.iph_len, c.v6);
        if !fits {
            return false;
        }
        let buffer = &mut self.buffers[open.buffer];
        buffer.extend_from_slice(&packet[c.iph_len + c.tcph_len..]);
        if c.psh {
            buffer[VNET_HDR_LEN + w.iph_len + 13] |= TCP_PSH;
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
            if w.segments > 1 {
                finish_coalesced(buffer, w);
            }
        }
        self.buffers[..self.used].iter().map(Vec::as_slice)
    }
}

/// Rewrites a coalesced packet's lengths and checksums and its virtio-net header.
fn finish_coalesced(buffer: &mut [u8], w: &Written) {
    let (header, packet) = buffer.split_at_mut(VNET_HDR_LEN);
    let tcp_len = packet.len() - w.iph_len;
    let pseudo = if w.v6 {
        let payload = (packet.len() - 40) as u16;
        packet[4..6].copy_from_slice(&payload.to_be_bytes());
        ones_sum(&packet[8..40], 6 + tcp_len as u64)
    } else {
        let total = packet.len() as u16;
        packet[2..4].copy_from_slice(&total.to_be_bytes());
        packet[10..12].fill(0);
        let ip = !fold(ones_sum(&packet[..20], 0));
        packet[10..12].copy_from_slice(&ip.to_be_bytes());
        ones_sum(&packet[12..20], 6 + tcp_len as u64)
    };
    // With NEEDS_CSUM the kernel completes the checksum from csum_start; the field holds the
    // pseudo-header's sum, not complemented.
    packet[w.iph_len + 16..w.iph_len + 18].copy_from_slice(&fold(pseudo).to_be_bytes());
    header[0] = NEEDS_CSUM;
    header[1] = if w.v6 { GSO_TCPV6 } else { GSO_TCPV4 };
    header[2..4].copy_from_slice(&((w.iph_len + w.tcph_len) as u16).to_ne_bytes());
    header[4..6].copy_from_slice(&(w.segment as u16).to_ne_bytes());
    header[6..8].copy_from_slice(&(w.iph_len as u16).to_ne_bytes());
    header[8..10].copy_from_slice(&16u16.to_ne_bytes());
}

/// Parses `packet` as a TCP segment GRO may coalesce.
fn candidate(packet: &[u8]) -> Option<Candidate> {
    let (v6, iph_len) = ip_header(packet)?;
    let tcp = &packet[iph_len..];
    let tcph_len = usize::from(tcp.get(12)? >> 4) * 4;
    if !(20..=60).contains(&tcph_len) || tcp.len() <= tcph_len {
        return None;
    }
    let flags = tcp[13];
    if flags != TCP_ACK && flags != TCP_ACK | TCP_PSH {
        return None;
    }
    Some(Candidate {
        v6,
        iph_len,
        tcph_len,
        tuple: tuple(packet, v6, iph_len),
        seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
        ack: u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]),
        psh: flags & TCP_PSH != 0,
        payload: tcp.len() - tcph_len,
    })
}

/// The addresses and ports of any TCP packet.
fn tcp_tuple(packet: &[u8]) -> Option<([u8; 32], u32)> {
    let (v6, iph_len) = ip_header(packet)?;
    (packet.len() >= iph_len + 20).then(|| tuple(packet, v6, iph_len))
}

fn tuple(packet: &[u8], v6: bool, iph_len: usize) -> ([u8; 32], u32) {
    let mut addresses = [0u8; 32];
    if v6 {
        addresses.copy_from_slice(&packet[8..40]);
    } else {
        addresses[..8].copy_from_slice(&packet[12..20]);
    }
    let p = &packet[iph_len..];
    (addresses, u32::from_be_bytes([p[0], p[1], p[2], p[3]]))
}

/// `(is IPv6, header length)` of a whole, unfragmented IPv4 or IPv6 packet carrying TCP with
/// no IP options or extension headers.
fn ip_header(packet: &[u8]) -> Option<(bool, usize)> {
    match packet.first()? >> 4 {
        4 if packet.len() >= 40 => {
            let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
            let fragment = u16::from_be_bytes([packet[6], packet[7]]) & 0x3fff;
            (packet[0] & 0x0f == 5 && packet[9] == 6 && total == packet.len() && fragment == 0)
                .then_some((false, 20))
        }
        6 if packet.len() >= 60 => {
            let payload = usize::from(u16::from_be_bytes([packet[4], packet[5]]));
            (packet[6] == 6 && payload + 40 == packet.len()).then_some((true, 40))
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

/// Whether the TCP checksum of a whole packet is right.
fn tcp_checksum_valid(packet: &[u8], iph_len: usize, v6: bool) -> bool {
    let tcp_len = (packet.len() - iph_len) as u64;
    let addresses = if v6 { &packet[8..40] } else { &packet[12..20] };
    let sum = ones_sum(addresses, 6 + tcp_len);
    fold(ones_sum(&packet[iph_len..], sum)) == 0xffff
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
