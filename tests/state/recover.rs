//! Start-up recovery (`daemon::recover`) on a state dir and host left by
//! an agent killed in each phase of its work: mid atomic write in every
//! directory it writes, mid download, mid destroy, and after starting a
//! VMM (which lives on, next to a leaked tap). One run of the recovery
//! must leave the store clean, the host's leftovers gone, and the live VMM
//! adopted: running, watched, and not restarted.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::config::{self, Command, Config};
use eitri_agent::deadline::Deadline;
use eitri_agent::model::Id;
use eitri_agent::provision::Lifecycle;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::state::{Record, Store};
use eitri_agent::testkit::tools::tool;
use eitri_agent::testkit::{desired, id};

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");

/// A tap prefix of this test process alone.
fn tap_prefix() -> String {
    format!("er{:04x}", std::process::id() & 0xffff)
}

fn launcher(dir: &Path) -> PathBuf {
    let path = dir.join("hv");
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &path, &[]);
    path
}

fn config(dir: &Path) -> Config {
    let confinement = eitri_agent::testkit::confinement(dir);
    let args: Vec<String> = [
        "run",
        "--desired",
        "/dev/null",
        "--state-dir",
        &dir.join("state").display().to_string(),
        "--run-dir",
        &dir.join("run").display().to_string(),
        "--hypervisor",
        &launcher(dir).display().to_string(),
        "--kernel",
        &dir.join("vmlinux").display().to_string(),
        "--tap-prefix",
        &tap_prefix(),
        "--underlay-bridge=",
        "--kvm-device",
        &confinement.kvm.display().to_string(),
        "--userfaultfd-device",
        &confinement
            .userfaultfd
            .as_ref()
            .map(|u| u.display().to_string())
            .unwrap_or_default(),
        "--cgroup-root",
        &confinement.cgroup_root,
        "--agents-dir",
        &dir.join("agents").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    match config::parse(&args, &HashMap::new()).expect("config") {
        Command::Run(c) => *c,
        other => panic!("not run: {other:?}"),
    }
}

/// What the killed agent had done to the host: a VMM it started for
/// `vm-live` (with its record and pidfile), still running.
fn a_vmm_left_running(config: &Config) -> i32 {
    std::fs::write(
        config.state.dir.parent().expect("dir").join("vmlinux"),
        b"k",
    )
    .expect("kernel");
    let store = Arc::new(Store::open(&config.state.dir).expect("store"));
    let spec = desired("vm-live").spec;
    let mut rec = Record::new(spec.clone());
    rec.created("boot-1".into(), true);
    store.save(&rec).expect("record");
    let backend = CloudHypervisor::new(
        Arc::clone(&store),
        CloudHvConfig {
            hypervisor: Arc::clone(&config.guest.hypervisor),
            tap_prefix: config.guest.tap_prefix.clone(),
            boot_wait: Duration::from_secs(5),
            network: None,
            confinement: Arc::clone(&config.guest.confinement),
            limits: Arc::clone(&config.guest.limits),
        },
    );
    backend.boot(&spec, Deadline::NONE).expect("boot");
    let pidfile = std::fs::read_to_string(store.layout().pidfile(&id("vm-live"))).expect("pidfile");
    pidfile
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .expect("pid")
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            != Some("Z")
    })
}

/// A persistent tap with the agent's prefix, as a crash (or `ip tuntap
/// add`) leaves; deleted on drop whatever happens.
struct LeakedTap(String);

impl LeakedTap {
    fn make(name: String) -> LeakedTap {
        let made = tool("ip")
            .args(["tuntap", "add", "dev", &name, "mode", "tap"])
            .status()
            .expect("ip");
        assert!(made.success());
        LeakedTap(name)
    }

    fn exists(&self) -> bool {
        Path::new("/sys/class/net").join(&self.0).exists()
    }
}

impl Drop for LeakedTap {
    fn drop(&mut self) {
        let _ = tool("ip").args(["link", "del", &self.0]).output();
    }
}

#[test]
fn recovery_repairs_what_a_crash_in_each_phase_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    let vmm = a_vmm_left_running(&config);
    let state = &config.state.dir;
    let leftovers: Vec<PathBuf> = [
        ".epoch.tmp-999-0",
        "vms/vm-live/.record.json.tmp-999-1",
        "net/.addresses.json.tmp-999-2",
        "jail/.ids.json.tmp-999-5",
        "volumes/.data-1.tmp-999-3",
        "images/.partial-abababab-999-4",
    ]
    .iter()
    .map(|p| state.join(p))
    .collect();
    for path in &leftovers {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("dir");
        std::fs::write(path, b"half").expect("leftover");
    }
    let half_deleted = state.join("vms/.deleting-vm-gone-999-0");
    std::fs::create_dir_all(&half_deleted).expect("dir");
    std::fs::write(half_deleted.join("disk.raw"), b"x").expect("disk");
    let leaked = LeakedTap::make(format!("{}leak", tap_prefix()));

    let recovered = eitri_agent::daemon::recover::recover(&config, vec![]).expect("recovery runs");

    let left: Vec<_> = leftovers.iter().filter(|p| p.exists()).collect();
    assert!(left.is_empty(), "not swept: {left:?}");
    assert!(!half_deleted.exists(), "the half-done delete is finished");
    assert!(!leaked.exists(), "the leaked tap is removed");
    let vm = Id::parse("vm-live").expect("id");
    assert!(alive(vmm), "the live VMM is left running");
    assert!(recovered.provisioner.running(&vm), "and adopted");
    // Adopted means watched: its exit is told at once.
    let (tx, rx) = crossbeam_channel::unbounded();
    recovered
        .provisioner
        .watch_exits(Arc::new(move |id: &Id| drop(tx.send(id.clone()))));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(vmm),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(vm.clone()));
    let _ = recovered.provisioner.destroy(&vm, Deadline::NONE);
    eitri_agent::testkit::remove_cgroup_root(&config.guest.confinement.cgroup_root);
}

#[test]
fn without_nft_status_says_guest_traffic_is_unprotected() {
    let _fakes = eitri_agent::testkit::tools::without(&["nft"]);
    eitri_agent::testkit::net::private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = config(dir.path());
    config.guest.underlay = Some(eitri_agent::net::underlay::UnderlayConfig {
        tap_prefix: tap_prefix(),
        ..eitri_agent::testkit::net::underlay_config()
    });

    let recovered = eitri_agent::daemon::recover::recover(&config, vec![]).expect("recovery");

    assert!(
        recovered
            .notes
            .iter()
            .any(|n| n.contains("unprotected") && n.contains("install nftables")),
        "{:?}",
        recovered.notes
    );
}
