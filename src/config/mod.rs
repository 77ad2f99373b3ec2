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
use crate::reconcile::{EngineConfig, HostCaps};
use crate::source::ControlPlane;

mod settings;

use settings::SETTINGS;

/// What the binary was asked to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Run(Box<Config>),
    Status {
        state_dir: PathBuf,
        json: bool,
    },
    /// Delete cached images no VM record names.
    ImagesPrune {
        state_dir: PathBuf,
    },
    Version,
    Help,
}

/// Where desired state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DesiredSource {
    File(PathBuf),
    ControlPlane(ControlPlane),
}

/// The daemon's validated settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub state_dir: PathBuf,
    pub source: DesiredSource,
    pub host_id: String,
    pub tick: Duration,
    pub backoff_max: Duration,
    pub shutdown_grace: Duration,
    pub notify_fd: Option<i32>,
    /// Bounds on one snapshot, from either source.
    pub limits: crate::source::SnapshotLimits,
    /// An HTTP proxy for the control plane and image downloads; never taken
    /// from the environment.
    pub proxy: Option<String>,
    pub guest: GuestBoot,
    pub engine: EngineConfig,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err(msg: impl Into<String>) -> ConfigError {
    ConfigError(msg.into())
}

/// The `--help` text, generated from the settings table.
pub fn usage() -> String {
    let mut out = String::from(
        "usage: eitri-agent run [FLAGS]        converge this host and report (the daemon)\n\
         \x20      eitri-agent status [--state-dir DIR] [--json]   show the last report\n\
         \x20      eitri-agent images prune [--state-dir DIR]      delete cached images no VM uses\n\
         \x20      eitri-agent --version | --help\n\n\
         The host agent of the eitri microVM platform. Give --desired FILE (standalone)\n\
         or --control-plane URL. Every flag may instead be set by the environment\n\
         variable shown; the flag wins.\n\nFlags of `run` (default in brackets):\n",
    );
    for s in SETTINGS {
        let default = if s.default.is_empty() {
            "none"
        } else {
            s.default
        };
        out.push_str(&format!(
            "  --{:<24} {}\n  {:<26} [{default}] ${}\n",
            s.flag, s.help, "", s.env
        ));
    }
    out.push_str("\nDurations take a unit: 500ms, 30s, 15m, 24h.\n");
    out
}

/// Parses the arguments after the program name, with `env` for fallbacks.
pub fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let Some((verb, rest)) = args.split_first() else {
        return Ok(Command::Help);
    };
    match verb.as_str() {
        "--version" | "-V" | "version" => Ok(Command::Version),
        "--help" | "-h" | "help" => Ok(Command::Help),
        "run" => parse_run(rest, env).map(|c| Command::Run(Box::new(c))),
        "status" => parse_status(rest, env),
        "images" => match rest.split_first() {
            Some((sub, flags)) if sub == "prune" => {
                let flags = flag_values(flags, &["state-dir"], &[])?;
                Ok(Command::ImagesPrune {
                    state_dir: state_dir_of(&flags, env),
                })
            }
            _ => Err(err("usage: eitri-agent images prune [--state-dir DIR]")),
        },
        other => Err(err(format!(
            "unknown command {other:?}; the commands are run, status and images prune (see eitri-agent --help)"
        ))),
    }
}

/// Splits `--flag value` and `--flag=value` pairs, refusing unknown flags
/// and flags given twice.
fn flag_values<'a>(
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

fn parse_status(args: &[String], env: &HashMap<String, String>) -> Result<Command, ConfigError> {
    let flags = flag_values(args, &["state-dir"], &["json"])?;
    Ok(Command::Status {
        state_dir: state_dir_of(&flags, env),
        json: flags.contains_key("json"),
    })
}

fn state_dir_of(flags: &HashMap<String, &str>, env: &HashMap<String, String>) -> PathBuf {
    PathBuf::from(
        flags
            .get("state-dir")
            .map(|s| s.to_string())
            .or_else(|| env.get("EITRI_STATE_DIR").cloned())
            .unwrap_or_else(|| "/var/lib/eitri".into()),
    )
}

/// Resolved raw values: flag, else environment, else default.
struct Raw<'a> {
    flags: HashMap<String, &'a str>,
    env: &'a HashMap<String, String>,
}

impl Raw<'_> {
    fn get(&self, flag: &str) -> String {
        let setting = SETTINGS.iter().find(|s| s.flag == flag);
        if let Some(v) = self.flags.get(flag) {
            return (*v).to_owned();
        }
        match setting {
            Some(s) => self
                .env
                .get(s.env)
                .cloned()
                .unwrap_or_else(|| s.default.to_owned()),
            None => String::new(),
        }
    }

    fn optional(&self, flag: &str) -> Option<String> {
        Some(self.get(flag)).filter(|v| !v.trim().is_empty())
    }

    fn duration(&self, flag: &str) -> Result<Duration, ConfigError> {
        let raw = self.get(flag);
        parse_duration(&raw).ok_or_else(|| {
            err(format!(
                "--{flag}: {raw:?} is not a duration; write a number with a unit, e.g. 500ms, 30s, 15m, 24h"
            ))
        })
    }

    fn number(&self, flag: &str) -> Result<u64, ConfigError> {
        let raw = self.get(flag);
        raw.trim()
            .parse()
            .map_err(|_| err(format!("--{flag}: {raw:?} is not a whole number")))
    }
}

