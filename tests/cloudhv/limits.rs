//! A VM's limits on its VMM's command line and in its cgroups.

use super::*;

/// What the VM's VMM's API says its configuration is.
pub(crate) fn vm_config(h: &Host, vm: &str) -> serde_json::Value {
    let (_, body) = eitri_agent::provision::unix_http::request(
        &h.backend.socket_path(&id(vm)),
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(2),
    )
    .expect("vm.info");
    let info: serde_json::Value = serde_json::from_slice(&body).expect("json");
    info["config"].clone()
}

/// A real cloud-hypervisor takes the limits' command line and holds them:
/// its own account of its configuration has the disks' group and bucket
/// and the NIC's. (That it paces a guest's I/O to them is measured by
/// `make bench-limits`, on a guest that does I/O.)
#[test]
fn a_real_vmm_holds_the_disk_and_nic_limits_it_was_given() {
    eitri_agent::testkit::net::private_network();
    let mut h = match real_host() {
        Ok(h) => h,
        Err(why) => return println!("SKIPPED: {why}"),
    };
    h.connect();
    let mut spec = h.spec("vm-1");
    spec.limits.disk_mbps = 50;
    spec.limits.disk_iops = 800;
    spec.limits.net_mbps = 80;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let config = vm_config(&h, "vm-1");
    assert_eq!(vm_state(&h, "vm-1").as_deref(), Some("Running"));
    let group = &config["rate_limit_groups"][0];
    assert_eq!(group["id"], "disks", "{config}");
    assert_eq!(
        group["rate_limiter_config"]["bandwidth"]["size"], 50_000_000,
        "{config}"
    );
    assert_eq!(group["rate_limiter_config"]["ops"]["size"], 800, "{config}");
    assert_eq!(config["disks"][0]["rate_limit_group"], "disks", "{config}");
    assert_eq!(
        config["net"][0]["rate_limiter_config"]["bandwidth"]["size"], 10_000_000,
        "{config}"
    );
}

#[test]
fn every_disk_the_hypervisor_is_given_is_raw_with_backing_files_off() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let log = std::fs::read_to_string(h.store.layout().hypervisor_log(&id("vm-1"))).expect("log");

    let start = args.iter().position(|a| a == "--disk").expect("--disk") + 1;
    let disks: Vec<&String> = args[start..]
        .iter()
        .take_while(|a| !a.starts_with("--"))
        .collect();
    assert_eq!(disks.len(), 2, "root disk and seed: {args:?}");
    assert!(
        disks
            .iter()
            .all(|d| d.ends_with(",image_type=raw,backing_files=off")),
        "{disks:?}"
    );
    assert!(
        !log.contains("DEPRECATION"),
        "the format is never probed: {log}"
    );
}

/// The VMM's arguments, as its /proc cmdline has them.
pub(crate) fn vmm_args(h: &Host, vm: &str) -> Vec<String> {
    let pid = h.pid(vm).expect("pid");
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .expect("cmdline")
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The VM's cgroup file `name`, from whichever hierarchy has it.
pub(crate) fn cgroup_file(h: &Host, vm: &str, name: &str) -> Option<String> {
    eitri_agent::testkit::cgroup_file(&h.cfg.confinement.cgroup_root, &id(vm), name)
}

#[test]
fn a_vms_cpu_cap_is_its_cgroups_quota_and_its_burst_too() {
    let h = Host::new(&[]);
    let mut spec = h.spec("vm-1");
    spec.limits.cpu_max_millis = 250;
    spec.limits.cpu_burst_ms = 10;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("25000") || quota.as_deref() == Some("25000 100000"),
        "{quota:?}"
    );
    let burst = cgroup_file(&h, "vm-1", "cpu.cfs_burst_us")
        .or_else(|| cgroup_file(&h, "vm-1", "cpu.max.burst"));
    assert_eq!(burst.as_deref(), Some("10000"));
}

#[test]
fn a_stopped_vm_boots_again_with_a_cap_below_its_old_burst() {
    let h = Host::new(&[]);
    let mut spec = h.spec("vm-1");
    spec.limits.cpu_max_millis = 500;
    spec.limits.cpu_burst_ms = 40;
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stop");
    spec.limits.cpu_max_millis = 200;
    spec.limits.cpu_burst_ms = 0;

    h.backend
        .boot(&spec, Deadline::NONE)
        .expect("boot with the lower cap");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("20000") || quota.as_deref() == Some("20000 100000"),
        "{quota:?}"
    );
}

#[test]
fn a_vm_with_no_cap_of_its_own_takes_the_hosts_per_vcpu() {
    let mut h = Host::new(&[]);
    Arc::make_mut(&mut h.cfg.limits)
        .defaults
        .cpu_max_millis_per_vcpu = 500;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let mut spec = h.spec("vm-1");
    spec.vcpus = 2;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let quota =
        cgroup_file(&h, "vm-1", "cpu.cfs_quota_us").or_else(|| cgroup_file(&h, "vm-1", "cpu.max"));
    assert!(
        quota.as_deref() == Some("100000") || quota.as_deref() == Some("100000 100000"),
        "{quota:?}"
    );
}

#[test]
fn a_vms_disk_and_nic_limits_are_on_its_vmms_command_line() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let mut spec = h.spec("vm-1");
    spec.limits.disk_mbps = 50;
    spec.limits.disk_iops = 800;
    spec.limits.net_mbps = 80;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let args = vmm_args(&h, "vm-1");
    assert!(
        args.iter().any(|a| a
            == "id=disks,bw_size=50000000,bw_refill_time=1000,ops_size=800,ops_refill_time=1000"),
        "{args:?}"
    );
    assert!(
        args.iter()
            .any(|a| a.starts_with("fd=") && a.ends_with(",bw_size=10000000,bw_refill_time=1000")),
        "{args:?}"
    );
}

#[test]
fn a_killed_vmm_raises_its_lost_counter_by_one() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let metrics = eitri_agent::daemon::metrics::MetricsFile::new(
        h.dir.path().join("eitri.prom"),
        Arc::new(ImageCache::new(h.dir.path().join("images"))),
    );
    let lost = || {
        let text = metrics.render(
            &eitri_agent::pb::HostInfo::default(),
            h.engine(),
            &h.engine().published(),
            1,
            &eitri_agent::daemon::metrics::Kept {
                contact_failures: &eitri_agent::metrics::CounterVec::default(),
                epoch_refusals: &eitri_agent::metrics::CounterVec::default(),
                usage: &Default::default(),
            },
        );
        text.lines()
            .find_map(|l| l.strip_prefix("eitri_vm_lost_total{vm_id=\"vm-1\"} "))
            .map(str::to_owned)
    };
    assert_eq!(lost().as_deref(), Some("0"));
    let pid = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("a new VMM", || {
        h.pid("vm-1").is_some_and(|p| p != pid && alive(p))
    });
    assert!(h.engine().wait_idle(Deadline::after(PATIENCE)));

    assert_eq!(lost().as_deref(), Some("1"));
}
