//! The guest agent's exchange: what the host asks a guest over virtio-vsock
//! and what it accepts back.
//!
//! The protocol is `proto/eitri/guest/v1/guest.proto` (its header is the
//! reference for a guest agent written for another OS). In short:
//!
//! 1. The host connects to the VMM's vsock socket (a unix socket in a
//!    directory of its own, see
//!    [`Layout::guest_socket`](crate::state::Layout::guest_socket)),
//!    writes `CONNECT 1031\n` and reads the VMM's `OK <port>\n`
//!    ([`ask()`]).
//! 2. It writes one [`Request`](crate::pb::guest::Request) framed by its
//!    4-byte big-endian length ([`frame`]), and reads one framed
//!    [`Answer`](crate::pb::guest::Answer), at most [`MAX_ANSWER`] bytes.
//! 3. The answer is checked ([`said`]) before anything of it is kept: its
//!    version and id are the request's, every string is bounded, and the
//!    kind of answer is the one the request asked for.
//!
//! The guest is the tenant's code. Everything it says is a report the host
//! checks and shows quoted; none of it becomes a host path, a command or a
//! size the host allocates. Every exchange is bounded by a deadline the
//! caller gives (a pass's), in time and in bytes, so a guest that stalls,
//! floods or lies costs its own worker that long and no other VM anything.
//!
//! [`serve`] is the guest's side of one exchange, shared by `eitri-guest`
//! (with the real guest's [`inside`] on Linux) and the stand-in
//! hypervisor's scripted guest.

pub mod ask;
pub mod frame;
#[cfg(target_os = "linux")]
pub mod inside;
pub mod said;
pub mod serve;

pub use ask::{AskError, Asked, ask, ask_made};
pub use said::{Reseeded, Said, SaidError, Status, SystemState};

/// The vsock port the guest agent listens on inside the guest.
pub const PORT: u32 = 1031;

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// The largest request a guest agent reads (an identity with its keys is a
/// few KiB).
pub const MAX_REQUEST: u32 = 64 << 10;

/// The largest answer the host reads: a status is a few hundred bytes.
pub const MAX_ANSWER: u32 = 16 << 10;
