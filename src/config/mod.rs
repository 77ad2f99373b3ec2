//! Command line and environment → a validated [`Command`].
//!
//! Every setting is a flag with an `EITRI_*` environment fallback, because
//! runit (`chpst -e`) and s6 (`s6-envdir`) configure a service from a
//! directory of environment files. A flag given on the command line wins
//! over the environment, which wins over the default. Each value is checked
//! here, once, and a bad one fails the start with a message naming the flag.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::provision::GuestBoot;
use crate::reconcile::EngineConfig;
use crate::source::ControlPlane;

mod file;
mod guests;
mod read;
mod run;
mod settings;
mod usage;
mod verbs;

pub use usage::usage;
use usage::{
    check_usage, config_usage, epoch_usage, events_usage, host_key_usage, images_usage,
    keygen_usage, logs_usage, release_usage, run_usage, sign_usage, status_usage, top_usage,
};
use verbs::{
    parse_epoch, parse_events, parse_images, parse_keygen, parse_logs, parse_release, parse_sign,
    parse_status, parse_top, show_config, state_dir_of,
};

/// What the binary was asked to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Run(Box<Config>),
    Status {
        state_dir: PathBuf,
        json: bool,
        /// One VM in detail, or the host (`None`).
        vm_id: Option<crate::model::Id>,
        /// Redraw every tick.
        watch: bool,
    },
    /// A VM's console (or its hypervisor's log).
    Logs {
        state_dir: PathBuf,
        vm_id: crate::model::Id,
        lines: usize,
        follow: bool,
        hypervisor: bool,
    },
    /// What each running VM uses, one row each, redrawn.
    Top {
        state_dir: PathBuf,
        /// Once, not redrawn.
        once: bool,
        json: bool,
        /// How often the rows are drawn again.
        every: std::time::Duration,
    },
    /// What happened to a VM (or to every VM), one line per event.
    Events {
        state_dir: PathBuf,
        /// One VM's, or every VM's (`None`).
        vm_id: Option<crate::model::Id>,
        lines: usize,
        follow: bool,
    },
    /// Delete cached images no VM record names.
    ImagesPrune {
        state_dir: PathBuf,
    },
    /// List the cached images, and which VMs name each.
    ImagesList {
        state_dir: PathBuf,
    },
    /// Show the epoch fence a stopped agent's state dir holds, or move it
    /// (the way back from an unsigned answer that raised it too far).
    Epoch {
        state_dir: PathBuf,
        set: Option<u64>,
    },
    /// Print the public line of the key that signs this host's reports,
    /// making the key if it has none yet.
    HostKey {
        state_dir: PathBuf,
    },
    /// End a state dir's claim on the host: take back what its agent was
    /// given (device ACL entries, cgroup roots) and free its ids.
    Release {
        state_dir: PathBuf,
        agents_dir: PathBuf,
        /// The devices its VMMs' group was given (`--kvm-device`,
        /// `--userfaultfd-device`), beside the usual ones.
        devices: Vec<PathBuf>,
        /// Release it even with VMs or volumes left in it.
        force: bool,
    },
    /// Make a signing key for desired state.
    Keygen {
        id: String,
        out: PathBuf,
    },
    /// Sign a desired file (`FILE.sig` beside it).
    Sign {
        key: PathBuf,
        file: PathBuf,
        /// The signature as the file's own first line, not `FILE.sig`.
        embed: bool,
        /// How long the signed file is obeyed from now (its
        /// `not_after_unix_ms`); `None`: it never expires.
        valid_for: Option<Duration>,
    },
    /// The settings `run` would use and where each came from; `problem`:
    /// why `run` would refuse them.
    Config {
        text: String,
        problem: Option<ConfigError>,
    },
    /// Check every host requirement `run` with these settings has.
    Check(Box<Config>),
    Version,
    /// Print this help text (the whole binary's, or one verb's).
    Help(String),
}

