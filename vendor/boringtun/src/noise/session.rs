// Copyright (c) 2019 Cloudflare, Inc. All rights reserved.
// SPDX-License-Identifier: BSD-3-Clause

use super::PacketData;
use crate::noise::errors::WireGuardError;
use parking_lot::Mutex;
use portable_atomic::{AtomicU64, Ordering};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

/// One data session's keys and counters. Every method takes `&self`: one session may seal and
/// open on many threads at once (the sending counter is atomic, the replay window locked).
pub struct Session {
    pub(crate) receiving_index: u32,
    sending_index: u32,
    receiver: LessSafeKey,
    sender: LessSafeKey,
    sending_key_counter: AtomicU64,
    receiving_key_counter: Mutex<ReceivingKeyCounterValidator>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "Session: {}<- ->{}",
            self.receiving_index, self.sending_index
        )
    }
}

/// Where encrypted data resides in a data packet
const DATA_OFFSET: usize = 16;
/// The overhead of the AEAD
const AEAD_SIZE: usize = 16;

// Receiving buffer constants
const WORD_SIZE: u64 = 64;
const N_WORDS: u64 = 16; // Suffice to reorder 64*16 = 1024 packets; can be increased at will
const N_BITS: u64 = WORD_SIZE * N_WORDS;

#[derive(Debug, Clone, Default)]
struct ReceivingKeyCounterValidator {
    /// In order to avoid replays while allowing for some reordering of the packets, we keep a
    /// bitmap of received packets, and the value of the highest counter
    next: u64,
    /// Used to estimate packet loss
    receive_cnt: u64,
    bitmap: [u64; N_WORDS as usize],
}

impl ReceivingKeyCounterValidator {
    #[inline(always)]
    fn set_bit(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        self.bitmap[word] |= 1 << bit;
    }

    #[inline(always)]
    fn clear_bit(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        self.bitmap[word] &= !(1u64 << bit);
    }

    /// Clear the word that contains idx
    #[inline(always)]
    fn clear_word(&mut self, idx: u64) {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        self.bitmap[word] = 0;
    }

    /// Returns true if bit is set, false otherwise
    #[inline(always)]
    fn check_bit(&self, idx: u64) -> bool {
        let bit_idx = idx % N_BITS;
        let word = (bit_idx / WORD_SIZE) as usize;
        let bit = (bit_idx % WORD_SIZE) as usize;
        ((self.bitmap[word] >> bit) & 1) == 1
    }

    /// Returns true if the counter was not yet received, and is not too far back
    #[inline(always)]
    fn will_accept(&self, counter: u64) -> Result<(), WireGuardError> {
        if counter >= self.next {
            // As long as the counter is growing no replay took place for sure
            return Ok(());
        }
        if counter + N_BITS < self.next {
            // Drop if too far back
            return Err(WireGuardError::InvalidCounter);
        }
        if !self.check_bit(counter) {
            Ok(())
        } else {
            Err(WireGuardError::DuplicateCounter)
        }
    }

    /// Marks the counter as received, and returns true if it is still good (in case during
    /// decryption something changed)
    #[inline(always)]
    fn mark_did_receive(&mut self, counter: u64) -> Result<(), WireGuardError> {
        if counter + N_BITS < self.next {
            // Drop if too far back
            return Err(WireGuardError::InvalidCounter);
        }
        if counter == self.next {
            // Usually the packets arrive in order, in that case we simply mark the bit and
            // increment the counter
            self.set_bit(counter);
            self.next += 1;
            return Ok(());
        }
        if counter < self.next {
            // A packet arrived out of order, check if it is valid, and mark
            if self.check_bit(counter) {
                return Err(WireGuardError::InvalidCounter);
            }
            self.set_bit(counter);
            return Ok(());
        }
        // Packets where dropped, or maybe reordered, skip them and mark unused
        if counter - self.next >= N_BITS {
            // Too far ahead, clear all the bits
            for c in self.bitmap.iter_mut() {
                *c = 0;
            }
        } else {
            let mut i = self.next;
            while i % WORD_SIZE != 0 && i < counter {
                // Clear until i aligned to word size
                self.clear_bit(i);
                i += 1;
            }
            while i + WORD_SIZE < counter {
                // Clear whole word at a time
                self.clear_word(i);
                i = (i + WORD_SIZE) & 0u64.wrapping_sub(WORD_SIZE);
            }
            while i < counter {
                // Clear any remaining bits
                self.clear_bit(i);
                i += 1;
            }
        }
        self.set_bit(counter);
        self.next = counter + 1;
        Ok(())
    }
}

