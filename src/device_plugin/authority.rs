//! Mends the `:authority` of the kubelet's calls to the plugin. Kubelets before 1.26 dial a
//! plugin's socket by its path and their grpc-go sends that path as the HTTP/2 `:authority`
//! (`/var/lib/kubelet/device-plugins/…sock`, kubernetes#112597). h2, under tonic, refuses such a
//! request as malformed and resets the stream (hyperium/h2#487), so the kubelet never gets the
//! device list. Each connection therefore passes through here on its way to the gRPC server:
//! frames go through unchanged, except header blocks, which are decoded (HPACK, with the
//! client's dynamic table), given `localhost` for an authority that is not one, and encoded
//! again for the server. Replies go back untouched.

use std::io;

use http::uri::Authority;
use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// The connection preface every HTTP/2 client sends first.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Frame types and flags this touches (RFC 9113).
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame a peer may send before settings say otherwise, which is what the blocks
/// written here keep to.
const DEFAULT_MAX_FRAME: usize = 16_384;
/// The largest frame accepted from the client (the protocol's ceiling).
const MAX_FRAME: usize = (1 << 24) - 1;
/// The largest header block accepted, encoded (a kubelet's are a few hundred bytes).
const MAX_BLOCK: usize = 64 * 1024;
/// The most decoded header bytes (names and values) a block may hold: small references into
/// the dynamic table must not expand into megabytes.
const MAX_DECODED: usize = 64 * 1024;
/// The dynamic table size both HPACK contexts keep to: the protocol's default, which the
/// client's encoder starts from and the gRPC server behind (h2 under tonic, whose settings
/// leave it as is) decodes with. A client may shrink its table, never grow it past this.
const TABLE_SIZE: usize = 4096;
/// What a path-shaped authority is replaced with.
const LOCALHOST: &[u8] = b"localhost";

/// Why a connection was dropped.
#[derive(Debug, thiserror::Error)]
pub(super) enum MendError {
    /// A frame that does not parse.
    #[error("malformed HTTP/2 frame: {0}")]
    Frame(&'static str),
    /// A header block HPACK cannot decode.
    #[error("undecodable header block: {0:?}")]
    Hpack(loona_hpack::decoder::DecoderError),
}

/// The header blocks of one connection: the client's HPACK context (decoding) and the
/// server's (encoding), and a block still waiting for its CONTINUATION frames.
pub(super) struct AuthorityMender {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// (stream, end of stream, the block so far).
    pending: Option<(u32, bool, Vec<u8>)>,
}

impl Default for AuthorityMender {
    fn default() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        let mut encoder = Encoder::new();
        encoder.set_max_table_size(TABLE_SIZE);
        Self {
            decoder,
            encoder,
            pending: None,
        }
    }
}

/// A frame: the 9-byte header, then the payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

impl AuthorityMender {
    /// The bytes to send the server for one frame from the client (nothing while a header
    /// block awaits its CONTINUATION frames).
    pub(super) fn frame(&mut self, head: [u8; 9], payload: &[u8]) -> Result<Vec<u8>, MendError> {
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut out = Vec::new();
        match (kind, self.pending.take()) {
            (HEADERS, None) => {
                let mut block = payload;
                let mut padding = 0;
                if flags & PADDED != 0 {
                    let (&n, rest) = block
                        .split_first()
                        .ok_or(MendError::Frame("PADDED without a pad length"))?;
                    padding = usize::from(n);
                    block = rest;
                }
                if flags & PRIORITY != 0 {
                    block = block
                        .get(5..)
                        .ok_or(MendError::Frame("PRIORITY without its 5 bytes"))?;
                }
                let block = block
                    .get(..block.len().saturating_sub(padding))
                    .filter(|_| padding <= block.len())
                    .ok_or(MendError::Frame("padding longer than the frame"))?;
                if block.len() > MAX_BLOCK {
                    return Err(MendError::Frame("header block over 64 KiB"));
                }
                let end_stream = flags & END_STREAM != 0;
                if flags & END_HEADERS != 0 {
                    self.reencode(stream, end_stream, block, &mut out)?;
                } else {
                    self.pending = Some((stream, end_stream, block.to_vec()));
                }
            }
            (CONTINUATION, Some((id, end_stream, mut block))) if id == stream => {
                block.extend_from_slice(payload);
                if block.len() > MAX_BLOCK {
                    return Err(MendError::Frame("header block over 64 KiB"));
                }
                if flags & END_HEADERS != 0 {
                    self.reencode(stream, end_stream, &block, &mut out)?;
                } else {
                    self.pending = Some((id, end_stream, block));
                }
            }
            (_, Some(_)) | (CONTINUATION, None) => {
                return Err(MendError::Frame(
                    "a header block interrupted or a stray CONTINUATION",
                ));
            }
            (_, None) => {
                out.extend_from_slice(&head);
                out.extend_from_slice(payload);
            }
        }
        Ok(out)
    }

