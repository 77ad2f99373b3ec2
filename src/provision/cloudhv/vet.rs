//! What a snapshot's `config.json` (and a restored hypervisor's `vm.info`)
//! may say. A restoring cloud-hypervisor takes its whole VM from that file
//! — disks, serial file, vCPUs, memory, devices, Landlock — and the file is
//! written by the hypervisor being saved: one its guest took over could
//! give its successor a host file as a disk or a QCOW2 backing file, a
//! passed-through device, a vhost-user socket, more vCPUs or memory than
//! the spec, or no Landlock. So, sealed (root's, out of any VMM's sight),
//! it is read field by field against what the agent started the VM with;
//! any difference refuses the snapshot (the VM is booted from its disks
//! instead, and says why). After a restore, the new hypervisor's own
//! account (`vm.info`) is read the same way, and one that differs is
//! killed.
//!
//! cloud-hypervisor cannot be told `--landlock` with `--restore` (the
//! flag belongs to a group that requires a payload): Landlock on a
//! restored VM is what this check holds the sealed file to.

use std::path::PathBuf;

use serde_json::Value;

/// What the agent started the VM with, as cloud-hypervisor writes it.
#[derive(Clone, Debug)]
pub(super) struct Expected {
    /// Every disk in order: the root disk, the seed, the volumes.
    pub disks: Vec<PathBuf>,
    pub serial: PathBuf,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// The kernel or firmware it boots; `None`: not compared (a restored
    /// hypervisor runs the guest in its memory, not the file).
    pub payload: Option<PathBuf>,
    /// The one Landlock rule, the snapshot's work dir, when it runs under
    /// Landlock.
    pub landlock_rule: Option<PathBuf>,
}

/// Devices the agent never gives a VM, each reaching something of the
/// host's: passed-through PCI devices, user-space devices and their
/// sockets, vDPA, vsock, shared directories, persistent memory backed by a
/// host file, a TPM's socket, SGX, shared memory, fds kept open.
const NEVER: [&str; 11] = [
    "devices",
    "user_devices",
    "vdpa",
    "vsock",
    "fs",
    "pmem",
    "tpm",
    "sgx_epc",
    "ivshmem",
    "preserved_fds",
    "numa",
];

/// Why `config` is not what `expected` says; `None` when it is.
pub(super) fn difference(config: &Value, expected: &Expected) -> Option<String> {
    if let Some(key) = NEVER.iter().find(|k| present(&config[**k])) {
        return Some(format!(
            "it gives the VM {key}, which the agent never does: a hypervisor its guest took over would reach the host through it"
        ));
    }
    let vcpus = u64::from(expected.vcpus);
    let cpus = &config["cpus"];
    if cpus["boot_vcpus"].as_u64() != Some(vcpus) || cpus["max_vcpus"].as_u64() != Some(vcpus) {
        return Some(format!(
            "it says {} vCPUs (at most {}), the VM has {vcpus}",
            cpus["boot_vcpus"], cpus["max_vcpus"]
        ));
    }
    let memory = &config["memory"];
    if memory["size"].as_u64() != Some(expected.memory_bytes)
        || present(&memory["hotplug_size"])
        || present(&memory["zones"])
    {
        return Some(format!(
            "its memory is {} bytes (or has hotplug or zones), the VM has {}",
            memory["size"], expected.memory_bytes
        ));
    }
    if let Some(payload) = &expected.payload {
        let named: Vec<&str> = ["kernel", "firmware", "initramfs", "igvm"]
            .iter()
            .filter_map(|k| config["payload"][*k].as_str())
            .collect();
        if named != [payload.to_string_lossy()] {
            return Some(format!(
                "its payload is {named:?}, the VM boots {}",
                payload.display()
            ));
        }
    }
    if let Some(why) = disks(&config["disks"], &expected.disks) {
        return Some(why);
    }
    for net in config["net"].as_array().into_iter().flatten() {
        if net["vhost_user"] == Value::Bool(true) || present(&net["vhost_socket"]) {
            return Some("a NIC of it is a vhost-user socket; the agent gives taps".into());
        }
    }
    let serial = &config["serial"];
    if serial["mode"] != "File"
        || serial["file"].as_str() != Some(&*expected.serial.to_string_lossy())
    {
        return Some(format!(
            "its serial console is {serial}, the VM's is the file {}",
            expected.serial.display()
        ));
    }
    if !matches!(config["console"]["mode"].as_str(), Some("Off") | None) {
        return Some(format!(
            "its virtio console is {}, the agent turns it off",
            config["console"]
        ));
    }
    landlock(config, expected.landlock_rule.as_ref())
}