impl Session {
    pub(super) fn new(
        local_index: u32,
        peer_index: u32,
        receiving_key: [u8; 32],
        sending_key: [u8; 32],
    ) -> Session {
        Session {
            receiving_index: local_index,
            sending_index: peer_index,
            receiver: LessSafeKey::new(
                UnboundKey::new(&CHACHA20_POLY1305, &receiving_key).unwrap(),
            ),
            sender: LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &sending_key).unwrap()),
            sending_key_counter: AtomicU64::new(0),
            receiving_key_counter: Mutex::new(Default::default()),
        }
    }

    pub(super) fn local_index(&self) -> usize {
        self.receiving_index as usize
    }

    /// Returns true if receiving counter is good to use
    fn receiving_counter_quick_check(&self, counter: u64) -> Result<(), WireGuardError> {
        let counter_validator = self.receiving_key_counter.lock();
        counter_validator.will_accept(counter)
    }

    /// Returns true if receiving counter is good to use, and marks it as used {
    fn receiving_counter_mark(&self, counter: u64) -> Result<(), WireGuardError> {
        let mut counter_validator = self.receiving_key_counter.lock();
        let ret = counter_validator.mark_did_receive(counter);
        if ret.is_ok() {
            counter_validator.receive_cnt += 1;
        }
        ret
    }

    /// Reserves the next `count` sending counters, in order. Each counter seals one packet
    /// ([`Session::seal_in_place`]); counters are consumed by sealing, so no nonce is used twice.
    pub fn reserve_sending_counters(&self, count: u64) -> SendingCounters {
        let first = self.sending_key_counter.fetch_add(count, Ordering::Relaxed);
        SendingCounters {
            next: first,
            end: first + count,
        }
    }

    /// Seals a data packet in place: `packet` holds room for the 16-byte header, the plaintext
    /// (`payload_len` bytes from byte 16), then room for the 16-byte tag. Writes the header and
    /// the tag and returns the packet's length. May run on any thread.
    ///
    /// # Panics
    /// If `packet` is shorter than `payload_len + DATA_OVERHEAD_SZ`.
    pub fn seal_in_place(
        &self,
        counter: SendingCounter,
        packet: &mut [u8],
        payload_len: usize,
    ) -> usize {
        if packet.len() < payload_len + super::DATA_OVERHEAD_SZ {
            panic!("The destination buffer is too small");
        }
        let sending_key_counter = counter.0;

        let (message_type, rest) = packet.split_at_mut(4);
        let (receiver_index, rest) = rest.split_at_mut(4);
        let (counter, data) = rest.split_at_mut(8);

        message_type.copy_from_slice(&super::DATA.to_le_bytes());
        receiver_index.copy_from_slice(&self.sending_index.to_le_bytes());
        counter.copy_from_slice(&sending_key_counter.to_le_bytes());

        // TODO: spec requires padding to 16 bytes, but actually works fine without it
        let mut nonce = [0u8; 12];
        nonce[4..12].copy_from_slice(&sending_key_counter.to_le_bytes());
        let tag = self
            .sender
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&[]),
                &mut data[..payload_len],
            )
            .unwrap();
        data[payload_len..payload_len + AEAD_SIZE].copy_from_slice(tag.as_ref());
        DATA_OFFSET + payload_len + AEAD_SIZE
    }

    /// src - an IP packet from the interface
    /// dst - pre-allocated space to hold the encapsulating UDP packet to send over the network
    /// returns the size of the formatted packet
    pub(super) fn format_packet_data<'a>(&self, src: &[u8], dst: &'a mut [u8]) -> &'a mut [u8] {
        if dst.len() < src.len() + super::DATA_OVERHEAD_SZ {
            panic!("The destination buffer is too small");
        }
        let counter = self.reserve_sending_counters(1).next().unwrap();
        dst[DATA_OFFSET..DATA_OFFSET + src.len()].copy_from_slice(src);
        let n = self.seal_in_place(counter, dst, src.len());
        &mut dst[..n]
    }

    /// Opens a data packet in place: `sealed` holds the encrypted payload and its tag (the
    /// datagram past its 16-byte header), `receiver_idx` and `counter` come from the header.
    /// Checks the counter against the replay window before and after decrypting, and returns
    /// the plaintext (the start of `sealed`). May run on any thread.
    pub fn open_in_place<'a>(
        &self,
        receiver_idx: u32,
        counter: u64,
        sealed: &'a mut [u8],
    ) -> Result<&'a mut [u8], WireGuardError> {
        let counter = self.check_receiving_counter(receiver_idx, counter)?;
        let (opened, plaintext) = self.open_checked_in_place(&counter, sealed)?;
        self.mark_received(opened)?;
        Ok(plaintext)
    }

    /// The first of [`Session::open_in_place`]'s three steps, for a caller that runs them apart
    /// (the decryption on another thread, say): checks that a data packet is addressed to this
    /// session and that its counter may still be accepted, before anything is decrypted.
    pub fn check_receiving_counter(
        &self,
        receiver_idx: u32,
        counter: u64,
    ) -> Result<ReceivingCounter, WireGuardError> {
        self.receiving_window().check(receiver_idx, counter)
    }

    /// The second step: decrypts `sealed` (payload and tag) in place and returns the plaintext.
    /// Nothing is marked received yet: the packet may be used only once
    /// [`Session::mark_received`] accepts its counter. The checked counter is only borrowed:
    /// decrypting twice gives nothing away, and only the mark accepts a counter once.
    pub fn open_checked_in_place<'a>(
        &self,
        counter: &ReceivingCounter,
        sealed: &'a mut [u8],
    ) -> Result<(OpenedCounter, &'a mut [u8]), WireGuardError> {
        let mut nonce = [0u8; 12];
        nonce[4..12].copy_from_slice(&counter.0.to_le_bytes());
        let plaintext = self
            .receiver
            .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(&[]), sealed)
            .map_err(|_| WireGuardError::InvalidAeadTag)?;
        Ok((OpenedCounter(counter.0), plaintext))
    }

    /// The last step: checks the counter again and marks it received (a packet opened twice,
    /// or overtaken by too many others meanwhile, is refused here).
    pub fn mark_received(&self, opened: OpenedCounter) -> Result<(), WireGuardError> {
        self.receiving_window().mark(opened)
    }

    /// Locks the replay window, for checking ([`ReceivingWindow::check`]) or marking
    /// ([`ReceivingWindow::mark`]) a run of packets under one lock instead of one each.
    pub fn receiving_window(&self) -> ReceivingWindow<'_> {
        ReceivingWindow {
            receiving_index: self.receiving_index,
            window: self.receiving_key_counter.lock(),
        }
    }

    /// packet - a data packet we received from the network
    /// dst - pre-allocated space to hold the encapsulated IP packet, to send to the interface
    ///       dst will always take less space than src
    /// return the size of the encapsulated packet on success
    pub(super) fn receive_packet_data<'a>(
        &self,
        packet: PacketData,
        dst: &'a mut [u8],
    ) -> Result<&'a mut [u8], WireGuardError> {
        let ct_len = packet.encrypted_encapsulated_packet.len();
        if dst.len() < ct_len {
            // This is a very incorrect use of the library, therefore panic and not error
            panic!("The destination buffer is too small");
        }
        if packet.receiver_idx != self.receiving_index {
            return Err(WireGuardError::WrongIndex);
        }
        dst[..ct_len].copy_from_slice(packet.encrypted_encapsulated_packet);
        self.open_in_place(packet.receiver_idx, packet.counter, &mut dst[..ct_len])
    }

    /// Returns the estimated downstream packet loss for this session
    pub(super) fn current_packet_cnt(&self) -> (u64, u64) {
        let counter_validator = self.receiving_key_counter.lock();
        (counter_validator.next, counter_validator.receive_cnt)
    }
}