fn parse_run(args: &[String], env: &HashMap<String, String>) -> Result<Config, ConfigError> {
    let known: Vec<&str> = SETTINGS.iter().map(|s| s.flag).collect();
    let raw = Raw {
        flags: flag_values(args, &known, &[])?,
        env,
    };

    let state_dir = PathBuf::from(raw.get("state-dir"));
    if state_dir.as_os_str().is_empty() {
        return Err(err(
            "--state-dir is empty; give the directory the agent keeps its state in",
        ));
    }
    let source = match (raw.optional("desired"), raw.optional("control-plane")) {
        (Some(file), None) => DesiredSource::File(PathBuf::from(file)),
        (None, Some(url)) => DesiredSource::ControlPlane(control_plane(&raw, &url)?),
        (Some(_), Some(_)) => {
            return Err(err(
                "--desired and --control-plane are both set; choose one",
            ));
        }
        (None, None) => {
            return Err(err(
                "no desired state: give --desired FILE (standalone) or --control-plane URL",
            ));
        }
    };
    let tick = raw.duration("tick")?;
    if tick.is_zero() {
        return Err(err("--tick must be longer than 0"));
    }
    let notify_fd = match raw.optional("notify-fd") {
        None => None,
        Some(v) => match v.trim().parse::<i32>() {
            Ok(fd) if fd >= 3 => Some(fd),
            _ => {
                return Err(err(format!(
                    "--notify-fd: {v:?} is not a file descriptor of 3 or more"
                )));
            }
        },
    };
    let tap_prefix = raw.get("tap-prefix");
    if tap_prefix.is_empty()
        || tap_prefix.len() > 8
        || !tap_prefix.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(err(format!(
            "--tap-prefix: {tap_prefix:?} must be 1-8 letters or digits (tap names are at most 15 bytes)"
        )));
    }
    let underlay = match raw.optional("underlay-bridge") {
        None => None,
        Some(bridge) => {
            if bridge.len() > 15
                || !bridge
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(err(format!(
                    "--underlay-bridge: {bridge:?} is not a link name (1-15 letters, digits, - or _)"
                )));
            }
            let subnet = crate::net::addresses::Subnet::parse(&raw.get("underlay-subnet"))
                .map_err(|e| err(format!("--underlay-subnet: {e}")))?;
            Some(crate::net::underlay::UnderlayConfig {
                bridge,
                subnet,
                table: "eitri".into(),
            })
        }
    };
    let guest_dns = match raw.optional("guest-dns") {
        Some(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .map_err(|_| err(format!("--guest-dns: {s:?} is not an IPv4 address")))
            })
            .collect::<Result<Vec<_>, _>>()?,
        None => host_resolvers(),
    };
    let mut host_networks = HashMap::new();
    for pair in raw
        .optional("host-network")
        .iter()
        .flat_map(|v| v.split(','))
    {
        let Some((name, bridge)) = pair.trim().split_once('=') else {
            return Err(err(format!("--host-network: {pair:?} is not NAME=BRIDGE")));
        };
        crate::model::Id::parse(name)
            .map_err(|e| err(format!("--host-network: network name {e}")))?;
        if bridge.is_empty() || bridge.len() > 15 {
            return Err(err(format!(
                "--host-network: {bridge:?} is not a link name"
            )));
        }
        host_networks.insert(name.to_owned(), bridge.to_owned());
    }
    let guest = GuestBoot {
        underlay,
        guest_dns,
        host_networks,
        hypervisor: PathBuf::from(raw.get("hypervisor")),
        run_dir: PathBuf::from(raw.get("run-dir")),
        tap_prefix,
        kernel: raw.optional("kernel").map(PathBuf::from),
        firmware: raw.optional("firmware").map(PathBuf::from),
        cmdline: raw.get("cmdline"),
    };
    if guest.kernel.is_some() && guest.firmware.is_some() {
        return Err(err(
            "--kernel and --firmware are both set; a guest boots one or the other",
        ));
    }
    let vm_timeout = raw.duration("vm-timeout")?;
    let max_create_attempts = raw.number("max-create-attempts")?;
    if !(1..=1000).contains(&max_create_attempts) {
        return Err(err("--max-create-attempts must be between 1 and 1000"));
    }
    let engine = EngineConfig {
        vm_timeout: (!vm_timeout.is_zero()).then_some(vm_timeout),
        tombstone_grace: raw.duration("tombstone-grace")?,
        vanish_grace: raw.duration("vanish-grace")?,
        max_create_attempts: max_create_attempts as u32,
        max_concurrent_creates: raw.number("max-concurrent-creates")? as usize,
        caps: HostCaps {
            max_vcpus: raw.number("max-vcpus")?,
            max_mem_mb: raw.number("max-mem-mb")?,
            max_disk_gb: raw.number("max-disk-gb")?,
        },
        ..EngineConfig::default()
    };
    Ok(Config {
        state_dir,
        source,
        host_id: raw
            .optional("host-id")
            .map_or_else(default_host_id, |h| h.trim().to_owned()),
        tick,
        backoff_max: raw.duration("backoff-max")?,
        shutdown_grace: raw.duration("shutdown-grace")?,
        notify_fd,
        limits: snapshot_limits(&raw)?,
        proxy: proxy(&raw)?,
        guest,
        engine,
    })
}

