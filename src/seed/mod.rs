//! The cloud-init NoCloud seed: an ISO 9660 image labelled `cidata`.
//!
//! Files, and why each looks the way it does:
//! - `meta-data`: `instance-id` is the VM id, stable forever, so cloud-init
//!   never takes a rebuilt seed for a new instance (which would regenerate
//!   host keys and re-run first-boot modules); `local-hostname`.
//! - `user-data`: the tenant's user-data **byte for byte**, whatever it is (a
//!   cloud-config, a shell script, a MIME archive).
//! - `vendor-data`: the agent's own settings as a cloud-config: the
//!   authorized key, the guest's host key and certificate, the tenant's user
//!   CAs as a `TrustedUserCAKeys` drop-in, `ssh_deletekeys: false`. NoCloud
//!   vendor-data is applied beside user-data, so the agent's part reaches the
//!   guest even when the tenant's user-data is a script or a different
//!   cloud-config; merging the two into one multipart user-data would have
//!   meant re-encoding the tenant's bytes. (A tenant can still opt out with
//!   `vendor_data: {enabled: false}`: their explicit choice.)
//! - the guest agent, when the host delivers one (`--guest-agent`): in
//!   vendor-data too, as a `write_files` entry (the static binary, base64:
//!   ~0.9 MB on the seed) and its systemd unit, enabled and started by
//!   `runcmd`. The tenant's user-data can turn vendor-data off, and with it
//!   the guest agent; an image without systemd gets the file and no
//!   service.
//! - `network-config` (v2): each NIC matched by its deterministic MAC, DHCP
//!   with the MAC as client id; no address is baked in. The site NIC takes no
//!   routes, so the default route stays on the underlay.
//!
//! Every generated document is JSON, which is YAML too: a value from the
//! wire can only ever be a quoted string, never a new directive.

mod iso;

use std::path::Path;
use std::time::SystemTime;

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::error::{Outcome, Simple};
use crate::model::is_hostname;
use crate::state::atomic::write_remade;

pub const VOLUME_ID: &str = "cidata";

/// What the cloud-init seed of one VM holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeedParams {
    pub hostname: String,
    /// Stable forever (the VM id), so cloud-init never regenerates host keys.
    pub instance_id: String,
    pub ssh_authorized_key: String,
    /// Tenant user-data, byte for byte.
    pub user_data: String,
    /// The tenant user-CA keys as TrustedUserCAKeys content, one per line.
    pub ssh_user_ca_keys: String,
    pub ssh_host_key_pem: String,
    /// The host key's public line, when there is a host key.
    pub ssh_host_key_public: String,
    pub ssh_host_cert: String,
    /// MAC of the underlay NIC.
    pub mac: String,
    /// MAC of the second NIC; empty when the VM has none.
    pub network_mac: String,
}

/// Builds NoCloud seed images on the local disk, each carrying the guest
/// agent when the host delivers one.
#[derive(Default)]
pub struct NoCloudSeed {
    guest_agent: Option<GuestAgent>,
}

/// The guest agent a seed carries: its `write_files` entry, the binary in
/// base64, rendered as JSON once. Escaping its ~0.8 MB again for every seed
/// took about a tenth of the host's CPU through a burst of 100 stand-in
/// clones (in `perf`).
struct GuestAgent {
    entry: Box<RawValue>,
}

/// The most a guest agent may weigh: the static build is ~0.7 MB.
const MAX_GUEST_AGENT: u64 = 8 << 20;

/// Where the guest agent goes in a guest, and its unit: names of their own,
/// so an agent the image carries (`contrib/guest`'s unit, one of
/// [`IMAGE_UNITS`]) is never written over, and is the one that runs (see
/// [`guest_agent_unit`]).
const GUEST_AGENT_PATH: &str = "/usr/local/lib/eitri/eitri-guest";
const DELIVERED_UNIT: &str = "eitri-guest-delivered.service";
const GUEST_AGENT_UNIT: &str = "/etc/systemd/system/eitri-guest-delivered.service";

/// Where an image's own guest agent's unit is.
const IMAGE_UNITS: [&str; 2] = [
    "/etc/systemd/system/eitri-guest.service",
    "/usr/lib/systemd/system/eitri-guest.service",
];

