//! `run`'s settings: each raw value (flag, else environment, else the
//! config file, else default) is looked up by [`Key`] through the reader of
//! its [`Section`], then checked and built into one typed part of the
//! [`Config`] by the function that owns that section: where desired state
//! comes from, where state is kept, how the engine reconciles, the guests'
//! network, images, the hypervisor, its jail, limits and reporting. A part
//! that needs another section's value takes it as built, typed, never by
//! reading that section's text. Nothing here reads the host but the files
//! named (the config file, the trusted keys); what must be discovered
//! there is left `None` for the daemon.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::file::FileSettings;
use super::settings::{Key, Section};
use super::{CacheCap, Config, ConfigError, DesiredSource, err, flag_values, parse_duration};
use crate::image::{ImageOptions, Reach};
use crate::model::{Cidr, IpRange};
use crate::net::addresses::Subnet;
use crate::net::underlay::{Egress, UnderlayConfig};
use crate::provision::hugepages;
use crate::provision::supervise::StopTimeouts;
use crate::provision::{Confinement, GuestBoot, GuestLimits, HypervisorSettings, Piece};
use crate::reconcile::{EngineConfig, HostCaps};
use crate::source::{ControlPlane, SnapshotLimits};

/// Parses `run`'s arguments, with `env` for fallbacks.
pub(super) fn parse(args: &[String], env: &HashMap<String, String>) -> Result<Config, ConfigError> {
    build(&Raw::read(args, env)?)
}

/// The config, each part built by the one function that reads its
/// section; a part that needs another's value takes it typed, as built.
pub(super) fn build(raw: &Raw<'_>) -> Result<Config, ConfigError> {
    super::log_filter(raw.env.get("EITRI_LOG").map(String::as_str))?;
    let state = state(&raw.section(Section::State))?;
    let desired = &raw.section(Section::Source);
    let source = source(desired)?;
    let trust = trust(desired, &source)?;
    let proxy = proxy(desired)?;
    let network = network(&raw.section(Section::Network))?;
    let images = &raw.section(Section::Images);
    let limits = &raw.section(Section::Limits);
    let (confinement, jail_wish) = confinement(&raw.section(Section::Jail))?;
    let reconcile = &raw.section(Section::Reconcile);
    let reporting = &raw.section(Section::Reporting);
    let hypervisor = hypervisor(&raw.section(Section::Hypervisor))?;
    Ok(Config {
        wish: crate::state::claim::Wish {
            ids: jail_wish.ids,
            cgroup_root: jail_wish.cgroup_root,
            default_state_dir: state.is_default,
            network: network
                .underlay
                .clone()
                .map(|u| crate::state::claim::Network {
                    subnet: u.subnet.cidr(),
                    bridge: u.bridge,
                    tap_prefix: u.tap_prefix,
                    table: u.table,
                }),
        },
        state: super::StateSettings {
            dir: state.dir,
            agents_dir: state.agents_dir,
        },
        images: super::ImageSettings {
            fetch: image_options(images, proxy.clone(), &network.deny)?,
            cache_max: image_cache_max(images)?,
        },
        source: super::SourceSettings {
            desired: source,
            host_id: desired.optional(Key::HostId).map(|h| h.trim().to_owned()),
            backoff_max: desired.duration(Key::BackoffMax)?,
            limits: snapshot_limits(desired)?,
            trust,
            proxy,
        },
        reconcile: super::ReconcileSettings {
            tick: tick(reconcile)?,
            shutdown_grace: reconcile.duration(Key::ShutdownGrace)?,
            engine: engine(reconcile, host_caps(limits, &hypervisor)?)?,
        },
        guest: guest_boot(hypervisor, network, confinement, limits)?,
        reporting: super::ReportingSettings {
            notify_fd: notify_fd(reporting)?,
            metrics_file: reporting.optional_path(Key::MetricsFile),
        },
    })
}

/// Where a setting's value came from; the later in this list wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Default,
    File,
    Env,
    Flag,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::Default => "default",
            Origin::File => "file",
            Origin::Env => "env",
            Origin::Flag => "flag",
        }
    }
}

/// The flag (and variable) naming the config file: not a setting of the
/// table, since a file cannot name itself.
pub(super) const CONFIG_FLAG: &str = "config";
pub(super) const CONFIG_ENV: &str = "EITRI_CONFIG";

/// Raw values of `run`'s settings: flag, else environment, else the
/// config file, else default.
pub(super) struct Raw<'a> {
    flags: HashMap<String, &'a str>,
    env: &'a HashMap<String, String>,
    file: FileSettings,
    /// The config file, if one was named.
    pub file_path: Option<PathBuf>,
    /// Settings a section's builder read although they are another
    /// section's: none, or a test fails (see the tests below).
    strays: RefCell<Vec<(Section, Key)>>,
}

