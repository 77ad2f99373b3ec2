//! The subcommands, each in its own file: what `main` dispatches to once
//! the command line is parsed. Each returns the process's exit code:
//! 0 done; 1 the daemon or a command failed (2, a bad command line, is
//! `main`'s, before anything here runs).

mod epoch;
mod events;
mod images;
mod keys;
mod logs;
mod release;
mod status;
mod top;

use std::io::Write;
use std::process::ExitCode;

use crate::config::Command;
use crate::daemon::Signals;
use crate::version::AGENT_VERSION;

/// Runs `command`. `signals` are the daemon's handlers, installed by `main`
/// before anything else for `run` (and `None` for every other command).
pub fn dispatch(command: Command, signals: Option<Signals>) -> ExitCode {
    match command {
        Command::Help(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Command::Config { text, problem } => {
            print!("{text}");
            match problem {
                None => ExitCode::SUCCESS,
                Some(e) => {
                    eprintln!("eitri-agent: run would refuse these settings: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Check(config) => {
            let items = crate::provision::checklist::check(&config.host());
            print!("{}", crate::provision::checklist::render(&items));
            if crate::provision::checklist::failed(&items) {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
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
        } => status::run(&state_dir, json, vm_id.as_ref(), watch),
        Command::Logs {
            state_dir,
            vm_id,
            lines,
            follow,
            hypervisor,
        } => logs::run(&state_dir, &vm_id, lines, follow, hypervisor),
        Command::Top {
            state_dir,
            once,
            json,
            every,
        } => top::run(&state_dir, once, json, every),
        Command::Events {
            state_dir,
            vm_id,
            lines,
            follow,
        } => events::run(&state_dir, vm_id.as_ref(), lines, follow),
        Command::ImagesPrune { state_dir } => images::prune(&state_dir),
        Command::ImagesList { state_dir } => images::list(&state_dir),
        Command::Release {
            state_dir,
            agents_dir,
            devices,
            force,
        } => release::run(&state_dir, &agents_dir, &devices, force),
        Command::Epoch { state_dir, set } => epoch::run(&state_dir, set),
        Command::Keygen { id, out } => keys::keygen(&id, &out),
        Command::HostKey { state_dir } => keys::host_key(&state_dir),
        Command::Sign {
            key,
            file,
            embed,
            valid_for,
        } => keys::sign(&key, &file, embed, valid_for),
        Command::Run(config) => {
            init_logging();
            let Some(signals) = signals else {
                eprintln!("eitri-agent: internal error: run without signal handlers");
                return ExitCode::FAILURE;
            };
            match crate::daemon::run(*config, signals) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

/// Prints `page` as the next of a redrawn view: over the last one on a
/// terminal, after it (with no terminal codes) into a pipe or a file.
fn redraw(page: &str) -> std::io::Result<()> {
    use std::io::IsTerminal;
    let mut out = std::io::stdout().lock();
    if out.is_terminal() {
        // Home and clear, then the page.
        write!(out, "\x1b[H\x1b[2J")?;
    } else {
        writeln!(out)?;
    }
    write!(out, "{page}")?;
    out.flush()
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
/// worker) and message. `EITRI_LOG` sets the level (default info); one the
/// agent cannot read was refused with the settings (see
/// [`crate::config::log_filter`]).
fn init_logging() {
    let filter = crate::config::log_filter(std::env::var("EITRI_LOG").ok().as_deref())
        .unwrap_or_else(|_| "info".into());
    let logger = env_logger::Builder::new()
        .parse_filters(&filter)
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
        .build();
    let max = logger.filter();
    // Each line about a VM is its event too, once the daemon keeps them.
    if log::set_boxed_logger(Box::new(crate::events::Tee { inner: logger })).is_ok() {
        log::set_max_level(max);
    }
}