    /// Decodes `block`, mends its authority and writes it as HEADERS (and CONTINUATION) frames.
    fn reencode(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), MendError> {
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut decoded = 0usize;
        self.decoder
            .decode_with_cb(block, |name, value| {
                decoded += name.len() + value.len();
                if decoded > MAX_DECODED {
                    return;
                }
                let value = if &*name == b":authority" && Authority::try_from(&*value).is_err() {
                    LOCALHOST.to_vec()
                } else {
                    value.into_owned()
                };
                headers.push((name.into_owned(), value));
            })
            .map_err(MendError::Hpack)?;
        if decoded > MAX_DECODED {
            return Err(MendError::Frame("header list over 64 KiB once decoded"));
        }
        // Re-encoded with indexing, "never indexed" included: what passes through here is a
        // kubelet's gRPC call on a local socket, with no secret in its headers.
        let encoded = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut chunks = encoded.chunks(DEFAULT_MAX_FRAME).peekable();
        let mut kind = HEADERS;
        let mut flags = if end_stream { END_STREAM } else { 0 };
        if chunks.peek().is_none() {
            frame(kind, flags | END_HEADERS, stream, &[], out);
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            frame(
                kind,
                flags | if last { END_HEADERS } else { 0 },
                stream,
                chunk,
                out,
            );
            kind = CONTINUATION;
            flags = 0;
        }
        Ok(())
    }
}

/// Copies the client's frames to the server through a mender.
async fn inbound(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
) -> io::Result<()> {
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an HTTP/2 client",
        ));
    }
    to.write_all(&preface).await?;
    let mut mender = AuthorityMender::default();
    let mut payload = Vec::new();
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            other => other?,
        };
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        if len > MAX_FRAME {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "frame too long"));
        }
        payload.resize(len, 0);
        from.read_exact(&mut payload).await?;
        let bytes = mender
            .frame(head, &payload)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        to.write_all(&bytes).await?;
    }
    to.shutdown().await
}

