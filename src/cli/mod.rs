//! The subcommands, each in its own file: what `main` dispatches to once
//! the command line is parsed. Each returns the process's exit code:
//! 0 done; 1 the daemon or a command failed (2, a bad command line, is
//! `main`'s, before anything here runs).

mod epoch;
mod images;
mod keys;
mod logs;
mod release;
mod status;

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
        Command::Sign { key, file } => keys::sign(&key, &file),
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
/// worker) and message. `EITRI_LOG` sets the level (default info); one
/// the agent cannot read is said, and info is used.
fn init_logging() {
    let (filter, mistake) = log_filter(std::env::var("EITRI_LOG").ok().as_deref());
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
    if let Some(mistake) = mistake {
        log::warn!("{mistake}");
    }
}

/// The log levels `EITRI_LOG` takes.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The filter `EITRI_LOG` asks for, or info and what was wrong with it: a
/// word that is no level (`warning`, `verbose`) would otherwise be read as
/// the name of a module to log, and the agent would log nothing at all.
/// Takes `LEVEL` or `MODULE=LEVEL`, comma-separated.
fn log_filter(raw: Option<&str>) -> (String, Option<String>) {
    let Some(raw) = raw.map(str::trim).filter(|r| !r.is_empty()) else {
        return ("info".into(), None);
    };
    let is_level = |word: &str| LEVELS.contains(&word.trim().to_ascii_lowercase().as_str());
    let bad = raw
        .split(',')
        .find(|directive| match directive.split_once('=') {
            Some((module, level)) => module.trim().is_empty() || !is_level(level),
            None => !is_level(directive),
        });
    match bad {
        None => (raw.to_owned(), None),
        Some(bad) => (
            "info".into(),
            Some(format!(
                "EITRI_LOG={raw:?}: {:?} is not a log level; logging at info. Give one of {} (or MODULE=LEVEL, comma-separated)",
                bad.trim(),
                LEVELS.join(", ")
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn no_eitri_log_is_info() {
        assert_eq!(log_filter(None), ("info".to_owned(), None));
    }

    #[test]
    fn a_level_and_module_levels_are_taken_as_given() {
        let (filter, mistake) = log_filter(Some("warn,eitri_agent::net=debug"));

        assert_eq!(filter, "warn,eitri_agent::net=debug");
        assert_eq!(mistake, None);
    }

    #[test]
    fn a_word_that_is_no_level_logs_at_info_and_says_so() {
        let (filter, mistake) = log_filter(Some("warning"));

        assert_eq!(filter, "info");
        let mistake = mistake.unwrap_or_default();
        assert!(
            mistake.contains("\"warning\" is not a log level") && mistake.contains("warn, info"),
            "{mistake}"
        );
    }

    #[test]
    fn a_module_with_a_bad_level_is_refused_too() {
        let (filter, mistake) = log_filter(Some("eitri_agent=verbose"));

        assert_eq!(filter, "info");
        assert!(mistake.is_some());
    }
}
