//! What a snapshot's `config.json` (and a restored hypervisor's `vm.info`)
//! may say. A restoring cloud-hypervisor takes its whole VM from that file
//! — disks, serial file, vCPUs, memory, devices, limiters, Landlock — and
//! the file is written by the hypervisor being saved: one its guest took
//! over could give its successor a host file as a disk or its entropy
//! source, a vhost-user socket, more vCPUs or memory than the spec, no
//! rate limiter, pinned CPUs, KSM, or no Landlock.
//!
//! So the file, sealed (root's, out of any VMM's sight), is held to an
//! allowlist of the whole document: [`shape`] says, for every field
//! cloud-hypervisor (v51 and later) writes, what the agent's VM has there
//! — the value the agent's command line gave it, or cloud-hypervisor's own
//! default for a field the agent never sets — and names the few the VMM
//! fills in at run time (its disks' ids, its NICs' fds, the host's address
//! width). A field it does not list is refused unless empty (cloud-
//! hypervisor leaves out, or writes `null` for, every option not set): a
//! field a later release adds is refused until this list learns it, which
//! is the safe way round. Any difference refuses the snapshot (the VM is
//! booted from its disks instead, and says why). After a restore, the new
//! hypervisor's own account (`vm.info`) is held to the same shape, and one
//! that differs is killed.
//!
//! cloud-hypervisor cannot be told `--landlock` with `--restore` (the
//! flag belongs to a group that requires a payload): Landlock on a
//! restored VM is what this check holds the sealed file to.

use std::path::PathBuf;

use serde_json::{Value, json};

use super::argv::{Buckets, DISK_GROUP, NicId, REFILL_MS};
use crate::model::Mac;

/// What the agent started the VM with, as cloud-hypervisor writes it.
#[derive(Clone, Debug)]
pub(super) struct Expected {
    /// Every disk in order: the root disk, the seed, the volumes.
    pub disks: Vec<PathBuf>,
    pub serial: PathBuf,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// Its memory on 2 MiB huge pages (`--guest-hugepages`).
    pub hugepages: bool,
    /// What it boots; `None`: not compared (a restored hypervisor runs
    /// the guest in its memory, and its sealed file was held to it).
    pub payload: Option<Payload>,
    /// Its NICs' MACs, in order.
    pub macs: Vec<Mac>,
    /// Its limiters' buckets, as its boot set them.
    pub buckets: Buckets,
    /// The one Landlock rule, the snapshot's work dir, when it runs under
    /// Landlock.
    pub landlock_rule: Option<PathBuf>,
    /// Its vsock socket. A VM booted before the agent gave VMs one has no
    /// vsock device, so none is as good.
    pub guest_socket: PathBuf,
}

/// What a VM boots.
#[derive(Clone, Debug)]
pub(super) enum Payload {
    Kernel { kernel: PathBuf, cmdline: String },
    Firmware(PathBuf),
}

/// What one field may hold.
#[derive(Debug)]
enum Rule {
    /// This value: the agent gave it.
    Is(Value),
    /// This value, or nothing (cloud-hypervisor's default, which an older
    /// release leaves unwritten): the agent never sets it.
    Default(Value),
    /// Anything: the VMM fills it in at run time (each use says why).
    Filled,
    /// An object of these fields; any other must be empty. Absent, it is
    /// as good as one of defaults, if every field may be.
    Object(Vec<(&'static str, Rule)>),
    /// A list of exactly these, in order.
    List(Vec<Rule>),
    /// This, or nothing at all: a device a VM started by an older agent
    /// lacks, which is no reach for a forger (a guest without it only
    /// loses what the agent asks of it).
    Either(Box<Rule>),
}

use Rule::{Default, Either, Filled, Is, List, Object};

/// Why `config` is not what `expected` says; `None` when it is.
pub(super) fn difference(config: &Value, expected: &Expected) -> Option<String> {
    let why = check(&shape(expected), config, "")?;
    Some(format!(
        "{why} (a hypervisor its guest took over would reach the host or free its successor through it)"
    ))
}

/// `config` (a document that keeps to another VM's shape) made one of
/// `expected`'s: every value the agent gives set to `expected`'s, every
/// default and run-time value kept, every field the shape has no place
/// for dropped. How a clone's configuration is written from its
/// template's; the caller vets what comes out like any other.
pub(super) fn conform(config: &Value, expected: &Expected) -> Value {
    fit(&shape(expected), config)
}

/// `value` fitted to `rule` (see [`conform`]).
fn fit(rule: &Rule, value: &Value) -> Value {
    match rule {
        Is(want) => want.clone(),
        Default(_) | Filled => value.clone(),
        Either(_) if value.is_null() => Value::Null,
        Either(rule) => fit(rule, value),
        Object(fields) => {
            let mut out = serde_json::Map::new();
            for (key, rule) in fields {
                let fitted = fit(rule, value.get(*key).unwrap_or(&Value::Null));
                if !fitted.is_null() {
                    out.insert((*key).to_owned(), fitted);
                }
            }
            Value::Object(out)
        }
        List(items) => {
            let list = value.as_array().map(Vec::as_slice).unwrap_or_default();
            Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, rule)| fit(rule, list.get(i).unwrap_or(&Value::Null)))
                    .collect(),
            )
        }
    }
}