impl<'a> Raw<'a> {
    /// The flags in `args`, the environment, and the config file they name.
    pub fn read(
        args: &'a [String],
        env: &'a HashMap<String, String>,
    ) -> Result<Raw<'a>, ConfigError> {
        let mut known: Vec<&str> = Key::ALL.iter().map(|k| k.setting().flag).collect();
        known.push(CONFIG_FLAG);
        let mut flags = flag_values(args, &known, &[])?;
        let file_path = flags
            .remove(CONFIG_FLAG)
            .map(str::to_owned)
            .or_else(|| env.get(CONFIG_ENV).cloned())
            .filter(|p| !p.trim().is_empty())
            .map(PathBuf::from);
        let file = match &file_path {
            Some(path) => FileSettings::read(path)?,
            None => FileSettings::default(),
        };
        Ok(Raw {
            flags,
            env,
            file,
            file_path,
            strays: RefCell::new(Vec::new()),
        })
    }

    /// `key`'s value and where it came from.
    pub fn value(&self, key: Key) -> (String, Origin) {
        let setting = key.setting();
        if let Some(v) = self.flags.get(setting.flag) {
            ((*v).to_owned(), Origin::Flag)
        } else if let Some(v) = self.env.get(setting.env) {
            (v.clone(), Origin::Env)
        } else if let Some(v) = self.file.values.get(&key) {
            (v.clone(), Origin::File)
        } else {
            (setting.default.to_owned(), Origin::Default)
        }
    }

    /// The reader of one section's settings.
    pub fn section(&self, section: Section) -> Part<'_> {
        Part { raw: self, section }
    }

    #[cfg(test)]
    fn strays(&self) -> Vec<(Section, Key)> {
        self.strays.borrow().clone()
    }
}

/// One section's settings, as its builder reads them. A read of another
/// section's key is answered (the agent must not fail over its own
/// wiring) and noted, for the test that keeps each section read in one
/// place.
pub(super) struct Part<'r> {
    raw: &'r Raw<'r>,
    section: Section,
}

impl Part<'_> {
    fn get(&self, key: Key) -> String {
        self.note(key);
        self.raw.value(key).0
    }

    fn note(&self, key: Key) {
        if key.setting().section != self.section {
            self.raw.strays.borrow_mut().push((self.section, key));
        }
    }

    /// Whether the operator set `key` (by flag, environment or file).
    fn given(&self, key: Key) -> bool {
        self.note(key);
        self.raw.value(key).1 != Origin::Default
    }

    /// The value, `None` when it is empty or blank.
    fn optional(&self, key: Key) -> Option<String> {
        Some(self.get(key)).filter(|v| !v.trim().is_empty())
    }

    /// A path setting, made absolute (see [`absolute`]).
    fn path(&self, key: Key) -> PathBuf {
        absolute(self.get(key))
    }

    fn optional_path(&self, key: Key) -> Option<PathBuf> {
        self.optional(key).map(absolute)
    }

    fn duration(&self, key: Key) -> Result<Duration, ConfigError> {
        let raw = self.get(key);
        parse_duration(&raw).ok_or_else(|| {
            err(format!(
                "--{}: {raw:?} is not a duration; write a number with a unit, e.g. 500ms, 30s, 15m, 24h",
                key.setting().flag
            ))
        })
    }

    fn yes_no(&self, key: Key) -> Result<bool, ConfigError> {
        match self.get(key).trim() {
            "yes" | "true" => Ok(true),
            "no" | "false" => Ok(false),
            other => Err(err(format!(
                "--{}: {other:?} is neither yes nor no",
                key.setting().flag
            ))),
        }
    }

    fn number(&self, key: Key) -> Result<u64, ConfigError> {
        let raw = self.get(key);
        raw.trim().parse().map_err(|_| {
            err(format!(
                "--{}: {raw:?} is not a whole number",
                key.setting().flag
            ))
        })
    }

    /// A comma-separated list of IPv4 ranges.
    fn ranges(&self, key: Key) -> Result<Vec<Cidr>, ConfigError> {
        Cidr::parse_list(&self.get(key)).map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    }

    /// IPv4 and IPv6 ranges alike.
    fn ip_ranges(&self, key: Key) -> Result<Vec<IpRange>, ConfigError> {
        IpRange::parse_list(&self.get(key))
            .map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    }
}

/// A directory the VMM is told about as `path=…` in an option list, which
/// cloud-hypervisor splits on commas.
fn no_comma(key: Key, path: &str) -> Result<(), ConfigError> {
    if path.contains(',') {
        return Err(err(format!(
            "--{}: {path:?} has a comma, which cloud-hypervisor reads as the end of a path; choose a directory without one",
            key.setting().flag
        )));
    }
    Ok(())
}

