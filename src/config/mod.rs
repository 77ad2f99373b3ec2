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
mod run;
mod settings;

use settings::{Key, Section};

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
}

impl Config {
    /// What the host checks look at (see [`crate::provision::checklist`]).
    pub fn host(&self) -> crate::provision::checklist::Host<'_> {
        crate::provision::checklist::Host {
            guest: &self.guest,
            state_dir: &self.state.dir,
            image_root: self.images.fetch.file_root.as_deref(),
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

/// The synopsis of every command, the top of `--help`.
const SYNOPSIS: &str = "\
usage: eitri-agent run [--config FILE] [FLAGS]   converge this host and report (the daemon)
       eitri-agent config [--config FILE] [FLAGS]   the settings run would use, and where each came from
       eitri-agent check [--config FILE] [FLAGS]    whether this host has all run needs, one line each
       eitri-agent status [VM] [--state-dir DIR] [--json] [--watch]   the last report, or one VM in detail
       eitri-agent logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]   a VM's console (or its hypervisor's log)
       eitri-agent images list|prune [--state-dir DIR]   the cached images and their VMs, or delete those no VM uses
       eitri-agent release [--state-dir DIR] [--agents-dir DIR] [--force]   end a state dir's claim on the host
       eitri-agent epoch [--state-dir DIR] [--set N]   the epoch fence a stopped agent holds, or move it
       eitri-agent keygen --id KEY-ID --out KEY-FILE  make a key that signs desired state; prints its public line
       eitri-agent sign --key KEY-FILE [--embed] FILE   sign a desired file: FILE.sig beside it, or its first line
       eitri-agent host-key [--state-dir DIR]         the key this host signs its reports with, to pin
       eitri-agent --version | --help
       eitri-agent COMMAND --help         one command's flags (run --help-all: in full)
";

/// The `--help` text: every command, then `run`'s flags by section,
/// generated from the settings table.
pub fn usage() -> String {
    let mut out = String::from(SYNOPSIS);
    out.push_str(
        "\nThe host agent of the eitri microVM platform. Give --desired FILE (standalone)\n\
         or --control-plane URL. A setting is taken from its flag, else its environment\n\
         variable, else the config file (--config FILE, $EITRI_CONFIG), else its default.\n\n",
    );
    out.push_str(&run_usage(false));
    out
}

/// `run --help` (`all`: `--help-all`): its flags section by section; in
/// full, each with its default, environment variable and config-file key.
fn run_usage(all: bool) -> String {
    let mut out = String::from(if all {
        "Flags of `run`, by section (default in brackets):\n"
    } else {
        "Flags of `run`, by section (run --help-all: each in full, with its default,\n\
         environment variable and config-file key):\n"
    });
    for section in Section::ALL {
        let (title, about) = section.title();
        out.push_str(&format!("\n{title}: {about}\n"));
        for s in Key::ALL
            .iter()
            .map(|k| k.setting())
            .filter(|s| s.section == *section)
        {
            if all {
                out.push_str(&flag_line(s.flag, s.help, s.default, Some(s.env)));
                out.push_str(&format!(
                    "  {:<26} file: {}.{}\n",
                    "",
                    section.name(),
                    s.flag
                ));
            } else {
                out.push_str(&format!("  --{:<26} {}\n", s.flag, s.help));
            }
        }
    }
    out.push_str(&format!(
        "\n  --{:<26} {}\n",
        run::CONFIG_FLAG,
        "a JSON file of these settings by section, e.g. {\"hypervisor\": {\"kernel\": \"/boot/vmlinux\"}} (or $EITRI_CONFIG)"
    ));
    out.push_str("\nDurations take a unit: 500ms, 30s, 15m, 24h.\n");
    out
}

/// One flag of `--help`: the flag and what it does, then its default and
/// its environment variable, if it has one.
fn flag_line(flag: &str, help: &str, default: &str, env: Option<&str>) -> String {
    let default = if default.is_empty() { "none" } else { default };
    let env = env.map(|e| format!(" ${e}")).unwrap_or_default();
    format!("  --{flag:<24} {help}\n  {:<26} [{default}]{env}\n", "")
}

