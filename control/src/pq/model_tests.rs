//! The two ends of a post-quantum link against a model of the tunnel their exchange runs
//! through and of the device's counts of failed handshakes, under random faults: exchange
//! messages and handshake answers lost, delays, and either kg restarted with its saved keys
//! kept, lost (it then makes a new ML-KEM key, as kg does) or altered.
//!
//! The tunnel is WireGuard's session: a handshake makes one only while both ends hold the same
//! preshared key (or none) and its answer arrives; a changed key keeps the session in use,
//! which carries the exchange for 180 s; from 120 s, and while there is none, a handshake is
//! tried every 5 s by either end. A failed handshake counts as the engine counts it: a refused
//! response at the end that initiated, an unused answer at the other when the next initiation
//! comes (a lost answer counts there too). Data on a session clears both. An end whose device
//! does not count (the kernel's WireGuard) never reads them, so neither end of its link falls
//! back. A restarted kg's device has no session.
//!
//! Checked at every step: two keys made by one exchange are equal, and a link that does not
//! fall back never drops a key. Checked once the faults stop: within 60 s both ends hold one
//! key again.

use std::sync::Arc;

use super::link::{FailedHandshakes, Installed, LinkSetup, PqLink};
use super::{tag_key, PqIdentity, SEED_LEN};
use crate::key::Key;
use keys::SecretKey;

const PERIOD_MS: i64 = 20_000;
const STEP_MS: i64 = 250;
const HANDSHAKE_EVERY_MS: i64 = 5_000;
const CHECK_EVERY_MS: i64 = 2_000;
const REKEY_AFTER_MS: i64 = 120_000;
const REJECT_AFTER_MS: i64 = 180_000;

/// xorshift64: the run's only randomness, so a seed replays it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

struct End {
    key: Key,
    identity: Arc<PqIdentity>,
    link: PqLink,
    /// What its kg saved: the key installed last.
    saved: Option<Installed>,
    /// Its device counts failed handshakes (the embedded engine).
    counts: bool,
    failed: FailedHandshakes,
    answer_unused: bool,
}

struct World {
    ends: [End; 2],
    now: i64,
    rng: Rng,
    /// In flight: when it arrives, to which end, the bytes.
    wire: Vec<(i64, usize, Vec<u8>)>,
    faults: bool,
    seeds_made: u8,
    /// When the session in use was made.
    session: Option<i64>,
}

fn setup(ends: &[End; 2], from: usize) -> LinkSetup {
    let (me, peer) = (&ends[from], &ends[1 - from]);
    LinkSetup {
        local: me.key,
        peer: peer.key,
        peer_fp: peer.identity.fingerprint(),
        tag_key: tag_key(&[0x42; 32]),
    }
}

impl World {
    /// End 1's device does not count failed handshakes when `kernel`.
    fn new(seed: u64, kernel: bool) -> Self {
        let end = |n: u8, counts: bool| {
            let identity = Arc::new(PqIdentity::from_seed(&[n; SEED_LEN]));
            let placeholder = LinkSetup {
                local: Key([n; 32]),
                peer: Key([n; 32]),
                peer_fp: [0; 32],
                tag_key: SecretKey::from_bytes([0; 32]),
            };
            End {
                key: Key([n; 32]),
                link: PqLink::new(placeholder, Arc::clone(&identity), PERIOD_MS),
                identity,
                saved: None,
                counts,
                failed: FailedHandshakes::default(),
                answer_unused: false,
            }
        };
        let mut w = Self {
            ends: [end(1, true), end(2, !kernel)],
            now: 1_800_000_000_000,
            rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            wire: Vec::new(),
            faults: true,
            seeds_made: 2,
            session: None,
        };
        for i in 0..2 {
            w.make_link(i);
        }
        w
    }

    fn make_link(&mut self, i: usize) {
        let mut link = PqLink::new(
            setup(&self.ends, i),
            Arc::clone(&self.ends[i].identity),
            PERIOD_MS,
        );
        link.set_falls_back(self.ends[0].counts && self.ends[1].counts);
        self.ends[i].link = link;
    }

    fn psk(&self, i: usize) -> Option<SecretKey> {
        self.ends[i].link.installed().map(|k| k.psk.clone())
    }

    fn agree(&self) -> bool {
        self.psk(0) == self.psk(1)
    }

    fn tunnel_up(&self) -> bool {
        self.session
            .is_some_and(|at| self.now - at < REJECT_AFTER_MS)
    }

    /// kg `i` restarts: its saved keys kept (0), lost (1: a new ML-KEM key, so the peer makes
    /// its link again too) or altered (2).
    fn restart(&mut self, i: usize, how: u64) {
        self.ends[i].failed = FailedHandshakes::default();
        self.ends[i].answer_unused = false;
        self.session = None;
        if how == 1 {
            self.seeds_made += 1;
            self.ends[i].identity = Arc::new(PqIdentity::from_seed(&[self.seeds_made; SEED_LEN]));
            self.ends[i].saved = None;
            let j = 1 - i;
            self.make_link(j);
            self.ends[j].saved = None;
        }
        let saved = self.ends[i].saved.clone();
        self.make_link(i);
        if let Some(mut saved) = saved {
            if how == 2 {
                let mut psk = [0; 32];
                self.rng.fill(&mut psk);
                saved.psk = SecretKey::from_bytes(psk);
            }
            saved.at_ms = 0;
            self.ends[i].link.restore(saved);
        }
    }