/// A sending counter reserved by [`Session::reserve_sending_counters`], used up by
/// [`Session::seal_in_place`]. It cannot be copied, so it seals one packet only.
#[derive(Debug)]
pub struct SendingCounter(u64);

impl SendingCounter {
    /// The counter's value (the packet's nonce).
    pub fn value(&self) -> u64 {
        self.0
    }
}

/// A session's replay window, locked ([`Session::receiving_window`]).
pub struct ReceivingWindow<'s> {
    receiving_index: u32,
    window: parking_lot::MutexGuard<'s, ReceivingKeyCounterValidator>,
}

impl ReceivingWindow<'_> {
    /// [`Session::check_receiving_counter`], under this lock.
    pub fn check(&self, receiver_idx: u32, counter: u64) -> Result<ReceivingCounter, WireGuardError> {
        if receiver_idx != self.receiving_index {
            return Err(WireGuardError::WrongIndex);
        }
        self.window.will_accept(counter)?;
        Ok(ReceivingCounter(counter))
    }

    /// [`Session::mark_received`], under this lock.
    pub fn mark(&mut self, opened: OpenedCounter) -> Result<(), WireGuardError> {
        self.window.mark_did_receive(opened.0)?;
        self.window.receive_cnt += 1;
        Ok(())
    }
}

