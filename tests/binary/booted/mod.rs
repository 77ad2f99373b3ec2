//! Agents that boot VMs: the stand-in hypervisor jailed as on a Linux host
//! (cgroups, a network namespace of the test's own).
use super::*;

mod host;
mod network;
mod status;
mod usage;

/// What an agent that boots VMs needs beside its temp dir: the stand-in
/// hypervisor and a kernel file, a KVM device of its own, a base image,
/// and a cgroup root whose VMMs are ended with the test (they outlive
/// their agent, by design).
struct Booting {
    flags: Vec<String>,
    image: String,
    image_sha256: String,
    cgroup_root: String,
}

impl Booting {
    fn new(dir: &Path) -> Booting {
        Booting::with_knobs(dir, &[])
    }

    /// As `new`, the stand-in's `knobs` set.
    fn with_knobs(dir: &Path, knobs: &[(&str, &str)]) -> Booting {
        use std::os::unix::fs::PermissionsExt;
        // The jailed VMM must reach its binary and kernel.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).expect("chmod");
        let hypervisor = dir.join("hypervisor");
        eitri_agent::testkit::standin_hypervisor(
            Path::new(env!("CARGO_BIN_EXE_eitri-standin-hypervisor")),
            &hypervisor,
            knobs,
        );
        let kernel = dir.join("vmlinux");
        std::fs::write(&kernel, b"not really a kernel").expect("kernel");
        let kvm = dir.join("kvm");
        std::fs::write(&kvm, b"").expect("kvm");
        let base = dir.join("base.raw");
        std::fs::write(&base, vec![0x5a; 1 << 20]).expect("base image");
        let cgroup_root = format!("eitri-test-{}-binary", std::process::id());
        let path = |p: &Path| p.display().to_string();
        Booting {
            flags: vec![
                "--hypervisor".into(),
                path(&hypervisor),
                "--kernel".into(),
                path(&kernel),
                "--kvm-device".into(),
                path(&kvm),
                "--userfaultfd-device=".into(),
                "--cgroup-root".into(),
                cgroup_root.clone(),
                "--image-root".into(),
                path(dir),
            ],
            image: format!("file://{}", path(&base)),
            image_sha256: eitri_agent::image::sha256_file(&base).expect("hash"),
            cgroup_root,
        }
    }

    /// A desired VM of one vCPU booting the base image, with `extra` keys.
    fn vm_json(&self, id: &str, extra: &str) -> String {
        format!(
            r#"{{"vm_id":"{id}","name":"{id}","image_url":"{}","image_sha256":"{}","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"{extra}}}"#,
            self.image, self.image_sha256
        )
    }

    fn start(&self, dir: &Path, extra: &[&str]) -> Agent {
        let mut flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        flags.extend_from_slice(extra);
        Agent::start(dir, &flags)
    }
}

