//! The one place signals are handled: handlers are installed first thing
//! in `main` (a SIGTERM in the agent's first milliseconds must stop it
//! cleanly, not kill it by the default action), and a `signals` thread
//! turns them into [`Event`] messages for the main loop.

use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Handle;

use super::Event;

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
        Ok(SignalThread { handle, thread })
    }
}

pub struct SignalThread {
    handle: Handle,
    thread: JoinHandle<()>,
}

impl SignalThread {
    /// Ends the thread and joins it.
    pub fn stop(self) {
        self.handle.close();
        let _ = self.thread.join();
    }
}