/// A received data packet's counter that the replay window may still accept, from
/// [`Session::check_receiving_counter`].
#[derive(Debug)]
pub struct ReceivingCounter(u64);

/// The counter of a data packet that decrypted, to be marked received with
/// [`Session::mark_received`] before the packet is used.
#[derive(Debug)]
#[must_use = "a packet is accepted only once its counter is marked received"]
pub struct OpenedCounter(u64);

/// Sending counters reserved together, handed out in order.
#[derive(Debug)]
pub struct SendingCounters {
    next: u64,
    end: u64,
}

impl Iterator for SendingCounters {
    type Item = SendingCounter;

    fn next(&mut self) -> Option<SendingCounter> {
        (self.next < self.end).then(|| {
            self.next += 1;
            SendingCounter(self.next - 1)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn test_replay_counter() {
        let mut c: ReceivingKeyCounterValidator = Default::default();

        assert!(c.mark_did_receive(0).is_ok());
        assert!(c.mark_did_receive(0).is_err());
        assert!(c.mark_did_receive(1).is_ok());
        assert!(c.mark_did_receive(1).is_err());
        assert!(c.mark_did_receive(63).is_ok());
        assert!(c.mark_did_receive(63).is_err());
        assert!(c.mark_did_receive(15).is_ok());
        assert!(c.mark_did_receive(15).is_err());

        for i in 64..N_BITS + 128 {
            assert!(c.mark_did_receive(i).is_ok());
            assert!(c.mark_did_receive(i).is_err());
        }

        assert!(c.mark_did_receive(N_BITS * 3).is_ok());
        for i in 0..=N_BITS * 2 {
            assert!(matches!(
                c.will_accept(i),
                Err(WireGuardError::InvalidCounter)
            ));
            assert!(c.mark_did_receive(i).is_err());
        }
        for i in N_BITS * 2 + 1..N_BITS * 3 {
            assert!(c.will_accept(i).is_ok());
        }
        assert!(matches!(
            c.will_accept(N_BITS * 3),
            Err(WireGuardError::DuplicateCounter)
        ));

        for i in (N_BITS * 2 + 1..N_BITS * 3).rev() {
            assert!(c.mark_did_receive(i).is_ok());
            assert!(c.mark_did_receive(i).is_err());
        }

        assert!(c.mark_did_receive(N_BITS * 3 + 70).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 71).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 72).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 72 + 125).is_ok());
        assert!(c.mark_did_receive(N_BITS * 3 + 63).is_ok());

        assert!(c.mark_did_receive(N_BITS * 3 + 70).is_err());
        assert!(c.mark_did_receive(N_BITS * 3 + 71).is_err());
        assert!(c.mark_did_receive(N_BITS * 3 + 72).is_err());
    }
}
