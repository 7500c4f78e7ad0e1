//! Coalescing rules, checked on hand-built TCP segments with valid checksums.

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

fn run(packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut gro = TcpCoalescer::new();
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
        let mut completed = packet.to_vec();
        let partial = ones_sum(&completed[iph..], 0);
        let full = !fold(partial);
        completed[iph + 16..iph + 18].copy_from_slice(&full.to_be_bytes());
        assert!(tcp_checksum_valid(&completed, iph, v6), "v6={v6}");
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
    // A bad checksum is never merged (the kernel must see it and drop it).
    let mut bad = v4(100, 100, false);
    bad[40] ^= 0xff;
    let out = run(&[v4(0, 100, false), bad.clone()]);
    assert_eq!(out.len(), 2);
    assert_eq!(&out[1][VNET_HDR_LEN..], bad.as_slice());
    assert_eq!(out[1][..VNET_HDR_LEN], [0; VNET_HDR_LEN], "written as is");
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
    assert_eq!(&out[2][VNET_HDR_LEN..], after.as_slice());
}

#[test]
fn a_round_holds_at_most_round_writes_and_reuses_its_buffers() {
    let mut gro = TcpCoalescer::new();
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
fn non_tcp_and_malformed_packets_pass_through_unchanged() {
    let mut udp = segment(false, 0, 100, false);
    udp[9] = 17;
    let short = vec![0x45, 0, 0];
    let garbage = vec![0xff; 70];
    let out = run(&[udp.clone(), short.clone(), garbage.clone()]);
    assert_eq!(out.len(), 3);
    for (written, original) in out.iter().zip([&udp, &short, &garbage]) {
        assert_eq!(&written[VNET_HDR_LEN..], original.as_slice());
        assert_eq!(written[..VNET_HDR_LEN], [0; VNET_HDR_LEN]);
    }
}