/// The whole document cloud-hypervisor writes for the agent's VM.
fn shape(e: &Expected) -> Rule {
    let mut fields = vec![
        ("cpus", cpus(e.vcpus)),
        ("memory", memory(e.memory_bytes, e.hugepages)),
        ("payload", payload(e.payload.as_ref())),
        ("disks", disks(e)),
        (
            "rng",
            Object(pci_common([("src", Default(json!("/dev/urandom")))])),
        ),
        (
            "serial",
            Object(vec![
                ("file", Is(path(&e.serial))),
                ("mode", Is(json!("File"))),
            ]),
        ),
        ("console", Object(pci_common([("mode", Is(json!("Off")))]))),
        (
            "debug_console",
            Object(vec![
                ("mode", Default(json!("Off"))),
                ("iobase", Default(json!(0xe9))),
            ]),
        ),
        ("pvpanic", Default(json!(false))),
        ("iommu", Default(json!(false))),
        ("watchdog", Default(json!(false))),
    ];
    if !e.macs.is_empty() {
        fields.push(("net", nets(&e.macs, e.buckets.net_bytes)));
    }
    fields.push((
        "vsock",
        Either(Box::new(Object(pci_common([
            // The VMM names its devices.
            ("id", Filled),
            ("cid", Is(json!(super::argv::GUEST_CID))),
            ("socket", Is(path(&e.guest_socket))),
        ])))),
    ));
    if e.buckets.disk_bytes != 0 || e.buckets.disk_ops != 0 {
        fields.push((
            "rate_limit_groups",
            List(vec![Object(vec![
                ("id", Is(json!(DISK_GROUP))),
                (
                    "rate_limiter_config",
                    limiter(e.buckets.disk_bytes, e.buckets.disk_ops),
                ),
            ])]),
        ));
    }
    match &e.landlock_rule {
        Some(rule) => fields.extend([
            ("landlock_enable", Is(json!(true))),
            (
                "landlock_rules",
                List(vec![Object(vec![
                    ("path", Is(path(rule))),
                    ("access", Is(json!("rw"))),
                ])]),
            ),
        ]),
        None => fields.push(("landlock_enable", Default(json!(false)))),
    }
    Object(fields)
}

fn cpus(vcpus: u32) -> Rule {
    Object(vec![
        ("boot_vcpus", Is(json!(vcpus))),
        ("max_vcpus", Is(json!(vcpus))),
        ("kvm_hyperv", Default(json!(false))),
        // The host's address width, as the VMM found it.
        ("max_phys_bits", Filled),
        ("features", Object(vec![("amx", Default(json!(false)))])),
        ("nested", Default(json!(true))),
        ("core_scheduling", Default(json!("Vm"))),
        ("profile", Default(json!("Host"))),
    ])
}

fn memory(bytes: u64, hugepages: bool) -> Rule {
    let mut fields = vec![
        ("size", Is(json!(bytes))),
        ("mergeable", Default(json!(false))),
        ("hotplug_method", Default(json!("Acpi"))),
        ("shared", Is(json!(true))),
        ("prefault", Default(json!(false))),
        ("thp", Default(json!(true))),
    ];
    if hugepages {
        fields.extend([
            ("hugepages", Is(json!(true))),
            ("hugepage_size", Is(json!(2u64 << 20))),
            ("reserve", Is(json!(true))),
        ]);
    } else {
        fields.extend([
            ("hugepages", Default(json!(false))),
            ("reserve", Default(json!(false))),
        ]);
    }
    Object(fields)
}