/// The state section as built.
struct State {
    dir: PathBuf,
    agents_dir: PathBuf,
    /// The state dir is the default one (its claim then keeps the
    /// historic ids and cgroup root).
    is_default: bool,
}

/// `path` from the agent's working directory when relative, so every
/// path flag means the same whatever reads it later: a hypervisor in its
/// own mount namespace, a child in another directory.
fn absolute(path: String) -> PathBuf {
    std::path::absolute(&path).unwrap_or_else(|_| PathBuf::from(path))
}

/// A program: a bare name is found on `PATH` as it is; a path is made
/// absolute like any other.
fn program(name: String) -> PathBuf {
    if name.contains('/') {
        absolute(name)
    } else {
        PathBuf::from(name)
    }
}

fn state(raw: &Part<'_>) -> Result<State, ConfigError> {
    let dir = raw.get(Key::StateDir);
    if dir.is_empty() {
        return Err(err(
            "--state-dir is empty; give the directory the agent keeps its state in",
        ));
    }
    no_comma(Key::StateDir, &dir)?;
    Ok(State {
        is_default: dir == Key::StateDir.setting().default,
        dir: absolute(dir),
        agents_dir: raw.path(Key::AgentsDir),
    })
}

fn tick(raw: &Part<'_>) -> Result<Duration, ConfigError> {
    let tick = raw.duration(Key::Tick)?;
    if tick.is_zero() {
        return Err(err("--tick must be longer than 0"));
    }
    Ok(tick)
}

fn notify_fd(raw: &Part<'_>) -> Result<Option<i32>, ConfigError> {
    let Some(v) = raw.optional(Key::NotifyFd) else {
        return Ok(None);
    };
    match v.trim().parse::<i32>() {
        Ok(fd) if fd >= 3 => Ok(Some(fd)),
        _ => Err(err(format!(
            "--notify-fd: {v:?} is not a file descriptor of 3 or more"
        ))),
    }
}

// ── where desired state comes from ──────────────────────────────────────

fn source(raw: &Part<'_>) -> Result<DesiredSource, ConfigError> {
    match (raw.optional(Key::Desired), raw.optional(Key::ControlPlane)) {
        (Some(file), None) => Ok(DesiredSource::File(absolute(file))),
        (None, Some(url)) => control_plane(raw, &url).map(DesiredSource::ControlPlane),
        (Some(_), Some(_)) => Err(err(
            "--desired and --control-plane are both set; choose one",
        )),
        (None, None) => Err(err(
            "no desired state: give --desired FILE (standalone) or --control-plane URL",
        )),
    }
}

/// `--trusted-keys`, read and checked at start; with them, a token is not
/// sent in clear unless `--token-in-clear yes` says so: signing proves the
/// control plane to the agent, and a token an eavesdropper copies would
/// let it speak for the agent.
fn trust(
    raw: &Part<'_>,
    source: &DesiredSource,
) -> Result<Option<crate::trust::TrustedKeys>, ConfigError> {
    let in_clear = raw.yes_no(Key::TokenInClear)?;
    let Some(path) = raw.optional_path(Key::TrustedKeys) else {
        return Ok(None);
    };
    let keys =
        crate::trust::TrustedKeys::load(&path).map_err(|e| err(format!("--trusted-keys: {e}")))?;
    if let DesiredSource::ControlPlane(cp) = source
        && cp.token_file.is_some()
        && cp.base_url.starts_with("http://")
        && !in_clear
    {
        return Err(err(
            "--trusted-keys with an http:// control plane and --token-file: the token would travel in clear, where anyone on the path can copy it and speak as this agent. Use https:// (a build with --features tls), drop --token-file, or accept it with --token-in-clear yes",
        ));
    }
    Ok(Some(keys))
}

fn control_plane(raw: &Part<'_>, url: &str) -> Result<ControlPlane, ConfigError> {
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
        token_file: raw.optional_path(Key::TokenFile),
        connect_timeout: raw.duration(Key::ConnectTimeout)?,
        request_timeout: raw.duration(Key::RequestTimeout)?,
    })
}

fn proxy(raw: &Part<'_>) -> Result<Option<String>, ConfigError> {
    let proxy = raw.optional(Key::Proxy);
    if let Some(p) = &proxy {
        ureq::Proxy::new(p).map_err(|e| {
            err(format!(
                "--proxy: {p:?} is not a proxy URL ({e}); write http://HOST:PORT"
            ))
        })?;
    }
    Ok(proxy)
}