fn control_plane(raw: &Raw<'_>, url: &str) -> Result<ControlPlane, ConfigError> {
    let url = url.trim().trim_end_matches('/');
    let tls = cfg!(feature = "tls");
    let scheme_ok = url.starts_with("http://") || (tls && url.starts_with("https://"));
    if !scheme_ok {
        return Err(err(if url.starts_with("https://") {
            format!(
                "--control-plane: {url:?} needs TLS, and this build has none; rebuild with --features tls or use http://"
            )
        } else {
            format!("--control-plane: {url:?} is not an http:// URL")
        }));
    }
    Ok(ControlPlane {
        base_url: url.to_owned(),
        token_file: raw.optional("token-file").map(PathBuf::from),
        connect_timeout: raw.duration("connect-timeout")?,
        request_timeout: raw.duration("request-timeout")?,
    })
}

fn proxy(raw: &Raw<'_>) -> Result<Option<String>, ConfigError> {
    let proxy = raw.optional("proxy");
    if let Some(p) = &proxy {
        ureq::Proxy::new(p).map_err(|e| {
            err(format!(
                "--proxy: {p:?} is not a proxy URL ({e}); write http://HOST:PORT"
            ))
        })?;
    }
    Ok(proxy)
}

fn snapshot_limits(raw: &Raw<'_>) -> Result<crate::source::SnapshotLimits, ConfigError> {
    let max_bytes = raw.number("max-response-bytes")?;
    if max_bytes < 1024 {
        return Err(err("--max-response-bytes must be at least 1024"));
    }
    let count = |flag: &str| -> Result<usize, ConfigError> {
        match raw.number(flag)? {
            0 => Err(err(format!("--{flag} must be at least 1"))),
            n => usize::try_from(n).map_err(|_| err(format!("--{flag} is too large"))),
        }
    };
    Ok(crate::source::SnapshotLimits {
        max_bytes,
        max_vms: count("max-vms")?,
        max_volumes: count("max-volumes")?,
    })
}

/// The host's own DNS servers, less loopback ones a guest cannot reach.
fn host_resolvers() -> Vec<std::net::Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .filter_map(|v| v.trim().parse::<std::net::Ipv4Addr>().ok())
        .filter(|ip| !ip.is_loopback())
        .collect()
}

/// `/etc/machine-id`, else the kernel's hostname, else "unknown-host".
fn default_host_id() -> String {
    ["/etc/machine-id", "/proc/sys/kernel/hostname"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_owned())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
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
            c.source,
            DesiredSource::File("/etc/eitri/desired.json".into())
        );
        assert_eq!(c.tick, Duration::from_secs(5));
        assert_eq!(c.engine.vm_timeout, Some(Duration::from_secs(900)));
    }

    #[test]
    fn flag_wins_over_environment() {
        let c = run(
            &["run", "--desired=/d.json", "--tick", "2s"],
            &[("EITRI_TICK", "9s"), ("EITRI_MAX_VCPUS", "64")],
        )
        .expect("valid");

        assert_eq!(c.tick, Duration::from_secs(2));
        assert_eq!(c.engine.caps.max_vcpus, 64);
    }

    #[test]
    fn bad_value_names_its_flag() {
        let e = run(&["run", "--desired", "/d", "--vm-timeout", "ten"], &[]).expect_err("bad");

        assert!(e.to_string().starts_with("--vm-timeout:"), "{e}");
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

        for s in SETTINGS {
            assert!(help.contains(&format!("--{}", s.flag)), "{}", s.flag);
            assert!(help.contains(s.env), "{}", s.env);
        }
        assert!(help.contains("[5s]"));
    }

    #[test]
    fn status_reads_the_state_dir_from_the_environment() {
        let env = [("EITRI_STATE_DIR".to_string(), "/srv/eitri".to_string())].into();

        let c = parse(&args(&["status", "--json"]), &env).expect("valid");

        assert_eq!(
            c,
            Command::Status {
                state_dir: "/srv/eitri".into(),
                json: true
            }
        );
    }
}
