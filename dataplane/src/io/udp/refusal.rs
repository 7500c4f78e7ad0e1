//! Which errors of a segmented send are the segmentation's, and which of those the offload's;
//! which errors of a send from a chosen source say that the source is gone.

use std::io;

/// Whether a segmented send failed for its segmentation and may go out unsegmented: a segment
/// above the destination's path MTU (`EMSGSIZE`), or the offload itself refused (see
/// [`gso_unsupported`]).
pub(super) fn segmentation_refused(error: &io::Error) -> bool {
    error.raw_os_error() == Some(libc::EMSGSIZE) || gso_unsupported(error)
}

/// Whether the kernel or the device cannot segment at all (`EIO`: the device has no checksum
/// offload; `EINVAL`, `ENOPROTOOPT`, `EOPNOTSUPP`: the option is not taken), so every later
/// send is better made without it. An unreachable destination or a full buffer says nothing
/// about segmentation and keeps it on.
pub(super) fn gso_unsupported(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
    )
}

/// Whether a send from a chosen source address failed because that address cannot be used
/// any more: it left the host (`EINVAL` for IPv6, `EADDRNOTAVAIL` or `ENETUNREACH` for
/// IPv4) or its interface did (`ENODEV`). The send is made again without it.
pub(super) fn source_refused(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EINVAL | libc::EADDRNOTAVAIL | libc::ENETUNREACH | libc::ENODEV)
    )
}