/// `eitri-agent config`: every setting of `run` by section, its value and
/// where the value came from, as `run` would read them with these flags,
/// this environment and this file.
fn show_config(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let raw = run::Raw::read(args, env)?;
    let mut text =
        String::from("# the settings `eitri-agent run` would use, and where each came from\n");
    match &raw.file_path {
        Some(path) => text.push_str(&format!(
            "# (flag, else env, else the file {}, else default)\n",
            crate::quote::path(path)
        )),
        None => text.push_str("# (flag, else env, else default; no --config file)\n"),
    }
    for section in Section::ALL {
        text.push_str(&format!("\n[{}]\n", section.name()));
        for key in Key::ALL.iter().filter(|k| k.setting().section == *section) {
            let (value, origin) = raw.value(*key);
            let shown = if value.is_empty() {
                "-".to_owned()
            } else {
                value
            };
            text.push_str(&format!(
                "{:<28} {:<40} {}\n",
                key.setting().flag,
                shown,
                origin.name()
            ));
        }
    }
    let problem = run::build(&raw).err();
    Ok(Command::Config { text, problem })
}

fn check_usage() -> String {
    format!(
        "usage: eitri-agent check [--config FILE] [FLAGS]\n\n\
         Checks, all at once, what `run` with these settings needs of this host: the\n\
         hypervisor and its version, the boot file, /dev/kvm, /dev/net/tun, the\n\
         userfaultfd device, root, cgroups, Landlock, ip and nft, the image root,\n\
         room in the state dir. One line each: ok, warn (it runs, with less) or\n\
         FAIL (no VM can be created), with what was found or what to do. Exits 1\n\
         when a check fails, 2 when the settings are refused; changes nothing. The\n\
         agent runs the same checks when it starts, and logs what is not ok. It\n\
         takes every flag of `run`.\n\n{}",
        run_usage(false)
    )
}

fn config_usage() -> String {
    format!(
        "usage: eitri-agent config [--config FILE] [FLAGS]\n\n\
         The settings `run` would use with these flags, this environment and this\n\
         file, section by section, and where each came from (flag, env, file or\n\
         default); then whether `run` would accept them. It takes every flag of\n\
         `run`.\n\n{}",
        run_usage(false)
    )
}

/// The help of a command that reads the state dir: its synopsis, then its
/// flags (`--state-dir` first, as `run` has it).
fn verb_usage(synopsis: &str, flags: &[(&str, &str)]) -> String {
    let dir = Key::StateDir.setting();
    let mut out = format!("usage: eitri-agent {synopsis}\n\nFlags:\n");
    out.push_str(&flag_line(dir.flag, dir.help, dir.default, Some(dir.env)));
    for (flag, help) in flags {
        out.push_str(&flag_line(flag, help, "", None));
    }
    out
}

fn status_usage() -> String {
    verb_usage(
        "status [VM] [--state-dir DIR] [--json] [--watch]\n\n\
         The last report the agent wrote, or VM in detail. Reads the state dir\n\
         without its lock: works beside a running agent.",
        &[
            ("json", "the report as JSON, as the agent wrote it"),
            ("watch", "redraw every tick of the agent"),
        ],
    )
}

fn logs_usage() -> String {
    verb_usage(
        "logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]\n\n\
         A VM's serial console, or its hypervisor's own log.",
        &[
            ("lines N", "how many of the last lines to print [50]"),
            ("follow", "keep printing what is added"),
            ("hypervisor", "the hypervisor's log instead of the console"),
        ],
    )
}

fn images_usage() -> String {
    verb_usage(
        "images list [--state-dir DIR] | images prune [--state-dir DIR]\n\n\
         list: each cached base image, its size, what it holds of the disk, how\n\
         long ago it was cached and which VMs name it; it reads, so it works\n\
         beside a running agent. prune: deletes cached base images no VM record\n\
         names and the last desired state does not, beside a running agent or\n\
         not: it waits (at most 30 s) for the VMs being created to make their\n\
         root disks. A running agent also prunes by itself with --image-cache-max.",
        &[],
    )
}

fn host_key_usage() -> String {
    verb_usage(
        "host-key [--state-dir DIR]\n\n\
         Prints the line a control plane pins to check this host's reports\n\
         (`ed25519 KEY-ID BASE64`): an agent with --trusted-keys signs each report\n\
         it sends with this key, kept secret in the state dir. The key is made\n\
         the first time it is asked for, here or by the agent, and kept.",
        &[],
    )
}