/// Where desired state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DesiredSource {
    File(PathBuf),
    ControlPlane(ControlPlane),
}

/// `--image-cache-max`: bytes, or a share of the state dir's filesystem
/// (resolved at start, when the state dir is there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheCap {
    Bytes(u64),
    Percent(u8),
}

impl CacheCap {
    /// In bytes, on a filesystem of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            CacheCap::Bytes(n) => n,
            CacheCap::Percent(p) => total / 100 * u64::from(p),
        }
    }
}

/// The daemon's validated settings, shaped as the settings are defined
/// (see `settings`): one field per section, and each part of the agent
/// takes the section it reads, by reference. What is to be found out from
/// the host rather than the flags (its id, its DNS servers) is left `None`
/// here and discovered by the daemon when it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub source: SourceSettings,
    pub state: StateSettings,
    pub reconcile: ReconcileSettings,
    pub images: ImageSettings,
    /// The network, hypervisor, jail and limits sections, as the backends
    /// take them.
    pub guest: GuestBoot,
    pub reporting: ReportingSettings,
    /// What this agent asks of the host's shared ids and cgroups; settled
    /// at start into `guest.confinement` (see `state::claim`).
    pub wish: crate::state::claim::Wish,
}

/// Where desired state comes from, and how far it is trusted.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceSettings {
    pub desired: DesiredSource,
    /// `--host-id`; `None`: the daemon reads /etc/machine-id.
    pub host_id: Option<String>,
    pub backoff_max: Duration,
    /// Bounds on one snapshot, from either source.
    pub limits: crate::source::SnapshotLimits,
    /// `--max-epoch-step`: how far one unsigned answer may raise the fence.
    pub max_epoch_step: u64,
    /// `--trusted-keys`, read: the keys desired state must be signed by;
    /// `None`: desired state is taken unsigned.
    pub trust: Option<crate::trust::TrustedKeys>,
    /// An HTTP proxy for the control plane and image downloads; never taken
    /// from the environment.
    pub proxy: Option<String>,
}

/// Where the agent keeps its state, and the host's registry of agents.
#[derive(Debug, Clone, PartialEq)]
pub struct StateSettings {
    pub dir: PathBuf,
    /// `--agents-dir`: the host-wide registry of the agents' claims.
    pub agents_dir: PathBuf,
}

/// The loop's pace and the engine's rules.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcileSettings {
    pub tick: Duration,
    pub shutdown_grace: Duration,
    pub engine: EngineConfig,
}

/// How base images are fetched and how much of them is kept.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSettings {
    /// The proxy again, `--image-root`, the stall timeout, ...
    pub fetch: crate::image::ImageOptions,
    /// `--image-cache-max`: bytes the image cache may hold; `None`: no cap.
    pub cache_max: Option<CacheCap>,
}

/// What the agent tells beside its report.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportingSettings {
    pub notify_fd: Option<i32>,
    /// `--metrics-file`: where the metrics go every tick; `None`: nowhere.
    pub metrics_file: Option<PathBuf>,
    /// `--usage-interval`: how often what VMs use is sampled; `None`:
    /// never.
    pub usage_interval: Option<std::time::Duration>,
}

