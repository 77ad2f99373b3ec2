//! What the agent says about its host outside the wire: the report file
//! the daemon writes every tick ([`file`](mod@file)), and how `status` shows it to a
//! person ([`render`](mod@render), and the host's claims under it:
//! [`claims`](mod@claims)). The daemon imports only the first.

mod claims;
mod file;
mod render;

pub use claims::render_claims;
pub use file::{ReportFile, StatusError, VmDetail};