/// The first boot's start of the delivered agent, from the first of
/// cloud-init's stages that runs modules (its network stage: bootcmd, each
/// boot; it acts on the first alone, and not where
/// the image has its own agent): a transient unit that waits for
/// write_files, moments later in the same stage, to put the binary there
/// (made executable once whole), then runs it. Started from the last
/// stage (runcmd) instead, it could answer nothing before cloud-init's
/// last stage runs, after the guest's sshd has started. Later boots start
/// the installed unit.
fn first_boot_start() -> String {
    let image: String = IMAGE_UNITS
        .iter()
        .map(|u| format!("[ -e {u} ] || "))
        .collect();
    format!(
        "{image}[ -e /etc/systemd/system/sysinit.target.wants/{DELIVERED_UNIT} ] || \
         systemd-run --no-block --unit=eitri-guest-first-boot -p DefaultDependencies=no \
         -p Conflicts=shutdown.target -p Before=shutdown.target -p Restart=always -p RestartSec=1 \
         -p StartLimitIntervalSec=0 /bin/sh -c \
         'until [ -x {GUEST_AGENT_PATH} ]; do sleep 0.1; done; exec {GUEST_AGENT_PATH}' || true"
    )
}

/// The last stage's part: the unit enabled for later boots, and started
/// now only where the first boot's start did not run.
fn enable() -> String {
    format!(
        "systemctl daemon-reload; systemctl enable {DELIVERED_UNIT}; \
         systemctl is-active --quiet eitri-guest-first-boot.service || \
         systemctl start --no-block {DELIVERED_UNIT}"
    )
}

impl NoCloudSeed {
    /// Seeds that carry the guest agent at `path` (read once, here).
    pub fn delivering(path: &Path) -> std::io::Result<NoCloudSeed> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path)?
            .take(MAX_GUEST_AGENT + 1)
            .read_to_end(&mut bytes)?;
        if bytes.len() as u64 > MAX_GUEST_AGENT {
            return Err(std::io::Error::other(format!(
                "{} is over {} MiB: not the guest agent (make static builds it, ~0.7 MB)",
                path.display(),
                MAX_GUEST_AGENT >> 20
            )));
        }
        if !bytes.starts_with(b"\x7fELF") {
            return Err(std::io::Error::other(format!(
                "{} is not an ELF binary: not the guest agent",
                path.display()
            )));
        }
        let entry = json!({"path": GUEST_AGENT_PATH, "permissions": "0755", "encoding": "b64",
                           "content": crate::base64::encode(&bytes)});
        Ok(NoCloudSeed {
            guest_agent: Some(GuestAgent {
                entry: serde_json::value::to_raw_value(&entry).map_err(std::io::Error::other)?,
            }),
        })
    }

    /// Whether its seeds install a guest agent.
    pub fn carries_guest_agent(&self) -> bool {
        self.guest_agent.is_some()
    }

    /// Builds the seed image for `params` at `out`, atomically.
    pub fn build(&self, out: &Path, params: &SeedParams) -> Outcome<crate::state::atomic::Pending> {
        check(params)?;
        let meta = meta_data(params);
        let vendor = vendor_data(params, self.guest_agent.as_ref());
        let network = network_config(params);
        let files = [
            iso::File {
                name: "meta-data",
                data: meta.as_bytes(),
            },
            iso::File {
                name: "network-config",
                data: network.as_bytes(),
            },
            iso::File {
                name: "user-data",
                data: params.user_data.as_bytes(),
            },
            iso::File {
                name: "vendor-data",
                data: vendor.as_bytes(),
            },
        ];
        let image = iso::build(VOLUME_ID, &files, SystemTime::now());
        // It carries the guest's private host key (0600). Made for a create
        // only, and made again by the next attempt if a power cut tears it.
        write_remade(out, &image).map_err(|e| {
            Simple::transient(format!(
                "cannot write the seed image {}: {e}",
                out.display()
            ))
            .into()
        })
    }
}

/// Refuses what must never reach a guest's configuration, even though the
/// wire conversion already checked it: this is the last line before YAML.
fn check(p: &SeedParams) -> Outcome {
    let hostname_ok = p.hostname.is_empty() || is_hostname(&p.hostname);
    if !hostname_ok {
        return Err(Simple::permanent(format!(
            "{:?} is not a valid hostname; the seed was not written",
            p.hostname
        ))
        .into());
    }
    if p.instance_id.is_empty() || p.instance_id.chars().any(char::is_control) {
        return Err(
            Simple::permanent("the instance id is empty or has a control character").into(),
        );
    }
    Ok(())
}

