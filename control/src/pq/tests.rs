use std::sync::Arc;

use super::link::{
    FailedHandshakes, LinkSetup, PqLink, FALLBACK_AFTER_REFUSED, FALLBACK_AFTER_UNUSED,
    RETRY_EXCHANGE_MS,
};
use super::message::{Malformed, Message};
use super::*;

/// Deterministic bytes for a test's randomness (xorshift64).
fn entropy(state: &mut u64) -> impl FnMut(&mut [u8]) + '_ {
    move |buf: &mut [u8]| {
        for b in buf {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *b = *state as u8;
        }
    }
}

fn identity(n: u8) -> Arc<PqIdentity> {
    Arc::new(PqIdentity::from_seed(&[n; SEED_LEN]))
}

/// Two ends of one link: `i` has the lower WireGuard key and initiates.
struct Pair {
    i: PqLink,
    r: PqLink,
    rng: u64,
    now: i64,
}

const PERIOD: i64 = 120_000;

impl Pair {
    fn new() -> Self {
        let (ik, rk) = (identity(1), identity(2));
        let tag = tag_key(&[7; 32]);
        let (low, high) = (Key([1; 32]), Key([2; 32]));
        let i = PqLink::new(
            LinkSetup {
                local: low,
                peer: high,
                peer_fp: rk.fingerprint(),
                tag_key: tag.clone(),
            },
            ik,
            PERIOD,
        );
        let r = PqLink::new(
            LinkSetup {
                local: high,
                peer: low,
                peer_fp: identity(1).fingerprint(),
                tag_key: tag,
            },
            rk,
            PERIOD,
        );
        Self {
            i,
            r,
            rng: 0x9e37_79b9_7f4a_7c15,
            now: 1_700_000_000_000,
        }
    }

    /// Runs the initiator's timers, then the wire until quiet, dropping what `drop` says.
    fn run(&mut self, mut drop: impl FnMut(&[u8]) -> bool) {
        self.i.poll(self.now, &mut entropy(&mut self.rng));
        for _ in 0..16 {
            let mut moved = false;
            while let Some(d) = self.i.poll_transmit() {
                moved = true;
                if !drop(&d) {
                    self.r
                        .handle(&d, self.now, &mut entropy(&mut self.rng))
                        .unwrap();
                }
            }
            while let Some(d) = self.r.poll_transmit() {
                moved = true;
                if !drop(&d) {
                    self.i
                        .handle(&d, self.now, &mut entropy(&mut self.rng))
                        .unwrap();
                }
            }
            if !moved {
                break;
            }
        }
    }

    fn keys(&self) -> (Option<SecretKey>, Option<SecretKey>) {
        (
            self.i.installed().map(|k| k.psk.clone()),
            self.r.installed().map(|k| k.psk.clone()),
        )
    }
}

#[test]
fn a_keypair_from_its_seed_has_the_standard_sizes_and_a_stable_fingerprint() {
    let a = identity(1);
    assert_eq!(a.encapsulation_key().len(), EK_LEN);
    assert_eq!(a.fingerprint(), identity(1).fingerprint());
    assert_ne!(a.fingerprint(), identity(2).fingerprint());
    assert!(!format!("{a:?}").contains(&format!("{:?}", &a.encapsulation_key()[..4])));
}

#[test]
fn a_peer_key_of_the_wrong_length_fingerprint_or_encoding_is_refused() {
    let a = identity(1);
    let fp = a.fingerprint();
    assert!(PeerEk::check(a.encapsulation_key(), &fp).is_ok());
    assert_eq!(
        PeerEk::check(&a.encapsulation_key()[1..], &fp).err(),
        Some(EkRefused::Length)
    );
    assert_eq!(
        PeerEk::check(identity(2).encapsulation_key(), &fp).err(),
        Some(EkRefused::Fingerprint)
    );
    // Every coefficient 0xfff: above the modulus, refused by the check.
    let bad = [0xff; EK_LEN];
    assert_eq!(
        PeerEk::check(&bad, &fingerprint(&bad)).err(),
        Some(EkRefused::Invalid)
    );
}