fn keygen_usage() -> String {
    verb_usage(
        "keygen --id KEY-ID --out KEY-FILE\n\n\
         Makes an ed25519 key for signing desired state: its secret is written to\n\
         KEY-FILE (0600, never over an existing file), and the line each host pins\n\
         in its --trusted-keys file is printed.",
        &[
            (
                "id",
                "the key's name, as hosts pin it and signatures carry it",
            ),
            ("out", "where the secret key is written"),
        ],
    )
}

fn sign_usage() -> String {
    verb_usage(
        "sign --key KEY-FILE [--embed] FILE\n\n\
         Signs a desired-state file with the secret key from `keygen`, writing\n\
         FILE.sig beside it, or with --embed, into FILE itself (its first line),\n\
         replaced in one rename: an agent never reads the file with a signature\n\
         that is not its own. The file must name the host it is for (`host_id`):\n\
         a host refuses a signed snapshot that names no host or another, so that\n\
         one host's cannot be replayed to another.",
        &[
            ("key", "the secret key file `keygen` wrote"),
            (
                "embed",
                "the signature as FILE's own first line (signing again replaces it)",
            ),
        ],
    )
}

fn epoch_usage() -> String {
    verb_usage(
        "epoch [--state-dir DIR] [--set N]\n\n\
         Prints the epoch fence the state dir holds: the highest epoch of desired\n\
         state its agent accepted, below which a control plane's snapshots are\n\
         refused as stale. With --set, moves it to N: the way back when an answer\n\
         the agent should not have trusted (unsigned, without --trusted-keys)\n\
         raised it past the real control plane's. Refused while the agent runs (it\n\
         takes the state dir's lock); the agent accepts epoch N or later once\n\
         started again.",
        &[("set", "the epoch to move the fence to")],
    )
}

fn release_usage() -> String {
    let [agents, kvm, userfaultfd] =
        [Key::AgentsDir, Key::KvmDevice, Key::UserfaultfdDevice].map(|k| k.setting());
    verb_usage(
        "release [--state-dir DIR] [--agents-dir DIR] [--kvm-device PATH] [--force]\n\n\
         Ends the state dir's claim on this host: takes its VMM group off the\n\
         devices' ACLs, removes its cgroup roots, frees its VMM ids and removes its\n\
         record from the agents' registry. Refused while its agent runs (it takes\n\
         the state dir's lock), while processes are in its cgroups, and while it has\n\
         VMs or volumes. The state dir itself is kept; an agent started on it again\n\
         claims anew. A state dir that is deleted needs none of this: the next\n\
         agent to start on the host takes its claim back.",
        &[
            (agents.flag, agents.help),
            (kvm.flag, kvm.help),
            (userfaultfd.flag, userfaultfd.help),
            (
                "force",
                "release it with VMs or volumes left in it (their files stay; they are said)",
            ),
        ],
    )
}

/// Whether `--help` (or `-h`) is among a command's arguments: it wins over
/// every other argument, right or wrong.
fn asks_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "--help" || a == "-h")
}