fn payload(payload: Option<&Payload>) -> Rule {
    Object(match payload {
        Some(Payload::Kernel { kernel, cmdline }) => vec![
            ("kernel", Is(path(kernel))),
            ("cmdline", Is(json!(cmdline))),
        ],
        Some(Payload::Firmware(firmware)) => vec![("firmware", Is(path(firmware)))],
        // A restored VM's: its sealed file was held to the VM's.
        None => vec![
            ("kernel", Filled),
            ("cmdline", Filled),
            ("firmware", Filled),
        ],
    })
}

fn disks(e: &Expected) -> Rule {
    let grouped = e.buckets.disk_bytes != 0 || e.buckets.disk_ops != 0;
    List(
        e.disks
            .iter()
            .enumerate()
            .map(|(i, disk)| {
                // The seed, second, is read-only and outside the group.
                let seed = i == 1;
                let mut fields = pci_common([
                    // The VMM names its disks.
                    ("id", Filled),
                    ("path", Is(path(disk))),
                    (
                        "readonly",
                        if seed {
                            Is(json!(true))
                        } else {
                            Default(json!(false))
                        },
                    ),
                    ("direct", Default(json!(false))),
                    ("num_queues", Default(json!(1))),
                    ("queue_size", Default(json!(128))),
                    ("vhost_user", Default(json!(false))),
                    ("disable_io_uring", Default(json!(false))),
                    ("disable_aio", Default(json!(false))),
                    // Raw, never probed, no backing file: see `argv::RAW`.
                    ("backing_files", Default(json!(false))),
                    ("sparse", Default(json!(true))),
                    ("image_type", Is(json!("Raw"))),
                    ("lock_granularity", Default(json!("ByteRange"))),
                ]);
                if grouped && !seed {
                    fields.push(("rate_limit_group", Is(json!(DISK_GROUP))));
                }
                Object(fields)
            })
            .collect(),
    )
}

fn nets(macs: &[Mac], bytes: u64) -> Rule {
    List(
        macs.iter()
            .enumerate()
            .map(|(i, mac)| {
                let mut fields = pci_common([
                    ("id", Is(json!(NicId(i).to_string()))),
                    ("mac", Is(json!(mac.to_string()))),
                    ("num_queues", Default(json!(2))),
                    ("queue_size", Default(json!(256))),
                    ("vhost_user", Default(json!(false))),
                    ("vhost_mode", Default(json!("Client"))),
                    // The tap's descriptor, by the VMM's own number.
                    ("fds", Filled),
                    ("offload_tso", Default(json!(true))),
                    ("offload_ufo", Default(json!(true))),
                    ("offload_csum", Default(json!(true))),
                ]);
                if bytes != 0 {
                    fields.push(("rate_limiter_config", limiter(bytes, 0)));
                }
                Object(fields)
            })
            .collect(),
    )
}

/// A limiter of buckets of `bytes` and `ops` (0: none).
fn limiter(bytes: u64, ops: u64) -> Rule {
    let bucket = |size: u64| {
        Object(vec![
            ("size", Is(json!(size))),
            ("refill_time", Is(json!(REFILL_MS))),
        ])
    };
    let mut fields = Vec::new();
    if bytes != 0 {
        fields.push(("bandwidth", bucket(bytes)));
    }
    if ops != 0 {
        fields.push(("ops", bucket(ops)));
    }
    Object(fields)
}

/// `fields` and what every device has, as v51 wrote it (its `iommu`,
/// always) and v53 does (its segment; `iommu` only when on).
fn pci_common<const N: usize>(fields: [(&'static str, Rule); N]) -> Vec<(&'static str, Rule)> {
    let mut out = Vec::from(fields);
    out.extend([
        ("pci_segment", Default(json!(0))),
        ("iommu", Default(json!(false))),
    ]);
    out
}

fn path(p: &std::path::Path) -> Value {
    json!(p.to_string_lossy())
}

/// Whether a field holds nothing: as cloud-hypervisor reads it, no more
/// than a field left out.
fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(empty),
        _ => false,
    }
}