#[test]
fn messages_round_trip_and_a_wrong_type_length_or_tag_is_refused() {
    let key = tag_key(&[3; 32]);
    let messages = [
        Message::KeyRequest,
        Message::Key {
            ek: Box::new(identity(1).encapsulation_key().try_into().unwrap()),
        },
        Message::Init {
            epoch: 9,
            nonce: [4; 16],
            ct: Box::new([5; CT_LEN]),
        },
        Message::Ack {
            epoch: 9,
            nonce: [6; 16],
            confirmation: [7; 16],
        },
        Message::Commit { epoch: 9 },
        Message::Done { epoch: 9 },
    ];
    for m in messages {
        let bytes = m.encode(&key);
        assert!(bytes.len() <= 1 + EK_LEN + 16, "{m:?}: {}", bytes.len());
        assert_eq!(Message::decode(&bytes, &key), Ok(m.clone()));
        assert_eq!(
            Message::decode(&bytes, &tag_key(&[4; 32])),
            Err(Malformed::Tag),
            "{m:?}"
        );
        assert_eq!(
            Message::decode(&bytes[..bytes.len() - 1], &key),
            Err(Malformed::Length)
        );
        let mut flipped = bytes.clone();
        flipped[1] ^= 1;
        assert_eq!(Message::decode(&flipped, &key), Err(Malformed::Tag));
    }
    assert_eq!(Message::decode(&[], &key), Err(Malformed::Type));
    assert_eq!(Message::decode(&[99; 40], &key), Err(Malformed::Type));
}

#[test]
fn both_ends_install_one_key_and_a_new_one_each_period() {
    let mut p = Pair::new();
    p.run(|_| false);
    let (i, r) = p.keys();
    assert!(i.is_some());
    assert_eq!(i, r, "both ends derived and installed the same key");
    let first = p.i.installed().unwrap().clone();
    assert_eq!(first.epoch, p.r.installed().unwrap().epoch);
    // Nothing more until the period has passed.
    assert_eq!(p.i.poll_timeout(), Some(p.now + PERIOD));
    p.now += PERIOD - 1;
    p.run(|_| false);
    assert_eq!(p.keys().0, i);
    p.now += 1;
    p.run(|_| false);
    let (i2, r2) = p.keys();
    assert_ne!(i2, i, "a new key each period");
    assert_eq!(i2, r2);
    assert!(p.i.installed().unwrap().epoch > first.epoch);
    assert!(p.i.refused().is_empty() && p.r.refused().is_empty());
}

#[test]
fn a_lost_message_is_sent_again_and_an_unanswered_exchange_is_dropped_and_retried() {
    let mut p = Pair::new();
    // The first Init is lost: the retry a second later completes the exchange.
    let mut dropped = 0;
    p.run(|d| {
        let init = d[0] == 3 && dropped == 0;
        dropped += usize::from(init);
        init
    });
    assert_eq!(p.keys(), (None, None));
    p.now += 1_000;
    p.run(|_| false);
    let (i, r) = p.keys();
    assert!(i.is_some() && i == r);

    // A responder that never answers: retries at 1, 2 and 4 s, then a pause, the key kept.
    let mut p = Pair::new();
    p.run(|_| false);
    let kept = p.keys().0;
    p.now += PERIOD;
    let mut sent = 0;
    for _ in 0..20 {
        p.i.poll(p.now, &mut entropy(&mut p.rng));
        while p.i.poll_transmit().is_some() {
            sent += 1;
        }
        p.now += 500;
    }
    assert_eq!(sent, 4, "the Init and three retries");
    assert_eq!(p.i.refused().get("unanswered"), Some(&1));
    assert_eq!(p.keys().0, kept, "the installed key stays");
    assert!(p.i.poll_timeout().unwrap() >= p.now - 500 + RETRY_EXCHANGE_MS - 3_000);
}

#[test]
fn a_replayed_init_never_installs_an_old_key() {
    let mut p = Pair::new();
    let mut first_init = None;
    p.run(|d| {
        if d[0] == 3 {
            first_init.get_or_insert_with(|| d.to_vec());
        }
        false
    });
    p.now += PERIOD;
    p.run(|_| false);
    let current = p.keys();
    let old = first_init.unwrap();
    p.r.handle(&old, p.now, &mut entropy(&mut p.rng)).unwrap();
    assert!(p.r.poll_transmit().is_none(), "no answer to a replay");
    assert_eq!(p.r.refused().get("replay"), Some(&1));
    // Even a commit for that epoch installs nothing.
    let epoch = match Message::decode(&old, &p.r.setup().tag_key).unwrap() {
        Message::Init { epoch, .. } => epoch,
        _ => unreachable!(),
    };
    let commit = Message::Commit { epoch }.encode(&p.r.setup().tag_key);
    p.r.handle(&commit, p.now, &mut entropy(&mut p.rng))
        .unwrap();
    assert_eq!(p.keys(), current);
}

