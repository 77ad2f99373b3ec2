//! What the agent says about its host outside the wire: the report file
//! the daemon writes every tick ([`file`](mod@file)), and how `status` shows it to a
//! person ([`render`](mod@render)). The daemon imports only the first.

mod file;
mod render;

pub use file::{ReportFile, StatusError, VmDetail};
pub use render::render_claims;