fn disks(disks: &Value, expected: &[PathBuf]) -> Option<String> {
    let listed: Vec<&Value> = disks
        .as_array()
        .map(|d| d.iter().collect())
        .unwrap_or_default();
    let paths: Vec<&str> = listed.iter().filter_map(|d| d["path"].as_str()).collect();
    let want: Vec<String> = expected
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if paths.len() != listed.len() || paths != want {
        return Some(format!("its disks are {paths:?}, the VM's are {want:?}"));
    }
    for disk in listed {
        // Raw, never probed, no backing file: see `argv::RAW`.
        if disk["image_type"] != "Raw"
            || disk["backing_files"] == Value::Bool(true)
            || disk["vhost_user"] == Value::Bool(true)
            || present(&disk["vhost_socket"])
        {
            return Some(format!(
                "its disk {} is not a raw file without backing files ({disk})",
                disk["path"]
            ));
        }
    }
    None
}

/// A restored hypervisor takes Landlock, and the paths it may reach, from
/// here: it must say what the agent booted with, Landlock on and no rule
/// but the one for the snapshot's work dir.
fn landlock(config: &Value, rule: Option<&PathBuf>) -> Option<String> {
    let rule = rule?;
    if config["landlock_enable"] != Value::Bool(true) {
        return Some(
            "it turns Landlock off, which its hypervisor was booted with: a hypervisor its guest took over would free its successor"
                .into(),
        );
    }
    let work = rule.to_string_lossy();
    let rules = config["landlock_rules"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    rules.iter().find(|r| r["path"] != *work).map(|r| {
        format!(
            "it gives Landlock a rule the agent did not ({}): a hypervisor its guest took over would widen what its successor reaches",
            crate::quote::text(&r.to_string())
        )
    })
}

/// Whether a field is there with something in it.
fn present(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_u64() != Some(0),
        Value::String(s) => !s.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected() -> Expected {
        Expected {
            disks: vec!["/s/vms/a/disk.raw".into(), "/s/vms/a/seed.iso".into()],
            serial: "/s/vms/a/serial.log".into(),
            vcpus: 1,
            memory_bytes: 64 << 20,
            payload: Some("/boot/vmlinux".into()),
            landlock_rule: Some("/s/vms/a/snapshot.tmp".into()),
        }
    }

    /// A `config.json` as cloud-hypervisor v54 writes it (seen on this
    /// host, trimmed of fields the check does not read).
    fn written() -> Value {
        serde_json::json!({
            "cpus": {"boot_vcpus": 1, "max_vcpus": 1, "nested": true},
            "memory": {"size": 67_108_864, "shared": true, "hugepages": false},
            "payload": {"kernel": "/boot/vmlinux", "cmdline": "console=ttyS0"},
            "disks": [
                {"id": "_disk0", "path": "/s/vms/a/disk.raw", "readonly": false, "vhost_user": false, "backing_files": false, "image_type": "Raw"},
                {"id": "_disk1", "path": "/s/vms/a/seed.iso", "readonly": true, "vhost_user": false, "backing_files": false, "image_type": "Raw"}
            ],
            "net": [{"id": "net0", "mac": "52:54:00:00:00:01", "vhost_user": false}],
            "rng": {"src": "/dev/urandom"},
            "serial": {"file": "/s/vms/a/serial.log", "mode": "File"},
            "console": {"mode": "Off"},
            "landlock_enable": true,
            "landlock_rules": [{"path": "/s/vms/a/snapshot.tmp", "access": "rw"}]
        })
    }

    #[test]
    fn what_the_agent_started_the_vm_with_passes() {
        assert_eq!(difference(&written(), &expected()), None);
    }

    #[test]
    fn each_field_a_hostile_hypervisor_could_change_is_refused() {
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
    fn a_device_the_agent_never_gives_is_refused() {
        let mut config = written();
        config["devices"] = serde_json::json!([{"path": "/sys/bus/pci/devices/0000:01:00.0"}]);

        let why = difference(&config, &expected()).unwrap_or_default();

        assert!(why.contains("devices"), "{why}");
    }

    #[test]
    fn a_disk_more_or_less_is_refused() {
        let mut more = written();
        more["disks"]
            .as_array_mut()
            .expect("disks")
            .push(serde_json::json!({"path": "/var/lib/other.raw", "image_type": "Raw"}));
        let mut fewer = written();
        fewer["disks"].as_array_mut().expect("disks").pop();

        assert!(difference(&more, &expected()).is_some());
        assert!(difference(&fewer, &expected()).is_some());
    }
}