#[test]
fn a_tampered_ciphertext_fails_the_confirmation_and_neither_end_changes_its_key() {
    let mut p = Pair::new();
    p.run(|_| false);
    let before = p.keys();
    p.now += PERIOD;
    p.i.poll(p.now, &mut entropy(&mut p.rng));
    let init = p.i.poll_transmit().unwrap();
    // Someone who holds the tag key (no one but the two nodes) changes the ciphertext.
    let key = p.r.setup().tag_key.clone();
    let Ok(Message::Init {
        epoch,
        nonce,
        mut ct,
    }) = Message::decode(&init, &key)
    else {
        panic!("an Init");
    };
    ct[0] ^= 1;
    let forged = Message::Init { epoch, nonce, ct }.encode(&key);
    p.r.handle(&forged, p.now, &mut entropy(&mut p.rng))
        .unwrap();
    let ack = p.r.poll_transmit().unwrap();
    p.i.handle(&ack, p.now, &mut entropy(&mut p.rng)).unwrap();
    assert_eq!(p.i.refused().get("confirmation"), Some(&1));
    assert!(p.i.poll_transmit().is_none(), "no commit");
    assert_eq!(p.keys(), before);
}

#[test]
fn a_message_from_anyone_without_the_tag_key_changes_nothing() {
    let mut p = Pair::new();
    p.run(|_| false);
    let before = p.keys();
    let forged = Message::Commit { epoch: u64::MAX }.encode(&tag_key(&[9; 32]));
    assert_eq!(
        p.r.handle(&forged, p.now, &mut entropy(&mut p.rng)),
        Err(Malformed::Tag)
    );
    assert_eq!(
        p.i.handle(&[4; 3], p.now, &mut entropy(&mut p.rng)),
        Err(Malformed::Length)
    );
    assert_eq!(p.keys(), before);
    assert_eq!(p.r.refused().get("tag"), Some(&1));
}

#[test]
fn a_responder_restarted_without_its_state_agrees_on_the_next_key() {
    let mut p = Pair::new();
    p.run(|_| false);
    // The responder's kg restarts: its link starts empty, with the same identity.
    p.r = PqLink::new(p.r.setup().clone(), identity(2), PERIOD);
    p.now += PERIOD;
    p.run(|_| false);
    let (i, r) = p.keys();
    assert!(r.is_some());
    assert_eq!(i, r);
}

#[test]
fn ends_whose_keys_differ_both_drop_them_and_the_next_exchange_keys_the_link_again() {
    let mut p = Pair::new();
    p.run(|_| false);
    let first = p.i.installed().unwrap().clone();
    // The responder's kg comes back with a key that is not the one the initiator holds.
    p.r.restore(crate::pq::link::Installed {
        psk: SecretKey::from_bytes([0x5a; 32]),
        ..first
    });
    assert_ne!(p.keys().0, p.keys().1);
    let counted = |refused_responses, unused_answers| FailedHandshakes {
        refused_responses,
        unused_answers,
    };
    let (refused, unused) = (
        counted(FALLBACK_AFTER_REFUSED, 0),
        counted(0, FALLBACK_AFTER_UNUSED),
    );
    // Without the peer's word that it falls back too, a link keeps its key.
    assert!(!p.i.note_failed_handshakes(refused, p.now));
    p.i.set_falls_back(true);
    p.r.set_falls_back(true);
    // One refused response is not enough (a forged one looks the same), nor are three unused
    // answers (lost ones look the same).
    p.now += 5_000;
    assert!(!p
        .i
        .note_failed_handshakes(counted(FALLBACK_AFTER_REFUSED - 1, 0), p.now));
    assert!(!p
        .r
        .note_failed_handshakes(counted(0, FALLBACK_AFTER_UNUSED - 1), p.now));
    assert!(p.i.fell_back().is_none());
    // Then the key goes at each end, with when and why.
    p.now += 5_000;
    assert!(p.i.note_failed_handshakes(refused, p.now));
    assert!(p.r.note_failed_handshakes(unused, p.now));
    assert_eq!(p.keys(), (None, None));
    let fell = p.i.fell_back().unwrap();
    assert_eq!(
        (fell.epoch, fell.at_ms, fell.failed),
        (first.epoch, p.now, refused)
    );
    // A link without a key has nothing to drop.
    assert!(!p.i.note_failed_handshakes(counted(9, 9), p.now));
    // The initiator starts a new exchange at once; both ends agree on a fresh key.
    assert_eq!(p.i.poll_timeout(), Some(p.now));
    p.run(|_| false);
    let (i, r) = p.keys();
    assert!(i.is_some() && i == r && i != Some(first.psk));
    assert!(p.i.installed().unwrap().epoch > first.epoch);
    assert_eq!(
        p.i.fell_back(),
        Some(fell),
        "when it last fell back stays known"
    );
}