/// How images are fetched: the proxy is the control plane's, and what
/// guests may not reach, downloads may not either (unless `--image-allow`).
fn image_options(
    raw: &Part<'_>,
    proxy: Option<String>,
    guest_deny: &[IpRange],
) -> Result<ImageOptions, ConfigError> {
    let file_root = raw.optional_path(Key::ImageRoot);
    let stall = raw.duration(Key::ImageStallTimeout)?;
    if stall.is_zero() {
        return Err(err(
            "--image-stall-timeout: 0 would fail every download; give a duration such as 60s",
        ));
    }
    let deadline = raw.duration(Key::ImageDownloadTimeout)?;
    if deadline < stall {
        return Err(err(
            "--image-download-timeout is shorter than --image-stall-timeout: every slow download would fail; give it hours (1h)",
        ));
    }
    Ok(ImageOptions {
        proxy,
        file_root,
        stall,
        deadline,
        min_rate: raw.number(Key::ImageMinRate)?.saturating_mul(1024),
        reach: Reach {
            deny: guest_deny.to_vec(),
            allow: raw.ip_ranges(Key::ImageAllow)?,
        },
    })
}

fn image_cache_max(raw: &Part<'_>) -> Result<Option<CacheCap>, ConfigError> {
    let text = raw.get(Key::ImageCacheMax);
    if let Some(percent) = text.trim().strip_suffix('%') {
        return match percent.trim().parse::<u8>() {
            Ok(0) => Ok(None),
            Ok(p) if p <= 100 => Ok(Some(CacheCap::Percent(p))),
            _ => Err(err(format!(
                "--image-cache-max: {text:?} is not a share of the filesystem; write 1% to 100%"
            ))),
        };
    }
    match super::parse_size(&text) {
        Some(0) => Ok(None),
        Some(n) => Ok(Some(CacheCap::Bytes(n))),
        None => Err(err(format!(
            "--image-cache-max: {text:?} is not a size; write 200G, 500M, 25% or 0 for no cap"
        ))),
    }
}

fn snapshot_limits(raw: &Part<'_>) -> Result<SnapshotLimits, ConfigError> {
    let max_bytes = raw.number(Key::MaxResponseBytes)?;
    if max_bytes < 1024 {
        return Err(err("--max-response-bytes must be at least 1024"));
    }
    let count = |key: Key| -> Result<usize, ConfigError> {
        let flag = key.setting().flag;
        match raw.number(key)? {
            0 => Err(err(format!("--{flag} must be at least 1"))),
            n => usize::try_from(n).map_err(|_| err(format!("--{flag} is too large"))),
        }
    };
    Ok(SnapshotLimits {
        max_bytes,
        max_vms: count(Key::MaxVms)?,
        max_volumes: count(Key::MaxVolumes)?,
    })
}

// ── the guests' network ─────────────────────────────────────────────────

/// The network section as built.
struct Network {
    /// `None` when guest networking is off.
    underlay: Option<UnderlayConfig>,
    tap_prefix: String,
    guest_dns: Option<Vec<Ipv4Addr>>,
    host_networks: HashMap<String, String>,
    /// `--guest-deny`, which image downloads obey too (its IPv6 ranges
    /// are theirs alone: the guests' network is IPv4).
    deny: Vec<IpRange>,
}

fn network(raw: &Part<'_>) -> Result<Network, ConfigError> {
    let tap_prefix = tap_prefix(raw)?;
    let deny = raw.ip_ranges(Key::GuestDeny)?;
    let guest_deny: Vec<Cidr> = deny.iter().filter_map(IpRange::v4).collect();
    Ok(Network {
        underlay: underlay(raw, &tap_prefix, &guest_deny)?,
        guest_dns: guest_dns(raw)?,
        host_networks: host_networks(raw)?,
        tap_prefix,
        deny,
    })
}

fn tap_prefix(raw: &Part<'_>) -> Result<String, ConfigError> {
    let tap_prefix = raw.get(Key::TapPrefix);
    if tap_prefix.is_empty()
        || tap_prefix.len() > 8
        || !tap_prefix.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(err(format!(
            "--tap-prefix: {tap_prefix:?} must be 1-8 letters or digits (tap names are at most 15 bytes)"
        )));
    }
    Ok(tap_prefix)
}

/// The `--underlay-bridge` that turns guest networking off, like empty.
const NO_BRIDGE: &str = "none";