impl Config {
    /// What the host checks look at (see [`crate::provision::checklist`]).
    pub fn host(&self) -> crate::provision::checklist::Host<'_> {
        crate::provision::checklist::Host {
            guest: &self.guest,
            state_dir: &self.state.dir,
            image_root: self.images.fetch.file_root.as_deref(),
            claim: Some((&self.state.agents_dir, &self.wish)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

pub(super) fn err(msg: impl Into<String>) -> ConfigError {
    ConfigError(msg.into())
}

/// The log levels `EITRI_LOG` takes.
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The filter `EITRI_LOG` asks for (info without one), or why it is
/// refused: a word that is no level (`warning`, `verbose`) would otherwise
/// be read as the name of a module to log, and the agent would log nothing
/// at all. Takes `LEVEL` or `MODULE=LEVEL`, comma-separated.
pub fn log_filter(raw: Option<&str>) -> Result<String, ConfigError> {
    let Some(raw) = raw.map(str::trim).filter(|r| !r.is_empty()) else {
        return Ok("info".into());
    };
    let is_level = |word: &str| LEVELS.contains(&word.trim().to_ascii_lowercase().as_str());
    let bad = raw
        .split(',')
        .find(|directive| match directive.split_once('=') {
            Some((module, level)) => module.trim().is_empty() || !is_level(level),
            None => !is_level(directive),
        });
    match bad {
        None => Ok(raw.to_owned()),
        Some(bad) => Err(err(format!(
            "EITRI_LOG={raw:?}: {:?} is not a log level; give one of {} (or MODULE=LEVEL, comma-separated), or leave it unset for info",
            bad.trim(),
            LEVELS.join(", ")
        ))),
    }
}

/// Whether `--help` (or `-h`) is among a command's arguments: it wins over
/// every other argument, right or wrong.
fn asks_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "--help" || a == "-h")
}

/// Parses the arguments after the program name, with `env` for fallbacks.
pub fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let Some((verb, rest)) = args.split_first() else {
        // Nothing asked is a usage error (exit 2), not a success: a
        // supervisor's run script that lost its `run` must not look fine.
        return Err(err(format!(
            "no command given (the daemon is `eitri-agent run`)\n\n{}",
            usage()
        )));
    };
    let help = asks_help(rest);
    match verb.as_str() {
        "--version" | "-V" | "version" => Ok(Command::Version),
        "--help" | "-h" | "help" => Ok(Command::Help(usage())),
        "run" if rest.iter().any(|a| a == "--help-all") => Ok(Command::Help(run_usage(true))),
        "run" if help => Ok(Command::Help(run_usage(false))),
        "run" => run::parse(rest, env).map(|c| Command::Run(Box::new(c))),
        "check" if help => Ok(Command::Help(check_usage())),
        "check" => run::parse(rest, env).map(|c| Command::Check(Box::new(c))),
        "config" if help => Ok(Command::Help(config_usage())),
        "config" => show_config(rest, env),
        "status" if help => Ok(Command::Help(status_usage())),
        "status" => parse_status(rest, env),
        "logs" if help => Ok(Command::Help(logs_usage())),
        "events" if help => Ok(Command::Help(events_usage())),
        "top" if help => Ok(Command::Help(top_usage())),
        "top" => parse_top(rest, env),
        "events" => parse_events(rest, env),
        "logs" => parse_logs(rest, env),
        "host-key" if help => Ok(Command::Help(host_key_usage())),
        "host-key" => {
            let flags = flag_values(rest, &["state-dir"], &[])?;
            Ok(Command::HostKey {
                state_dir: state_dir_of(&flags, env),
            })
        }
        "keygen" if help => Ok(Command::Help(keygen_usage())),
        "sign" if help => Ok(Command::Help(sign_usage())),
        "keygen" => parse_keygen(rest),
        "sign" => parse_sign(rest),
        "epoch" if help => Ok(Command::Help(epoch_usage())),
        "epoch" => parse_epoch(rest, env),
        "release" if help => Ok(Command::Help(release_usage())),
        "release" => parse_release(rest, env),
        "images" if help => Ok(Command::Help(images_usage())),
        "images" => parse_images(rest, env),
        other => Err(err(format!(
            "unknown command {other:?}; the commands are run, config, check, status, logs, images list, images prune, epoch, release, keygen, sign and host-key (see eitri-agent --help)"
        ))),
    }
}

