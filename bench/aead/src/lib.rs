//! One interface over the three ChaCha20-Poly1305 implementations the bench compares, each used
//! the way a WireGuard data path would: a key set up once per session, then one call per packet
//! with that packet's nonce, sealing or opening in place with the tag kept apart.

use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;

/// Length of a ChaCha20-Poly1305 tag.
pub const TAG_LEN: usize = 16;

/// A WireGuard data nonce: four zero bytes, then the packet's counter in little-endian order.
pub fn nonce(counter: u64) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&counter.to_le_bytes());
    nonce
}

/// A ChaCha20-Poly1305 key set up for sealing and opening packets one at a time.
pub trait PacketAead {
    /// Encrypts `data` in place and returns the tag.
    fn seal(&mut self, counter: u64, data: &mut [u8]) -> [u8; TAG_LEN];
    /// Decrypts `sealed` (the ciphertext, then its tag, as a WireGuard data message carries
    /// them) in place if the tag authenticates it; false (the plaintext unspecified) if not.
    fn open(&mut self, counter: u64, sealed: &mut [u8]) -> bool;
}

/// A [`PacketAead`] over a `LessSafeKey` of ring or of aws-lc-rs, whose `aead` modules have the
/// same interface (aws-lc-rs keeps ring's).
macro_rules! less_safe_key_aead {
    ($(#[$doc:meta])* $name:ident, $($aead:ident)::+) => {
        $(#[$doc])*
        pub struct $name($($aead)::+::LessSafeKey);

        impl $name {
            /// A key for `key`.
            pub fn new(key: &[u8; 32]) -> Self {
                use $($aead)::+::{CHACHA20_POLY1305, LessSafeKey, UnboundKey};
                Self(LessSafeKey::new(
                    UnboundKey::new(&CHACHA20_POLY1305, key).expect("32-byte key"),
                ))
            }
        }

        impl PacketAead for $name {
            fn seal(&mut self, counter: u64, data: &mut [u8]) -> [u8; TAG_LEN] {
                use $($aead)::+::{Aad, Nonce};
                let nonce = Nonce::assume_unique_for_key(nonce(counter));
                let tag = self
                    .0
                    .seal_in_place_separate_tag(nonce, Aad::empty(), data)
                    .expect("fits");
                tag.as_ref().try_into().expect("16 bytes")
            }

            fn open(&mut self, counter: u64, sealed: &mut [u8]) -> bool {
                use $($aead)::+::{Aad, Nonce};
                let nonce = Nonce::assume_unique_for_key(nonce(counter));
                self.0.open_in_place(nonce, Aad::empty(), sealed).is_ok()
            }
        }
    };
}

less_safe_key_aead!(
    /// ring 0.17's ChaCha20-Poly1305.
    Ring,
    ring::aead
);
less_safe_key_aead!(
    /// aws-lc-rs 1's ChaCha20-Poly1305 (AWS-LC, as gotatun uses it).
    AwsLc,
    aws_lc_rs::aead
);

/// OpenSSL's EVP interface: one context per direction keyed once, then per packet a new nonce,
/// one update and the final call (and the tag set or read), as `openssl speed -aead` runs it.
pub struct OpenSsl {
    sealing: CipherCtx,
    opening: CipherCtx,
}

impl OpenSsl {
    /// Contexts for `key`.
    pub fn new(key: &[u8; 32]) -> Self {
        let cipher = Cipher::chacha20_poly1305();
        let mut sealing = CipherCtx::new().expect("context");
        sealing
            .encrypt_init(Some(cipher), Some(key), Some(&nonce(0)))
            .expect("key");
        let mut opening = CipherCtx::new().expect("context");
        opening
            .decrypt_init(Some(cipher), Some(key), Some(&nonce(0)))
            .expect("key");
        Self { sealing, opening }
    }
}

impl PacketAead for OpenSsl {
    fn seal(&mut self, counter: u64, data: &mut [u8]) -> [u8; TAG_LEN] {
        let ctx = &mut self.sealing;
        ctx.encrypt_init(None, None, Some(&nonce(counter)))
            .expect("nonce");
        let n = ctx.cipher_update_inplace(data, data.len()).expect("update");
        debug_assert_eq!(n, data.len());
        ctx.cipher_final(&mut []).expect("final");
        let mut tag = [0u8; TAG_LEN];
        ctx.tag(&mut tag).expect("tag");
        tag
    }

    fn open(&mut self, counter: u64, sealed: &mut [u8]) -> bool {
        let Some(len) = sealed.len().checked_sub(TAG_LEN) else {
            return false;
        };
        let (data, tag) = sealed.split_at_mut(len);
        let ctx = &mut self.opening;
        ctx.decrypt_init(None, None, Some(&nonce(counter)))
            .expect("nonce");
        ctx.set_tag(tag).expect("tag");
        ctx.cipher_update_inplace(data, len).is_ok() && ctx.cipher_final(&mut []).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three agree byte for byte, and each refuses a flipped bit: a bench of a wrong
    /// implementation would measure nothing worth choosing.
    #[test]
    fn the_three_agree_and_refuse_forgeries() {
        let key = [0x42u8; 32];
        let mut engines: Vec<Box<dyn PacketAead>> = vec![
            Box::new(Ring::new(&key)),
            Box::new(AwsLc::new(&key)),
            Box::new(OpenSsl::new(&key)),
        ];
        for size in [0usize, 1, 64, 513, 1420, 8192] {
            let plaintext: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
            let mut sealed_by_each = Vec::new();
            for engine in &mut engines {
                let mut data = plaintext.clone();
                let tag = engine.seal(9, &mut data);
                data.extend_from_slice(&tag);
                sealed_by_each.push(data);
            }
            assert!(
                sealed_by_each.windows(2).all(|w| w[0] == w[1]),
                "size {size}"
            );
            for engine in &mut engines {
                let mut sealed = sealed_by_each[0].clone();
                assert!(engine.open(9, &mut sealed), "size {size}");
                assert_eq!(&sealed[..size], &plaintext[..]);
                let mut forged = sealed_by_each[0].clone();
                forged[size / 2] ^= 1;
                assert!(!engine.open(9, &mut forged), "forgery of size {size}");
            }
        }
    }

    /// RFC 8439 section 2.8.2's example through each (its nonce and associated data differ from
    /// WireGuard's, so through ring's and aws-lc-rs's general calls, and OpenSSL's).
    #[test]
    fn rfc_8439_example() {
        let key: [u8; 32] = core::array::from_fn(|i| 0x80 + i as u8);
        let nonce = [
            0x07, 0, 0, 0, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47,
        ];
        let aad = [
            0x50, 0x51, 0x52, 0x53, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7,
        ];
        let plaintext = b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, sunscreen would be it.";
        let tag = [
            0x1a, 0xe1, 0x0b, 0x59, 0x4f, 0x09, 0xe2, 0x6a, 0x7e, 0x90, 0x2e, 0xcb, 0xd0, 0x60,
            0x06, 0x91,
        ];
        let mut data = plaintext.to_vec();
        let key_ring = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, &key).unwrap(),
        );
        let got = key_ring
            .seal_in_place_separate_tag(
                ring::aead::Nonce::assume_unique_for_key(nonce),
                ring::aead::Aad::from(aad),
                &mut data,
            )
            .unwrap();
        assert_eq!(got.as_ref(), tag);
        let ring_ciphertext = data.clone();
        let mut data = plaintext.to_vec();
        let key_aws = aws_lc_rs::aead::LessSafeKey::new(
            aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::CHACHA20_POLY1305, &key).unwrap(),
        );
        let got = key_aws
            .seal_in_place_separate_tag(
                aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce),
                aws_lc_rs::aead::Aad::from(aad),
                &mut data,
            )
            .unwrap();
        assert_eq!(got.as_ref(), tag);
        assert_eq!(data, ring_ciphertext);
        let mut ctx = CipherCtx::new().unwrap();
        ctx.encrypt_init(Some(Cipher::chacha20_poly1305()), Some(&key), Some(&nonce))
            .unwrap();
        ctx.cipher_update(&aad, None).unwrap();
        let mut data = plaintext.to_vec();
        let len = data.len();
        ctx.cipher_update_inplace(&mut data, len).unwrap();
        ctx.cipher_final(&mut []).unwrap();
        let mut got = [0u8; 16];
        ctx.tag(&mut got).unwrap();
        assert_eq!(got, tag);
        assert_eq!(data, ring_ciphertext);
        assert_eq!(&ring_ciphertext[..4], [0xd3, 0x1a, 0x8d, 0x34]);
    }
}