fn underlay(
    raw: &Part<'_>,
    tap_prefix: &str,
    deny: &[Cidr],
) -> Result<Option<UnderlayConfig>, ConfigError> {
    // `none` says it where an empty value cannot be given: an empty
    // env-dir file unsets its variable under s6-envdir and chpst (and the
    // systemd unit), which gives the default.
    let Some(bridge) = raw.optional(Key::UnderlayBridge).filter(|b| b != NO_BRIDGE) else {
        return Ok(None);
    };
    if bridge.len() > 15
        || !bridge
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(err(format!(
            "--underlay-bridge: {bridge:?} is not a link name (1-15 letters, digits, - or _)"
        )));
    }
    let subnet = Subnet::parse(&raw.get(Key::UnderlaySubnet))
        .map_err(|e| err(format!("--underlay-subnet: {e}")))?;
    Ok(Some(UnderlayConfig {
        bridge,
        subnet,
        table: "eitri".into(),
        tap_prefix: tap_prefix.to_owned(),
        egress: Egress {
            deny: deny.to_vec(),
            allow: raw.ranges(Key::GuestAllow)?,
            dns: Vec::new(),
        },
        publish: crate::model::PortRange::parse(&raw.get(Key::PublishPorts))
            .map_err(|e| err(format!("--publish-ports: {e}")))?,
    }))
}

/// `--guest-dns`; `None` when not given: the daemon then tells guests the
/// host's own resolvers.
fn guest_dns(raw: &Part<'_>) -> Result<Option<Vec<Ipv4Addr>>, ConfigError> {
    let Some(list) = raw.optional(Key::GuestDns) else {
        return Ok(None);
    };
    list.split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| err(format!("--guest-dns: {s:?} is not an IPv4 address")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn host_networks(raw: &Part<'_>) -> Result<HashMap<String, String>, ConfigError> {
    let mut networks = HashMap::new();
    for pair in raw
        .optional(Key::HostNetwork)
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
        networks.insert(name.to_owned(), bridge.to_owned());
    }
    Ok(networks)
}

// ── the hypervisor, its jail, and what a guest may use ──────────────────

/// How guests boot: the network, hypervisor, jail and limits sections,
/// each as built, shared with the backend that uses them.
fn guest_boot(
    hypervisor: HypervisorSettings,
    network: Network,
    confinement: Confinement,
    limits: &Part<'_>,
) -> Result<GuestBoot, ConfigError> {
    Ok(GuestBoot {
        underlay: network.underlay,
        guest_dns: network.guest_dns,
        host_networks: network.host_networks,
        tap_prefix: network.tap_prefix,
        hypervisor: Arc::new(hypervisor),
        confinement: Arc::new(confinement),
        limits: Arc::new(guest_limits(limits)?),
    })
}

fn hypervisor(raw: &Part<'_>) -> Result<HypervisorSettings, ConfigError> {
    let run_dir = raw.get(Key::RunDir);
    no_comma(Key::RunDir, &run_dir)?;
    let kernel = raw.optional_path(Key::Kernel);
    let firmware = raw.optional_path(Key::Firmware);
    if kernel.is_some() && firmware.is_some() {
        return Err(err(
            "--kernel and --firmware are both set; a guest boots one or the other",
        ));
    }
    Ok(HypervisorSettings {
        binary: program(raw.get(Key::Hypervisor)),
        run_dir: absolute(run_dir),
        kernel,
        firmware,
        cmdline: raw.get(Key::Cmdline),
        stop: StopTimeouts {
            power_button: raw.duration(Key::StopGrace)?,
            ..StopTimeouts::default()
        },
        hugepages: guest_hugepages(raw)?,
    })
}

/// `--guest-hugepages`: refused where no guest can have them (vfkit), and
/// where the host sets none aside, since every boot would then fail.
fn guest_hugepages(raw: &Part<'_>) -> Result<bool, ConfigError> {
    if !raw.yes_no(Key::GuestHugepages)? {
        return Ok(false);
    }
    if cfg!(target_os = "macos") {
        return Err(err(
            "--guest-hugepages: vfkit has no huge pages to back a guest with; leave it at no",
        ));
    }
    match hugepages::Pool::of_host() {
        Ok(pool) if pool.total > 0 => Ok(true),
        Ok(_) => Err(err(
            "--guest-hugepages: this host sets no 2 MiB huge pages aside (nr_hugepages is 0); reserve the guests' memory first, e.g. sysctl vm.nr_hugepages=2048 for 4 GiB, or leave it at no",
        )),
        Err(e) => Err(err(format!(
            "--guest-hugepages: cannot read this host's 2 MiB huge page pool ({e}); the kernel needs CONFIG_HUGETLBFS, or leave it at no"
        ))),
    }
}

/// What the operator asked of the host's shared ids and cgroups, when
/// they asked: the defaults are the claim's to choose (`state::claim`).
struct JailWish {
    ids: Option<(u32, u32)>,
    cgroup_root: Option<String>,
}

fn confinement(raw: &Part<'_>) -> Result<(Confinement, JailWish), ConfigError> {
    let ids = raw.get(Key::VmmIds);
    let (first, count) = ids
        .split_once(':')
        .and_then(|(f, c)| Some((f.trim().parse::<u32>().ok()?, c.trim().parse::<u32>().ok()?)))
        .filter(|(f, c)| *f >= 65_536 && *c >= 2 && f.checked_add(*c).is_some())
        .ok_or_else(|| {
            err(format!(
                "--vmm-ids: {ids:?} is not FIRST:COUNT (FIRST at least 65536, clear of the host's users; COUNT at least 2: a group for /dev/kvm and one id per VM)"
            ))
        })?;
    let mut allow_without = Vec::new();
    for name in raw
        .get(Key::AllowWithout)
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let piece = Piece::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            err(format!(
                "--allow-without: {name:?} is not a piece of confinement (jail, cgroups, landlock)"
            ))
        })?;
        allow_without.push(piece);
    }
    let cgroup_root = raw.get(Key::CgroupRoot);
    if cgroup_root.is_empty()
        || cgroup_root
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(err(format!(
            "--cgroup-root: {cgroup_root:?} is not a relative cgroup path such as eitri or machine/eitri"
        )));
    }
    let wish = JailWish {
        ids: raw.given(Key::VmmIds).then_some((first, count)),
        cgroup_root: raw.given(Key::CgroupRoot).then(|| cgroup_root.clone()),
    };
    let confinement = Confinement {
        first_id: first,
        id_count: count,
        kvm: raw.path(Key::KvmDevice),
        userfaultfd: raw.optional_path(Key::UserfaultfdDevice),
        cgroup_root,
        allow_without,
    };
    Ok((confinement, wish))
}

