//! Coalescing rules, checked on hand-built TCP segments and UDP datagrams with valid checksums.

use super::*;

/// A TCP segment of the flow 10.0.0.1:5201 → 10.0.0.2:40000 (or fd00::1 → fd00::2) with
/// `payload` bytes following `seq`, ACK (and PSH with `psh`), valid checksums.
fn segment(v6: bool, seq: u32, payload: usize, psh: bool) -> Vec<u8> {
    let iph = if v6 { 40 } else { 20 };
    let total = iph + 20 + payload;
    let mut p = vec![0u8; total];
    if v6 {
        p[0] = 0x60;
        p[4..6].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
        p[6] = 6;
        p[7] = 64;
        p[8] = 0xfd;
        p[23] = 1;
        p[24] = 0xfd;
        p[39] = 2;
    } else {
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&(seq as u16).to_be_bytes());
        p[6] = 0x40;
        p[8] = 64;
        p[9] = 6;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let ip = !fold(ones_sum(&p[..20], 0));
        p[10..12].copy_from_slice(&ip.to_be_bytes());
    }
    let t = iph;
    p[t..t + 2].copy_from_slice(&5201u16.to_be_bytes());
    p[t + 2..t + 4].copy_from_slice(&40000u16.to_be_bytes());
    p[t + 4..t + 8].copy_from_slice(&seq.to_be_bytes());
    p[t + 8..t + 12].copy_from_slice(&77u32.to_be_bytes());
    p[t + 12] = 5 << 4;
    p[t + 13] = if psh { TCP_ACK | TCP_PSH } else { TCP_ACK };
    p[t + 14..t + 16].copy_from_slice(&512u16.to_be_bytes());
    for (i, b) in p[t + 20..].iter_mut().enumerate() {
        *b = (seq as usize + i) as u8;
    }
    let addresses = if v6 { &p[8..40] } else { &p[12..20] };
    let sum = ones_sum(addresses, 6 + (20 + payload) as u64);
    let tcp = !fold(ones_sum(&p[t..], sum));
    p[t + 16..t + 18].copy_from_slice(&tcp.to_be_bytes());
    p
}

