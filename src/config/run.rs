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

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::guests::{confinement, guest_boot, host_caps, hypervisor, network};
use super::read::{Part, Raw, absolute, no_comma};
use super::settings::{Key, Section};
use super::{CacheCap, Config, ConfigError, DesiredSource, err};
use crate::image::{ImageOptions, Reach};
use crate::model::IpRange;
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
    let guest_agent = super::guests::guest_agent(&raw.section(Section::Hypervisor));
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
                    // The claim's to fill, where the agent runs.
                    netns: String::new(),
                }),
        },
        state: super::StateSettings {
            dir: state.dir,
            agents_dir: state.agents_dir,
        },
        images: super::ImageSettings {
            fetch: image_options(
                images,
                proxy.clone(),
                &network.deny,
                network.underlay.as_ref().map(|u| u.subnet.cidr()),
            )?,
            cache_max: image_cache_max(images)?,
        },
        source: super::SourceSettings {
            desired: source,
            host_id: desired.optional(Key::HostId).map(|h| h.trim().to_owned()),
            backoff_max: desired.duration(Key::BackoffMax)?,
            limits: snapshot_limits(desired)?,
            max_epoch_step: max_epoch_step(desired)?,
            trust,
            proxy,
        },
        reconcile: super::ReconcileSettings {
            tick: tick(reconcile)?,
            shutdown_grace: reconcile.duration(Key::ShutdownGrace)?,
            engine: engine(reconcile, host_caps(limits, &hypervisor)?)?,
        },
        guest: guest_boot((hypervisor, guest_agent), network, confinement, limits)?,
        reporting: super::ReportingSettings {
            notify_fd: notify_fd(reporting)?,
            metrics_file: reporting.optional_path(Key::MetricsFile),
            usage_interval: Some(reporting.duration(Key::UsageInterval)?)
                .filter(|every| !every.is_zero()),
        },
    })
}

/// The state section as built.
struct State {
    dir: PathBuf,
    agents_dir: PathBuf,
    /// The state dir is the default one (its claim then keeps the
    /// historic ids and cgroup root).
    is_default: bool,
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
/// guests may not reach, downloads may not either (unless `--image-allow`);
/// the guests themselves never, whatever it says.
fn image_options(
    raw: &Part<'_>,
    proxy: Option<String>,
    guest_deny: &[IpRange],
    guests: Option<crate::model::Cidr>,
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
            guests,
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

/// `--max-epoch-step`: at least 1, or no unsigned answer could move the
/// fence at all.
fn max_epoch_step(raw: &Part<'_>) -> Result<u64, ConfigError> {
    match raw.number(Key::MaxEpochStep)? {
        0 => Err(err(
            "--max-epoch-step must be at least 1: at 0 no unsigned answer could move the epoch",
        )),
        n => Ok(n),
    }
}

// ── the guests' network ─────────────────────────────────────────────────

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
    use super::super::read::{CONFIG_ENV, Origin};
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
    fn image_downloads_refuse_the_guests_subnet() {
        let args = args(&["--desired", "/d.json", "--underlay-subnet", "10.9.0.0/16"]);
        let env = env(&[]);
        let raw = Raw::read(&args, &env).expect("flags");

        let built = build(&raw).expect("valid");

        assert_eq!(
            built.images.fetch.reach.guests,
            Some(crate::model::Cidr::parse("10.9.0.0/16").expect("subnet"))
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

    /// A config file of `mode`, owned by `owner`, that sets the desired
    /// file; what reading `run`'s settings with it says.
    fn read_config_of(mode: u32, owner: Option<u32>) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("agent.json");
        std::fs::write(&file, r#"{"source": {"desired": "/d"}}"#).expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("mode");
        if let Some(uid) = owner {
            std::os::unix::fs::chown(&file, Some(uid), None).expect("chown");
        }
        let config = file.display().to_string();
        Raw::read(&args(&["--config", &config]), &env(&[]))
            .map(drop)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_config_file_others_may_write_is_refused_saying_how_to_fix_it() {
        let refused = read_config_of(0o666, None).expect_err("refused");

        assert!(
            refused.contains("may be written by group or others (mode 0666)"),
            "{refused}"
        );
        assert!(refused.contains("chmod go-w"), "{refused}");
    }

    #[test]
    fn a_config_file_another_user_owns_is_refused_saying_how_to_fix_it() {
        let refused = read_config_of(0o644, Some(65534)).expect_err("refused");

        assert!(refused.contains("owned by uid 65534"), "{refused}");
        assert!(refused.contains("chown"), "{refused}");
    }

    #[test]
    fn a_config_file_only_its_owner_may_write_is_read() {
        assert_eq!(read_config_of(0o644, None), Ok(()));
    }
}