/// The host's caps on what it commits to VMs.
fn host_caps(raw: &Part<'_>, hypervisor: &HypervisorSettings) -> Result<HostCaps, ConfigError> {
    let pool_mb = match hypervisor.hugepages {
        true => hugepages::Pool::of_host().map(|p| p.total_mb()).ok(),
        false => None,
    };
    let max_mem_mb = match raw.get(Key::MaxMemMb).trim() {
        "auto" => None,
        _ => Some(raw.number(Key::MaxMemMb)?),
    };
    let meminfo = || std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    Ok(HostCaps {
        max_vcpus: raw.number(Key::MaxVcpus)?,
        max_mem_mb: memory_cap_mb(max_mem_mb, pool_mb, meminfo)?,
        max_disk_gb: raw.number(Key::MaxDiskGb)?,
    })
}

/// `--max-mem-mb`: `asked`, or `None` for auto. With guests on huge
/// pages (a pool of `pool_mb`), memory is what the pool holds: auto is the
/// pool, and a cap past it is refused, since the guests it would admit
/// past the pool could not boot.
fn memory_cap_mb(
    asked: Option<u64>,
    pool_mb: Option<u64>,
    meminfo: impl FnOnce() -> String,
) -> Result<u64, ConfigError> {
    match (asked, pool_mb) {
        (None, Some(pool_mb)) => Ok(pool_mb),
        (None, None) => Ok(auto_memory_cap_mb(&meminfo())),
        (Some(cap), Some(pool_mb)) if cap == 0 || cap > pool_mb => {
            let asked = match cap {
                0 => "0 (no cap)".to_owned(),
                _ => format!("{cap} MiB"),
            };
            Err(err(format!(
                "--max-mem-mb: {asked} is more than the {pool_mb} MiB of huge pages this host sets aside for guests (--guest-hugepages yes); give at most {pool_mb}, or auto"
            )))
        }
        (Some(cap), _) => Ok(cap),
    }
}

/// `--max-mem-mb auto`: the host's memory (`meminfo`'s MemTotal) less a
/// tenth, and at least 1 GiB, for the host itself (the agent, the page
/// cache, the VMMs' own few MiB each). Memory is what VMs cannot share:
/// admitting more than the host has ends with the kernel killing a VMM,
/// a customer's running VM, to free some. 0 (unlimited) when the host
/// does not say.
fn auto_memory_cap_mb(meminfo: &str) -> u64 {
    let total_mb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024);
    total_mb.saturating_sub((total_mb / 10).max(1024))
}