/// A UDP datagram of the flow 10.0.0.1:4000 → 10.0.0.2:5000 (or fd00::1 → fd00::2) with
/// `payload` bytes starting at `fill`, valid checksums.
fn datagram(v6: bool, fill: u8, payload: usize) -> Vec<u8> {
    let iph = if v6 { 40 } else { 20 };
    let udp_len = UDP_HEADER + payload;
    let mut p = vec![0u8; iph + udp_len];
    if v6 {
        p[0] = 0x60;
        p[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
        p[6] = UDP;
        p[7] = 64;
        p[8] = 0xfd;
        p[23] = 1;
        p[24] = 0xfd;
        p[39] = 2;
    } else {
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((iph + udp_len) as u16).to_be_bytes());
        p[4..6].copy_from_slice(&u16::from(fill).to_be_bytes());
        p[6] = 0x40;
        p[8] = 64;
        p[9] = UDP;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let ip = !fold(ones_sum(&p[..20], 0));
        p[10..12].copy_from_slice(&ip.to_be_bytes());
    }
    p[iph..iph + 2].copy_from_slice(&4000u16.to_be_bytes());
    p[iph + 2..iph + 4].copy_from_slice(&5000u16.to_be_bytes());
    p[iph + 4..iph + 6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    for (i, b) in p[iph + UDP_HEADER..].iter_mut().enumerate() {
        *b = fill.wrapping_add(i as u8);
    }
    let sum = !fold(pseudo_and_body(&p, iph, v6, UDP));
    p[iph + 6..iph + 8].copy_from_slice(&if sum == 0 { 0xffff } else { sum }.to_be_bytes());
    p
}

/// The ones'-complement sum of the pseudo-header and transport segment of `p`, folded.
fn pseudo_and_body(p: &[u8], iph: usize, v6: bool, proto: u8) -> u64 {
    let addresses = if v6 { &p[8..40] } else { &p[12..20] };
    let sum = ones_sum(addresses, u64::from(proto) + (p.len() - iph) as u64);
    u64::from(fold(ones_sum(&p[iph..], sum)))
}

/// Whether the TCP or UDP checksum of a whole packet is right.
fn checksum_valid(p: &[u8], iph: usize, v6: bool, proto: u8) -> bool {
    fold(pseudo_and_body(p, iph, v6, proto)) == 0xffff
}

/// Completes a `NEEDS_CSUM` packet's checksum the way the kernel does: the ones' complement of
/// the sum from `csum_start` on, the field holding the pseudo-header sum, stored at
/// `csum_start + csum_offset`.
fn complete(written: &[u8]) -> Vec<u8> {
    let (header, packet) = written.split_at(VNET_HDR_LEN);
    assert_eq!(header[0], NEEDS_CSUM);
    let start = usize::from(u16_ne(&header[6..8]));
    let field = start + usize::from(u16_ne(&header[8..10]));
    let mut packet = packet.to_vec();
    let full = !fold(ones_sum(&packet[start..], 0));
    packet[field..field + 2].copy_from_slice(&full.to_be_bytes());
    packet
}

fn run(packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    run_with(false, packets)
}

fn run_with(udp: bool, packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut gro = Coalescer::with_udp(udp);
    for p in packets {
        assert!(gro.push(p));
    }
    gro.finish().map(<[u8]>::to_vec).collect()
}

fn u16_ne(b: &[u8]) -> u16 {
    u16::from_ne_bytes([b[0], b[1]])
}

#[test]
fn in_order_segments_of_one_flow_become_one_gso_write() {
    for v6 in [false, true] {
        let iph = if v6 { 40 } else { 20 };
        let packets: Vec<Vec<u8>> = (0..40u32)
            .map(|i| segment(v6, 1000 + i * 1300, 1300, i == 39))
            .collect();
        let out = run(&packets);
        assert_eq!(out.len(), 1, "v6={v6}");
        let (header, packet) = out[0].split_at(VNET_HDR_LEN);
        assert_eq!(header[0], NEEDS_CSUM);
        assert_eq!(header[1], if v6 { GSO_TCPV6 } else { GSO_TCPV4 });
        assert_eq!(u16_ne(&header[2..4]) as usize, iph + 20, "hdr_len");
        assert_eq!(u16_ne(&header[4..6]), 1300, "gso_size");
        assert_eq!(u16_ne(&header[6..8]) as usize, iph, "csum_start");
        assert_eq!(u16_ne(&header[8..10]), 16, "csum_offset");
        assert_eq!(packet.len(), iph + 20 + 40 * 1300);
        if v6 {
            assert_eq!(
                usize::from(u16::from_be_bytes([packet[4], packet[5]])),
                20 + 40 * 1300
            );
        } else {
            assert_eq!(
                usize::from(u16::from_be_bytes([packet[2], packet[3]])),
                packet.len()
            );
            assert_eq!(
                fold(ones_sum(&packet[..20], 0)),
                0xffff,
                "IPv4 header checksum"
            );
        }
        // The payload is every segment's, in order; PSH moved to the merged header.
        let payload: Vec<u8> = packets
            .iter()
            .flat_map(|p| p[iph + 20..].to_vec())
            .collect();
        assert_eq!(&packet[iph + 20..], payload.as_slice());
        assert_eq!(packet[iph + 13], TCP_ACK | TCP_PSH);
        // The checksum field holds the pseudo-header sum: completing it over the segment the
        // way the kernel does gives a valid checksum.
        let completed = complete(&out[0]);
        assert!(checksum_valid(&completed, iph, v6, TCP), "v6={v6}");
    }
}

#[test]
fn a_gap_a_psh_a_short_segment_or_another_flow_starts_a_new_write() {
    let v4 = |seq, len, psh| segment(false, seq, len, psh);
    // A gap in sequence numbers.
    assert_eq!(run(&[v4(0, 100, false), v4(200, 100, false)]).len(), 2);
    // Nothing joins after PSH.
    assert_eq!(run(&[v4(0, 100, true), v4(100, 100, false)]).len(), 2);
    // Nothing joins after a short segment; a larger one never follows a smaller.
    assert_eq!(
        run(&[v4(0, 100, false), v4(100, 50, false), v4(150, 50, false)]).len(),
        2
    );
    assert_eq!(run(&[v4(0, 50, false), v4(50, 100, false)]).len(), 2);
    // Another flow (IPv6 here) is its own write; each flow still merges.
    let mixed = run(&[
        v4(0, 100, false),
        segment(true, 0, 100, false),
        v4(100, 100, false),
        segment(true, 100, 100, false),
    ]);
    assert_eq!(mixed.len(), 2);
}

#[test]
fn checksums_are_not_verified_since_wireguard_authenticated_the_packet() {
    // A segment whose checksum its sender got wrong still merges: like the kernel's WireGuard,
    // which marks decrypted packets CHECKSUM_UNNECESSARY, the engine trusts what the tunnel
    // authenticated.
    let mut bad = segment(false, 100, 100, false);
    bad[40] ^= 0xff;
    assert_eq!(run(&[segment(false, 0, 100, false), bad]).len(), 1);
}

#[test]
fn a_packet_that_cannot_join_closes_its_flow_so_nothing_is_reordered() {
    let a = segment(false, 0, 100, false);
    let mut fin = segment(false, 100, 0, false);
    fin[33] |= 0x01; // FIN: not a candidate
    let after = segment(false, 100, 100, false);
    let out = run(&[a, fin, after.clone()]);
    assert_eq!(
        out.len(),
        3,
        "the segment after the FIN is not pulled ahead of it"
    );
    assert_eq!(complete(&out[2]), after);
}

#[test]
fn a_round_holds_at_most_round_writes_and_reuses_its_buffers() {
    let mut gro = Coalescer::new();
    // Gaps everywhere: nothing merges, so each packet takes a buffer.
    for i in 0..ROUND as u32 {
        assert!(gro.push(&segment(false, i * 1000, 100, false)));
    }
    assert!(
        !gro.push(&segment(false, 999_999, 100, false)),
        "the round is full"
    );
    assert_eq!(gro.finish().count(), ROUND);
    let capacity = gro.buffers[0].capacity();
    gro.clear();
    assert!(gro.push(&segment(false, 0, 100, false)));
    assert_eq!(gro.finish().count(), 1);
    assert_eq!(gro.buffers[0].capacity(), capacity);
    assert_eq!(gro.buffers.len(), ROUND);
}

#[test]
fn other_protocols_unchecksummed_udp_and_malformed_packets_pass_through_unchanged() {
    let mut icmp = segment(false, 0, 100, false);
    icmp[9] = 1;
    let mut no_checksum = datagram(false, 0, 100);
    no_checksum[26..28].fill(0);
    let short = vec![0x45, 0, 0];
    let garbage = vec![0xff; 70];
    let all = [icmp, no_checksum, short, garbage];
    for udp in [false, true] {
        let out = run_with(udp, &all);
        assert_eq!(out.len(), all.len());
        for (written, original) in out.iter().zip(&all) {
            assert_eq!(&written[VNET_HDR_LEN..], original.as_slice());
            assert_eq!(written[..VNET_HDR_LEN], [0; VNET_HDR_LEN]);
        }
    }
}

#[test]
fn a_packet_written_alone_has_its_checksum_taken_as_checked() {
    // A lone TCP segment, a bare ACK (not a candidate) and a UDP datagram (with UDP merging
    // off): each goes with NEEDS_CSUM, no GSO, and a checksum field the kernel completes back
    // to the sender's.
    let cases = [
        (segment(false, 0, 1300, true), 20, 16),
        (segment(true, 0, 0, false), 40, 16),
        (datagram(false, 3, 1300), 20, 6),
        (datagram(true, 3, 1300), 40, 6),
    ];
    for (packet, iph, csum_offset) in cases {
        let out = run(std::slice::from_ref(&packet));
        assert_eq!(out.len(), 1);
        let header = &out[0][..VNET_HDR_LEN];
        assert_eq!(header[0], NEEDS_CSUM, "flags");
        assert_eq!(header[1], 0, "no GSO");
        assert_eq!(u16_ne(&header[4..6]), 0, "gso_size");
        assert_eq!(usize::from(u16_ne(&header[6..8])), iph, "csum_start");
        assert_eq!(u16_ne(&header[8..10]), csum_offset, "csum_offset");
        assert_eq!(
            complete(&out[0]),
            packet,
            "the kernel's completion restores it"
        );
    }
}

#[test]
fn udp_datagrams_of_one_flow_become_one_uso_write() {
    for v6 in [false, true] {
        let iph = if v6 { 40 } else { 20 };
        let mut packets: Vec<Vec<u8>> = (0..10u8).map(|i| datagram(v6, i, 1200)).collect();
        packets.push(datagram(v6, 10, 500));
        let out = run_with(true, &packets);
        assert_eq!(out.len(), 1, "v6={v6}");
        let (header, packet) = out[0].split_at(VNET_HDR_LEN);
        assert_eq!(header[0], NEEDS_CSUM);
        assert_eq!(header[1], GSO_UDP_L4);
        assert_eq!(
            usize::from(u16_ne(&header[2..4])),
            iph + UDP_HEADER,
            "hdr_len"
        );
        assert_eq!(
            u16_ne(&header[4..6]),
            1200,
            "gso_size: one datagram's payload"
        );
        assert_eq!(usize::from(u16_ne(&header[6..8])), iph, "csum_start");
        assert_eq!(u16_ne(&header[8..10]), 6, "csum_offset");
        let udp_len = UDP_HEADER + 10 * 1200 + 500;
        assert_eq!(packet.len(), iph + udp_len);
        let length = |at: usize| usize::from(u16::from_be_bytes([packet[at], packet[at + 1]]));
        assert_eq!(length(iph + 4), udp_len, "UDP length");
        if v6 {
            assert_eq!(length(4), udp_len, "IPv6 payload length");
        } else {
            assert_eq!(length(2), packet.len(), "IPv4 total length");
            assert_eq!(
                fold(ones_sum(&packet[..20], 0)),
                0xffff,
                "IPv4 header checksum"
            );
        }
        let payload: Vec<u8> = packets
            .iter()
            .flat_map(|p| p[iph + UDP_HEADER..].to_vec())
            .collect();
        assert_eq!(&packet[iph + UDP_HEADER..], payload.as_slice());
        assert!(checksum_valid(&complete(&out[0]), iph, v6, UDP), "v6={v6}");
    }
}

#[test]
fn udp_merges_only_with_offload_equal_sizes_and_within_the_segment_limit() {
    let d = |fill, len| datagram(false, fill, len);
    // Without UDP segmentation offload, every datagram is its own write.
    assert_eq!(run_with(false, &[d(0, 100), d(1, 100)]).len(), 2);
    // A larger datagram never follows a smaller; nothing joins after a short one.
    assert_eq!(run_with(true, &[d(0, 50), d(1, 100)]).len(), 2);
    assert_eq!(run_with(true, &[d(0, 100), d(1, 50), d(2, 50)]).len(), 2);
    // At most UDP_MAX_SEGMENTS datagrams to a write.
    let many: Vec<Vec<u8>> = (0..UDP_MAX_SEGMENTS + 6).map(|i| d(i as u8, 100)).collect();
    let out = run_with(true, &many);
    assert_eq!(out.len(), 2);
    assert_eq!(
        out[0].len(),
        VNET_HDR_LEN + 20 + UDP_HEADER + UDP_MAX_SEGMENTS * 100
    );
    // A TCP segment with the same addresses and ports is another flow.
    let mut tcp = segment(false, 0, 100, false);
    tcp[20..22].copy_from_slice(&4000u16.to_be_bytes());
    tcp[22..24].copy_from_slice(&5000u16.to_be_bytes());
    let out = run_with(true, &[d(0, 100), tcp, d(1, 100)]);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0][1], GSO_UDP_L4);
}
