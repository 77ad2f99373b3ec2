//! The daemon: the main loop, signals, readiness and a graceful stop.
//!
//! Three kinds of thread meet here, and only the first may ever wait on
//! the network:
//! - `source` (see [`exchange`]): contacts the control plane or reads the
//!   desired file, hands new desired state over already converted and
//!   validated (the worst snapshot the limits allow takes ~130 ms, spent
//!   here, never by the main loop), sends the newest report.
//! - `main` (this module): acts on events the moment they arrive, and
//!   steps the engine at every tick as the level-triggered safety net:
//!   1. New desired state: check its epoch (a stale snapshot from a
//!      control plane is fenced: logged once, never kept, and every report
//!      says so until a current one arrives; see `epoch_rule` for what
//!      unsigned state may not do to it), keep it (persisted, so an agent restarted during an outage still has
//!      it), and step the engine with it at once.
//!   2. A tick: step the engine with the last desired state (reachable or
//!      not, so a crashed VM is restarted while the control plane is down),
//!      or observe the host if there has never been any (stepping an empty
//!      snapshot would reap every VM as vanished). A state persisted by an
//!      earlier agent is only observed until the source's first answer
//!      (or failure): it may be older than what that agent did.
//!   3. A VM's row changed between steps (a pass ended, a crashed VM was
//!      repaired): report it at once, at most every
//!      [`MIN_WRITE_GAP`](event_loop::MIN_WRITE_GAP).
//!   4. Every report is published to the exchange and written to
//!      `report.json` atomically; after the first, readiness is signalled.
//! - `signals`: SIGTERM/SIGINT stop the loop (passes in flight get the
//!   shutdown grace, VMs keep running); SIGHUP re-reads the desired file.
//!
//! The rooms: [`wire`] makes the real parts and wires them (the one place
//! that does), [`event_loop`] is the loop above, [`publish`] writes what it
//! reports, [`error`] says why the daemon could not start.

mod backoff;
mod details;
mod discover;
mod error;
mod event_loop;
pub mod exchange;
mod last;
pub mod metrics;
mod notify;
mod publish;
pub mod recover;
mod signals;
mod wire;

pub use crate::rng::XorShift;
pub use backoff::Backoff;
pub use error::DaemonError;
pub use event_loop::{Clock, Daemon, Event, Parts, SystemClock};
pub use exchange::{Contact, Exchange, ExchangeThread, Link};
pub use last::{LastError, images_named};
pub use notify::Readiness;
pub use recover::Recovered;
pub use signals::Signals;
pub use wire::{host_info, run};