    /// A handshake started by end `from`, its answer lost when `lost`.
    fn handshake(&mut self, from: usize, lost: bool) {
        let agree = self.agree();
        let to = 1 - from;
        if self.ends[to].answer_unused {
            self.ends[to].failed.unused_answers += 1;
        }
        self.ends[to].answer_unused = true;
        if lost {
            return;
        }
        if agree {
            self.session = Some(self.now);
        } else {
            self.ends[from].failed.refused_responses += 1;
        }
    }

    fn step(&mut self, altered: bool) {
        self.now += STEP_MS;
        let now = self.now;
        if self.faults && self.rng.below(200) == 0 {
            let (who, how) = (
                self.rng.below(2) as usize,
                self.rng.below(if altered { 3 } else { 2 }),
            );
            self.restart(who, how);
        }
        let due = self.session.is_none_or(|at| now - at >= REKEY_AFTER_MS);
        if now % HANDSHAKE_EVERY_MS == 0 && due {
            let from = self.rng.below(2) as usize;
            let lost = self.faults && self.rng.below(10) < 2;
            self.handshake(from, lost);
        }
        if self.tunnel_up() {
            for end in &mut self.ends {
                end.failed = FailedHandshakes::default();
                end.answer_unused = false;
            }
        }
        if now % CHECK_EVERY_MS == 0 {
            for end in self.ends.iter_mut().filter(|e| e.counts) {
                end.link.note_failed_handshakes(end.failed, now);
            }
        }
        for i in 0..2 {
            let rng = &mut self.rng;
            self.ends[i].link.poll(now, &mut |b| rng.fill(b));
        }
        self.send();
        // Deliver what is due, if the tunnel carries it now.
        let mut due: Vec<(i64, usize, Vec<u8>)> = Vec::new();
        self.wire.retain(|m| {
            if m.0 <= now {
                due.push(m.clone());
                false
            } else {
                true
            }
        });
        for (_, to, bytes) in due {
            if !self.tunnel_up() {
                continue;
            }
            let rng = &mut self.rng;
            let _ = self.ends[to].link.handle(&bytes, now, &mut |b| rng.fill(b));
            self.send();
        }
        for end in &mut self.ends {
            if let Some(k) = end.link.installed() {
                end.saved = Some(k.clone());
            } else if end.link.fell_back().is_some() {
                end.saved = None;
            }
        }
        self.check();
    }

    fn send(&mut self) {
        for from in 0..2 {
            while let Some(bytes) = self.ends[from].link.poll_transmit() {
                let lost = self.faults && self.rng.below(10) < 2;
                let delay = 5 + self.rng.below(400) as i64;
                if !lost {
                    self.wire.push((self.now + delay, 1 - from, bytes));
                }
            }
        }
    }

    fn check(&self) {
        let (a, b) = (self.ends[0].link.installed(), self.ends[1].link.installed());
        if let (Some(a), Some(b)) = (a, b) {
            if a.epoch == b.epoch && a.at_ms > 0 && b.at_ms > 0 {
                assert_eq!(a.psk, b.psk, "one exchange made two keys at {}", self.now);
            }
        }
        if !self.ends[1].counts {
            assert!(
                self.ends.iter().all(|e| e.link.fell_back().is_none()),
                "a link with an end that does not count fell back"
            );
        }
    }
}

/// Runs `seeds`, end 1 on the kernel's WireGuard when `kernel`, with altered saved keys among
/// the restarts when `altered`: (runs that lost saved keys, ends that fell back).
fn run(seeds: std::ops::RangeInclusive<u64>, kernel: bool, altered: bool) -> (u64, usize) {
    let (mut lost_keys, mut fallbacks) = (0, 0);
    for seed in seeds {
        let mut w = World::new(seed, kernel);
        for _ in 0..(240_000 / STEP_MS) {
            w.step(altered);
        }
        w.faults = false;
        let calm = w.now;
        while !(w.agree() && w.tunnel_up() && w.psk(0).is_some()) {
            assert!(
                w.now - calm <= 60_000,
                "seed {seed}: no agreement 60 s after the faults stopped: {:?} / {:?}, fell back {:?} / {:?}, refused {:?} / {:?}",
                w.ends[0].link.installed(),
                w.ends[1].link.installed(),
                w.ends[0].link.fell_back(),
                w.ends[1].link.fell_back(),
                w.ends[0].link.refused(),
                w.ends[1].link.refused(),
            );
            w.step(altered);
        }
        lost_keys += u64::from(w.seeds_made > 2);
        fallbacks += w
            .ends
            .iter()
            .filter(|e| e.link.fell_back().is_some())
            .count();
        println!(
            "seed {seed}: one key {} ms after the faults stopped; fell back at {:?} / {:?}",
            w.now - calm,
            w.ends[0].link.fell_back().map(|f| f.at_ms),
            w.ends[1].link.fell_back().map(|f| f.at_ms),
        );
    }
    println!("{lost_keys} runs lost saved keys, {fallbacks} ends fell back");
    (lost_keys, fallbacks)
}

#[test]
fn random_faults_never_split_a_key_and_the_ends_always_agree_again() {
    let (lost_keys, fallbacks) = run(1..=24, false, true);
    assert!(
        lost_keys > 0,
        "no run lost its saved keys: the faults do not reach it"
    );
    assert!(
        fallbacks > 0,
        "no link fell back: the altered keys do not reach it"
    );
}

#[test]
fn a_link_to_the_kernels_wireguard_never_falls_back_and_still_agrees_after_lost_keys() {
    // Altered saved keys are left out: such a link stays down by design (docs/keys.md).
    let (lost_keys, fallbacks) = run(101..=116, true, false);
    assert!(
        lost_keys > 0,
        "no run lost its saved keys: the faults do not reach it"
    );
    assert_eq!(fallbacks, 0);
}