/// What a VM whose spec sets none may use (each bounded as a spec's own
/// is), and how much of its serial output is kept.
fn guest_limits(raw: &Part<'_>) -> Result<GuestLimits, ConfigError> {
    use crate::model::Limits;
    let within = |key: Key, max: u64| -> Result<u32, ConfigError> {
        let n = raw.number(key)?;
        if n > max {
            return Err(err(format!(
                "--{}: {n} is past {max}; 0 means none",
                key.setting().flag
            )));
        }
        Ok(n as u32)
    };
    let serial_mb = raw.number(Key::SerialLogMaxMb)?;
    if serial_mb == 0 {
        return Err(err(
            "--serial-log-max-mb: 0 would keep no serial output at all; give at least 1",
        ));
    }
    Ok(GuestLimits {
        defaults: crate::model::LimitDefaults {
            cpu_max_millis_per_vcpu: within(Key::VmCpuMaxPerVcpu, 1000)?,
            cpu_burst_ms: within(Key::VmCpuBurst, 100 * u64::from(Limits::MAX_VCPUS))?,
            disk_mbps: within(Key::VmDiskMbps, Limits::MAX_DISK_MBPS)?,
            disk_iops: within(Key::VmDiskIops, Limits::MAX_DISK_IOPS)?,
            net_mbps: within(Key::VmNetMbps, Limits::MAX_NET_MBPS)?,
        },
        serial_log_bytes: serial_mb.saturating_mul(1 << 20),
    })
}

// ── how the engine behaves ───────────────────────────────────────────────

