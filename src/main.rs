//! The `eitri-agent` binary: parse, run, print the error chain, exit.
//!
//! Exit codes: 0 done; 1 the daemon or a command failed; 2 the command line
//! or environment is wrong (nothing was started).

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::SystemTime;

use eitri_agent::config::{self, Command};
use eitri_agent::status::ReportFile;
use eitri_agent::version::AGENT_VERSION;

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

/// Prints the report (or one VM), once; returns the agent's tick, for
/// `--watch`, or the exit code to end with.
fn show_status(
    state_dir: &std::path::Path,
    json: bool,
    vm_id: Option<&eitri_agent::model::Id>,
    watch: bool,
) -> Result<std::time::Duration, ExitCode> {
    let file = ReportFile::read(state_dir).map_err(|e| fail(&e))?;
    let tick = std::time::Duration::from_millis(file.tick_ms.clamp(200, 60_000));
    if json {
        let text = serde_json::to_string_pretty(&file).map_err(|e| fail(&e))?;
        println!("{text}");
        return Ok(tick);
    }
    let now = SystemTime::now();
    let text = match vm_id {
        None => file.render(now),
        Some(vm) => {
            let console = eitri_agent::console::last_lines(
                &eitri_agent::state::vm_dir_in(state_dir, vm).join(eitri_agent::state::SERIAL_LOG),
                5,
            )
            .unwrap_or_default();
            match file.render_vm(vm.as_str(), &console, now) {
                Some(text) => text,
                None => {
                    eprintln!(
                        "eitri-agent: VM {vm} is not on this host (the last report does not name it)"
                    );
                    return Err(ExitCode::FAILURE);
                }
            }
        }
    };
    if watch {
        // Home and clear, then the page: a redraw, not a scroll.
        print!("\x1b[H\x1b[2J");
    }
    print!("{text}");
    let _ = std::io::stdout().flush();
    Ok(tick)
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
    match command {
        Command::Help => {
            print!("{}", config::usage());
            ExitCode::SUCCESS
        }
        Command::Version => {
            println!("eitri-agent {AGENT_VERSION}");
            ExitCode::SUCCESS
        }
        Command::Status {
            state_dir,
            json,
            vm_id,
            watch,
        } => loop {
            let shown = show_status(&state_dir, json, vm_id.as_ref(), watch);
            match shown {
                Ok(tick) if watch => std::thread::sleep(tick),
                Ok(_) => return ExitCode::SUCCESS,
                Err(code) => return code,
            }
        },
        Command::Logs {
            state_dir,
            vm_id,
            lines,
            follow,
            hypervisor,
        } => {
            let file = eitri_agent::state::vm_dir_in(&state_dir, &vm_id).join(if hypervisor {
                eitri_agent::state::HYPERVISOR_LOG
            } else {
                eitri_agent::state::SERIAL_LOG
            });
            let mut out = std::io::stdout().lock();
            match eitri_agent::console::print(&file, lines, follow, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                // The reader went away (`| head`): done.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    eprintln!(
                        "eitri-agent: VM {vm_id} has no {} on this host ({}): is it created here, and is --state-dir right?",
                        if hypervisor {
                            "hypervisor log"
                        } else {
                            "console"
                        },
                        file.display()
                    );
                    ExitCode::FAILURE
                }
                Err(e) => fail(&e),
            }
        }
        Command::ImagesPrune { state_dir } => {
            let store = match eitri_agent::state::Store::open(&state_dir) {
                Ok(store) => store,
                Err(e) => return fail(&e),
            };
            match eitri_agent::image::prune(&store) {
                Ok(pruned) => {
                    for sha in &pruned.removed {
                        println!("removed {sha}");
                    }
                    println!(
                        "{} image(s) removed, {:.1} MiB freed",
                        pruned.removed.len(),
                        pruned.bytes as f64 / (1u64 << 20) as f64
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Run(config) => {
            init_logging();
            let Some(signals) = signals else {
                eprintln!("eitri-agent: internal error: run without signal handlers");
                return ExitCode::FAILURE;
            };
            match eitri_agent::daemon::run(*config, signals) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

/// Prints an error with its whole source chain, one cause per line.
fn fail(err: &dyn std::error::Error) -> ExitCode {
    let mut text = format!("eitri-agent: error: {err}");
    let mut next = err.source();
    while let Some(cause) = next {
        text.push_str(&format!("\n  caused by: {cause}"));
        next = cause.source();
    }
    eprintln!("{text}");
    log::error!("{}", text.replace('\n', ";"));
    ExitCode::FAILURE
}

/// One line per event on stderr: time, level, thread (`vm-<id>` for a VM's
/// worker) and message. `EITRI_LOG` sets the level (default info).
fn init_logging() {
    env_logger::Builder::new()
        .parse_filters(&std::env::var("EITRI_LOG").unwrap_or_else(|_| "info".into()))
        .format(|buf, record| {
            let thread = std::thread::current();
            writeln!(
                buf,
                "{} {:<5} [{}] {}",
                buf.timestamp_millis(),
                record.level(),
                thread.name().unwrap_or("main"),
                record.args()
            )
        })
        .init();
}
