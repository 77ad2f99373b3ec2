//! The one place signals are handled: handlers are installed first thing
//! in `main` (a SIGTERM in the agent's first milliseconds must stop it
//! cleanly, not kill it by the default action), and a `signals` thread
//! turns them into [`Event`] messages for the main loop.

use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Handle;

use super::Event;
use crate::deadline::Deadline;
use crate::threads::join_within;

/// Handlers installed; signals that arrive before [`Signals::spawn`] are
/// kept and delivered then.
pub struct Signals(signal_hook::iterator::Signals);

impl Signals {
    pub fn install() -> std::io::Result<Signals> {
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]).map(Signals)
    }

    /// Starts the `signals` thread, which sends each signal as an event.
    pub fn spawn(self, events: Sender<Event>) -> std::io::Result<SignalThread> {
        let mut signals = self.0;
        let handle = signals.handle();
        let thread = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    let event = match signal {
                        SIGHUP => Event::Reload,
                        _ => Event::Shutdown,
                    };
                    log::info!("signal {signal}: {event:?}");
                    if events.send(event).is_err() {
                        return;
                    }
                }
            })?;
        Ok(SignalThread {
            handle,
            thread: Some(thread),
        })
    }
}

/// The `signals` thread; ended and joined (within a bound) when dropped.
pub struct SignalThread {
    handle: Handle,
    thread: Option<JoinHandle<()>>,
}

/// Closing the handle ends the thread's wait at once.
const SIGNALS_JOIN: Duration = Duration::from_secs(1);

impl SignalThread {
    /// Ends the thread and joins it.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for SignalThread {
    fn drop(&mut self) {
        self.handle.close();
        if let Some(thread) = self.thread.take() {
            join_within(thread, Deadline::after(SIGNALS_JOIN));
        }
    }
}
