//! The one place signals are handled: a `signals` thread turns them into
//! [`Control`] messages for the tick loop.

use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};

use super::Control;

pub struct SignalThread {
    handle: Handle,
    thread: JoinHandle<()>,
}

pub fn spawn(control: Sender<Control>) -> std::io::Result<SignalThread> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let handle = signals.handle();
    let thread = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                let message = match signal {
                    SIGHUP => Control::Reload,
                    _ => Control::Shutdown,
                };
                log::info!("signal {signal}: {message:?}");
                if control.send(message).is_err() {
                    return;
                }
            }
        })?;
    Ok(SignalThread { handle, thread })
}

impl SignalThread {
    /// Ends the thread and joins it.
    pub fn stop(self) {
        self.handle.close();
        let _ = self.thread.join();
    }
}