/// Why `value`, at `at`, breaks `rule`; `None` when it keeps it.
fn check(rule: &Rule, value: &Value, at: &str) -> Option<String> {
    let name = || if at.is_empty() { "the document" } else { at };
    match rule {
        Filled => None,
        Either(_) if value.is_null() => None,
        Either(rule) => check(rule, value, at),
        Is(want) | Default(want) if value == want => None,
        Default(_) if value.is_null() => None,
        Is(want) | Default(want) => Some(format!(
            "{} is {}, where the agent's VM has {want}",
            name(),
            shown(value)
        )),
        Object(fields) => {
            let Some(map) = value.as_object() else {
                return match value {
                    Value::Null => fields
                        .iter()
                        .find_map(|(key, rule)| check(rule, &Value::Null, &join(at, key))),
                    _ => Some(format!("{} is {}, not an object", name(), shown(value))),
                };
            };
            if let Some((key, v)) = map
                .iter()
                .find(|(key, v)| !fields.iter().any(|(k, _)| k == key) && !empty(v))
            {
                return Some(format!(
                    "it sets {} to {}, which the agent never does",
                    join(at, key),
                    shown(v)
                ));
            }
            fields.iter().find_map(|(key, rule)| {
                check(rule, map.get(*key).unwrap_or(&Value::Null), &join(at, key))
            })
        }
        List(items) => {
            let list = value.as_array().map(Vec::as_slice).unwrap_or_default();
            if list.len() > items.len() {
                return Some(format!(
                    "{} holds {} more than the agent's VM has: {}",
                    name(),
                    list.len() - items.len(),
                    shown(&Value::from(list[items.len()..].to_vec()))
                ));
            }
            if list.len() < items.len() {
                return Some(format!(
                    "{} holds {} where the agent's VM has {}",
                    name(),
                    list.len(),
                    items.len()
                ));
            }
            items
                .iter()
                .zip(list)
                .enumerate()
                .find_map(|(i, (rule, v))| check(rule, v, &format!("{at}[{i}]")))
        }
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

/// A value as the refusal says it: its JSON (which escapes whatever a
/// string holds), cut short.
fn shown(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(200) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected() -> Expected {
        Expected {
            disks: vec![
                "/tmp/.tmpwCiMiF/state/vms/nap-1/disk.raw".into(),
                "/tmp/.tmpwCiMiF/state/vms/nap-1/seed.iso".into(),
            ],
            serial: "/tmp/.tmpwCiMiF/state/vms/nap-1/serial.log".into(),
            vcpus: 1,
            memory_bytes: 512 << 20,
            hugepages: false,
            payload: Some(Payload::Kernel {
                kernel: "/var/cache/eitri-e2e/kernel/vmlinux".into(),
                cmdline: "console=ttyS0 root=/dev/vda rw".into(),
            }),
            macs: vec![Mac::parse("26:1c:bc:6b:7e:4b").expect("mac")],
            buckets: Buckets::default(),
            landlock_rule: Some("/tmp/.tmpwCiMiF/state/vms/nap-1/snapshot.tmp".into()),
            guest_socket: "/tmp/.tmpwCiMiF/state/vms/nap-1/vsock/guest.sock".into(),
        }
    }

    /// A `config.json` as cloud-hypervisor v54 wrote it on this host, for
    /// a VM the agent started (`make e2e-real`'s suspend test), whole.
    fn written() -> Value {
        json!({
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "kvm_hyperv": false, "max_phys_bits": 46,
                     "features": {"amx": false}, "nested": true, "core_scheduling": "Vm", "profile": "Host"},
            "memory": {"size": 536_870_912_u64, "mergeable": false, "hotplug_method": "Acpi", "shared": true,
                       "hugepages": false, "prefault": false, "reserve": false, "thp": true},
            "payload": {"kernel": "/var/cache/eitri-e2e/kernel/vmlinux", "cmdline": "console=ttyS0 root=/dev/vda rw"},
            "disks": [
                {"id": "_disk0", "pci_segment": 0, "path": "/tmp/.tmpwCiMiF/state/vms/nap-1/disk.raw",
                 "readonly": false, "direct": false, "num_queues": 1, "queue_size": 128, "vhost_user": false,
                 "disable_io_uring": false, "disable_aio": false, "backing_files": false, "sparse": true,
                 "image_type": "Raw", "lock_granularity": "ByteRange"},
                {"id": "_disk1", "pci_segment": 0, "path": "/tmp/.tmpwCiMiF/state/vms/nap-1/seed.iso",
                 "readonly": true, "direct": false, "num_queues": 1, "queue_size": 128, "vhost_user": false,
                 "disable_io_uring": false, "disable_aio": false, "backing_files": false, "sparse": true,
                 "image_type": "Raw", "lock_granularity": "ByteRange"}
            ],
            "net": [{"id": "net0", "pci_segment": 0, "mac": "26:1c:bc:6b:7e:4b", "num_queues": 2,
                     "queue_size": 256, "vhost_user": false, "vhost_mode": "Client", "fds": [4],
                     "offload_tso": true, "offload_ufo": true, "offload_csum": true}],
            "rng": {"pci_segment": 0, "src": "/dev/urandom"},
            "serial": {"file": "/tmp/.tmpwCiMiF/state/vms/nap-1/serial.log", "mode": "File"},
            "console": {"mode": "Off", "pci_segment": 0},
            "debug_console": {"mode": "Off", "iobase": 233},
            "pvpanic": false,
            "iommu": false,
            "watchdog": false,
            "landlock_enable": true,
            "landlock_rules": [{"path": "/tmp/.tmpwCiMiF/state/vms/nap-1/snapshot.tmp", "access": "rw"}]
        })
    }

    fn limited() -> Expected {
        Expected {
            buckets: Buckets::of(crate::model::VmLimits {
                disk_mbps: 100,
                disk_iops: 500,
                net_mbps: 80,
                ..crate::model::VmLimits::default()
            }),
            ..expected()
        }
    }

    /// `written()` with the limiters of [`limited`], as v54 writes them
    /// (a bucket's `one_time_burst` null, a missing bucket null).
    fn written_limited() -> Value {
        let mut config = written();
        let bucket = |size: u64| json!({"size": size, "one_time_burst": null, "refill_time": 1000});
        config["rate_limit_groups"] = json!([{"id": "disks", "rate_limiter_config":
            {"bandwidth": bucket(100_000_000), "ops": bucket(500)}}]);
        config["disks"][0]["rate_limit_group"] = json!("disks");
        config["net"][0]["rate_limiter_config"] =
            json!({"bandwidth": bucket(10_000_000), "ops": null});
        config
    }

    #[test]
    fn what_cloud_hypervisor_wrote_for_the_agents_vm_passes() {
        assert_eq!(difference(&written(), &expected()), None);
        assert_eq!(difference(&written_limited(), &limited()), None);
    }

    /// The VM of [`expected`] as a clone `web-2` of it, with limits.
    fn its_clone() -> Expected {
        let swap = |p: &PathBuf| PathBuf::from(p.to_string_lossy().replace("nap-1", "web-2"));
        let e = limited();
        Expected {
            disks: e.disks.iter().map(swap).collect(),
            serial: swap(&e.serial),
            macs: vec![Mac::parse("26:aa:bb:cc:dd:ee").expect("mac")],
            landlock_rule: e.landlock_rule.as_ref().map(swap),
            guest_socket: swap(&e.guest_socket),
            ..e
        }
    }

    #[test]
    fn a_template_conformed_to_its_clone_is_the_clones_whole() {
        let clone = its_clone();

        let config = conform(&written(), &clone);

        assert_eq!(difference(&config, &clone), None);
        assert_eq!(config["net"][0]["mac"], json!("26:aa:bb:cc:dd:ee"));
        assert_eq!(
            config["disks"][0]["path"],
            json!("/tmp/.tmpwCiMiF/state/vms/web-2/disk.raw")
        );
        assert_eq!(config["net"][0]["fds"], json!([4]), "the VMM's own, kept");
    }

    #[test]
    fn a_templates_limiters_are_dropped_for_a_clone_without_them() {
        let config = conform(&written_limited(), &expected());

        assert_eq!(difference(&config, &expected()), None);
        assert!(config.get("rate_limit_groups").is_none(), "{config}");
    }

    #[test]
    fn a_forged_default_in_a_template_is_still_refused_once_conformed() {
        let mut forged = written();
        forged["rng"]["src"] = json!("/etc/shadow");

        let config = conform(&forged, &its_clone());

        assert!(difference(&config, &its_clone()).is_some());
    }

    #[test]
    fn fields_left_out_at_their_defaults_pass() {
        let mut config = written();
        for key in ["debug_console", "pvpanic", "iommu", "watchdog", "rng"] {
            config.as_object_mut().expect("object").remove(key);
        }
        config["cpus"]
            .as_object_mut()
            .expect("cpus")
            .remove("core_scheduling");
        config["memory"]["hugepage_size"] = Value::Null;

        assert_eq!(difference(&config, &expected()), None);
    }

    /// Each field a hostile hypervisor could write for its successor,
    /// with what it would gain, refused.
    #[test]
    fn each_field_a_hostile_hypervisor_could_change_is_refused() {
        let forged: [(&str, Value); 13] = [
            // The tenant's bandwidth caps gone.
            ("/rate_limit_groups", Value::Null),
            ("/disks/0/rate_limit_group", Value::Null),
            ("/net/0/rate_limiter_config", Value::Null),
            // A host path as the guest's entropy (a Landlock read rule).
            ("/rng/src", json!("/")),
            ("/debug_console/mode", json!("Tty")),
            (
                "/generic_vhost_user",
                json!([{"socket": "/run/x.sock", "queue_sizes": [1]}]),
            ),
            ("/memory/hugepages", json!(true)),
            ("/memory/mergeable", json!(true)),
            ("/cpus/affinity", json!([{"vcpu": 0, "host_cpus": [0]}])),
            ("/net/0/mac", json!("02:00:00:00:00:01")),
            ("/balloon", json!({"size": 0})),
            ("/memory/thp", json!(false)),
            ("/platform", json!({"num_pci_segments": 8})),
        ];
        for (pointer, value) in forged {
            let mut config = written_limited();
            let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
            let at = config.pointer_mut(parent).and_then(Value::as_object_mut);
            at.expect("its parent").insert(key.into(), value);

            let why = difference(&config, &limited());

            assert!(why.is_some(), "{pointer} passed");
        }
    }

    #[test]
    fn each_field_the_agent_gave_changed_is_refused() {
        let forged: [(&str, Value); 11] = [
            ("/cpus/boot_vcpus", 8.into()),
            ("/memory/size", (1u64 << 34).into()),
            ("/payload/kernel", "/etc/shadow".into()),
            ("/disks/1/path", "/dev/sda".into()),
            ("/disks/0/image_type", "Qcow2".into()),
            ("/disks/0/backing_files", true.into()),
            ("/net/0/vhost_user", true.into()),
            ("/serial/file", "/etc/passwd".into()),
            ("/console/mode", "Pty".into()),
            ("/landlock_enable", false.into()),
            ("/landlock_rules/0/path", "/".into()),
        ];
        for (pointer, value) in forged {
            let mut config = written();
            *config.pointer_mut(pointer).expect("a field") = value;

            let why = difference(&config, &expected());

            assert!(why.is_some(), "{pointer} passed");
        }
    }

    #[test]
    fn a_field_cloud_hypervisor_may_add_tomorrow_is_refused_until_named() {
        let mut config = written();
        config["memory"]["shiny_new_knob"] = json!(true);

        let why = difference(&config, &expected()).unwrap_or_default();

        assert!(why.contains("memory.shiny_new_knob"), "{why}");
    }

    #[test]
    fn a_disk_more_or_less_is_refused() {
        let mut more = written();
        more["disks"]
            .as_array_mut()
            .expect("disks")
            .push(json!({"path": "/var/lib/other.raw", "image_type": "Raw"}));
        let mut fewer = written();
        fewer["disks"].as_array_mut().expect("disks").pop();

        assert!(difference(&more, &expected()).is_some());
        assert!(difference(&fewer, &expected()).is_some());
    }

    #[test]
    fn v51s_device_iommu_fields_pass_when_off_and_are_refused_on() {
        let mut config = written();
        for pointer in ["/disks/0", "/disks/1", "/net/0", "/rng", "/console"] {
            let device = config.pointer_mut(pointer).and_then(Value::as_object_mut);
            device
                .expect("a device")
                .insert("iommu".into(), json!(false));
        }
        let mut on = config.clone();
        on["disks"][0]["iommu"] = json!(true);

        assert_eq!(difference(&config, &expected()), None);
        assert!(difference(&on, &expected()).is_some());
    }

    #[test]
    fn the_vmms_run_time_fields_may_be_anything() {
        let mut config = written();
        config["net"][0]["fds"] = json!([9]);
        config["disks"][1]["id"] = json!("_disk7");
        config["cpus"]["max_phys_bits"] = json!(52);

        assert_eq!(difference(&config, &expected()), None);
    }
}