/// Parses the arguments after the program name, with `env` for fallbacks.
pub fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let Some((verb, rest)) = args.split_first() else {
        return Ok(Command::Help(usage()));
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

fn parse_keygen(rest: &[String]) -> Result<Command, ConfigError> {
    let flags = flag_values(rest, &["id", "out"], &[])?;
    match (flags.get("id"), flags.get("out")) {
        (Some(id), Some(out)) => Ok(Command::Keygen {
            id: (*id).to_owned(),
            out: PathBuf::from(out),
        }),
        _ => Err(err("usage: eitri-agent keygen --id KEY-ID --out KEY-FILE")),
    }
}

fn parse_sign(rest: &[String]) -> Result<Command, ConfigError> {
    let usage = "usage: eitri-agent sign --key KEY-FILE [--embed] FILE";
    let Some((file, flags)) = rest.split_last() else {
        return Err(err(usage));
    };
    let flags = flag_values(flags, &["key"], &["embed"])?;
    match flags.get("key") {
        Some(key) if !file.starts_with("--") => Ok(Command::Sign {
            key: PathBuf::from(key),
            file: PathBuf::from(file),
            embed: flags.contains_key("embed"),
        }),
        _ => Err(err(usage)),
    }
}

fn parse_epoch(rest: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let flags = flag_values(rest, &["state-dir", "set"], &[])?;
    let set = match flags.get("set") {
        None => None,
        Some(n) => Some(n.parse::<u64>().map_err(|_| {
            err(format!(
                "--set {n:?}: not an epoch; give a whole number (0 to 18446744073709551615)"
            ))
        })?),
    };
    Ok(Command::Epoch {
        state_dir: state_dir_of(&flags, env),
        set,
    })
}

fn parse_release(rest: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let keys = [Key::AgentsDir, Key::KvmDevice, Key::UserfaultfdDevice];
    let mut known = vec!["state-dir"];
    known.extend(keys.iter().map(|k| k.setting().flag));
    let flags = flag_values(rest, &known, &["force"])?;
    Ok(Command::Release {
        state_dir: state_dir_of(&flags, env),
        agents_dir: path_of(Key::AgentsDir, &flags, env),
        devices: [Key::KvmDevice, Key::UserfaultfdDevice]
            .into_iter()
            .map(|k| path_of(k, &flags, env))
            .filter(|p| !p.as_os_str().is_empty())
            .collect(),
        force: flags.contains_key("force"),
    })
}

fn parse_images(rest: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let state_dir = |flags: &[String]| -> Result<PathBuf, ConfigError> {
        let flags = flag_values(flags, &["state-dir"], &[])?;
        Ok(state_dir_of(&flags, env))
    };
    match rest.split_first() {
        Some((sub, flags)) if sub == "prune" => Ok(Command::ImagesPrune {
            state_dir: state_dir(flags)?,
        }),
        Some((sub, flags)) if sub == "list" => Ok(Command::ImagesList {
            state_dir: state_dir(flags)?,
        }),
        _ => Err(err(
            "usage: eitri-agent images list [--state-dir DIR] | images prune [--state-dir DIR]",
        )),
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

/// The VM a command names first, if it names one.
fn vm_arg(args: &[String]) -> Result<(Option<crate::model::Id>, &[String]), ConfigError> {
    match args.split_first() {
        Some((first, rest)) if !first.starts_with("--") => crate::model::Id::parse(first)
            .map(|id| (Some(id), rest))
            .map_err(|e| err(format!("VM id {e}"))),
        _ => Ok((None, args)),
    }
}

fn parse_status(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let (vm_id, args) = vm_arg(args)?;
    let flags = flag_values(args, &["state-dir"], &["json", "watch"])?;
    Ok(Command::Status {
        state_dir: state_dir_of(&flags, env),
        json: flags.contains_key("json"),
        vm_id,
        watch: flags.contains_key("watch"),
    })
}

fn parse_logs(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let usage =
        "usage: eitri-agent logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]";
    let (Some(vm_id), args) = vm_arg(args)? else {
        return Err(err(usage));
    };
    let flags = flag_values(args, &["state-dir", "lines"], &["follow", "hypervisor"])?;
    let lines = match flags.get("lines") {
        None => 50,
        Some(n) => n
            .parse()
            .map_err(|_| err(format!("--lines: {n:?} is not a number of lines")))?,
    };
    Ok(Command::Logs {
        state_dir: state_dir_of(&flags, env),
        vm_id,
        lines,
        follow: flags.contains_key("follow"),
        hypervisor: flags.contains_key("hypervisor"),
    })
}

/// `--state-dir` of a command other than `run`, read as `run` reads it:
/// the flag, else its environment variable, else its default.
fn state_dir_of(flags: &HashMap<String, &str>, env: &HashMap<String, String>) -> PathBuf {
    path_of(Key::StateDir, flags, env)
}

/// A path setting of `run` given to another command, read as `run` reads
/// it (the flag, else its environment variable, else its default).
fn path_of(key: Key, flags: &HashMap<String, &str>, env: &HashMap<String, String>) -> PathBuf {
    let setting = key.setting();
    PathBuf::from(
        flags
            .get(setting.flag)
            .map(|s| s.to_string())
            .or_else(|| env.get(setting.env).cloned())
            .unwrap_or_else(|| setting.default.into()),
    )
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
    fn logs_without_a_vm_says_how_to_call_it() {
        let e = parse(&args(&["logs", "--follow"]), &HashMap::new()).expect_err("no vm");

        assert!(
            e.to_string().starts_with("usage: eitri-agent logs VM"),
            "{e}"
        );
    }
}
