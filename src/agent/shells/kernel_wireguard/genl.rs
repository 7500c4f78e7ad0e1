//! A generic netlink socket bound to one family: requests and their answers.

use anyhow::{bail, Context, Result};
use netlink_packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::GenlMessage;
use netlink_packet_wireguard::WireguardMessage;
use netlink_sys::{protocols::NETLINK_GENERIC, Socket, SocketAddr};

/// A generic netlink socket bound to one family.
pub(super) struct GenlSocket {
    socket: Socket,
    family: u16,
    sequence: u32,
}

impl GenlSocket {
    /// Opens a socket and resolves `family`'s id.
    pub(super) fn open(family: &str) -> Result<Self> {
        let mut socket =
            Socket::new(NETLINK_GENERIC).context("opening a generic netlink socket")?;
        socket
            .bind_auto()
            .context("binding a generic netlink socket")?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .context("connecting a generic netlink socket")?;
        let mut this = Self {
            socket,
            family: 0,
            sequence: 0,
        };
        let request = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(family.to_string())],
        });
        let answers = this.exchange(request, NLM_F_REQUEST | NLM_F_ACK)?;
        this.family = answers
            .iter()
            .flat_map(|a| &a.payload.nlas)
            .find_map(|nla| match nla {
                GenlCtrlAttrs::FamilyId(id) => Some(*id),
                _ => None,
            })
            .with_context(|| format!("no id for generic netlink family {family}"))?;
        Ok(this)
    }

    /// Sends a WireGuard request and collects the answers.
    pub(super) fn request(
        &mut self,
        message: WireguardMessage,
        flags: u16,
    ) -> Result<Vec<WireguardMessage>> {
        let mut message = GenlMessage::from_payload(message);
        message.set_resolved_family_id(self.family);
        Ok(self
            .exchange(message, flags)?
            .into_iter()
            .map(|m| m.payload)
            .collect())
    }

    /// Sends `message` and reads answers until the kernel's acknowledgement or the end of a
    /// dump. A negative acknowledgement is the kernel's errno.
    fn exchange<F>(&mut self, message: GenlMessage<F>, flags: u16) -> Result<Vec<GenlMessage<F>>>
    where
        F: netlink_packet_generic::GenlFamily
            + netlink_packet_core::Emitable
            + netlink_packet_core::ParseableParametrized<[u8], netlink_packet_generic::GenlHeader>
            + std::fmt::Debug,
    {
        self.sequence = self.sequence.wrapping_add(1);
        let mut message = NetlinkMessage::from(message);
        message.header.flags = flags;
        message.header.sequence_number = self.sequence;
        message.finalize();
        let mut buffer = vec![0; message.buffer_len()];
        message.serialize(&mut buffer);
        self.socket
            .send(&buffer, 0)
            .context("sending a generic netlink request")?;
        let mut answers = Vec::new();
        loop {
            let (bytes, _) = self
                .socket
                .recv_from_full()
                .context("reading a generic netlink answer")?;
            let mut offset = 0;
            while offset < bytes.len() {
                let answer = NetlinkMessage::<GenlMessage<F>>::deserialize(&bytes[offset..])
                    .context("parsing a generic netlink answer")?;
                let length = answer.header.length as usize;
                if length == 0 {
                    bail!("a generic netlink answer of length 0");
                }
                offset += (length + 3) & !3;
                if answer.header.sequence_number != self.sequence {
                    continue;
                }
                match answer.payload {
                    NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                    NetlinkPayload::Done(_) => return Ok(answers),
                    NetlinkPayload::Error(e) => match e.code {
                        None => return Ok(answers),
                        Some(_) => return Err(e.to_io().into()),
                    },
                    _ => {}
                }
            }
        }
    }
}
