//! Longest-prefix match over all peers' allowed IPs (cryptokey routing).
//!
//! Prefixes are stored per family in one hash map per prefix length that is in use; a lookup
//! probes the lengths in use from longest to shortest. A mesh uses a handful of lengths (/32,
//! /24, /16, /128, /64), so a lookup is a few hash probes whatever the number of prefixes.
//! Prefixes are canonical (host bits cleared) on insert, so `10.1.2.3/24` is `10.1.2.0/24`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::IpAddr;

use ipnet::IpNet;

/// A longest-prefix-match table from IP prefixes to values.
#[derive(Debug, Clone)]
pub struct AllowedIps<T> {
    v4: Family<u32, T>,
    v6: Family<u128, T>,
}

/// A multiply-shift hash for address keys. The keys come from configuration, not from the
/// network, so a keyed (DoS-resistant) hash buys nothing here and costs most of a lookup.
#[derive(Debug, Default, Clone, Copy)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        // Masked addresses have zero low bits and the table indexes by the low bits: fold the
        // high bits down (murmur3's finaliser).
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u128(&mut self, value: u128) {
        self.write_u64(value as u64);
        self.write_u64((value >> 64) as u64);
    }
}

type AddressMap<K, T> = HashMap<K, T, BuildHasherDefault<AddressHasher>>;

#[derive(Debug, Clone)]
struct Family<K, T> {
    /// `(prefix length, masked address → value)`, sorted by length, longest first.
    by_len: Vec<(u8, AddressMap<K, T>)>,
}

impl<K: Copy + Eq + std::hash::Hash, T> Family<K, T> {
    const fn new() -> Self {
        Self { by_len: Vec::new() }
    }

    fn insert(&mut self, len: u8, key: K, value: T) -> Option<T> {
        let slot = match self.by_len.binary_search_by(|(l, _)| len.cmp(l)) {
            Ok(i) => i,
            Err(i) => {
                self.by_len.insert(i, (len, AddressMap::default()));
                i
            }
        };
        self.by_len[slot].1.insert(key, value)
    }

    fn remove(&mut self, len: u8, key: K) -> Option<T> {
        let i = self.by_len.binary_search_by(|(l, _)| len.cmp(l)).ok()?;
        let removed = self.by_len[i].1.remove(&key);
        if self.by_len[i].1.is_empty() {
            self.by_len.remove(i);
        }
        removed
    }

    fn get(&self, len: u8, key: K) -> Option<&T> {
        let i = self.by_len.binary_search_by(|(l, _)| len.cmp(l)).ok()?;
        self.by_len[i].1.get(&key)
    }

    fn lookup(&self, addr: K, mask: impl Fn(K, u8) -> K) -> Option<&T> {
        self.by_len
            .iter()
            .find_map(|(len, map)| map.get(&mask(addr, *len)))
    }

    fn len(&self) -> usize {
        self.by_len.iter().map(|(_, m)| m.len()).sum()
    }
}

fn mask_v4(addr: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        addr & (u32::MAX << (32 - u32::from(len)))
    }
}

fn mask_v6(addr: u128, len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        addr & (u128::MAX << (128 - u32::from(len)))
    }
}

impl<T> Default for AllowedIps<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> AllowedIps<T> {
    /// An empty table.
    pub const fn new() -> Self {
        Self {
            v4: Family::new(),
            v6: Family::new(),
        }
    }

    /// Inserts `prefix` (canonicalised) → `value`, returning the value it replaced.
    pub fn insert(&mut self, prefix: IpNet, value: T) -> Option<T> {
        match prefix.trunc() {
            IpNet::V4(n) => self
                .v4
                .insert(n.prefix_len(), u32::from(n.network()), value),
            IpNet::V6(n) => self
                .v6
                .insert(n.prefix_len(), u128::from(n.network()), value),
        }
    }

    /// Removes `prefix` (canonicalised), returning its value.
    pub fn remove(&mut self, prefix: IpNet) -> Option<T> {
        match prefix.trunc() {
            IpNet::V4(n) => self.v4.remove(n.prefix_len(), u32::from(n.network())),
            IpNet::V6(n) => self.v6.remove(n.prefix_len(), u128::from(n.network())),
        }
    }

    /// The value stored for exactly `prefix` (canonicalised).
    pub fn get_exact(&self, prefix: IpNet) -> Option<&T> {
        match prefix.trunc() {
            IpNet::V4(n) => self.v4.get(n.prefix_len(), u32::from(n.network())),
            IpNet::V6(n) => self.v6.get(n.prefix_len(), u128::from(n.network())),
        }
    }

    /// The value of the longest prefix containing `addr`.
    #[inline]
    pub fn lookup(&self, addr: IpAddr) -> Option<&T> {
        match addr {
            IpAddr::V4(a) => self.v4.lookup(u32::from(a), mask_v4),
            IpAddr::V6(a) => self.v6.lookup(u128::from(a), mask_v6),
        }
    }

    /// Number of prefixes stored.
    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    /// True when no prefix is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn longest_prefix_wins() {
        let mut t = AllowedIps::new();
        t.insert(net("10.0.0.0/8"), "wide");
        t.insert(net("10.1.0.0/16"), "mid");
        t.insert(net("10.1.2.3/32"), "host");
        t.insert(net("0.0.0.0/0"), "default");
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(&"host"));
        assert_eq!(t.lookup(ip("10.1.2.4")), Some(&"mid"));
        assert_eq!(t.lookup(ip("10.2.0.1")), Some(&"wide"));
        assert_eq!(t.lookup(ip("192.168.0.1")), Some(&"default"));
        assert_eq!(t.lookup(ip("fd00::1")), None);
    }

    #[test]
    fn ipv6_prefixes_match_and_are_separate_from_ipv4() {
        let mut t = AllowedIps::new();
        t.insert(net("fd00::/64"), 1);
        t.insert(net("fd00::1/128"), 2);
        t.insert(net("::/0"), 3);
        assert_eq!(t.lookup(ip("fd00::1")), Some(&2));
        assert_eq!(t.lookup(ip("fd00::2")), Some(&1));
        assert_eq!(t.lookup(ip("2001:db8::1")), Some(&3));
        assert_eq!(t.lookup(ip("10.0.0.1")), None);
    }

    #[test]
    fn host_bits_are_cleared_on_insert_and_remove() {
        let mut t = AllowedIps::new();
        t.insert(net("10.1.2.3/24"), 'a');
        assert_eq!(t.get_exact(net("10.1.2.0/24")), Some(&'a'));
        assert_eq!(t.lookup(ip("10.1.2.200")), Some(&'a'));
        assert_eq!(t.remove(net("10.1.2.77/24")), Some('a'));
        assert!(t.is_empty());
        assert_eq!(t.lookup(ip("10.1.2.200")), None);
    }

    #[test]
    fn reinserting_a_prefix_moves_it() {
        let mut t = AllowedIps::new();
        t.insert(net("10.0.0.0/24"), 1);
        assert_eq!(t.insert(net("10.0.0.0/24"), 2), Some(1));
        assert_eq!(t.len(), 1);
        assert_eq!(t.lookup(ip("10.0.0.9")), Some(&2));
    }
}