fn meta_data(p: &SeedParams) -> String {
    let mut m = Map::new();
    m.insert("instance-id".into(), json!(p.instance_id));
    if !p.hostname.is_empty() {
        m.insert("local-hostname".into(), json!(p.hostname));
    }
    pretty(&Value::Object(m))
}

fn vendor_data(p: &SeedParams, agent: Option<&GuestAgent>) -> String {
    let mut c = Map::new();
    // Host keys the agent made (and the control plane certified) must
    // survive cloud-init's first boot.
    c.insert("ssh_deletekeys".into(), json!(false));
    if !p.ssh_authorized_key.is_empty() {
        c.insert("ssh_authorized_keys".into(), json!([p.ssh_authorized_key]));
    }
    if !p.ssh_host_key_pem.is_empty() {
        let mut keys = Map::new();
        keys.insert("ed25519_private".into(), json!(p.ssh_host_key_pem));
        if !p.ssh_host_key_public.is_empty() {
            keys.insert("ed25519_public".into(), json!(p.ssh_host_key_public));
        }
        if !p.ssh_host_cert.is_empty() {
            keys.insert("ed25519_certificate".into(), json!(p.ssh_host_cert));
        }
        c.insert("ssh_keys".into(), Value::Object(keys));
    }
    let mut files = Vec::new();
    if !p.ssh_user_ca_keys.is_empty() {
        files.extend([
            FileEntry::Made(json!({"path": "/etc/ssh/eitri_user_ca_keys", "permissions": "0644", "content": p.ssh_user_ca_keys})),
            FileEntry::Made(json!({"path": "/etc/ssh/sshd_config.d/60-eitri-user-ca.conf", "permissions": "0644",
                   "content": "TrustedUserCAKeys /etc/ssh/eitri_user_ca_keys\n"})),
        ]);
    }
    if let Some(agent) = agent {
        files.extend([
            FileEntry::Rendered(&agent.entry),
            FileEntry::Made(
                json!({"path": GUEST_AGENT_UNIT, "permissions": "0644", "content": guest_agent_unit()}),
            ),
        ]);
        c.insert("bootcmd".into(), json!([["sh", "-c", first_boot_start()]]));
        c.insert("runcmd".into(), json!([["sh", "-c", enable()]]));
    }
    let doc = VendorData {
        settings: c,
        write_files: files,
    };
    format!("#cloud-config\n{}", pretty(&doc))
}

/// Vendor-data's cloud-config: its settings, then its files (the key
/// `write_files` sorts after every setting's, as it did in one map).
#[derive(serde::Serialize)]
struct VendorData<'a> {
    #[serde(flatten)]
    settings: Map<String, Value>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    write_files: Vec<FileEntry<'a>>,
}

/// A `write_files` entry: made for this seed, or the guest agent's,
/// rendered once.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum FileEntry<'a> {
    Made(Value),
    Rendered(&'a RawValue),
}

/// The guest agent's unit, as vendor-data installs it (the same as
/// `contrib/guest/eitri-guest.service` but for where the binary is). An
/// image that carries its own agent's unit runs that one: this one does
/// not start beside it (both would listen on the same port).
fn guest_agent_unit() -> String {
    let not_the_images: String = IMAGE_UNITS
        .iter()
        .map(|u| format!("ConditionPathExists=!{u}\n"))
        .collect();
    format!(
        "[Unit]\nDescription=eitri guest agent (answers the host over vsock)\n\
         DefaultDependencies=no\nAfter=local-fs.target\nBefore=sysinit.target\n\
         Conflicts=shutdown.target\nBefore=shutdown.target\n{not_the_images}\n\
         [Service]\nExecStart={GUEST_AGENT_PATH}\nRestart=always\nRestartSec=1\n\n\
         [Install]\nWantedBy=sysinit.target\n"
    )
}

fn network_config(p: &SeedParams) -> String {
    let mut nics = Map::new();
    nics.insert(
        "underlay".into(),
        json!({"match": {"macaddress": p.mac}, "dhcp4": true, "dhcp-identifier": "mac"}),
    );
    if !p.network_mac.is_empty() {
        nics.insert(
            "site".into(),
            json!({"match": {"macaddress": p.network_mac}, "dhcp4": true, "dhcp-identifier": "mac",
                   "dhcp4-overrides": {"use-routes": false, "route-metric": 1000}}),
        );
    }
    pretty(&json!({"version": 2, "ethernets": nics}))
}