fn engine(raw: &Part<'_>, caps: HostCaps) -> Result<EngineConfig, ConfigError> {
    let vm_timeout = raw.duration(Key::VmTimeout)?;
    let max_create_attempts = raw.number(Key::MaxCreateAttempts)?;
    if !(1..=1000).contains(&max_create_attempts) {
        return Err(err("--max-create-attempts must be between 1 and 1000"));
    }
    Ok(EngineConfig {
        vm_timeout: (!vm_timeout.is_zero()).then_some(vm_timeout),
        tombstone_grace: raw.duration(Key::TombstoneGrace)?,
        vanish_grace: raw.duration(Key::VanishGrace)?,
        max_create_attempts: max_create_attempts as u32,
        create_rearm: raw.duration(Key::CreateRearm)?,
        max_concurrent_creates: raw.number(Key::MaxConcurrentCreates)? as usize,
        caps,
        ..EngineConfig::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_section_reads_only_its_own_settings() {
        // A control plane and a guest network: every builder runs.
        let args = args(&["--control-plane", "http://cp.test", "--token-file", "/t"]);
        let env = env(&[]);
        let raw = Raw::read(&args, &env).expect("flags");

        build(&raw).expect("valid");

        assert_eq!(raw.strays(), Vec::new());
    }

    #[test]
    fn guest_deny_and_image_allow_take_ipv6_ranges_for_downloads() {
        let args = args(&[
            "--desired",
            "/d.json",
            "--guest-deny",
            "10.0.0.0/8,fd00:ec2::/32",
            "--image-allow",
            "2001:db8::/32",
        ]);
        let env = env(&[]);
        let raw = Raw::read(&args, &env).expect("flags");

        let built = build(&raw).expect("valid");

        let reach = &built.images.fetch.reach;
        assert_eq!(
            reach.deny,
            IpRange::parse_list("10.0.0.0/8,fd00:ec2::/32").expect("ranges")
        );
        assert_eq!(
            reach.allow,
            IpRange::parse_list("2001:db8::/32").expect("ranges")
        );
    }

    #[test]
    fn an_ipv6_range_with_host_bits_is_refused_with_the_range_meant() {
        let args = args(&["--desired", "/d.json", "--image-allow", "2001:db8::1/32"]);
        let env = env(&[]);
        let raw = Raw::read(&args, &env).expect("flags");

        let refused = build(&raw).map(drop).map_err(|e| e.to_string());

        assert_eq!(
            refused,
            Err(
                "--image-allow: 2001:db8::1/32 has host bits set; did you mean 2001:db8::/32?"
                    .into()
            )
        );
    }

    #[test]
    fn with_guests_on_huge_pages_the_automatic_memory_cap_is_the_pool() {
        let cap = memory_cap_mb(None, Some(1200), || unreachable!("the pool is the cap"));

        assert_eq!(cap.expect("cap"), 1200);
    }

    #[test]
    fn with_guests_on_huge_pages_a_cap_past_the_pool_or_none_is_refused() {
        let past = memory_cap_mb(Some(2048), Some(1200), String::new).expect_err("past");
        let none = memory_cap_mb(Some(0), Some(1200), String::new).expect_err("none");

        assert!(
            past.to_string()
                .contains("2048 MiB is more than the 1200 MiB"),
            "{past}"
        );
        assert!(none.to_string().contains("0 (no cap)"), "{none}");
        assert_eq!(
            memory_cap_mb(Some(1000), Some(1200), String::new).expect("within"),
            1000
        );
    }

    #[test]
    fn the_automatic_memory_cap_keeps_a_tenth_and_at_least_1_gib_for_the_host() {
        let meminfo = |mib: u64| format!("MemTotal:       {} kB\nMemFree: 1 kB\n", mib * 1024);

        assert_eq!(auto_memory_cap_mb(&meminfo(24 * 1024)), 24 * 1024 - 2457);
        assert_eq!(auto_memory_cap_mb(&meminfo(4096)), 3072);
        assert_eq!(
            auto_memory_cap_mb(&meminfo(512)),
            0,
            "all of it is the host's"
        );
        assert_eq!(auto_memory_cap_mb(""), 0, "unknown: no cap");
    }

    #[test]
    fn the_image_cache_cap_is_a_size_or_a_share_of_the_filesystem() {
        let cap = |v: &str| {
            let args = args(&["--desired", "/d.json", "--image-cache-max", v]);
            let env = env(&[]);
            let raw = Raw::read(&args, &env).expect("flags");
            build(&raw)
                .map(|c| c.images.cache_max)
                .map_err(|e| e.to_string())
        };

        assert_eq!(cap("25%"), Ok(Some(CacheCap::Percent(25))));
        assert_eq!(cap("200G"), Ok(Some(CacheCap::Bytes(200 << 30))));
        assert_eq!(cap("0"), Ok(None));
        assert!(cap("101%").is_err_and(|e| e.contains("1% to 100%")));
        assert_eq!(CacheCap::Percent(25).bytes(1000), 250);
    }

    #[test]
    fn a_read_outside_its_section_is_noted() {
        let args = args(&[]);
        let env = env(&[]);
        let raw = Raw::read(&args, &env).expect("flags");

        let _ = raw.section(Section::Images).get(Key::Tick);

        assert_eq!(raw.strays(), vec![(Section::Images, Key::Tick)]);
    }

    #[test]
    fn a_flag_wins_over_the_environment_which_wins_over_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.json");
        std::fs::write(
            &file,
            r#"{
                "reconcile": { "tick": "7s", "vm-timeout": "7m", "vanish-grace": "7h" },
                "limits": { "max-vcpus": 7 }
            }"#,
        )
        .expect("write");
        let config = file.display().to_string();
        let args = args(&["--config", &config, "--desired", "/d", "--tick", "2s"]);
        let env = env(&[("EITRI_TICK", "9s"), ("EITRI_VM_TIMEOUT", "9m")]);
        let raw = Raw::read(&args, &env).expect("flags");

        let built = build(&raw).expect("valid");

        assert_eq!(raw.value(Key::Tick).1, Origin::Flag);
        assert_eq!(built.reconcile.tick, Duration::from_secs(2));
        assert_eq!(raw.value(Key::VmTimeout).1, Origin::Env);
        assert_eq!(
            built.reconcile.engine.vm_timeout,
            Some(Duration::from_secs(540))
        );
        assert_eq!(raw.value(Key::VanishGrace).1, Origin::File);
        assert_eq!(
            built.reconcile.engine.vanish_grace,
            Duration::from_secs(7 * 3600)
        );
        assert_eq!(built.reconcile.engine.caps.max_vcpus, 7);
        assert_eq!(raw.value(Key::TombstoneGrace).1, Origin::Default);
    }

    #[test]
    fn the_config_file_may_be_named_by_the_environment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.json");
        std::fs::write(
            &file,
            r#"{"source": {"desired": "/etc/eitri/desired.json"}}"#,
        )
        .expect("write");
        let args = args(&[]);
        let env = env(&[(CONFIG_ENV, &file.display().to_string())]);

        let built = build(&Raw::read(&args, &env).expect("flags")).expect("valid");

        assert_eq!(
            built.source.desired,
            DesiredSource::File("/etc/eitri/desired.json".into())
        );
    }

    #[test]
    fn an_unknown_key_in_the_config_file_is_refused_naming_the_file_and_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.json");
        std::fs::write(
            &file,
            "{\n  \"source\": {\"desired\": \"/d\"},\n  \"hypervisor\": {\n    \"kernal\": \"/boot/vmlinux\"\n  }\n}\n",
        )
        .expect("write");
        let config = file.display().to_string();
        let args = args(&["--config", &config]);
        let env = env(&[]);

        let e = Raw::read(&args, &env).err().expect("refused").to_string();

        assert!(e.starts_with("--config "), "{e}");
        assert!(e.contains(&config), "{e}");
        assert!(e.contains("unknown setting \"kernal\""), "{e}");
        assert!(e.contains("line 4"), "{e}");
    }

    #[test]
    fn a_bad_value_from_the_file_names_its_setting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.json");
        std::fs::write(
            &file,
            r#"{"source": {"desired": "/d"}, "reconcile": {"tick": "soon"}}"#,
        )
        .expect("write");
        let config = file.display().to_string();
        let args = args(&["--config", &config]);
        let env = env(&[]);

        let e = build(&Raw::read(&args, &env).expect("flags")).expect_err("bad");

        assert!(e.to_string().starts_with("--tick:"), "{e}");
    }
}