#[test]
fn the_key_is_bound_to_both_wireguard_keys_and_both_fingerprints() {
    let b = Binding {
        initiator: Key([1; 32]),
        responder: Key([2; 32]),
        initiator_fp: [3; 32],
        responder_fp: [4; 32],
        epoch: 5,
        initiator_nonce: [6; 16],
        responder_nonce: [7; 16],
    };
    let base = derive(&[8; 32], &[9; CT_LEN], &b);
    let changed = [
        Binding {
            initiator: Key([0; 32]),
            ..b
        },
        Binding {
            responder: Key([0; 32]),
            ..b
        },
        Binding {
            initiator_fp: [0; 32],
            ..b
        },
        Binding {
            responder_fp: [0; 32],
            ..b
        },
        Binding { epoch: 6, ..b },
        Binding {
            initiator_nonce: [0; 16],
            ..b
        },
        Binding {
            responder_nonce: [0; 16],
            ..b
        },
    ];
    for other in changed {
        assert_ne!(
            derive(&[8; 32], &[9; CT_LEN], &other).psk,
            base.psk,
            "{other:?}"
        );
    }
    assert_ne!(derive(&[8; 32], &[0; CT_LEN], &b).psk, base.psk);
    assert_ne!(base.psk.as_bytes()[..16], base.confirmation[..]);
}

mod book {
    use std::net::IpAddr;

    use super::super::book::{PqBook, PqPeer, Refusal};
    use super::*;

    fn books() -> (PqBook, PqBook, Vec<PqPeer>, Vec<PqPeer>) {
        let (low, high) = (Key([1; 32]), Key([2; 32]));
        let tag = tag_key(&[7; 32]);
        let a = PqBook::new(identity(1), low, 120_000, true);
        let b = PqBook::new(identity(2), high, 120_000, true);
        let peer = |key, n: u8| PqPeer {
            key,
            fingerprint: identity(n).fingerprint(),
            wireguard_ip: IpAddr::from([10, 4, 0, n]),
            tag_key: tag.clone(),
            falls_back: true,
        };
        (a, b, vec![peer(high, 2)], vec![peer(low, 1)])
    }

    /// Delivers every datagram between the two books until quiet.
    fn wire(a: &mut PqBook, b: &mut PqBook, now: i64, rng: &mut u64) {
        for _ in 0..16 {
            let (to_b, to_a) = (a.transmits(), b.transmits());
            if to_b.is_empty() && to_a.is_empty() {
                break;
            }
            for (ip, d) in to_b {
                assert_eq!(ip, IpAddr::from([10, 4, 0, 2]));
                b.handle(IpAddr::from([10, 4, 0, 1]), &d, now, &mut entropy(rng))
                    .unwrap();
            }
            for (_, d) in to_a {
                a.handle(IpAddr::from([10, 4, 0, 2]), &d, now, &mut entropy(rng))
                    .unwrap();
            }
        }
    }

    #[test]
    fn two_books_key_their_link_and_a_changed_fingerprint_drops_the_key() {
        let (mut a, mut b, a_peers, b_peers) = books();
        let mut rng = 1;
        a.set_peers(Key([1; 32]), &a_peers);
        b.set_peers(Key([2; 32]), &b_peers);
        assert!(a.initiates(&Key([2; 32])) && !b.initiates(&Key([1; 32])));
        a.poll(0, &mut entropy(&mut rng));
        wire(&mut a, &mut b, 0, &mut rng);
        let (ka, kb) = (a.installed(), b.installed());
        assert_eq!(ka[&Key([2; 32])].psk, kb[&Key([1; 32])].psk);
        assert_eq!(a.next_timeout(), Some(120_000));
        // A datagram from an address that is no peer's goes nowhere.
        assert_eq!(
            b.handle(
                IpAddr::from([10, 4, 0, 9]),
                &[1; 17],
                0,
                &mut entropy(&mut rng)
            ),
            Err(Refusal::Stranger)
        );
        // The peer's fingerprint changes (a new ML-KEM key): its key goes at once.
        let mut changed = a_peers.clone();
        changed[0].fingerprint = identity(3).fingerprint();
        a.set_peers(Key([1; 32]), &changed);
        assert!(a.installed().is_empty());
        // The same peers again keep the key; none at all drop it.
        b.set_peers(Key([2; 32]), &b_peers);
        assert_eq!(b.installed().len(), 1);
        b.set_peers(Key([2; 32]), &[]);
        assert!(b.installed().is_empty());
    }
}

#[test]
fn the_announcement_round_trips_and_ignores_flags_it_does_not_know() {
    let fingerprint = identity(1).fingerprint();
    for falls_back in [false, true] {
        let announced = PqAnnouncement {
            fingerprint,
            falls_back,
        };
        let text = announced.format();
        assert_eq!(text.ends_with(",fallback"), falls_back, "{text}");
        assert_eq!(PqAnnouncement::parse(&text), Some(announced));
    }
    let later = format!("v1:{},fallback,another", Key(fingerprint).to_base64());
    assert_eq!(
        PqAnnouncement::parse(&later).map(|a| a.falls_back),
        Some(true)
    );
    for bad in ["v2:AAAA", "v1:", "v1:not-base64", "fallback"] {
        assert_eq!(PqAnnouncement::parse(bad), None, "{bad}");
    }
}