fn pretty(v: &impl serde::Serialize) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SeedParams {
        SeedParams {
            hostname: "web-1".into(),
            instance_id: "vm-1".into(),
            mac: "02:00:00:00:00:01".into(),
            ..SeedParams::default()
        }
    }

    #[test]
    fn a_hostname_with_a_newline_is_refused() {
        let p = SeedParams {
            hostname: "web\nruncmd: [reboot]".into(),
            ..params()
        };

        let err = check(&p).expect_err("refused");

        assert!(err.is_permanent());
    }

    #[test]
    fn the_site_nic_takes_no_routes() {
        let p = SeedParams {
            network_mac: "02:00:00:00:00:02".into(),
            ..params()
        };

        let v: Value = serde_json::from_str(&network_config(&p)).expect("json");

        assert_eq!(
            v["ethernets"]["site"]["dhcp4-overrides"]["use-routes"],
            json!(false)
        );
        assert_eq!(v["ethernets"]["underlay"]["dhcp-identifier"], json!("mac"));
    }

    #[test]
    fn vendor_data_carries_the_guest_agent_and_starts_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let binary = dir.path().join("eitri-guest");
        std::fs::write(&binary, b"\x7fELF the guest agent").expect("write");
        let seed = NoCloudSeed::delivering(&binary).expect("read");

        let text = vendor_data(&params(), seed.guest_agent.as_ref());

        let v: Value = serde_json::from_str(&text["#cloud-config\n".len()..]).expect("json");
        let files = v["write_files"].as_array().expect("files");
        let agent = files
            .iter()
            .find(|f| f["path"] == GUEST_AGENT_PATH)
            .expect("the agent");
        let carried = crate::base64::decode(agent["content"].as_str().expect("b64")).expect("b64");
        assert_eq!(carried, b"\x7fELF the guest agent");
        assert!(files.iter().any(|f| f["path"] == GUEST_AGENT_UNIT));
        assert_eq!(v["bootcmd"][0][2], json!(first_boot_start()));
        assert_eq!(v["runcmd"][0][2], json!(enable()));
    }

    #[test]
    fn the_guest_agents_rendered_entry_sits_among_the_seeds_own_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let binary = dir.path().join("eitri-guest");
        std::fs::write(&binary, b"\x7fELF the guest agent").expect("write");
        let seed = NoCloudSeed::delivering(&binary).expect("read");
        let p = SeedParams {
            ssh_user_ca_keys: "ssh-ed25519 AAAA\" ca\n".into(),
            ..params()
        };

        let text = vendor_data(&p, seed.guest_agent.as_ref());

        let v: Value = serde_json::from_str(&text["#cloud-config\n".len()..]).expect("json");
        let paths: Vec<&str> = v["write_files"]
            .as_array()
            .expect("files")
            .iter()
            .filter_map(|f| f["path"].as_str())
            .collect();
        assert_eq!(
            paths,
            [
                "/etc/ssh/eitri_user_ca_keys",
                "/etc/ssh/sshd_config.d/60-eitri-user-ca.conf",
                GUEST_AGENT_PATH,
                GUEST_AGENT_UNIT
            ]
        );
        assert_eq!(
            v["write_files"][0]["content"],
            json!("ssh-ed25519 AAAA\" ca\n")
        );
        assert_eq!(v["ssh_deletekeys"], json!(false));
    }

    #[test]
    fn a_file_that_is_no_binary_is_not_delivered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("eitri-guest");
        std::fs::write(&script, b"#!/bin/sh\nrm -rf /\n").expect("write");

        assert!(NoCloudSeed::delivering(&script).is_err());
    }

    #[test]
    fn without_a_guest_agent_vendor_data_runs_nothing() {
        let text = vendor_data(&params(), None);

        let v: Value = serde_json::from_str(&text["#cloud-config\n".len()..]).expect("json");
        assert!(
            v.get("runcmd").is_none()
                && v.get("bootcmd").is_none()
                && v.get("write_files").is_none(),
            "{v}"
        );
    }

    #[test]
    fn vendor_data_keeps_host_keys() {
        let text = vendor_data(&params(), None);

        assert!(text.starts_with("#cloud-config\n"));
        let v: Value = serde_json::from_str(&text["#cloud-config\n".len()..]).expect("json");
        assert_eq!(v["ssh_deletekeys"], json!(false));
    }
}