impl Drop for Booting {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

/// `vm`'s detail in `report` (what `status VM` shows).
fn detail_of(report: &serde_json::Value, vm: &str) -> serde_json::Value {
    report["details"][vm].clone()
}

/// An agent over `dir` whose one desired VM, `vm`, is ready.
fn one_vm_ready(dir: &Path, vm: &str) -> (Booting, Agent) {
    let boot = Booting::new(dir);
    desired(dir, &format!(r#"{{"vms":[{}]}}"#, boot.vm_json(vm, "")));
    let agent = boot.start(dir, &[]);
    agent.wait_report(&format!("{vm} ready"), |r| {
        row_of(r, vm)["phase"] == "ready"
    });
    (boot, agent)
}

#[test]
fn a_vm_is_ready_once_its_guest_prints_the_probes_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    // The stand-in prints "eitri standin: booting" as it starts.
    desired(
        dir.path(),
        &format!(
            r#"{{"vms":[{}]}}"#,
            boot.vm_json(
                "up-1",
                r#","readiness":{"serial_contains":"standin: booting","period_s":1}"#
            )
        ),
    );

    let agent = boot.start(dir.path(), &[]);
    let report = agent.wait_report("up-1 ready", |r| row_of(r, "up-1")["phase"] == "ready");

    let row = row_of(&report, "up-1");
    assert_eq!(row["power_state"], "running", "{row}");
    let readiness = row["readiness"].as_str().unwrap_or_default();
    assert!(readiness.contains("answered"), "{row}");
}

#[test]
fn a_vm_whose_guest_never_prints_the_probes_line_stays_creating_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    desired(
        dir.path(),
        &format!(
            r#"{{"vms":[{}]}}"#,
            boot.vm_json(
                "mute-1",
                r#","readiness":{"serial_contains":"never printed","period_s":1,"grace_s":60}"#
            )
        ),
    );

    let agent = boot.start(dir.path(), &[]);
    let report = agent.wait_report("mute-1 waiting for its guest", |r| {
        row_of(r, "mute-1")["status_detail"]
            .as_str()
            .is_some_and(|d| d.contains("waiting for the guest"))
    });

    let row = row_of(&report, "mute-1");
    assert_eq!(row["phase"], "creating", "{row}");
    let detail = row["status_detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("never printed") && detail.contains("of 60 s"),
        "{row}"
    );
}

#[test]
fn the_hosts_per_vcpu_cpu_cap_flag_is_a_booted_vms_cgroup_quota() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    desired(
        dir.path(),
        &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("cap-1", r#","vcpus":2"#)),
    );

    let agent = boot.start(dir.path(), &["--vm-cpu-max-millis-per-vcpu", "250"]);
    let report = agent.wait_report("cap-1 ready", |r| row_of(r, "cap-1")["phase"] == "ready");

    let row = row_of(&report, "cap-1");
    assert!(
        row["limits"]
            .as_str()
            .is_some_and(|l| l.contains("cpu 0.5")),
        "{row}"
    );
    // Half a CPU: 50 ms of every 100 ms period.
    assert_eq!(quota(&boot, "cap-1"), Some(50_000));
}

#[test]
fn a_limit_changed_on_a_running_vm_waits_saying_so_and_is_taken_at_its_next_boot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    let wanted = |millis: u32, power: &str| {
        let vm = boot
            .vm_json("cap-1", &format!(r#","cpu_max_millis":{millis}"#))
            .replace(
                r#""power_state":"running""#,
                &format!(r#""power_state":"{power}""#),
            );
        format!(r#"{{"vms":[{vm}]}}"#)
    };
    desired(dir.path(), &wanted(500, "running"));
    let agent = boot.start(dir.path(), &[]);
    agent.wait_report("cap-1 ready", |r| row_of(r, "cap-1")["phase"] == "ready");
    let pid = vmm_pid(&boot, "cap-1");

    desired(dir.path(), &wanted(250, "running"));
    let waiting = agent.wait_report("the change said to wait", |r| {
        row_of(r, "cap-1")["status_detail"]
            .as_str()
            .is_some_and(|d| d.contains("limits change at the next boot"))
    });
    let (quota_while_waiting, pid_while_waiting) = (quota(&boot, "cap-1"), vmm_pid(&boot, "cap-1"));
    desired(dir.path(), &wanted(250, "stopped"));
    agent.wait_report("cap-1 stopped", |r| {
        row_of(r, "cap-1")["power_state"] == "stopped"
    });
    desired(dir.path(), &wanted(250, "running"));
    let booted = agent.wait_report("cap-1 booted again", |r| {
        let row = row_of(r, "cap-1");
        row["power_state"] == "running" && row["phase"] == "ready"
    });

    assert_eq!(row_of(&waiting, "cap-1")["limits"], "cpu 0.5", "{waiting}");
    assert_eq!(quota_while_waiting, Some(50_000));
    assert_eq!(pid_while_waiting, pid);
    assert_eq!(quota(&boot, "cap-1"), Some(25_000));
    assert_eq!(row_of(&booted, "cap-1")["limits"], "cpu 0.25", "{booted}");
    assert!(
        row_of(&booted, "cap-1")["status_detail"]
            .as_str()
            .is_some_and(|d| !d.contains("limits change"))
    );
}

#[test]
fn a_spec_error_in_a_running_vms_entry_keeps_it_running_and_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (boot, agent) = one_vm_ready(dir.path(), "run-1");
    let pid = vmm_pid(&boot, "run-1");

    let bad = boot.vm_json("run-1", r#","no_such_key":1"#);
    desired(dir.path(), &format!(r#"{{"vms":[{bad}]}}"#));
    let report = agent.wait_report("the entry refused", |r| {
        row_of(r, "run-1")["spec_rejected"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    });

    let row = row_of(&report, "run-1");
    assert_eq!(row["phase"], "ready", "{row}");
    assert_eq!(row["power_state"], "running", "{row}");
    assert!(
        row["spec_rejected"]
            .as_str()
            .is_some_and(|s| s.contains("no_such_key")),
        "{row}"
    );
    assert_eq!(vmm_pid(&boot, "run-1"), pid, "its VMM was touched");
    let status = eitri(&["status", "--state-dir", &agent.state.display().to_string()]);
    let header = String::from_utf8_lossy(&status.stdout);
    assert!(
        header.contains("1 spec rejected") && !header.contains("failed"),
        "{header}"
    );
}

/// `vm`'s cgroup file `name` under `boot`'s root.
fn cgroup_file(boot: &Booting, vm: &str, name: &str) -> Option<String> {
    eitri_agent::testkit::cgroup_file(&boot.cgroup_root, &eitri_agent::testkit::id(vm), name)
}

/// `vm`'s CPU quota, in µs per period (cgroup v1 or v2).
fn quota(boot: &Booting, vm: &str) -> Option<u64> {
    cgroup_file(boot, vm, "cpu.cfs_quota_us")
        .or_else(|| cgroup_file(boot, vm, "cpu.max"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The pid of the VMM in `vm`'s cgroup under `boot`'s root.
fn vmm_pid(boot: &Booting, vm: &str) -> Option<u32> {
    cgroup_file(boot, vm, "cgroup.procs")?
        .lines()
        .next()?
        .parse()
        .ok()
}
