//! The `eitri-agent` binary: hold the stop signals, parse, dispatch, exit.
//!
//! Exit codes: 0 done; 1 the daemon or a command failed; 2 the command line
//! or environment is wrong (nothing was started). What each command does
//! is [`eitri_agent::cli`]'s.

use std::collections::HashMap;
use std::process::ExitCode;

use eitri_agent::config;

/// The stop signals are blocked before `main` runs, from the binary's
/// initialisers: a supervisor's SIGTERM in the daemon's first milliseconds
/// then waits, pending, until the handlers are installed, and is an orderly
/// stop rather than death by the default action. (Only the dynamic loader's
/// own time, before any of the agent's code runs, is left uncovered; the
/// static build has next to none.)
#[cfg(any(target_os = "linux", target_os = "macos"))]
#[used]
#[cfg_attr(target_os = "linux", unsafe(link_section = ".init_array"))]
#[cfg_attr(target_os = "macos", unsafe(link_section = "__DATA,__mod_init_func"))]
static HOLD_STOP_SIGNALS: extern "C" fn() = hold_stop_signals;

extern "C" fn hold_stop_signals() {
    let _ = stop_signals().thread_block();
}

fn stop_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        set.add(signal);
    }
    set
}

fn main() -> ExitCode {
    // Nothing the agent (or a hypervisor it starts) creates is for other
    // users: tenants' data, user-data and keys live in these files.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let signals = if args.first().is_some_and(|a| a == "run") {
        match eitri_agent::daemon::Signals::install() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("eitri-agent: cannot install the signal handlers: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    // Handled from here on (by the handlers just installed, or the default
    // action for a command that is not the daemon): a signal that came
    // while they were blocked is delivered now.
    let _ = stop_signals().thread_unblock();
    let env: HashMap<String, String> = std::env::vars().collect();
    let command = match config::parse(&args, &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("eitri-agent: {e}");
            return ExitCode::from(2);
        }
    };
    eitri_agent::cli::dispatch(command, signals)
}