/// Splits `--flag value` and `--flag=value` pairs, refusing unknown flags
/// and flags given twice.
pub(super) fn flag_values<'a>(
    args: &'a [String],
    known: &[&str],
    switches: &[&str],
) -> Result<HashMap<String, &'a str>, ConfigError> {
    let mut out = HashMap::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let Some(body) = arg.strip_prefix("--") else {
            return Err(err(format!(
                "unexpected argument {arg:?}; flags start with --"
            )));
        };
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, v),
            None if switches.contains(&body) => (body, "true"),
            None => {
                i += 1;
                let value = args
                    .get(i)
                    .ok_or_else(|| err(format!("--{body} needs a value")))?;
                (body, value.as_str())
            }
        };
        if !known.contains(&name) && !switches.contains(&name) {
            return Err(err(format!(
                "unknown flag --{name}; see eitri-agent --help"
            )));
        }
        if out.insert(name.to_owned(), value).is_some() {
            return Err(err(format!("--{name} is given twice")));
        }
        i += 1;
    }
    Ok(out)
}

/// `200G`, `500M`, `64K` or bytes; `None` for anything else.
pub fn parse_size(raw: &str) -> Option<u64> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(split);
    let n: u64 = number.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// `500ms`, `30s`, `15m`, `24h`, or `0`.