/// The server's end of a connection from the kubelet whose header blocks are mended on the
/// way in; the copying runs in two tasks that end with the connection.
pub(super) fn mended<S>(client: S) -> DuplexStream
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (server_side, ours) = tokio::io::duplex(64 * 1024);
    let (client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, server_write) = tokio::io::split(ours);
    tokio::spawn(async move {
        if let Err(e) = inbound(client_read, server_write).await {
            tracing::debug!("a kubelet connection ended: {e}");
        }
    });
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    });
    server_side
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &[u8] = b"/var/lib/kubelet/device-plugins/kilotun-squat.ai-tun.sock";

    fn head(kind: u8, flags: u8, stream: u32, len: usize) -> [u8; 9] {
        let mut bytes = Vec::new();
        frame(kind, flags, stream, &vec![0; len], &mut bytes);
        bytes[..9].try_into().unwrap()
    }

    /// Splits `bytes` into frames: (type, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
            let stream = u32::from_be_bytes(bytes[5..9].try_into().unwrap());
            out.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        out
    }

    fn request(authority: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/v1beta1.DevicePlugin/ListAndWatch"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect()
    }

    #[test]
    fn a_path_as_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut client = Encoder::new();
        let mut server = Decoder::new();
        let mut mender = AuthorityMender::default();
        // Twice on one connection: the second block leans on the client's dynamic table.
        for stream in [1, 3] {
            let block = client.encode(request(PATH).iter().map(|(n, v)| (&n[..], &v[..])));
            // Split over HEADERS (padded, with priority) and a CONTINUATION.
            let (first, rest) = block.split_at(block.len() / 2);
            let mut payload = vec![2];
            payload.extend_from_slice(&[0, 0, 0, 0, 15]);
            payload.extend_from_slice(first);
            payload.extend_from_slice(&[0, 0]);
            let mut out = mender
                .frame(
                    head(HEADERS, PADDED | PRIORITY, stream, payload.len()),
                    &payload,
                )
                .unwrap();
            assert!(out.is_empty(), "sent before the block was complete");
            out = mender
                .frame(head(CONTINUATION, END_HEADERS, stream, rest.len()), rest)
                .unwrap();
            let sent = frames(&out);
            assert_eq!(sent.len(), 1);
            let (kind, flags, id, block) = &sent[0];
            assert_eq!((*kind, *flags, *id), (HEADERS, END_HEADERS, stream));
            let decoded = server.decode(block).unwrap();
            assert_eq!(decoded, request(LOCALHOST), "stream {stream}");
        }
    }

    #[test]
    fn a_valid_authority_end_of_stream_and_other_frames_pass_unchanged() {
        let mut client = Encoder::new();
        let mut server = Decoder::new();
        let mut mender = AuthorityMender::default();
        let block = client.encode(
            request(b"localhost:1107")
                .iter()
                .map(|(n, v)| (&n[..], &v[..])),
        );
        let out = mender
            .frame(
                head(HEADERS, END_HEADERS | END_STREAM, 5, block.len()),
                &block,
            )
            .unwrap();
        let sent = frames(&out);
        assert_eq!(sent[0].1, END_HEADERS | END_STREAM);
        assert_eq!(
            server.decode(&sent[0].3).unwrap(),
            request(b"localhost:1107")
        );
        let data = [0u8, 0, 0, 0, 3, 1, 2, 3];
        let out = mender.frame(head(0x0, 0, 5, data.len()), &data).unwrap();
        assert_eq!(out[9..], data);
        assert_eq!(out[..9], head(0x0, 0, 5, data.len()));
    }

    #[test]
    fn a_block_too_big_for_one_frame_is_sent_as_headers_and_continuations() {
        let mut client = Encoder::new();
        let mut server = Decoder::new();
        let mut mender = AuthorityMender::default();
        let mut request = request(PATH);
        request.push((b"x-padding".to_vec(), vec![b'a'; 40_000]));
        let block = client.encode(request.iter().map(|(n, v)| (&n[..], &v[..])));
        let out = mender
            .frame(
                head(HEADERS, END_HEADERS | END_STREAM, 7, block.len()),
                &block,
            )
            .unwrap();
        let sent = frames(&out);
        assert!(sent.len() >= 3, "{} frames", sent.len());
        assert_eq!((sent[0].0, sent[0].1), (HEADERS, END_STREAM));
        for (i, (kind, flags, stream, payload)) in sent.iter().enumerate() {
            assert_eq!(*stream, 7);
            assert!(payload.len() <= DEFAULT_MAX_FRAME);
            if i > 0 {
                assert_eq!(*kind, CONTINUATION);
                let last = i == sent.len() - 1;
                assert_eq!(*flags, if last { END_HEADERS } else { 0 });
            }
        }
        let whole: Vec<u8> = sent.iter().flat_map(|f| f.3.clone()).collect();
        request[3].1 = LOCALHOST.to_vec();
        assert_eq!(server.decode(&whole).unwrap(), request);
    }

    #[test]
    fn a_block_that_expands_past_the_limit_is_refused() {
        // One large header in the client's table, then referenced a hundred times.
        let mut client = Encoder::new();
        let mut mender = AuthorityMender::default();
        let big = vec![b'b'; 3000];
        let first = client.encode([(&b"x-big"[..], &big[..])]);
        mender
            .frame(head(HEADERS, END_HEADERS, 1, first.len()), &first)
            .unwrap();
        let again = client.encode(std::iter::repeat_n((&b"x-big"[..], &big[..]), 100));
        assert!(
            again.len() < 200,
            "the repeats are indexed: {}",
            again.len()
        );
        assert!(mender
            .frame(head(HEADERS, END_HEADERS, 3, again.len()), &again)
            .is_err());
    }

    #[test]
    fn malformed_frames_are_refused_not_panicked_on() {
        let mut mender = AuthorityMender::default();
        for (h, payload) in [
            (head(HEADERS, PADDED | END_HEADERS, 1, 0), vec![]),
            (head(HEADERS, PADDED | END_HEADERS, 1, 2), vec![9, 0]),
            (head(HEADERS, PRIORITY | END_HEADERS, 1, 2), vec![0, 0]),
            (head(CONTINUATION, END_HEADERS, 1, 1), vec![0]),
            (head(HEADERS, END_HEADERS, 1, 1), vec![0xff]),
        ] {
            assert!(mender.frame(h, &payload).is_err(), "{h:?} {payload:?}");
            mender = AuthorityMender::default();
        }
        // A block interrupted by another frame, or continued on another stream.
        mender.frame(head(HEADERS, 0, 1, 1), &[0x82]).unwrap();
        assert!(mender.frame(head(0x0, 0, 1, 0), &[]).is_err());
        let mut mender = AuthorityMender::default();
        mender.frame(head(HEADERS, 0, 1, 1), &[0x82]).unwrap();
        assert!(mender
            .frame(head(CONTINUATION, END_HEADERS, 3, 1), &[0x84])
            .is_err());
    }
}