pub fn parse_duration(raw: &str) -> Option<Duration> {
    let raw = raw.trim();
    if raw == "0" {
        return Some(Duration::ZERO);
    }
    let split = raw.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = raw.split_at(split);
    let n: u64 = number.parse().ok()?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return None,
    };
    n.checked_mul(unit_ms).map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::settings::Key;
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn run(list: &[&str], env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        match parse(&args(list), &env)? {
            Command::Run(c) => Ok(*c),
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn standalone_with_defaults() {
        let c = run(&["run", "--desired", "/etc/eitri/desired.json"], &[]).expect("valid");

        assert_eq!(
            c.source.desired,
            DesiredSource::File("/etc/eitri/desired.json".into())
        );
        assert_eq!(c.reconcile.tick, Duration::from_secs(5));
        assert_eq!(
            c.reconcile.engine.vm_timeout,
            Some(Duration::from_secs(900))
        );
    }

    #[test]
    fn file_images_are_refused_unless_an_image_root_is_named() {
        let default = run(&["run", "--desired", "/d"], &[]).expect("valid");
        let named = run(
            &["run", "--desired", "/d", "--image-root", "/srv/images"],
            &[],
        )
        .expect("valid");

        assert_eq!(default.images.fetch.file_root, None);
        assert_eq!(
            named.images.fetch.file_root,
            Some(PathBuf::from("/srv/images"))
        );
    }

    #[test]
    fn every_relative_path_flag_is_taken_from_the_working_directory() {
        let cwd = std::env::current_dir().expect("cwd");

        let c = run(
            &[
                "run",
                "--desired",
                "d.json",
                "--state-dir",
                "state",
                "--image-root",
                "images",
                "--kernel",
                "boot/vmlinux",
                "--hypervisor",
                "bin/cloud-hypervisor",
            ],
            &[],
        )
        .expect("valid");

        assert_eq!(c.images.fetch.file_root, Some(cwd.join("images")));
        assert_eq!(c.state.dir, cwd.join("state"));
        assert!(
            matches!(&c.source.desired, DesiredSource::File(f) if *f == cwd.join("d.json")),
            "{:?}",
            c.source.desired
        );
        assert_eq!(c.guest.hypervisor.kernel, Some(cwd.join("boot/vmlinux")));
        assert_eq!(c.guest.hypervisor.binary, cwd.join("bin/cloud-hypervisor"));
    }

    #[test]
    fn no_eitri_log_is_info() {
        assert_eq!(super::log_filter(None).expect("info"), "info");
    }

    #[test]
    fn a_level_and_module_levels_are_taken_as_given() {
        let filter = super::log_filter(Some("warn,eitri_agent::net=debug")).expect("taken");

        assert_eq!(filter, "warn,eitri_agent::net=debug");
    }

    #[test]
    fn a_word_that_is_no_log_level_refuses_the_start_naming_the_levels() {
        let refused =
            run(&["run", "--desired", "/d"], &[("EITRI_LOG", "warning")]).expect_err("refused");

        let said = refused.to_string();
        assert!(
            said.contains("\"warning\" is not a log level") && said.contains("warn, info"),
            "{said}"
        );
    }

    #[test]
    fn a_module_with_a_bad_level_is_refused_too() {
        assert!(super::log_filter(Some("eitri_agent=verbose")).is_err());
    }

    #[test]
    fn an_underlay_bridge_of_none_turns_guest_networking_off() {
        let c = run(
            &["run", "--desired", "/d"],
            &[("EITRI_UNDERLAY_BRIDGE", "none")],
        )
        .expect("valid");

        assert_eq!(c.guest.underlay, None);
    }

    #[test]
    fn a_bare_hypervisor_name_is_left_for_path_to_find() {
        let c = run(
            &["run", "--desired", "/d", "--hypervisor", "cloud-hypervisor"],
            &[],
        )
        .expect("valid");

        assert_eq!(c.guest.hypervisor.binary, PathBuf::from("cloud-hypervisor"));
    }

    #[test]
    fn flag_wins_over_environment() {
        let c = run(
            &["run", "--desired=/d.json", "--tick", "2s"],
            &[("EITRI_TICK", "9s"), ("EITRI_MAX_VCPUS", "64")],
        )
        .expect("valid");

        assert_eq!(c.reconcile.tick, Duration::from_secs(2));
        assert_eq!(c.reconcile.engine.caps.max_vcpus, 64);
    }

    #[test]
    fn bad_value_names_its_flag() {
        let e = run(&["run", "--desired", "/d", "--vm-timeout", "ten"], &[]).expect_err("bad");

        assert!(e.to_string().starts_with("--vm-timeout:"), "{e}");
    }

    #[test]
    fn guest_huge_pages_are_yes_or_no_and_off_unless_asked() {
        let off = run(&["run", "--desired", "/d"], &[]).expect("config");
        let e = run(
            &["run", "--desired", "/d", "--guest-hugepages", "maybe"],
            &[],
        )
        .expect_err("bad");

        assert!(!off.guest.hypervisor.hugepages);
        assert_eq!(
            e.to_string(),
            "--guest-hugepages: \"maybe\" is neither yes nor no"
        );
    }

    #[test]
    fn bad_environment_value_names_the_flag_too() {
        let e = run(&["run", "--desired", "/d"], &[("EITRI_MAX_MEM_MB", "lots")]).expect_err("bad");

        assert!(e.to_string().starts_with("--max-mem-mb:"), "{e}");
    }

    #[test]
    fn unknown_flag_is_refused() {
        let e = run(&["run", "--desired", "/d", "--frobnicate", "1"], &[]).expect_err("bad");

        assert!(e.to_string().contains("--frobnicate"), "{e}");
    }

    #[test]
    fn a_source_is_required() {
        let e = run(&["run"], &[]).expect_err("no source");

        assert!(e.to_string().contains("--desired"), "{e}");
    }

    #[test]
    fn https_without_tls_says_how_to_fix_it() {
        let e = run(&["run", "--control-plane", "https://cp"], &[]).expect_err("no tls");

        assert!(e.to_string().contains("--features tls"), "{e}");
    }

    #[test]
    fn notify_fd_must_not_be_a_standard_stream() {
        let e = run(&["run", "--desired", "/d", "--notify-fd", "1"], &[]).expect_err("stdout");

        assert!(e.to_string().starts_with("--notify-fd:"), "{e}");
    }

    #[test]
    fn sizes_take_units() {
        assert_eq!(parse_size("200G"), Some(200 << 30));
        assert_eq!(parse_size("500M"), Some(500 << 20));
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("5 apples"), None);
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("15m"), Some(Duration::from_secs(900)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("15"), None);
        assert_eq!(parse_duration("1d"), None);
    }

    #[test]
    fn help_documents_every_flag_with_its_default() {
        let help = usage();

        let all = run_usage(true);

        for s in Key::ALL.iter().map(|k| k.setting()) {
            assert!(help.contains(&format!("--{}", s.flag)), "{}", s.flag);
            assert!(all.contains(s.env), "{}", s.env);
            assert!(
                all.contains(&format!("file: {}.{}", s.section.name(), s.flag)),
                "{}",
                s.flag
            );
        }
        assert!(all.contains("[5s]"));
    }

    #[test]
    fn status_reads_the_state_dir_from_the_environment() {
        let env = [("EITRI_STATE_DIR".to_string(), "/srv/eitri".to_string())].into();

        let c = parse(&args(&["status", "--json"]), &env).expect("valid");

        assert_eq!(
            c,
            Command::Status {
                state_dir: "/srv/eitri".into(),
                json: true,
                vm_id: None,
                watch: false,
            }
        );
    }

    #[test]
    fn host_id_and_guest_dns_are_left_to_the_daemon_unless_given() {
        let c = run(&["run", "--desired", "/d"], &[]).expect("valid");

        assert_eq!(c.source.host_id, None);
        assert_eq!(c.guest.guest_dns, None);
    }

    #[test]
    fn a_state_dir_with_a_comma_is_refused() {
        let e =
            run(&["run", "--desired", "/d", "--state-dir", "/srv/a,b"], &[]).expect_err("comma");

        assert!(e.to_string().starts_with("--state-dir:"), "{e}");
    }

    #[test]
    fn the_stop_grace_defaults_to_30s_and_takes_a_duration() {
        let default = run(&["run", "--desired", "/d"], &[]).expect("valid");
        let given = run(&["run", "--desired", "/d", "--stop-grace", "5s"], &[]).expect("valid");

        assert_eq!(
            default.guest.hypervisor.stop.power_button,
            Duration::from_secs(30)
        );
        assert_eq!(
            given.guest.hypervisor.stop.power_button,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn the_metrics_file_is_off_unless_given() {
        let default = run(&["run", "--desired", "/d"], &[]).expect("valid");
        let given = run(
            &[
                "run",
                "--desired",
                "/d",
                "--metrics-file",
                "/var/lib/node_exporter/eitri.prom",
            ],
            &[],
        )
        .expect("valid");

        assert_eq!(default.reporting.metrics_file, None);
        assert_eq!(
            given.reporting.metrics_file,
            Some(PathBuf::from("/var/lib/node_exporter/eitri.prom"))
        );
    }

    #[test]
    fn logs_takes_a_vm_and_its_flags() {
        let c = parse(
            &args(&["logs", "vm-1", "--lines", "5", "--follow"]),
            &HashMap::new(),
        )
        .expect("valid");

        assert_eq!(
            c,
            Command::Logs {
                state_dir: "/var/lib/eitri".into(),
                vm_id: crate::model::Id::parse("vm-1").expect("id"),
                lines: 5,
                follow: true,
                hypervisor: false,
            }
        );
    }

    #[test]
    fn events_takes_a_vm_or_none_and_its_flags() {
        let one = parse(&args(&["events", "vm-1", "--follow"]), &HashMap::new()).expect("valid");
        let all = parse(&args(&["events", "--lines", "5"]), &HashMap::new()).expect("valid");

        assert_eq!(
            (one, all),
            (
                Command::Events {
                    state_dir: "/var/lib/eitri".into(),
                    vm_id: Some(crate::model::Id::parse("vm-1").expect("id")),
                    lines: 20,
                    follow: true,
                },
                Command::Events {
                    state_dir: "/var/lib/eitri".into(),
                    vm_id: None,
                    lines: 5,
                    follow: false,
                }
            )
        );
    }

    #[test]
    fn logs_without_a_vm_says_how_to_call_it() {
        let e = parse(&args(&["logs", "--follow"]), &HashMap::new()).expect_err("no vm");

        assert!(
            e.to_string().starts_with("usage: eitri-agent logs VM"),
            "{e}"
        );
    }
}
